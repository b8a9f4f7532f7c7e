"""Route edits infra teams make to envoy.yaml, through real Envoy: what each does to admission, and that
`extproc check --envoy` refuses the config that holds them (tests/unit/test_envoy_lint.py has one edit a test)."""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys

import aiohttp
import pytest
import yaml

from extproc.tools.envoylint import lint
from extproc.tools.stack import Stack, free_port
from tests.conftest import policy_file, run_upstream, until
from tests.integration.helpers import chat, metrics, sample, sample_once, upstream_reset, upstream_stats

PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
DEAD_PORT = free_port()  # nothing listens there


def edit(cfg: dict) -> None:
    """Seven edits, each seen in real configs: a route on a model header ahead of the route on the ext_proc's
    pool header; hedged retries and a mirror (a canary pool) on that route; a second virtual host (by
    :authority) with the static routes only; the ext_proc switched off on a route a team thought cheap, and on
    one weighted cluster of another; a route given to another processor."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    vh = hcm["route_config"]["virtual_hosts"][0]
    routes = vh["routes"]
    routes[0]["route"].update(retry_policy={"retry_on": "5xx,reset", "num_retries": 2, "per_try_timeout": "0.3s"},
                              hedge_policy={"hedge_on_per_try_timeout": True},
                              request_mirror_policies=[{"cluster": "vllm_llama8b"}])
    internal = copy.deepcopy(vh)
    internal.update(name="internal", domains=["internal.example", "internal.example:*"], routes=routes[1:])
    hcm["route_config"]["virtual_hosts"].insert(0, internal)
    routes.insert(0, {"match": {"prefix": "/", "headers": [{"name": "x-model",
                                                             "string_match": {"exact": "llama-8b"}}]},
                      "route": {"cluster": "vllm_llama8b", "timeout": "0s"}})
    next(r for r in routes if r["match"].get("path") == "/v1/embeddings")["typed_per_filter_config"] = {
        "envoy.filters.http.ext_proc": {"@type": PER_ROUTE, "disabled": True}}
    # a route sent to another processor (a staging policy), down: Envoy fails open
    next(r for r in routes if r["match"].get("path") == "/v1/responses")["typed_per_filter_config"] = {
        "envoy.filters.http.ext_proc": {"@type": PER_ROUTE, "overrides": {
            "grpc_service": {"envoy_grpc": {"cluster_name": "policy_staging"}}}}}
    staging = copy.deepcopy(next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "extproc"))
    staging.pop("health_checks", None)
    staging.update(name="policy_staging", load_assignment={"cluster_name": "policy_staging", "endpoints": [
        {"lb_endpoints": [{"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                       "port_value": DEAD_PORT}}}}]}]})
    cfg["static_resources"]["clusters"].append(staging)
    next(r for r in routes if r["match"].get("path") == "/v1/completions")["route"] = {
        "timeout": "0s", "weighted_clusters": {"clusters": [{"name": "vllm_llama70b", "weight": 1,
                                                               "typed_per_filter_config": {
                                                                   "envoy.filters.http.ext_proc": {
                                                                       "@type": PER_ROUTE, "disabled": True}}}]}}


class EditedStack(Stack):
    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        edit(cfg)
        return cfg


@pytest.fixture
def small_pool():
    """A second test upstream for the 8B pool, so a test can tell where a request ran."""
    with run_upstream() as address:
        yield address


async def test_each_edit_moves_requests_around_admission_and_check_refuses_the_config(tmp_path, upstream,
                                                                                      small_pool):
    policy = policy_file(tmp_path, endpoints={"embeddings": True})
    with EditedStack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [small_pool]},
                     policy_path=policy) as s:
        found = lint(s.envoy_config(), {"vllm_llama70b", "vllm_llama8b"})
        async with aiohttp.ClientSession() as http:
            async def served(pool) -> int:
                return (await upstream_stats(http, pool))["served"]

            async def send(path: str, body: dict, **headers) -> int:
                for pool in (upstream, small_pool):
                    await upstream_reset(http, pool)
                async with http.post(f"{s.url}{path}", json=body, headers=headers) as r:
                    await r.read()
                    return r.status

            # Admitted as llama-70b (counted against its pool), run on the 8B pool by the header.
            assert await send("/v1/chat/completions", chat(), **{"x-model": "llama-8b"}) == 200
            assert (await upstream_stats(http, small_pool))["served"] == 1
            assert (await upstream_stats(http, upstream))["served"] == 0
            # Admitted as llama-8b, run on the 70B pool: the internal host has no route on the pool header.
            assert await send("/v1/chat/completions", chat(model="llama-8b"), host="internal.example") == 200
            assert (await upstream_stats(http, upstream))["served"] == 1
            # One admission, three generations at once (each per_try_timeout hedges another attempt), and a
            # fourth on the mirror's pool, with the ticket: the replica cannot tell.
            assert await send("/v1/chat/completions", chat(), **{"x-test-delay-ms": "1000"}) == 200
            assert (await upstream_stats(http, upstream))["max_in_service"] == 3
            assert await until(lambda: served(small_pool), holds=lambda n: n == 1) == 1
            # No admission at all.
            for path, body in (("/v1/embeddings", {"model": "llama-70b", "input": "hi"}),
                               ("/v1/completions", {"model": "llama-70b", "prompt": "hi", "max_tokens": 2}),
                               ("/v1/responses", {"model": "llama-70b", "input": "hi", "max_output_tokens": 2})):
                assert await send(path, body) == 200
                seen = await (await http.get(f"http://{upstream[0]}:{upstream[1]}/test/seen")).json()
                assert [x["ticket"] for x in seen if x["path"] == path] == [False]
            assert await sample_once(http, s.metrics_url, "extproc_unadmitted_requests_total", 3.0) == 3.0
            ms = await metrics(http, s.metrics_url)
            assert sample(ms, "extproc_requests_total", decision="accept") == 3
    errors = "\n".join(found.errors)
    assert "route 0 (prefix / with header x-model) comes before the route on the x-extproc-cluster" in errors
    assert "virtual host 'internal': no route is on the x-extproc-cluster header" in errors
    assert "hedge_on_per_try_timeout starts another attempt" in errors
    assert "(path /v1/embeddings) sends to vllm_llama70b with the ext_proc disabled" in errors
    assert "(path /v1/completions) sends to vllm_llama70b with the ext_proc disabled" in errors
    assert "mirrors its requests to vllm_llama8b" in errors
    assert "(path /v1/responses) sends its requests to another processor (cluster 'policy_staging')" in errors
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(s.envoy_config()))
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", str(path), str(policy)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "invalid (requests can reach a model pool without admission" in run.stderr


class ShortExtensionStack(Stack):
    """envoy.yaml with max_message_timeout lowered to 2 s, under a policy that queues for up to 6 s."""

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"][0]["typed_config"]["max_message_timeout"] = "2s"
        return cfg


async def test_a_queue_longer_than_max_message_timeout_lets_requests_through_and_check_refuses_it(tmp_path,
                                                                                                 upstream):
    """Envoy ignores an extension past max_message_timeout, so the queued request's message timeout (0.5 s) ran
    out and failure_mode_allow sent it upstream past a full cap of 1. The schema caps max_wait_ms for the shipped
    30 s, but nothing compared it with the Envoy config actually used."""
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": 1, "max_queue": 4,
                                                            "max_wait_ms": 6000}}, tenants=[])
    with ShortExtensionStack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
                             policy_path=policy) as s:
        async with aiohttp.ClientSession() as http:
            await upstream_reset(http, upstream)

            async def one() -> int:
                async with http.post(f"{s.url}/v1/chat/completions", json=chat(),
                                     headers={"x-test-delay-ms": "3000"}) as r:
                    await r.read()
                    return r.status

            assert await asyncio.gather(one(), one()) == [200, 200]
            stats = await upstream_stats(http, upstream)
            assert stats["max_in_service"] == 2 and stats["unticketed"] == 1, stats
        found = lint(s.envoy_config(), {"vllm_llama70b", "vllm_llama8b"}, longest_wait_s=6.0)
    assert any("max_message_timeout 2s is below the longest queue wait, 6s + 0.5s" in e and "forwarded unadmitted"
               in e for e in found.errors), found.errors
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(s.envoy_config()))
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "check", "--envoy", str(path), str(policy)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "max_message_timeout 2s" in run.stderr, run.stderr


class OtherServiceStack(Stack):
    """envoy.yaml with a route a team adds beside the API: /docs to a service of its own, the ext_proc off (as on
    envoy.yaml's read-only routes); and /v1/embeddings with the ext_proc off by mistake, which still counts."""

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        off = routes[-1]["typed_per_filter_config"]
        routes.insert(1, {"match": {"prefix": "/docs"}, "route": {"cluster": "docs", "timeout": "5s"},
                          "typed_per_filter_config": off})
        next(r for r in routes if r["match"].get("path") == "/v1/embeddings")["typed_per_filter_config"] = off
        pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "vllm_llama70b")
        cfg["static_resources"]["clusters"].append({"name": "docs", "type": "STATIC", "connect_timeout": "1s",
                                                    "load_assignment": {**pool["load_assignment"],
                                                                        "cluster_name": "docs"}})
        return cfg


