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
    assert policy_changes(old, new) == "classes reordered"
    assert policy_changes(old, old) == "no change"
