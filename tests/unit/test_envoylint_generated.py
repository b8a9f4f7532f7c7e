"""`extproc check --envoy` on envoy/envoy.yaml as infra teams edit it, generated: seeded structural mutations (a key
deleted, a value of the wrong type, an entry duplicated) never raise out of `check` (it analyses the config or says
it cannot read it), and each documented bypass (docs/envoy-integration.md section 7) is an error wherever it is
placed: the first listener, a second listener, a second filter chain, a default filter chain, a second virtual
host; per-route overrides on a route, its virtual host, the route table or one weighted cluster, bare or wrapped in
a FilterConfig. Deterministic: a fixed seed, a fixed list of placements."""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from extproc.tools import check, envoyconf
from extproc.tools.envoylint import EXT_PROC_TYPE, TCP_PROXY_TYPE, lint

ROOT = Path(__file__).resolve().parents[2]
POLICY = str(ROOT / "policies/default.yaml")
POOLS = {"vllm_llama70b", "vllm_llama8b"}
WAIT_S = 5.0  # policies/default.yaml's longest max_wait_ms
PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
FILTER_CONFIG = "type.googleapis.com/envoy.config.route.v3.FilterConfig"
CHAT = "/v1/chat/completions"
BASE = envoyconf.load_source()


def _run_check(cfg: Any, tmp: Path, text: str | None = None) -> tuple[int, str]:
    """`check --envoy` in-process: its exit status and what it printed; any exception escapes to the test."""
    path = tmp / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg) if text is None else text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = check.run(argparse.Namespace(files=[POLICY], envoy=str(path), max_body_bytes=4 << 20,
                                          max_pending_bodies=10_000))
    return rc, out.getvalue()


# -- structural mutations: no exception escapes `check --envoy` ------------------------------------------------

ODD = [None, 0, 1, -1, "x", "", True, 1.5, [], {}, [1], ["x"], [{}], [None], {"a": 1}, {"@type": "type.googleapis"
       ".com/some.Unknown"}, 10**400]


def _paths(o: Any, at: tuple = ()):
    yield at
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _paths(v, at + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _paths(v, at + (i,))


def _at(o: Any, at: tuple) -> Any:
    for k in at:
        o = o[k]
    return o


def _mutate(rng: random.Random, cfg: dict) -> tuple:
    at = rng.choice(list(_paths(cfg))[1:])
    parent, key = _at(cfg, at[:-1]), at[-1]
    op = rng.choice(("delete", "retype", "retype", "duplicate", "unknown field"))
    if op == "delete":
        del parent[key]
    elif op == "retype":
        parent[key] = copy.deepcopy(rng.choice(ODD))
    elif op == "duplicate":
        if isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        else:
            parent[key] = [copy.deepcopy(parent[key])]
    elif isinstance(parent[key], dict):
        parent[key]["an_unknown_field"] = copy.deepcopy(rng.choice(ODD))
    return op, at


def test_structural_mutations_never_raise_out_of_check(tmp_path):
    rng = random.Random(20261206)
    for n in range(160):
        cfg = copy.deepcopy(BASE)
        done = [_mutate(rng, cfg) for _ in range(rng.choice((1, 1, 2, 3)))]
        try:
            rc, said = _run_check(cfg, tmp_path)
        except Exception as e:  # noqa: BLE001 - the finding is that anything escapes
            pytest.fail(f"mutation {n} {done}: {e!r} escaped `check --envoy`")
        assert rc in (0, 1, 2), (done, rc)
        assert "Traceback" not in said


@pytest.mark.parametrize("text", [
    "", "\n", "null\n", "[]\n", "[1, 2]\n", "a string\n", "42\n", "static_resources: []\n",
    "static_resources: {clusters: {}}\n", "static_resources: {clusters: [1]}\n",
    "static_resources: {clusters: [{name: vllm_llama8b}, {name: 1}]}\n", "static_resources: {clusters: [{name: ~}]}\n",
    "static_resources: {clusters: [{name: vllm_llama8b}, {name: vllm_llama70b}], listeners: [1, null, x]}\n",
    "static_resources: {clusters: [{name: vllm_llama8b}, {name: vllm_llama70b}], listeners: {a: 1}}\n",
    "dynamic_resources: [1]\n", "dynamic_resources: {lds_config: {}, cds_config: {}}\n",
    "static_resources: " + "[" * 3000 + "]" * 3000 + "\n", "a: " + "{b: " * 3000 + "1" + "}" * 3000 + "\n",
    "\x00\x01", "a: [unclosed\n", "\ufeffstatic_resources: {}\n",
])
def test_a_file_that_is_not_an_envoy_config_is_read_or_refused_without_a_traceback(tmp_path, text):
    rc, said = _run_check(None, tmp_path, text)
    assert rc in (0, 1, 2) and "Traceback" not in said, said  # 0: all from xDS, said in warnings


def test_the_cli_on_a_few_mutated_configs_prints_no_traceback(tmp_path):
    rng = random.Random(7)
    for n in range(3):
        cfg = copy.deepcopy(BASE)
        done = _mutate(rng, cfg)
        path = tmp_path / f"envoy{n}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", str(path), POLICY],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode in (0, 1, 2) and "Traceback" not in run.stderr, (done, run.stderr)


