"""Policy files the docs allow people to write wrong: each is refused with a clear message, or read the one way that
can work (header names in any case)."""

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.policy.admission import AdmissionController, RequestFacts
from extproc.policy.schema import PolicyError, load_policy, load_policy_file, policy_warnings
from extproc.server.protocol import HeaderNames, read_request_headers

from .test_schema import BASE, errors_of

GOOD = "classes: {a: {max_concurrency: 1}}\nmodels: {m: {cluster: c}}\n"


def file_errors(tmp_path, content: bytes) -> list[str]:
    path = tmp_path / "policy.yaml"
    path.write_bytes(content)
    with pytest.raises(PolicyError) as e:
        load_policy_file(str(path))
    return e.value.errors


def test_a_latin1_file_is_a_policy_error_naming_the_byte_and_its_offset(tmp_path):
    content = GOOD.encode() + 'classify: {header: "x-caf\u00e9"}\n'.encode("latin-1")
    (error,) = file_errors(tmp_path, content)
    offset = content.index(b"\xe9")
    assert error == (f"{tmp_path / 'policy.yaml'}: not valid UTF-8: byte 0xe9 at offset {offset} (line 3); save "
                     "the file as UTF-8")


def test_a_utf16_file_is_a_policy_error(tmp_path):
    (error,) = file_errors(tmp_path, GOOD.encode("utf-16"))
    assert "not valid UTF-8: byte 0xff at offset 0" in error


def test_a_control_character_is_a_policy_error_naming_where(tmp_path):
    # PyYAML's reader refuses one (here an ESC pasted with a terminal's colours) when the loader is built, before
    # the parse the errors were caught around: `extproc check` and `serve` ended in a traceback.
    content = (GOOD + "default_class: \x1b[1ma\x1b[0m\n").encode()
    (error,) = file_errors(tmp_path, content)
    assert error == (f"{tmp_path / 'policy.yaml'}: not valid YAML: unacceptable character #x001b: special "
                     f"characters are not allowed in \"{tmp_path / 'policy.yaml'}\", position 76 (line 3)")


def test_a_top_level_key_given_twice_is_refused_with_its_line(tmp_path):
    (error,) = file_errors(tmp_path, (GOOD + "classes: {b: {max_concurrency: 2}}\n").encode())
    assert error.endswith("policy.yaml: line 3: duplicate key 'classes' (first at line 1)")


def test_a_class_given_twice_is_refused_with_its_line(tmp_path):
    content = b"classes:\n  a: {max_concurrency: 1}\n  a: {max_concurrency: 2}\nmodels: {m: {cluster: c}}\n"
    (error,) = file_errors(tmp_path, content)
    assert error.endswith("line 3: duplicate key 'a' (first at line 2)")


