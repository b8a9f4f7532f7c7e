"""Policy validation: every error names its key path; `extproc check` exits 1 on errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.policy.schema import PolicyError, load_policy, load_policy_file

ROOT = Path(__file__).resolve().parents[2]


def errors_of(data):
    with pytest.raises(PolicyError) as e:
        load_policy(data)
    return e.value.errors


BASE = {"classes": {"a": {"max_concurrency": 1}, "b": {"max_concurrency": 2}}, "models": {"m": {"cluster": "c"}}}


def test_shipped_policies_validate():
    shipped = sorted((ROOT / "policies").glob("*.yaml"))
    assert shipped, f"no policy found in {ROOT / 'policies'}: nothing was validated"
    for path in shipped:
        load_policy_file(str(path))


def test_defaults_apply():
    p = load_policy(BASE)
    assert p.fallback_class() == "a"
    assert p.classes["b"].max_queue == 20 and p.classes["b"].max_wait_ms == 200
    assert p.shed_map() == {"a": ["b"]}
    assert p.classify.header == "x-priority"


def test_unknown_keys_are_errors_with_their_path():
    errs = errors_of({**BASE, "classes": {"a": {"max_concurrency": 1, "max_concurency": 2}}, "extra": 1})
    assert any(e.startswith("classes.a.max_concurency: unknown key (allowed: max_concurrency, max_queue, ")
               for e in errs)
    assert any(e.startswith("extra: unknown key") for e in errs)


def test_wrong_types_and_bounds_name_the_key():
    errs = errors_of({**BASE, "classes": {"a": {"max_concurrency": 0, "max_queue": "x", "max_wait_ms": True}}})
    assert "classes.a.max_concurrency: must be >= 1, got 0" in errs
    assert "classes.a.max_queue: must be an integer, got 'x'" in errs
    assert "classes.a.max_wait_ms: must be an integer, got True" in errs


def test_missing_required_keys():
    errs = errors_of({"classes": {"a": {}}})
    assert "models: required" in errs and "classes.a.max_concurrency: required" in errs


def test_class_references_must_exist():
    errs = errors_of({**BASE, "default_class": "z", "shed": {"a": ["q"]},
                      "tenants": [{"name": "t", "api_keys": ["k"], "max_class": "gold"}]})
    assert "default_class: unknown class 'z' (classes: a, b)" in errs
    assert "shed.a[0]: unknown class 'q' (classes: a, b)" in errs
    assert "tenants[0].max_class: unknown class 'gold' (classes: a, b)" in errs


def test_duplicate_api_keys_are_refused_without_echoing_the_key():
    errs = errors_of({**BASE, "tenants": [{"name": "t1", "api_keys": ["sk-secret"]},
                                          {"name": "t2", "api_keys": ["sk-secret"]}]})
    assert errs == ["tenants[1].api_keys[0]: key already belongs to tenant 't1'"]


def test_tenant_default_above_its_cap_is_refused():
    errs = errors_of({**BASE, "tenants": [{"name": "t", "max_class": "b", "default_class": "a"}]})
    assert errs == ["tenants[0].default_class: 'a' is above max_class 'b'"]


def test_check_command_prints_paths_and_exits_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: {a: {max_concurrency: -1}}\nmodels: {m: {cluster: c}}\n")
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", str(bad)], capture_output=True, text=True)
    assert run.returncode == 1
    assert "classes.a.max_concurrency: must be >= 1, got -1" in run.stderr
    good = subprocess.run([sys.executable, "-m", "extproc.cli", "check", str(ROOT / "policies/default.yaml")],
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    one = tmp_path / "one.yaml"
    one.write_text("classes: {a: {max_concurrency: 3}}\nmodels: {m: {cluster: c}}\n")
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", str(one)], capture_output=True, text=True)
    assert run.stdout == f"{one}: ok (1 class: a=3; 1 model; 0 tenants)\n"


def test_not_yaml_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: [unclosed\n")
    with pytest.raises(PolicyError) as e:
        load_policy_file(str(bad))
    assert "not valid YAML" in e.value.errors[0]


def test_a_yaml_error_on_a_key_line_names_where_without_quoting_the_line(tmp_path):
    # PyYAML quotes the offending line: a reload log showed the tenant's key (or a store.url password).
    bad = tmp_path / "bad.yaml"
    bad.write_text('classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\ntenants:\n'
                   '  - {name: t, api_keys: ["sk-live-123", ]]\n')
    with pytest.raises(PolicyError) as e:
        load_policy_file(str(bad))
    (error,) = e.value.errors
    assert "not valid YAML" in error and "line 4, column 42" in error and "sk-live" not in error, error


def test_a_yaml_error_is_one_line(tmp_path):
    # PyYAML's message spans four lines (context, where, problem, where): `extproc check` printed them as if they
    # were four errors, the last three without indent, and a reload log line broke in four.
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: {a: {max_concurrency: 1}\nmodels: [\n")
    with pytest.raises(PolicyError) as e:
        load_policy_file(str(bad))
    (error,) = e.value.errors
    assert "\n" not in error, error
    assert error == (f"{bad}: not valid YAML: while parsing a flow mapping in \"{bad}\", line 1, column 10; "
                     f"expected ',' or '}}', but got '<scalar>' in \"{bad}\", line 2, column 1")


def test_a_queue_wait_envoy_would_not_wait_out_is_refused():
    # Envoy's max_message_timeout (30 s) caps the ext_proc's extension of its timeout for a queued request; a
    # longer max_wait_ms had the queued request forwarded unadmitted after message_timeout (0.5 s).
    ok = {**BASE, "classes": {"a": {"max_concurrency": 1, "max_wait_ms": 29_000}}}
    load_policy(ok)
    too_long = {**BASE, "classes": {"a": {"max_concurrency": 1, "max_wait_ms": 29_001}}}
    assert any("classes.a.max_wait_ms" in e and "29000" in e.replace(",", "").replace("_", "") for e in
               errors_of(too_long)), errors_of(too_long)


def test_slips_that_load_are_warned_about():
    from extproc.policy.schema import policy_warnings
    p = load_policy({**BASE, "classes": {
        "a": {"max_concurrency": 30, "slo_p95_ms": 2, "min_share": 0.2,
              "adaptive": {"enabled": True, "max_limit": 8}}},
        "pools": {"c": {"scrape_interval_ms": 500, "stale_ms": 500, "replicas": ["h:1"]}},
        "tenants": [{"name": "t", "api_keys": ["k"], "guaranteed_share": 0.5}]})
    text = "\n".join(policy_warnings(p))
    for expected in ("classes.a.slo_p95_ms: 2 ms", "classes.a.max_concurrency: 30 is outside",
                     "classes.a.min_share: no pool has a `limit`", "pools.c.stale_ms: 500 ms",
                     "tenants.t.guaranteed_share: no class"):
        assert expected in text, text


def test_an_slo_past_what_the_latency_metrics_measure_is_warned_about():
    # histogram_quantile() reads no quantile above the highest finite bucket of extproc_request_duration_seconds:
    # for an SLO at or past it the dashboard's p95 never crosses the SLO line and ExtprocLatencyOverSLO never fires.
    from extproc.policy.schema import policy_warnings
    p = load_policy({**BASE, "classes": {"a": {"max_concurrency": 1, "slo_p95_ms": 900_000}}})
    (warning,) = policy_warnings(p)
    assert warning.startswith("classes.a.slo_p95_ms: 900000 ms is at or past 600 s"), warning
    ok = load_policy({**BASE, "classes": {"a": {"max_concurrency": 1, "slo_p95_ms": 300_000}}})
    assert policy_warnings(ok) == []


def test_every_problem_is_listed_at_once():
    # Cross-references were checked only once every field was valid: fixing two errors showed two new ones.
    errors = errors_of({"classes": {"a": {"max_concurrency": -1},
                                    "b": {"max_concurrency": 1, "fallback": {"action": "degrade", "model": "nope"}}},
                        "models": {"m": {"cluster": "c"}}, "shed": {"zz": ["a"]}})
    assert any("classes.a.max_concurrency" in e for e in errors)
    assert any("classes.b.fallback.model" in e for e in errors) and any("shed.zz" in e for e in errors)


def test_values_that_cannot_work_are_refused_at_check_time():
    # An operator audit: a header name with a space (it can never match), a cap past any real fleet, and a store
    # URL that is not Redis's (it failed only when the server started) were accepted.
    errs = errors_of({**BASE, "classify": {"header": "bad header"},
                      "classes": {"a": {"max_concurrency": 10 ** 20}},
                      "store": {"kind": "redis", "url": "http://x"}})
    assert any(e.startswith("classify.header: 'bad header' is not an HTTP header name") for e in errs), errs
    assert any(e.startswith("classes.a.max_concurrency: must be <=") for e in errs), errs
    assert any(e.startswith("store.url: 'http://x' is not a Redis URL") for e in errs), errs
    load_policy({**BASE, "classify": {"header": "X-Priority"}, "store": {"kind": "redis", "url": "rediss://h:1/0"}})


def test_a_store_url_that_is_not_redis_is_quoted_without_its_password():
    # changes.py never shows store.url ("it may hold a password"); its validation error quoted it whole.
    errs = errors_of({**BASE, "store": {"kind": "redis", "url": "redis//:hunter2@cache:6379/0"}})
    assert errs == ["store.url: 'redis//***@cache:6379/0' is not a Redis URL (redis://host:6379/0, rediss:// or "
                    "unix://)"]


def test_a_store_url_password_holding_an_at_or_a_slash_is_not_quoted_in_part():
    # Only the run before the first @ (and after the last /) was masked: of a password "p@ss" (redis-py reads the
    # userinfo up to the last @) or "pa/ss" the error quoted "ss".
    for url, shown in (("redis:/:p@ss@cache:6379/0", "redis:/***@cache:6379/0"),
                       ("http://:pa/ss@cache:6379", "http://***@cache:6379")):
        errs = errors_of({**BASE, "store": {"kind": "redis", "url": url}})
        assert errs == [f"store.url: {shown!r} is not a Redis URL (redis://host:6379/0, rediss:// or unix://)"]


def test_a_slow_ratio_that_would_call_the_fastest_replica_slow_is_refused():
    assert errors_of({**BASE, "pools": {"c": {"slow_ratio": 1.0}}}) == [
        "pools.c.slow_ratio: 1 would call the fastest replica slow (over 1, or 0: off)"]
    load_policy({**BASE, "pools": {"c": {"slow_ratio": 0}}})
    assert load_policy({**BASE, "pools": {"c": {}}}).pools["c"].slow_ratio == 1.5


def test_check_with_envoy_refuses_a_model_on_a_cluster_envoy_lacks(tmp_path):
    """Found by writing a policy from the docs: a typo'd `cluster` passed `extproc check`, and through the real
    stack every request of that model was admitted, answered 503 cluster_not_found by Envoy and tripped the
    class's error breaker on a pool that does not exist."""
    policy = tmp_path / "p.yaml"
    policy.write_text("classes: {a: {max_concurrency: 3}}\n"
                      "models: {llama-70b: {cluster: vllm_llama70b}, tiny: {cluster: vllm_lama8b}}\n")
    envoy = str(ROOT / "envoy/envoy.yaml")
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", envoy, str(policy)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert (f"models.tiny.cluster: 'vllm_lama8b' is not a cluster of {envoy} (clusters: vllm_llama70b, "
            "vllm_llama8b)") in run.stderr
    assert "llama-70b" not in run.stderr
    good = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", envoy,
                           str(ROOT / "policies/demo-full.yaml")], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    bad_envoy = tmp_path / "envoy.yaml"
    bad_envoy.write_text("admin: {}\n")
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", str(bad_envoy), str(policy)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "no static_resources.clusters" in run.stderr and "Traceback" not in run.stderr
    assert errors_of({**BASE, "models": {"m": {"cluster": ""}}}) == [
        "models.m.cluster: empty; name the Envoy cluster that serves this model"]