# -- placements: where the edited connection manager and virtual host sit --------------------------------------

Place = Callable[[dict], tuple[dict, dict, str]]  # lays the config out; returns the HCM and virtual host to edit


def _hcm(listener: dict, chain: int = 0) -> dict:
    chains = listener["filter_chains"] + ([listener["default_filter_chain"]] if "default_filter_chain" in listener
                                          else [])
    return chains[chain]["filters"][0]["typed_config"]


def first_listener(cfg: dict) -> tuple[dict, dict, str]:
    hcm = _hcm(cfg["static_resources"]["listeners"][0])
    return hcm, hcm["route_config"]["virtual_hosts"][0], "listener 'openai'"


def second_listener(cfg: dict) -> tuple[dict, dict, str]:
    listeners = cfg["static_resources"]["listeners"]
    extra = copy.deepcopy(listeners[0])
    extra["name"] = "openai-internal"
    extra["address"]["socket_address"]["port_value"] = 8081
    listeners.append(extra)
    hcm = _hcm(extra)
    return hcm, hcm["route_config"]["virtual_hosts"][0], "listener 'openai-internal'"


def second_filter_chain(cfg: dict) -> tuple[dict, dict, str]:
    listener = cfg["static_resources"]["listeners"][0]
    extra = copy.deepcopy(listener["filter_chains"][0])
    extra["filter_chain_match"] = {"server_names": ["internal.example.com"]}
    listener["filter_chains"].append(extra)
    hcm = _hcm(listener, 1)
    return hcm, hcm["route_config"]["virtual_hosts"][0], "listener 'openai'"


def default_filter_chain(cfg: dict) -> tuple[dict, dict, str]:
    listener = cfg["static_resources"]["listeners"][0]
    listener["default_filter_chain"] = copy.deepcopy(listener["filter_chains"][0])
    listener["filter_chains"][0]["filter_chain_match"] = {"server_names": ["api.example.com"]}
    hcm = _hcm(listener, 1)
    return hcm, hcm["route_config"]["virtual_hosts"][0], "listener 'openai'"


def second_virtual_host(cfg: dict) -> tuple[dict, dict, str]:
    hcm = _hcm(cfg["static_resources"]["listeners"][0])
    hosts = hcm["route_config"]["virtual_hosts"]
    extra = copy.deepcopy(hosts[0])
    extra.update(name="internal", domains=["internal.example.com"])
    hosts.insert(0, extra)
    return hcm, extra, "virtual host 'internal'"


PLACES = [first_listener, second_listener, second_filter_chain, default_filter_chain, second_virtual_host]


def _filter(hcm: dict) -> dict:
    return next(f for f in hcm["http_filters"] if f.get("typed_config", {}).get("@type") == EXT_PROC_TYPE)


def _route(vh: dict, path: str) -> dict:
    return next(r for r in vh["routes"] if r["match"].get("path") == path)


# -- per-route overrides, and the level they are put at ---------------------------------------------------------

OVERRIDES = {
    "disabled": {"@type": PER_ROUTE, "disabled": True},
    "another processor": {"@type": PER_ROUTE, "overrides": {"grpc_service": {"envoy_grpc": {"cluster_name":
                                                                                             "extproc_staging"}}}},
    "body not buffered": {"@type": PER_ROUTE, "overrides": {"processing_mode": {
        "request_header_mode": "SEND", "request_body_mode": "NONE", "request_trailer_mode": "SEND"}}},
    "headers skipped": {"@type": PER_ROUTE, "overrides": {"processing_mode": {
        "request_header_mode": "SKIP", "request_body_mode": "BUFFERED", "request_trailer_mode": "SEND"}}},
    "trailers left out": {"@type": PER_ROUTE, "overrides": {"processing_mode": {"request_body_mode": "BUFFERED"}}},
    "an empty mode": {"@type": PER_ROUTE, "overrides": {"processing_mode": {}}},  # every field at its default
}