def test_keys_next_to_a_yaml_merge_may_override_the_merged_ones(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("classes:\n  a: &a {max_concurrency: 1, max_queue: 5}\n  b: {<<: *a, max_concurrency: 2}\n"
                    "models: {m: {cluster: c}}\n")
    assert load_policy_file(str(path)).classes["b"].max_concurrency == 2


@pytest.mark.parametrize("path,value", [
    ("learn_sample", float("nan")),
    ("classes.a.min_share", float("nan")),
    ("tenants[0].weight", float("nan")),
    ("tenants[0].guaranteed_share", float("nan")),
    ("tenants[0].burst_s", float("inf")),
    ("pools.c.waiting_saturated", float("inf")),
    ("pools.c.limit.max", float("inf")),
    ("pools.c.limit.interval_s", float("inf")),
    ("pools.c.limit.min", float("-inf")),
])
def test_numbers_that_are_not_finite_are_refused(path, value):
    assert errors_of(with_value(path, value)) == [f"{path}: must be a finite number, got {value}"]


def test_an_integer_past_the_largest_float_is_refused():
    assert errors_of(with_value("pools.c.limit.max", 10 ** 400)) == [
        "pools.c.limit.max: must be a finite number, got inf"]


def with_value(path: str, value) -> dict:
    """A valid policy (a tenant, a pool) with `value` set at key `path`."""
    doc = {"classes": {"a": {"max_concurrency": 1}}, "models": {"m": {"cluster": "c"}},
           "tenants": [{"name": "t"}], "pools": {"c": {"replicas": ["10.0.0.1:8000"], "limit": {}}}}
    *parents, leaf = path.replace("[0]", ".0").split(".")
    target = doc
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[leaf] = value
    return doc


def test_anonymous_default_class_above_its_max_class_is_refused():
    errs = errors_of({**BASE, "anonymous": {"max_class": "b", "default_class": "a"}})
    assert errs == ["anonymous.default_class: 'a' is above max_class 'b'"]


def test_anonymous_default_class_above_the_default_max_class_is_refused():
    errs = errors_of({**BASE, "anonymous": {"default_class": "a"}})
    assert errs == ["anonymous.default_class: 'a' is above max_class 'b' (anonymous.max_class defaults to the "
                    "lowest class)"]
    assert load_policy({**BASE, "anonymous": {"max_class": "a", "default_class": "a"}})


def test_header_names_are_lower_cased_on_load():
    p = load_policy({**BASE, "classify": {"header": "X-Tier", "objective_header": "X-Objective",
                                          "fairness_header": "X-Flow", "deadline_header": "X-Deadline-Ms"},
                     "sessions": {"header": "X-Session-Id"}})
    c = p.classify
    assert (c.header, c.objective_header, c.fairness_header, c.deadline_header, p.sessions.header) == \
        ("x-tier", "x-objective", "x-flow", "x-deadline-ms", "x-session-id")


def test_a_session_header_written_with_capitals_reads_the_lower_case_header_envoy_sends():
    p = load_policy({**BASE, "sessions": {"header": "X-Session-Id"}, "classify": {"header": "X-Tier"}})
    sent = {"x-session-id": b"s-1", "x-tier": b"B"}  # Envoy hands the ext_proc lower-case keys
    msg = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v)
                                                              for k, v in sent.items()]))
    head = read_request_headers(msg, HeaderNames.of(p))
    assert (head.session, head.claim) == ("s-1", "b")


@pytest.mark.parametrize("section, key, name, words", [
    ("classify", "fairness_header", "x-session-id", "'x-session-id' is also sessions.header"),
    ("classify", "objective_header", "X-Priority", "'x-priority' is also classify.header"),
    ("classify", "header", "api-key", "'api-key' is a header the ext_proc reads for itself"),
    ("sessions", "header", "Authorization", "'authorization' is a header the ext_proc reads for itself"),
])
def test_a_header_read_for_two_things_is_refused(section, key, name, words):
    # The ext_proc reads each request header as one thing: the second never saw its value (fairness by
    # x-session-id split nothing, an objective on the class header skipped the objectives map).
    errs = errors_of({**BASE, section: {key: name}})
    assert errs == [f"{section}.{key}: {words}: a request header is read as one thing only; name another"], errs


def test_class_names_with_capitals_are_refused():
    errs = errors_of({**BASE, "classes": {"Premium": {"max_concurrency": 1}}})
    assert errs == ["classes.Premium: class names must be lower case (claims are lower-cased before they are "
                    "matched, so this one could never be claimed): write 'premium'"]


def test_a_class_name_that_is_not_ascii_is_refused():
    # The ext_proc reads header values byte for byte (latin-1): `x-priority: \u00fcber` sent as UTF-8 (curl) read as
    # '\u00c3\u00bcber' and the request ran as its default class, while a latin-1 client's matched: the name had two
    # spellings, one of which could never be claimed.
    p = {**BASE, "classes": {"\u00fcber": {"max_concurrency": 1}, "a": {"max_concurrency": 1}}}
    msg = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="x-priority",
                                                                                  raw_value="\u00fcber".encode())]))
    assert read_request_headers(msg, HeaderNames.of(load_policy(BASE))).claim != "\u00fcber"
    assert errors_of(p) == ["classes.\u00fcber: class names are ASCII (a claim's header is read byte for byte, so a "
                            "client sending UTF-8 could never claim this one)"]


def test_a_class_name_with_a_control_character_is_refused():
    # YAML's escapes make one ("a\nb"); every response carries the name in x-extproc-class, a header value.
    p = {**BASE, "classes": {"a\nb": {"max_concurrency": 1}, "a": {"max_concurrency": 1}}}
    assert errors_of(p) == ["classes.'a\\nb': holds a control character; a class's name is a header value (Envoy "
                            "refuses one with a control character) and a metric label"]


def test_objective_names_with_capitals_are_refused():
    errs = errors_of({**BASE, "classify": {"objectives": {"Fast": "a"}}})
    assert errs == ["classify.objectives.Fast: objective names must be lower case (the header's value is "
                    "lower-cased before it is matched): write 'fast'"]