def test_check_with_envoy_whose_clusters_come_from_cds_does_not_call_them_missing(tmp_path):
    """An Envoy that takes its pools from CDS keeps only a few clusters static (the ext_proc's): every model was
    refused as on a cluster Envoy lacks, or the whole config as not a bootstrap."""
    import yaml

    cfg = yaml.safe_load((ROOT / "envoy/envoy.yaml").read_text())
    cfg["static_resources"]["clusters"] = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "extproc"]
    cfg["dynamic_resources"] = {"cds_config": {"ads": {}}}
    envoy = tmp_path / "envoy.yaml"
    envoy.write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", str(envoy),
                          str(ROOT / "policies/default.yaml")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{envoy}: warning: its clusters come from CDS: the models' `cluster` names are not checked" in run.stderr


def test_api_keys_no_request_can_present_are_refused_without_echoing_them():
    """Found by writing tenants from the docs: a key pasted with a trailing space (or empty, or with a comma)
    validated, but presented keys are trimmed and cut at commas, so the tenant's requests silently ran as
    anonymous (the lowest class)."""
    errs = errors_of({**BASE, "tenants": [{"name": "t", "api_keys": ["sk-ok", "sk-pasted \n", "", "sk-a,sk-b"]}]})
    assert [e.split(":")[0] for e in errs] == ["tenants[0].api_keys[1]", "tenants[0].api_keys[2]",
                                               "tenants[0].api_keys[3]"]
    assert "starts or ends with whitespace" in errs[0] and "empty" in errs[1] and "holds a comma" in errs[2]
    assert not any("sk-" in e for e in errs)