def _wrap(per: dict, wrapped: bool) -> dict:
    return {"@type": FILTER_CONFIG, "config": per} if wrapped else per


def _put(level: str, hcm: dict, vh: dict, per: dict) -> None:
    if level == "weighted cluster":
        r = _route(vh, CHAT)
        r["route"] = {"weighted_clusters": {"clusters": [
            {"name": "vllm_llama70b", "weight": 50}, {"name": "vllm_llama70b", "weight": 50,
                                                      "typed_per_filter_config": {}}]}, "timeout": "0s"}
        scope = r["route"]["weighted_clusters"]["clusters"][1]
    else:
        if level == "catch-all route":  # envoy.yaml's default deny, sent to a pool instead (clean on its own)
            vh["routes"][-1] = {"match": {"prefix": "/"}, "route": {"cluster": "vllm_llama70b", "timeout": "0s"}}
        scope = {"chat route": _route(vh, CHAT), "header route": vh["routes"][0], "catch-all route": vh["routes"][-1],
                 "virtual host": vh, "route table": hcm["route_config"]}[level]
    scope.setdefault("typed_per_filter_config", {})[_filter(hcm)["name"]] = per


LEVELS = ["header route", "chat route", "catch-all route", "virtual host", "route table", "weighted cluster"]


def _new_errors(place: Place, edit: Callable[[dict, dict, dict], None]) -> tuple[list[str], str]:
    base = copy.deepcopy(BASE)
    place(base)
    before = lint(base, POOLS, 2000, WAIT_S)
    assert before.errors == [], before.errors  # each placement alone is clean
    cfg = copy.deepcopy(BASE)
    hcm, vh, where = place(cfg)
    edit(cfg, hcm, vh)
    after = lint(cfg, POOLS, 2000, WAIT_S)
    return [e for e in after.errors if e not in before.errors], where


def test_a_catch_all_route_to_a_pool_with_the_ext_proc_on_is_clean():  # the level "catch-all route" alone
    cfg = copy.deepcopy(BASE)
    _hcm(cfg["static_resources"]["listeners"][0])["route_config"]["virtual_hosts"][0]["routes"][-1] = {
        "match": {"prefix": "/"}, "route": {"cluster": "vllm_llama70b", "timeout": "0s"}}
    assert lint(cfg, POOLS, 2000, WAIT_S).errors == []


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "in FilterConfig"])
def test_a_per_route_override_that_bypasses_admission_is_an_error_at_every_level(place, level, override, wrapped):
    new, where = _new_errors(place, lambda cfg, hcm, vh: _put(level, hcm, vh, _wrap(OVERRIDES[override], wrapped)))
    assert new, f"{override} on the {level} ({place.__name__}): no error"
    assert any(where in e for e in new), (where, new)


# -- the other documented bypasses ----------------------------------------------------------------------------

def _mirror(scope: str, mirror: dict | None = None):
    def edit(cfg, hcm, vh):
        target = vh if scope == "virtual host" else _route(vh, CHAT)["route"]
        target["request_mirror_policies"] = [mirror or {"cluster": "vllm_llama8b"}]
    return edit


def _hedge(scope: str):
    def edit(cfg, hcm, vh):
        r = vh["routes"][0]["route"]
        r["retry_policy"] = {"retry_on": "5xx", "num_retries": 2, "per_try_timeout": "0.3s"}
        (vh if scope == "virtual host" else r)["hedge_policy"] = {"hedge_on_per_try_timeout": True}
    return edit


def _header_route_ahead(cfg, hcm, vh):
    vh["routes"].insert(0, {"match": {"prefix": "/", "headers": [{"name": "x-model", "string_match": {
        "exact": "llama-8b"}}]}, "route": {"cluster": "vllm_llama8b", "timeout": "0s"}})


def _pool_route_dropped(cfg, hcm, vh):
    del vh["routes"][0]


def _pool_route_weighted(cfg, hcm, vh):
    vh["routes"][0]["route"] = {"weighted_clusters": {"clusters": [{"name": "vllm_llama8b", "weight": 1}]},
                                "timeout": "0s"}


def _filter_option(**options):
    def edit(cfg, hcm, vh):
        _filter(hcm)["typed_config"].update(copy.deepcopy(options))
    return edit