async def test_requests_to_another_service_are_not_counted_as_unadmitted(tmp_path, upstream):
    policy = policy_file(tmp_path, endpoints={"embeddings": True})
    with OtherServiceStack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]},
                           policy_path=policy) as s:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.get(f"{s.url}/docs/index.html") as r:
                    assert r.status == 404  # the test upstream's own: it reached the service
            async with http.post(f"{s.url}/v1/embeddings", json={"model": "llama-70b", "input": "hi"}) as r:
                assert r.status == 200
            # Before: 4 (the docs GETs too), and the ExtprocRequestsUnadmitted alert for an ordinary route.
            assert await sample_once(http, s.metrics_url, "extproc_unadmitted_requests_total", 1.0) == 1.0
            await asyncio.sleep(1.2)  # the unadmitted log flushes every second: nothing more comes
            ms = await metrics(http, s.metrics_url)
            assert sample(ms, "extproc_unadmitted_requests_total") == 1
            assert sample(ms, "extproc_completion_reports_total", result="unmatched") == 0


class FilterOptionStack(Stack):
    """envoy.yaml with one option of the ext_proc filter set, as found in teams' configs."""

    option: dict = {}

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"][0]["typed_config"].update(self.option)
        return cfg


OPTIONS = {
    "disable_immediate_response": {"disable_immediate_response": True},
    "disable_clear_route_cache": {"disable_clear_route_cache": True},
    "mutation_rules": {"mutation_rules": {"disallow_expression": {"regex": "x-extproc-.*"}}},
    "forward_rules": {"forward_rules": {"allowed_headers": {"patterns": [{"prefix": ":"},
                                                                         {"exact": "content-type"}]}}},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
async def test_ext_proc_options_that_undo_admission_are_refused_by_check(tmp_path, upstream, small_pool, name):
    """Cap 1, three llama-8b requests at once from tenant acme (max_class batch): what each option did."""
    policy = policy_file(tmp_path, classes={"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0},
                                            "batch": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0}})
    stack = FilterOptionStack(tmp_path / "stack", {"vllm_llama70b": [upstream], "vllm_llama8b": [small_pool]},
                              policy_path=policy)
    stack.option = OPTIONS[name]
    with stack as s:
        async with aiohttp.ClientSession() as http:
            for pool in (upstream, small_pool):
                await upstream_reset(http, pool)

            async def one() -> tuple[int, str | None]:
                async with http.post(f"{s.url}/v1/chat/completions", json=chat(model="llama-8b"),
                                     headers={"x-test-delay-ms": "800", "authorization": "Bearer sk-acme-1"}) as r:
                    await r.read()
                    return r.status, r.headers.get("x-extproc-class")

            answers = await asyncio.gather(one(), one(), one())
            big, small = await upstream_stats(http, upstream), await upstream_stats(http, small_pool)
        found = lint(s.envoy_config(), {"vllm_llama70b", "vllm_llama8b"})
    if name == "disable_immediate_response":  # refusals ignored: all three ran, two unadmitted on the static route
        assert sorted(a[0] for a in answers) == [200, 200, 200] and big["unticketed"] == 2
    elif name == "disable_clear_route_cache":  # admitted for the 8B pool, run on the static route's 70B pool
        assert big["served"] == 1 and small["served"] == 0
    elif name == "mutation_rules":  # admitted, but neither ticket nor pool header reached Envoy's router
        assert big["served"] == 1 and big["unticketed"] == 1
    else:  # the key never reached the ext_proc: acme's request ran as an anonymous interactive one
        assert sorted(answers)[0] == (200, "interactive"), answers
    assert any(name in e for e in found.errors), found.errors
