"""The live half of tests/ops/test_envoy_check_audit.py: each variant shown to bypass admission (the check accepted
them until stop 56 and refuses them since) and a few safe ones, applied to a local stack
(real Envoy + the ext_proc + two test upstreams standing in for the 70B and 8B pools), and the request that shows
where it went. Prints one JSON line per variant with the evidence: the response status, what each upstream saw
(ticket or not), and the ext_proc's decisions (extproc_requests_total) and unadmitted count around the request.

    timeout 900 env PYTHONPATH=. .venv/bin/python -m tests.ops.envoy_audit_live [NAME ...]

Not collected by pytest (a script: it starts a stack per variant, ~1-2 minutes in all)."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import aiohttp

from extproc.tools.stack import Stack, free_port
from tests.conftest import policy_file, run_upstream
from tests.integration.helpers import chat, metrics, sample
from tests.ops import test_envoy_check_audit as audit


class VariantStack(Stack):
    edit = None
    extra_port = 0

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        if self.edit is not None:
            self.edit(cfg, self.extra_port)
        return cfg


async def seen(http, up) -> list[dict]:
    async with http.get(f"http://{up[0]}:{up[1]}/test/seen") as r:
        return [{**{k: x[k] for k in ("method", "path", "ticket", "body_len")},
                 **{k: v for k, v in x["values"] if k == "x-extproc-cluster"}}
                for x in await r.json() if x["path"] != "/health"]


async def reset(http, *ups) -> None:
    for up in ups:
        async with http.post(f"http://{up[0]}:{up[1]}/test/reset") as r:
            await r.read()


async def stats(http, up) -> dict:
    async with http.get(f"http://{up[0]}:{up[1]}/test/stats") as r:
        return {k: v for k, v in (await r.json()).items() if k in ("max_in_service", "served", "unticketed")}


async def counts(http, s: Stack) -> dict:
    ms = await metrics(http, s.metrics_url)
    return {"decided": sample(ms, "extproc_requests_total"),
            "accepted": sample(ms, "extproc_requests_total", decision="accept"),
            "unadmitted": sample(ms, "extproc_unadmitted_requests_total")}


async def post(http, url: str, body, **headers) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"content-type": "application/json", **headers}) as r:
        text = await r.read()
        if r.status >= 400:
            LAST[r.status] = (dict(r.headers), text[:300].decode("latin-1"))
        return r.status


LAST: dict = {}


async def slow_uploads(port: int, n: int) -> list[asyncio.StreamWriter]:
    """n HTTP/1.1 requests whose headers are sent and whose body never finishes: each holds an ext_proc stream."""
    writers = []
    for i in range(n):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1000\r\n\r\n{\"model\":")
        await w.drain()
        writers.append(w)
    return writers


async def probe(name: str, s: Stack, http, a, b) -> dict:
    """The request that shows the variant's effect; a, b: the 70B and 8B pools' upstreams."""
    url = s.url
    out: dict = {}
    if name in ("renamed_filter_canonical_key_off", "override_google_grpc_processor"):
        out["status"] = await post(http, f"{url}/v1/chat/completions", chat())
    elif name in ("bigger_request_buffer", "bigger_route_buffer"):
        big = chat() | {"messages": [{"role": "user", "content": "x" * (9 << 20)}]}
        out["status_9MiB"] = await post(http, f"{url}/v1/chat/completions", big)
        out["answer_9MiB"] = {k: [v[0].get("x-extproc-reason"), v[0].get("server"), v[1][:160]]
                              for k, v in LAST.items()}
        LAST.clear()
        out["ext_proc_after_9MiB"] = await counts(http, s)
        out["after_9MiB"] = await seen(http, a)
        await reset(http, a)
        mid = chat() | {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
        out["status_5MiB"] = await post(http, f"{url}/v1/chat/completions", mid)
        out["errors"] = {k: [v[0].get("x-extproc-reason"), v[1][:160]] for k, v in LAST.items()}
    elif name in ("short_message_timeout", "shipped_burst"):
        tasks = [post(http, f"{url}/v1/chat/completions", chat(), **{"x-test-delay-ms": "1500"})
                 for _ in range(300)]
        st = [x if isinstance(x, int) else type(x).__name__ for x in await asyncio.gather(*tasks,
                                                                                          return_exceptions=True)]
        out["statuses"] = {str(k): st.count(k) for k in set(st)}
        out["upstream"] = await stats(http, a)
        return out
    elif name in ("ext_proc_breakers_left_out", "shipped_slow_uploads"):
        writers = await slow_uploads(s.listen_port, 1030)
        try:
            await asyncio.sleep(1.0)
            out["status"] = await post(http, f"{url}/v1/chat/completions", chat())
            out["upstream_a"] = [x for x in await seen(http, a) if x["path"] == "/v1/chat/completions"]
        finally:
            for w in writers:
                w.close()
        return out
    elif name == "header_route_narrowed_to_v1":
        body = {"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        out["status"] = await post(http, f"{url}/invocations", body)
    elif name == "internal_route_to_sibling_cluster":
        out["status"] = await post(http, f"{url}/internal/v1/chat/completions", chat())
    elif name == "canary_route_before_header_route":
        out["status"] = await post(http, f"{url}/v1/chat/completions", chat(), **{"x-canary": "1"})
    elif name in ("trusted_internal_addresses", "shipped_hedge_headers"):
        out["status"] = await post(http, f"{url}/v1/chat/completions", chat(), **{
            "x-envoy-retry-on": "5xx,reset", "x-envoy-max-retries": "2",
            "x-envoy-upstream-rq-per-try-timeout-ms": "300", "x-envoy-hedge-on-per-try-timeout": "true",
            "x-test-delay-ms": "1000"})
        await asyncio.sleep(0.3)
        out["upstream_a_stats"] = await stats(http, a)
    elif name == "forward_proxy_listener":
        out["status"] = await post(http, f"http://127.0.0.1:{s.extra_port}/v1/chat/completions", chat(),
                                   host=f"{a[0]}:{a[1]}")
    elif name == "typed_struct_listener":
        out["status"] = await post(http, f"http://127.0.0.1:{s.extra_port}/v1/chat/completions", chat())
    elif name == "weighted_entry_by_header_without_ext_proc":
        body = {"model": "llama-70b", "prompt": "hi", "max_tokens": 2}
        out["status"] = await post(http, f"{url}/v1/completions", body, **{"x-pool": "vllm_llama70b"})
    elif name == "no_path_normalisation":
        for p in ("/v1/chat/%63ompletions", "//v1/chat/completions", "/v1/chat%2Fcompletions",
                  "/v1/./chat/completions", "/health/../v1/chat/completions"):
            out[p] = await post(http, url + p, chat())
    elif name == "websocket_upgrades":
        ws = {"upgrade": "websocket", "connection": "upgrade", "sec-websocket-version": "13",
              "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}
        async with http.get(f"{url}/v1/chat/completions", headers=ws) as r:
            out["status_get_upgrade"] = r.status
    elif name in ("internal_route_to_aggregate", "internal_route_to_sibling_by_fqdn",
                  "internal_route_to_sibling_port_quoted", "guardrail_ext_proc_first"):
        out["status"] = await post(http, f"{url}/internal/v1/chat/completions", chat())
    elif name in ("mirror_to_aggregate", "route_table_mirror_to_pool"):
        out["status"] = await post(http, f"{url}/v1/chat/completions", chat(), **{"x-test-delay-ms": "1000"})
        await asyncio.sleep(0.5)
        out["upstream_a_stats"] = await stats(http, a)
    elif name == "original_dst_lower_case":
        out["status"] = await post(http, f"http://127.0.0.1:{s.extra_port}/v1/chat/completions", chat(),
                                   **{"x-envoy-original-dst-host": f"{a[0]}:{a[1]}"})
    elif name == "scoped_routes_listener":
        out["status"] = await post(http, f"http://127.0.0.1:{s.extra_port}/v1/chat/completions", chat(),
                                   **{"x-tenant-scope": "batch"})
    elif name in ("vhost_processor_under_route_overrides", "route_override_async_mode", "body_without_waiting",
                  "rc_level_off_under_route_processing_mode"):
        out["status"] = await post(http, f"{url}/v1/chat/completions", chat())
    elif name == "internal_route_to_eds_cluster":
        out["status"] = await post(http, f"{url}/internal/v1/chat/completions", chat())
    elif name == "header_route_runtime_fraction":
        out["statuses"] = [await post(http, f"{url}/v1/chat/completions", chat(model="llama-8b")) for _ in range(8)]
    elif name == "generic_proxy_http1_listener":
        out["status"] = await post(http, f"http://127.0.0.1:{s.extra_port}/v1/chat/completions", chat())
    elif name in ("bigger_request_buffer_quoted", "shipped_big", "fail_closed_route_fails_open_big_buffer"):
        big = chat() | {"messages": [{"role": "user", "content": "x" * (9 << 20)}]}
        out["status_9MiB"] = await post(http, f"{url}/v1/chat/completions", big)
        # Who answered: the test upstream (aiohttp, 1 MiB body limit) means the body went past Envoy and the
        # ext_proc to the replica; Envoy's own 413 or the ext_proc's refusal would say so.
        out["answer_9MiB"] = {k: [v[0].get("x-extproc-reason"), v[0].get("server"), v[1][:160]]
                              for k, v in LAST.items()}
        LAST.clear()
        out["upstream_a"] = [{k: x[k] for k in ("path", "ticket", "body_len")} for x in await seen(http, a)]
    elif name == "lua_before_ext_proc" or name == "shipped":
        out["status"] = await post(http, f"{url}/v1/chat/completions", chat())
    return out


LIVE = ["shipped", "shipped_big", "shipped_hedge_headers", "shipped_burst", "shipped_slow_uploads",
        "renamed_filter_canonical_key_off", "override_google_grpc_processor",
        "bigger_request_buffer", "bigger_route_buffer", "short_message_timeout", "header_route_narrowed_to_v1",
        "internal_route_to_sibling_cluster", "canary_route_before_header_route", "trusted_internal_addresses",
        "forward_proxy_listener", "typed_struct_listener", "weighted_entry_by_header_without_ext_proc",
        "no_path_normalisation", "websocket_upgrades", "lua_before_ext_proc", "ext_proc_breakers_left_out",
        # the third round
        "internal_route_to_aggregate", "mirror_to_aggregate", "internal_route_to_sibling_by_fqdn",
        "internal_route_to_sibling_port_quoted", "route_table_mirror_to_pool", "guardrail_ext_proc_first",
        "vhost_processor_under_route_overrides", "original_dst_lower_case", "scoped_routes_listener",
        "rc_level_off_under_route_processing_mode", "route_override_async_mode",
        "fail_closed_route_fails_open_big_buffer", "header_route_runtime_fraction", "internal_route_to_eds_cluster",
        "generic_proxy_http1_listener", "bigger_request_buffer_quoted", "body_without_waiting"]


async def run_one(name: str, a, b, tmp: Path) -> dict:
    edit = None if name.startswith("shipped") else getattr(audit, name)
    tmp.mkdir(parents=True, exist_ok=True)
    policy = policy_file(tmp)
    cls = type("S", (VariantStack,), {"edit": staticmethod(edit) if edit else None, "extra_port": free_port()})
    try:
        with cls(tmp / "stack", {"vllm_llama70b": [a], "vllm_llama8b": [b]}, policy_path=policy) as s:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                await reset(http, a, b)
                before = await counts(http, s)
                out = await probe(name, s, http, a, b)
                await asyncio.sleep(1.5)  # the unadmitted access log flushes every second
                after = await counts(http, s)
                out["ext_proc"] = {k: after[k] - before[k] for k in after}
                out.setdefault("upstream_a", await seen(http, a))
                out["upstream_b"] = await seen(http, b)
                for k in ("upstream_a", "upstream_b"):
                    if isinstance(out[k], list) and len(out[k]) > 5:
                        out[k] = {"n": len(out[k]), "unticketed": sum(not x["ticket"] for x in out[k])}
                return out
    except RuntimeError as e:
        return {"start_failed": str(e)[-600:]}


async def main(names: list[str]) -> None:
    with run_upstream() as a, run_upstream() as b, tempfile.TemporaryDirectory() as d:
        for name in names or LIVE:
            out = await run_one(name, a, b, Path(d) / name)
            print(json.dumps({"variant": name, **out}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
