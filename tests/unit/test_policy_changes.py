"""The reload log line says what a new policy file changed (found by an operator audit: a reload that only said
"policy reloaded" hid a removed class until its waiters got 503 class_removed)."""

import dataclasses

from extproc.policy.changes import policy_changes
from tests.conftest import make_policy


def test_added_removed_and_changed_fields_are_named():
    old = make_policy()
    classes = dict(old.classes)
    first, *_ = classes
    classes[first] = dataclasses.replace(classes[first], max_concurrency=classes[first].max_concurrency + 1)
    gone = list(classes)[-1]
    del classes[gone]
    new = dataclasses.replace(old, classes=classes, lease_ms=old.lease_ms + 1)
    text = policy_changes(old, new)
    assert f"classes -{gone}" in text
    assert f"classes.{first}.max_concurrency {old.classes[first].max_concurrency} -> " in text
    assert "lease_ms" in text


def test_a_reorder_is_a_change_of_priority():
    old = make_policy()
    new = dataclasses.replace(old, classes=dict(reversed(list(old.classes.items()))))
    assert policy_changes(old, new) == ("classes reordered; shed (default) {interactive: batch, internal} -> "
                                        "{internal: batch, interactive}")
    assert policy_changes(old, old) == "no change"


def test_nested_top_level_and_tenant_changes_name_their_leaves():
    """Found by editing a policy live: a fallback edit logged `classes.x.fallback FallbackSpec(action='degrade',
    model=... -> FallbackSpec(...`, `mode: shadow` logged just `mode` and a tenant edit just `tenants`."""
    old = make_policy()
    first = next(iter(old.classes))
    classes = dict(old.classes)
    fb = dataclasses.replace(classes[first].fallback, action="canned", status=503)
    classes[first] = dataclasses.replace(classes[first], fallback=fb)
    kept = old.tenants[0]
    tenants = [dataclasses.replace(kept, api_keys=["sk-new-secret"], weight=2.0),
               dataclasses.replace(kept, name="jobs", api_keys=["sk-jobs"])]
    new = dataclasses.replace(old, classes=classes, mode="shadow", tenants=tenants,
                              store=dataclasses.replace(old.store, url="redis://:hunter2@h:6379/0"))
    text = policy_changes(old, new)
    assert f"classes.{first}.fallback.action {old.classes[first].fallback.action!r} -> 'canned'" in text
    assert f"classes.{first}.fallback.status 200 -> 503" in text
    assert "mode 'enforce' -> 'shadow'" in text
    assert "tenants +jobs" in text and f"tenants.{kept.name}.weight 1.0 -> 2.0" in text
    assert f"tenants.{kept.name}.api_keys changed" in text and "store.url changed" in text
    assert "sk-new-secret" not in text and "hunter2" not in text  # keys and passwords never reach the log


def test_a_class_added_first_or_last_names_the_defaults_it_moves():
    """Found by adding a class live: the line said only `classes +premium`, while the default shed map (the first
    class protects every other) now shed interactive whenever premium was full; a class added last likewise
    moved anonymous requests down to it without a word."""
    old = make_policy(shed=None, anonymous={}, tenants=[{"name": "free", "api_keys": ["sk-free"]}])
    names = list(old.classes)
    spec = old.classes[names[0]]
    top = dataclasses.replace(old, classes={"premium": spec, **old.classes})
    text = policy_changes(old, top)
    assert text.startswith("classes +premium; ")
    assert f"shed (default) {{{names[0]}: {', '.join(names[1:])}}} -> {{premium: {', '.join(names)}}}" in text
    # A tenant without a max_class may claim the highest class, whichever it is.
    assert f"tenants.max_class (default: the highest class) {names[0]!r} -> 'premium' for free" in text
    bottom = dataclasses.replace(old, classes={**old.classes, "scavenger": spec})
    assert f"anonymous.max_class (default: the lowest class) {names[-1]!r} -> 'scavenger'" in policy_changes(old,
                                                                                                          bottom)


def test_a_reload_of_thousands_of_tenants_names_a_few_and_counts_the_rest():
    # A reload that raised every one of 20,000 tenants' rate limits logged one line of 968,888 characters (and
    # replacing them all, 737,778): past what log shippers take as a line, and built on the event loop.
    old = make_policy(tenants=[{"name": f"t{i}", "api_keys": [f"k{i}"], "requests_per_minute": 600}
                               for i in range(5000)])
    new = make_policy(tenants=[{"name": f"t{i}", "api_keys": [f"k{i}"], "requests_per_minute": 700}
                               for i in range(2, 5002)])
    text = policy_changes(old, new)
    assert len(text) < 2000
    assert "tenants +t5000" in text and "tenants -t0" in text and "tenants.t2.requests_per_minute 600 -> 700" in text
    assert text.endswith("tenants: 4,992 more (0 added, 0 removed, 4,992 changed)")
    replaced = policy_changes(old, make_policy(tenants=[{"name": f"u{i}", "api_keys": [f"v{i}"]} for i in range(5000)]))
    assert replaced.endswith("tenants: 9,990 more (4,990 added, 5,000 removed, 0 changed)")