def test_an_objective_name_that_is_not_ascii_is_refused():
    # Read only from its header, byte for byte (latin-1): a client sending it as UTF-8 never matched it.
    errs = errors_of({**BASE, "classify": {"objectives": {"r\u00e1pido": "a"}}})
    assert errs == ["classify.objectives.r\u00e1pido: objective names are ASCII (the header is read byte for byte, "
                    "so a client sending UTF-8 could never name this one)"]


def test_the_objective_header_is_matched_lower_cased_like_the_other_claims():
    p = load_policy({**BASE, "anonymous": {"max_class": "a"},
                     "classify": {"objective_header": "x-objective", "objectives": {"fast": "a"}}})
    core = AdmissionController(p)
    assert core.decide(RequestFacts(model="m", objective="FAST")).cls == "a"
    assert core.decide(RequestFacts(model="m", objective="B")).cls == "b"


@pytest.mark.parametrize("address", ["http://10.0.0.1:8000", "10.0.0.2", "10.0.0.3:80/metrics", ":8000",
                                     "10.0.0.4:0", "10.0.0.5:http"])
def test_a_replica_that_is_not_host_port_is_refused(address):
    errs = errors_of({**BASE, "pools": {"c": {"replicas": ["10.0.0.1:8000", address]}}})
    assert errs == [f"pools.c.replicas[1]: {address!r} is not HOST:PORT (no scheme, no path: e.g. 10.0.0.1:8000)"]


def test_replica_addresses_may_be_names_or_ipv6():
    assert load_policy({**BASE, "pools": {"c": {"replicas": ["vllm-0.vllm:8000", "[::1]:8000"]}}})


def test_a_pool_with_nothing_to_scrape_is_warned_about():
    base = {**BASE, "anonymous": {"max_class": "a"}}  # every class reachable: the pool's warning alone
    p = load_policy({**base, "pools": {"c": {"limit": {"enabled": True}}}})
    (warning,) = policy_warnings(p)
    assert warning.startswith("pools.c: names neither `replicas` nor `envoy_admin` and no class has `slo_p95_ms`, "
                              "so its limit has nothing to move on and stays at its `max`")
    slo = {**base["classes"], "a": {"max_concurrency": 1, "slo_p95_ms": 2000}}
    (warning,) = policy_warnings(load_policy({**base, "classes": slo, "pools": {"c": {"limit": {"enabled": True}}}}))
    assert warning.startswith("pools.c: names neither `replicas` nor `envoy_admin`, so nothing is scraped and its "
                              "limit (and the adaptive caps on it) run on latency only")
    for scraped in ({"replicas": ["10.0.0.1:8000"]}, {"envoy_admin": "http://127.0.0.1:9901"}):
        assert policy_warnings(load_policy({**base, "pools": {"c": scraped}})) == []


def test_the_anonymous_rate_limit_counts_against_the_fleet_in_the_warning():
    fleet = {"fleet": {"requests_per_minute": 100},
             "tenants": [{"name": "t", "api_keys": ["k"], "requests_per_minute": 80}]}
    assert policy_warnings(load_policy({**BASE, **fleet})) == []
    (warning,) = policy_warnings(load_policy({**BASE, **fleet, "anonymous": {"requests_per_minute": 40}}))
    assert warning.startswith("tenants: requests_per_minute sum to 120 requests/min, past fleet.requests_per_minute")


def test_an_unknown_model_is_quoted_short_in_its_error():
    core = AdmissionController(load_policy(BASE))
    d = core.decide(RequestFacts(model="x" * 5000))
    assert d.status == 404 and len(d.message) < 300 and "xxx..." in d.message


def test_class_counts_and_name_lengths_the_runtime_cannot_hold_are_refused_at_load():
    # the workers' shared table has 256 rows (the 257th class failed every request at run time), and a class name
    # travels in a wake-up datagram, a metric label and a header
    many = {f"c{i}": {"max_concurrency": 1} for i in range(257)}
    assert any("at most 256" in e for e in errors_of({**BASE, "classes": many, "default_class": "c0"}))
    long = "a" * 65
    assert any("at most 64 bytes" in e for e in errors_of({**BASE, "classes": {long: {"max_concurrency": 1}},
                                                            "default_class": long}))