def test_an_api_key_holding_a_control_character_is_refused_naming_its_tenant_not_the_key():
    # No HTTP header carries a control character but a tab (Envoy refuses the request), so the tenant's requests
    # could never present this key: its clients got 401 under keys only, or ran as anonymous.
    keys = ["sk-ok", "sk-a\x01b", "sk-a\x7fb", "sk-a\tb"]
    errs = errors_of({**BASE, "tenants": [{"name": "acme", "api_keys": keys}]})
    assert [e.split(":")[0] for e in errs] == ["tenants[0].api_keys[1]", "tenants[0].api_keys[2]"]
    assert all("tenant 'acme'" in e and "control character" in e for e in errs)
    assert not any("sk-" in e for e in errs)


def test_an_api_key_yaml_reads_as_a_number_is_refused_without_echoing_it():
    # `api_keys: [4815162342]` is an int to YAML: its type error quoted the key into `extproc check` and reload logs.
    errs = errors_of({**BASE, "tenants": [{"name": "t", "api_keys": [4815162342, True]}]})
    assert errs == ["tenants[0].api_keys[0]: must be a string, got an int (quote the key)",
                    "tenants[0].api_keys[1]: must be a string, got a bool (quote the key)"]


def test_a_store_url_of_the_wrong_type_is_refused_without_echoing_it():
    # A list of Redis URLs (one per node, as cluster clients take) was quoted whole, passwords and all.
    urls = ["redis://:hunter2@a:6379", "redis://:hunter2@b:6379"]
    errs = errors_of({**BASE, "store": {"kind": "redis", "url": urls}})
    assert errs == ["store.url: must be a string, got a list"]