def _mode(**mode):
    def edit(cfg, hcm, vh):
        _filter(hcm)["typed_config"].setdefault("processing_mode", {}).update(mode)
    return edit


def _filter_disabled(cfg, hcm, vh):
    _filter(hcm)["disabled"] = True


def _filter_after_router(cfg, hcm, vh):
    filters = hcm["http_filters"]
    filters.append(filters.pop(filters.index(_filter(hcm))))


def _filter_removed(cfg, hcm, vh):
    hcm["http_filters"].remove(_filter(hcm))


def _forward_rules(cfg, hcm, vh):
    _filter(hcm)["typed_config"]["forward_rules"] = {"allowed_headers": {"patterns": [{"prefix": "x-"}, {
        "exact": ":path"}]}}


def _early_removes_key(cfg, hcm, vh):
    hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"].append({"remove": "authorization"})


def _early_strip_dropped(cfg, hcm, vh):
    del hcm["early_header_mutation_extensions"]


def _tcp_proxy(cfg, hcm, vh):
    cfg["static_resources"]["listeners"].append({
        "name": "raw", "address": {"socket_address": {"address": "0.0.0.0", "port_value": 9000}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": TCP_PROXY_TYPE, "stat_prefix": "raw", "cluster": "vllm_llama8b"}}]}]})


PER_HOST = {"mirror on the route", "mirror on the virtual host", "mirror by the pool header",
            "mirror by the pool header on the virtual host", "hedged retries on the route",
            "hedge on the virtual host", "a header route ahead", "no route on the pool header",
            "the pool route weighted", "the filter disabled by default"}
BYPASSES = {
    "mirror on the route": _mirror("route"),
    "mirror on the virtual host": _mirror("virtual host"),
    "mirror by the pool header": _mirror("route", {"cluster_header": "x-extproc-cluster"}),
    "mirror by the pool header on the virtual host": _mirror("virtual host", {"cluster_header": "x-extproc-cluster"}),
    "hedged retries on the route": _hedge("route"),
    "hedge on the virtual host": _hedge("virtual host"),
    "a header route ahead": _header_route_ahead,
    "no route on the pool header": _pool_route_dropped,
    "the pool route weighted": _pool_route_weighted,
    "observability_mode": _filter_option(observability_mode=True),
    "disable_immediate_response": _filter_option(disable_immediate_response=True),
    "disable_clear_route_cache": _filter_option(disable_clear_route_cache=True),
    "route_cache_action RETAIN": _filter_option(route_cache_action="RETAIN"),
    "mutation_rules refuse the pool header": _filter_option(mutation_rules={"disallow_expression": {
        "regex": "x-extproc-cluster"}}),
    "mutation_rules refuse content-length": _filter_option(mutation_rules={"disallow_all": True, "allow_expression": {
        "regex": "x-extproc-.*"}}),
    "max_message_timeout under the wait": _filter_option(max_message_timeout="2s"),
    "body not buffered": _mode(request_body_mode="STREAMED"),
    "headers skipped": _mode(request_header_mode="SKIP"),
    "request trailers skipped": _mode(request_trailer_mode="SKIP"),
    "the filter disabled by default": _filter_disabled,
    "the filter after the router": _filter_after_router,
    "no ext_proc filter": _filter_removed,
    "forward_rules leave out the key": _forward_rules,
    "an early mutation removes the key": _early_removes_key,
    "no early strip of x-extproc-": _early_strip_dropped,
    "a tcp_proxy to a pool": _tcp_proxy,
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("bypass", BYPASSES)
def test_a_documented_bypass_is_an_error_wherever_it_is_placed(place, bypass):
    new, where = _new_errors(place, BYPASSES[bypass])
    assert new, f"{bypass} ({place.__name__}): no error"
    if bypass == "a tcp_proxy to a pool":
        where = "listener 'raw'"  # its own
    elif bypass not in PER_HOST:  # the connection manager's: named by its listener
        where = where if place is not second_virtual_host else "listener 'openai'"
    assert any(where in e for e in new), (where, new)


def test_a_bypass_makes_check_exit_1_naming_where(tmp_path):
    cfg = copy.deepcopy(BASE)
    hcm, vh, where = second_listener(cfg)
    _put("virtual host", hcm, vh, _wrap(OVERRIDES["disabled"], True))
    rc, said = _run_check(cfg, tmp_path)
    assert rc == 1 and "invalid (requests can reach a model pool" in said and where in said, said
