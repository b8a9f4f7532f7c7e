"""One base model, many names, through real Envoy + the ext_proc + simulated vLLM replicas: LoRA adapters (given at
start-up and loaded at runtime) and a served-name alias reach their model's pool, are counted as that model, an
adapter's class degrades to the small model, and names nobody serves neither pass nor become metric labels."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp

from extproc.tools.sim.fleet import SimFleet
from tests.conftest import policy_file, until

from .helpers import chat, metrics, post

SPEED = 10.0
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
ADAPTERS = [f"ft-{i}" for i in range(8)]


def write_policy(tmp_path, replicas: list[str]):
    tuned = {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0, "on_overflow": "fallback",
             "fallback": {"action": "degrade", "model": "llama-8b", "max_tokens": 2}}
    models = {"llama-70b": {"cluster": "vllm_llama70b", "names_from_replicas": True},
              "llama-8b": {"cluster": "vllm_llama8b", "aliases": ["llama-3.1-8b-instruct"]}}
    return policy_file(tmp_path, classes={"interactive": {"max_concurrency": 8, "max_queue": 0, "max_wait_ms": 0},
                                          "tuned": tuned},
                       models=models, tenants=[], shed={},
                       pools={"vllm_llama70b": {"replicas": replicas, "models_interval_ms": 200,
                                                "scrape_interval_ms": 100}})


async def answer(http, url: str, model: str, **extra):
    status, headers, body = await post(http, url, chat(model=model, **extra))
    doc = json.loads(body)
    return status, headers.get("x-extproc-decision"), doc.get("model") or doc["error"]["message"]


async def test_adapters_and_aliases_reach_their_models_pool_and_degrade_to_the_small_model(make_stack, tmp_path):
    big = SimFleet("h100-llama70b-awq", replicas=2, speed=SPEED, model_names=["llama-70b"],
                   lora_modules=[f"{a}=/adapters/{a}" for a in ADAPTERS], runtime_lora=True)
    small = SimFleet("h100-llama8b", replicas=1, speed=SPEED, model_names=["llama-8b", "llama-3.1-8b-instruct"])
    async with big, small, aiohttp.ClientSession() as http:
        s = make_stack(write_policy(tmp_path, [f"127.0.0.1:{p}" for p in big.ports]),
                       pools={"vllm_llama70b": [("127.0.0.1", p) for p in big.ports],
                              "vllm_llama8b": [("127.0.0.1", small.ports[0])]})
        # An adapter given at start-up: admitted once the replicas' /v1/models were read, answered by the 70B pool.
        assert await until(lambda: answer(http, s.url, "ft-3"), 10, holds=lambda a: a[0] == 200) == \
            (200, "accept", "ft-3")
        # The 8B's alias reaches the 8B pool (which answers under its first served name).
        assert await answer(http, s.url, "llama-3.1-8b-instruct") == (200, "accept", "llama-8b")

        # An adapter loaded at runtime: refused until a replica lists it, then served.
        assert (await answer(http, s.url, "late-a"))[:2] == (404, "invalid")
        (tmp_path / "late-a").mkdir()
        (tmp_path / "late-a" / "adapter_config.json").write_text("{}")  # a runtime load reads its local path
        for url in big.urls:
            async with http.post(url + "/v1/load_lora_adapter",
                                 json={"lora_name": "late-a", "lora_path": str(tmp_path / "late-a")}) as r:
                assert r.status == 200
        assert await until(lambda: answer(http, s.url, "late-a"), 10, holds=lambda a: a[0] == 200) == \
            (200, "accept", "late-a")

        # The adapter's class is full: the next request of the class degrades to the 8B model, its body rewritten.
        held = asyncio.create_task(post(http, s.url, chat(model="ft-1", max_tokens=3000, ignore_eos=True),
                                        {"x-priority": "tuned"}))
        await until(lambda: metrics(http, s.metrics_url),
                    holds=lambda ms: ms.get(("extproc_inflight", frozenset({("class", "tuned")}))) == 1)
        status, headers, body = await post(http, s.url, chat(model="ft-2", max_tokens=50), {"x-priority": "tuned"})
        doc = json.loads(body)
        assert (status, headers.get("x-extproc-decision"), doc["model"]) == (200, "degrade", "llama-8b")
        assert doc["usage"]["completion_tokens"] <= 2
        held.cancel()

        # Requests for six adapters at once: vLLM (--max-loras 1) runs one adapter's at a time per replica and keeps
        # the others waiting, deferred for its LoRA budget. That is not saturation: the pool must not read saturated.
        burst = asyncio.gather(*[post(http, s.url, chat(model=f"ft-{i}", max_tokens=1000, ignore_eos=True))
                                 for i in range(6)])
        deferred = saturated = 0
        while not burst.done():
            deferred = max([deferred] + [r.engine.deferred for r in big.replicas])
            ms = await metrics(http, s.metrics_url)
            saturated = max(saturated, ms.get(("extproc_pool_saturated", frozenset({("pool", "vllm_llama70b")}))))
            await asyncio.sleep(0.05)
        assert all(status == 200 for status, _, _ in await burst)
        assert deferred >= 1 and saturated == 0, (deferred, saturated)

        # Names nobody serves: 404 from the ext_proc, and no metric series of their own.
        for i in range(200):
            assert (await answer(http, s.url, f"bogus-{i}"))[:2] == (404, "invalid")
        ms = await metrics(http, s.metrics_url)
        models = {dict(labels).get("model") for _, labels in ms} - {None}
        assert models <= {"llama-70b", "llama-8b"}, models
        assert not any("bogus" in value for _, labels in ms for _, value in labels)


async def test_get_models_through_envoy_lists_every_pools_names_once_as_vllm_cards(make_stack, tmp_path):
    """GET /v1/models and /v1/models/{id} through Envoy: the ext_proc answers for both pools (the route alone would
    reach one), the adapters with the fields their replicas give, each name once, in vLLM's card shape."""
    big = SimFleet("h100-llama70b-awq", replicas=2, speed=SPEED, model_names=["llama-70b"],
                   lora_modules=[f"{a}=/adapters/{a}" for a in ADAPTERS])
    small = SimFleet("h100-llama8b", replicas=1, speed=SPEED, model_names=["llama-8b", "llama-3.1-8b-instruct"])
    fixture = json.loads((FIXTURES / "models.json").read_text())["body"]["data"][0]
    async with big, small, aiohttp.ClientSession() as http:
        s = make_stack(write_policy(tmp_path, [f"127.0.0.1:{p}" for p in big.ports]),
                       pools={"vllm_llama70b": [("127.0.0.1", p) for p in big.ports],
                              "vllm_llama8b": [("127.0.0.1", small.ports[0])]})

        async def listing():
            async with http.get(f"{s.url}/v1/models") as r:
                assert r.status == 200 and "x-extproc-decision" not in r.headers
                return (await r.json())["data"]

        cards = await until(listing, 10, holds=lambda d: len(d) == 3 + len(ADAPTERS))
        assert [c["id"] for c in cards] == ["llama-70b", *ADAPTERS, "llama-8b", "llama-3.1-8b-instruct"]
        assert all(set(c) == set(fixture) and c["object"] == "model" for c in cards)
        by_id = {c["id"]: c for c in cards}
        assert (by_id["ft-3"]["root"], by_id["ft-3"]["parent"], by_id["ft-3"]["max_model_len"]) == \
            ("/adapters/ft-3", "llama-70b", None)
        assert isinstance(by_id["llama-70b"]["max_model_len"], int)  # the replicas' own card
        assert (by_id["llama-3.1-8b-instruct"]["root"], by_id["llama-3.1-8b-instruct"]["parent"]) == \
            ("llama-8b", None)  # its pool's listings are not read: what the policy knows

        async with http.get(f"{s.url}/v1/models/ft-3") as r:
            assert r.status == 200 and (await r.json())["parent"] == "llama-70b"
        async with http.get(f"{s.url}/v1/models/llama-3.1-8b-instruct") as r:
            assert r.status == 200 and (await r.json())["id"] == "llama-3.1-8b-instruct"
        async with http.get(f"{s.url}/v1/models/no-such-model") as r:
            assert r.status == 404 and r.headers["x-extproc-reason"] == "unknown_model"
            assert (await r.json())["error"]["param"] == "model"
        async with http.post(f"{s.url}/v1/models", json={}) as r:
            assert r.status == 404  # GET only, as before