def test_an_integer_past_the_largest_float_is_refused():
    # YAML reads 1 and 400 zeros as an int: accepted, it raised OverflowError where the core divides it
    # (AdmissionController for lease_ms, the cost model for default_max_tokens) and in `extproc check`'s warnings
    # (slo_p95_ms), so `serve` could not start on a policy `check` accepted.
    huge = 10 ** 400
    errs = errors_of({**BASE, "lease_ms": huge, "classes": {"a": {"max_concurrency": 1, "slo_p95_ms": huge}},
                      "models": {"m": {"cluster": "c", "cost": {"default_max_tokens": huge}}}})
    assert errs == [f"{path}: must be a finite number, got a number of 401 digits" for path in
                    ("classes.a.slo_p95_ms", "models.m.cost.default_max_tokens", "lease_ms")]


def _check_file(tmp_path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "extproc.cli", "check", str(path)], capture_output=True, text=True,
                          timeout=30)


def test_yaml_the_parser_cannot_hold_is_an_error_not_a_traceback(tmp_path):
    """Found by feeding `extproc check` odd files: a 5,000-digit number and 500 nested brackets ended in Python
    tracebacks (int conversion limit, RecursionError), and a reload of either logged one."""
    models = "models: {m: {cluster: c}}\n"
    run = _check_file(tmp_path, "classes: {a: {max_concurrency: " + "1" * 5000 + "}}\n" + models)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-500:]
    assert "line 1" in run.stderr and "5000 digits" in run.stderr and "set_int_max_str_digits" not in run.stderr
    run = _check_file(tmp_path, "classes: {a: {max_concurrency: " + "[" * 500 + "]" * 500 + "}}\n" + models)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-500:]
    assert "nested too deeply" in run.stderr


def test_an_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    """Found by trying YAML anchors: nine lists of nine aliases, eight deep, is a small file that names 43 million
    strings. Loading shares them, but the error message repr()'d the whole value: `extproc check` ran 30 s
    into gigabytes, and a reload would have held the ext_proc's event loop (and every admission) that long."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 8)]
    text = "\n".join(lines) + "\nclasses: {a: {max_concurrency: *l7}}\nmodels: {m: {cluster: c}}\n"
    run = _check_file(tmp_path, text)
    assert run.returncode == 1
    assert "classes.a.max_concurrency: must be an integer, got [[[" in run.stderr
    assert len(run.stderr) < 5000


def test_degrade_keys_without_action_degrade_are_refused():
    """Found by writing fallbacks from the docs: `fallback: {model: llama-8b, max_tokens: 64}` (no action) validated
    and meant reject - the default action - so an open breaker answered 503 instead of the small model."""
    errs = errors_of({**BASE, "classes": {"a": {"max_concurrency": 1, "fallback": {"model": "m", "max_tokens": 64}},
                                          "b": {"max_concurrency": 1,
                                                "fallback": {"action": "canned", "max_concurrency": 2}}}})
    assert errs == [
        "classes.a.fallback.model: only action degrade uses it, and the action is 'reject' (the default is reject): "
        "add `action: degrade`, or remove it",
        "classes.a.fallback.max_tokens: only action degrade uses it, and the action is 'reject' (the default is "
        "reject): add `action: degrade`, or remove it",
        "classes.b.fallback.max_concurrency: only action degrade uses it, and the action is 'canned' (the default is "
        "reject): add `action: degrade`, or remove it"]


def test_a_shed_map_that_sheds_a_higher_class_is_warned_about():
    """Found by writing a `shed` map from the docs: `shed: {batch: [interactive]}` validated silently, and sheds
    interactive (503) whenever batch is full - priority upside down, most likely the map written backwards."""
    from extproc.policy.schema import policy_warnings
    policy = load_policy({**BASE, "shed": {"b": ["a"]}})
    assert ("shed.b[0]: a is listed above b in `classes` (higher priority), yet it is shed whenever b is saturated; "
            "a class normally sheds those below it") in policy_warnings(policy)
    assert not [w for w in policy_warnings(load_policy({**BASE, "shed": {"a": ["b"]}})) if w.startswith("shed")]


def test_classes_no_request_can_reach_are_warned_about():
    """Found by writing a policy from the docs: two classes of one's own and no tenants checked ok, yet every
    request is anonymous, capped at the lowest class (anonymous.max_class's default), so the first class, its
    overflow fallback and its shedding never served a request."""
    from extproc.policy.schema import policy_warnings
    (warning,) = policy_warnings(load_policy(BASE))
    assert warning == ("classes: no request can be in a: anonymous requests are capped at 'b' (`anonymous.max_class` "
                       "defaults to the lowest class); give the tenants that may use it API keys and a `max_class`, "
                       "or set `anonymous.max_class`"), warning
    three = {"a": {"max_concurrency": 1}, "b": {"max_concurrency": 1}, "c": {"max_concurrency": 1}}
    capped = {**BASE, "classes": three, "anonymous": {"max_class": "c"},
              "tenants": [{"name": "t", "api_keys": ["k"], "max_class": "c"},
                          {"name": "keyless", "max_class": "a"}]}  # no key: no request is ever its
    (warning,) = policy_warnings(load_policy(capped))
    assert warning.startswith("classes: no request can be in a, b: no tenant's `max_class` (nor "
                              "`anonymous.max_class`) reaches above 'c'"), warning
    (warning,) = policy_warnings(load_policy({**BASE, "anonymous": {"allow": False}}))
    assert warning == "anonymous.allow: false and no tenant has `api_keys`, so every request is refused with 401"
    for reachable in ({"anonymous": {"max_class": "a"}}, {"tenants": [{"name": "t", "api_keys": ["k"]}]},
                      {"anonymous": {"allow": False}, "tenants": [{"name": "t", "api_keys": ["k"]}]}):
        assert policy_warnings(load_policy({**BASE, **reachable})) == [], reachable


def test_a_fallback_that_changes_nothing_or_is_never_taken_is_warned_about():
    """Found by writing a policy from the docs: `on_overflow: fallback` without a fallback's action checked ok and
    refuses overflow with 429 exactly as `reject` does (the action defaults to reject); and a degrade or canned
    fallback in a class with both breakers off and `on_overflow: reject` checked ok and is never taken."""
    from extproc.policy.schema import policy_warnings
    reach = {"anonymous": {"max_class": "a"}}
    plain = {**BASE, **reach, "classes": {"a": {"max_concurrency": 1, "on_overflow": "fallback"}}}
    (warning,) = policy_warnings(load_policy(plain))
    assert warning.startswith("classes.a.on_overflow: `fallback`, and the fallback's action is `reject` (the "
                              "default), so overflow is refused with 429 as with `on_overflow: reject`"), warning
    off = {"error_breaker": {"enabled": False}, "fallback": {"action": "canned"}}
    (warning,) = policy_warnings(load_policy({**BASE, **reach, "classes": {"a": {"max_concurrency": 1, **off}}}))
    assert warning.startswith("classes.a.fallback: its `canned` is never used: both breakers are off"), warning
    for used in ({**off, "on_overflow": "fallback"}, {**off, "slo_p95_ms": 2000},
                 {**off, "error_breaker": {"enabled": True}}, {"fallback": {"action": "canned"}},
                 {"on_overflow": "fallback", "fallback": {"action": "canned"}}):
        warnings = policy_warnings(load_policy({**BASE, **reach, "classes": {"a": {"max_concurrency": 1, **used}}}))
        assert not [w for w in warnings if "never used" in w], used  # a breaker or the overflow takes it
    idle = {**off, "slo_p95_ms": 2000, "latency_breaker": {"enabled": False}}
    (warning,) = policy_warnings(load_policy({**BASE, **reach, "classes": {"a": {"max_concurrency": 1, **idle}}}))
    assert "is never used" in warning, warning


def test_tenant_names_that_cannot_label_their_metrics_are_refused():
    """Found by writing tenants from the docs: `name: ''` validated (an empty metric label, which Prometheus reads
    as no label), and `name: other` merged its series with the fairness keys no tenant owns."""
    tenants = [{"name": "", "api_keys": ["k1"]}, {"name": "other", "api_keys": ["k2"]}]
    errs = errors_of({**BASE, "tenants": tenants, "classify": {"fairness_header": "x-flow"}})
    assert errs == ["tenants[0].name: empty; a tenant's name is its metric label and log name",
                    "tenants[1].name: 'other' is the metric label of the classify.fairness_header keys that are no "
                    "tenant's: name the tenant otherwise"]
    assert errors_of({**BASE, "tenants": tenants}) == errs[:1]  # without header keys, no label to share


def test_tenant_names_with_control_characters_are_refused():
    """Found by a multi-tenant audit: `name: "x\\0y"` validated, and the fair queue, which nests a fairness-header
    key in its tenant's share behind a NUL, read that tenant as key "y" of a tenant "x": its `weight` and
    `guaranteed_share` were looked up under "x" (weight 1, none)."""
    tenants = [{"name": "x\x00y", "api_keys": ["k1"], "weight": 4}, {"name": "tab\there", "api_keys": ["k2"]}]
    assert errors_of({**BASE, "tenants": tenants}) == [
        f"tenants[{i}].name: {name!r} holds a control character; a tenant's name is its metric label and its "
        "fairness key" for i, name in enumerate(["x\x00y", "tab\there"])]


def test_shares_that_add_up_to_exactly_one_validate():
    """Found by a multi-tenant audit: twenty tenants of guaranteed_share 0.05 sum to 1.0000000000000002 in floating
    point and were refused as "more than 1" (and twenty classes of min_share 0.05 likewise)."""
    tenants = [{"name": f"t{i}", "api_keys": [f"k{i}"], "guaranteed_share": 0.05} for i in range(20)]
    classes = {f"c{i}": {"max_concurrency": 1, "min_share": 0.05} for i in range(20)}
    load_policy({**BASE, "classes": classes, "tenants": tenants})
    tenants.append({"name": "t20", "api_keys": ["k20"], "guaranteed_share": 0.001})
    assert "tenants: the guaranteed_share of every tenant add up to more than 1" in errors_of({**BASE,
                                                                                              "tenants": tenants})


def test_weights_and_guarantees_that_no_class_reads_are_warned_about():
    """Found by a multi-tenant audit: round_robin takes turns whatever the guarantee (tenant a guaranteed 75% and of
    weight 3 was granted b, a, b, a), yet `extproc check` was silent for it beside round_robin classes, its warning
    even saying round_robin would honour it; and a weight in a policy of fifo classes only was not warned about."""
    from extproc.policy.schema import policy_warnings

    tenants = [{"name": "a", "api_keys": ["ka"], "guaranteed_share": 0.5, "weight": 3}]
    guarantee = ("tenants.a.guaranteed_share: no class has `fairness.mode: fair` (round_robin takes turns whatever "
                 "the guarantee), so the share guarantees nothing")
    weight = ("tenants.a.weight: no class has a fairness mode (fifo serves in arrival order), so the weight weighs "
              "nothing")
    rr = {"a": {"max_concurrency": 1, "fairness": {"mode": "round_robin"}}}
    assert guarantee in policy_warnings(load_policy({**BASE, "classes": rr, "tenants": tenants}))
    assert weight not in policy_warnings(load_policy({**BASE, "classes": rr, "tenants": tenants}))
    warned = policy_warnings(load_policy({**BASE, "tenants": tenants}))
    assert guarantee in warned and weight in warned
    fair = {"a": {"max_concurrency": 1, "fairness": {"mode": "fair"}}}
    assert not [w for w in policy_warnings(load_policy({**BASE, "classes": fair, "tenants": tenants}))
                if w.startswith("tenants.")]


def test_an_envoy_admin_that_is_not_a_base_url_is_refused():
    """Found through the real stack: `envoy_admin: 127.0.0.1:9901` (no scheme) validated, the scraper never found a
    replica, and the pool read as saturated for good (its limit at its floor)."""
    for bad in ("127.0.0.1:9901", "http://127.0.0.1:9901/clusters", "", "ftp://h:1", "http://h:99999"):
        errs = errors_of({**BASE, "pools": {"c": {"envoy_admin": bad}}})
        assert errs == [f"pools.c.envoy_admin: {bad!r} is not the admin's base URL (http:// or https://, a host, "
                        "no path: e.g. http://127.0.0.1:9901)"], bad
    for good in ("http://127.0.0.1:9901", "http://envoy:9901/", "https://[::1]:9901"):
        load_policy({**BASE, "pools": {"c": {"envoy_admin": good}}})


def test_a_fairness_header_nothing_reads_is_warned_about():
    # Found by writing a plan-weighted policy from the docs: `classify.fairness_header` alone (no class with
    # `fairness.key: header`) loaded and checked clean, and every request still counted as its tenant's one flow.
    from extproc.policy.schema import policy_warnings
    header = {"classify": {"fairness_header": "x-end-user"}}
    fair = {"max_concurrency": 4, "fairness": {"mode": "fair"}}
    text = "\n".join(policy_warnings(load_policy({**BASE, **header, "classes": {"a": fair}})))
    assert "classify.fairness_header: no class has `fairness.key: header`" in text, text
    fifo = {"max_concurrency": 4, "fairness": {"key": "header"}}
    text = "\n".join(policy_warnings(load_policy({**BASE, **header, "classes": {"a": fifo}})))
    assert "classes.a.fairness.key: `header` in a `fifo` queue" in text, text
    keyed = {"max_concurrency": 4, "fairness": {"mode": "fair", "key": "header"}}
    assert policy_warnings(load_policy({**BASE, **header, "classes": {"a": keyed}})) == []


def test_a_rate_limit_no_bucket_can_hold_is_refused():
    # Both passed `extproc check` and crashed at run time: 10**400 tokens a minute building the bucket
    # (OverflowError: int too large to convert to float), and a bucket of 1e20 a minute over a 1e300 s burst
    # (infinite) writing its x-ratelimit-remaining header (int(inf)).
    errs = errors_of({**BASE, "tenants": [{"name": "t", "api_keys": ["k"], "tokens_per_minute": 10**400}]})
    assert any(e.startswith("tenants[0].tokens_per_minute: ") for e in errs)
    errs = errors_of({**BASE, "anonymous": {"requests_per_minute": 10**20, "burst_s": 1e300}})
    assert any(e.startswith("anonymous.requests_per_minute: ") for e in errs)
    load_policy({**BASE, "tenants": [{"name": "t", "api_keys": ["k"], "tokens_per_minute": 10**12,
                                      "burst_s": 86400}]})


@pytest.mark.parametrize("fallback", [{"action": "degrade", "stream": True},
                                      {"action": "degrade", "model": "m", "stream": True}])
def test_a_fallback_that_would_turn_streaming_on_is_refused(fallback):
    # The gateway turns streams off (an answer in one piece), never on: `stream: true` passed validation and did
    # nothing, and on its own made every degrade a refusal ("is the model it asked for").
    data = {**BASE, "classes": {"a": {"max_concurrency": 1, "fallback": fallback}}}
    (error,) = errors_of(data)
    assert error.startswith("classes.a.fallback.stream: only `false`"), error


def test_a_fallback_that_turns_streaming_off_is_a_degrade():
    load_policy({**BASE, "classes": {"a": {"max_concurrency": 1, "fallback": {"action": "degrade", "stream": False}}}})


def test_a_fallback_that_serves_only_breakers_says_so():
    """Found by writing a policy from docs/overload.md: a degrade fallback with `on_overflow` left at `reject`
    checked ok, and overflow is refused with 429; the fallback serves only an open breaker."""
    from extproc.policy.schema import policy_warnings
    cls = {"max_concurrency": 1, "fallback": {"action": "canned"}}
    (warning,) = policy_warnings(load_policy({**BASE, "anonymous": {"max_class": "a"}, "classes": {"a": cls}}))
    assert warning.startswith("classes.a.fallback: its `canned` serves only while one of the class's breakers is "
                              "open; overflow (queue full, wait expired, early reject) is refused with 429"), warning


@pytest.mark.parametrize("fallback, models", [
    ({"action": "degrade", "model": "m"}, {"m": {"cluster": "c"}}),
    ({"action": "degrade", "model": "small"}, {"m": {"cluster": "c"}, "small": {"cluster": "c"}})])
def test_a_degrade_that_leaves_the_request_on_its_own_pool_unchanged_is_warned_about(fallback, models):
    # Fallbacks.answer refuses such a degrade (the pool that had no room would get the request back unchanged).
    from extproc.policy.schema import policy_warnings
    cls = {"max_concurrency": 1, "on_overflow": "fallback", "fallback": fallback}
    policy = load_policy({"classes": {"a": cls}, "models": models, "anonymous": {"max_class": "a"}})
    (warning,) = policy_warnings(policy)
    assert warning.startswith("classes.a.fallback: a degrade ") and "each one the fallback takes is refused " \
        "instead (429 on overflow, 503 while a breaker is open)" in warning, warning


@pytest.mark.parametrize("fallback", [{"action": "degrade", "model": "small"},
                                      {"action": "degrade", "max_tokens": 64}, {"action": "degrade", "stream": False}])
def test_a_degrade_that_changes_the_request_is_not_warned_about(fallback):
    from extproc.policy.schema import policy_warnings
    cls = {"max_concurrency": 1, "on_overflow": "fallback", "fallback": fallback}
    models = {"m": {"cluster": "c"}, "small": {"cluster": "s"}}
    assert policy_warnings(load_policy({"classes": {"a": cls}, "models": models,
                                        "anonymous": {"max_class": "a"}})) == []


def test_a_min_share_on_the_first_class_is_warned_about():
    from extproc.policy.schema import policy_warnings
    classes = {"a": {"max_concurrency": 1, "min_share": 0.1}, "b": {"max_concurrency": 1, "min_share": 0.05}}
    limited = {"anonymous": {"max_class": "a"}, "pools": {"c": {"limit": {"enabled": True}, "replicas": ["h:1"]}}}
    (warning,) = policy_warnings(load_policy({**BASE, **limited, "classes": classes}))
    assert warning.startswith("classes.a.min_share: the first class waits behind no class, so its share guarantees "
                              "nothing"), warning


@pytest.mark.parametrize("wait, target, warned", [(200, 0.85, False), (250, 0.85, True), (300, 0.8, False),
                                                  (301, 0.8, True)])
def test_the_first_class_with_an_slo_waits_at_most_what_the_limit_leaves_of_it(wait, target, warned):
    # docs/overload.md rule 1: max_wait_ms <= (1 - target) x slo_p95_ms under a pool limit.
    from extproc.policy.schema import policy_warnings
    classes = {"top": {"max_concurrency": 1}, "a": {"max_concurrency": 1, "slo_p95_ms": 1500, "max_wait_ms": wait},
               "b": {"max_concurrency": 1, "slo_p95_ms": 1500, "max_wait_ms": 5000}}
    pools = {"c": {"limit": {"enabled": True, "target": target}, "replicas": ["h:1"]}}
    warnings = policy_warnings(load_policy({**BASE, "anonymous": {"max_class": "top"}, "classes": classes,
                                            "pools": pools}))
    assert [w for w in warnings if w.startswith("classes.a.max_wait_ms")] == ([
        f"classes.a.max_wait_ms: {wait} ms is over (1 - pools.c.limit.target {target:g}) x slo_p95_ms 1500 = "
        f"{(1 - target) * 1500:.0f} ms: the limit aims the served p95 at {target:g} x the SLO and a queued "
        "request's wait comes on top, so its p95 can pass the SLO; keep it within that unless its answers take a "
        "small part of the SLO (docs/overload.md, \"Writing the policy\", rule 1)"] if warned else [])
    assert warnings == [w for w in warnings if w.startswith("classes.a.max_wait_ms")]  # b waits behind a by design
    unlimited = {**BASE, "anonymous": {"max_class": "top"}, "classes": classes}
    assert policy_warnings(load_policy(unlimited)) == []
