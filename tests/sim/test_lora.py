"""LoRA adapters as vLLM serves them: --lora-modules, /v1/models cards, runtime load/unload, errors."""

import asyncio
import json

import aiohttp
import pytest

from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.lora import parse_module

BASE = "llama-70b"


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_static_adapters_are_listed_with_parent_and_root_and_answer_under_their_name(http):
    modules = ["sql-lora=/adapters/sql", '{"name": "chat-lora", "path": "/adapters/chat", "base_model_name": "l70"}']
    async with SimFleet("h100-llama70b-awq", port=0, speed=50, model_names=[BASE, "l70"],
                        lora_modules=modules) as fleet:
        url = fleet.urls[0]
        async with http.get(url + "/v1/models") as resp:
            cards = {c["id"]: c for c in (await resp.json())["data"]}
        assert list(cards) == [BASE, "l70", "sql-lora", "chat-lora"]
        assert cards[BASE]["parent"] is None and cards[BASE]["max_model_len"] == 8192
        assert (cards["sql-lora"]["root"], cards["sql-lora"]["parent"]) == ("/adapters/sql", BASE)
        assert (cards["chat-lora"]["root"], cards["chat-lora"]["parent"]) == ("/adapters/chat", "l70")
        assert cards["sql-lora"]["max_model_len"] is None and cards["sql-lora"]["owned_by"] == "vllm"
        async with http.post(url + "/v1/chat/completions", json=chat("sql-lora")) as resp:
            assert resp.status == 200
            assert (await resp.json())["model"] == "sql-lora"  # vLLM names the adapter, not the base
        async with http.post(url + "/v1/chat/completions", json=chat("l70")) as resp:
            assert (await resp.json())["model"] == BASE  # an alias is answered under the first served name


async def test_runtime_endpoints_exist_only_when_enabled(http):
    async with SimFleet("h100-llama70b-awq", port=0, speed=50, model_names=[BASE], runtime_lora=False) as fleet:
        async with http.post(fleet.urls[0] + "/v1/load_lora_adapter",
                             json={"lora_name": "a", "lora_path": "/a"}) as resp:
            assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}


async def test_runtime_load_and_unload_as_vllm_answers(http, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")  # a runtime load reads a local path (see below)
    async with SimFleet("h100-llama70b-awq", port=0, speed=50, model_names=[BASE], runtime_lora=True) as fleet:
        url = fleet.urls[0]
        async with http.post(url + "/v1/chat/completions", json=chat("late-lora")) as resp:
            err = (await resp.json())["error"]
            assert resp.status == 404 and err["type"] == "NotFoundError" and err["param"] == "model"
            assert err["message"].startswith("The model `late-lora` does not exist.") and err["code"] == 404
        load = {"lora_name": "late-lora", "lora_path": str(tmp_path)}
        async with http.post(url + "/v1/load_lora_adapter", json=load) as resp:
            assert resp.status == 200 and "content-type" not in resp.headers
            assert await resp.text() == "Success: LoRA adapter 'late-lora' added successfully."
        async with http.post(url + "/v1/load_lora_adapter", json=load) as resp:
            err = (await resp.json())["error"]
            assert resp.status == 400 and err["type"] == "InvalidUserInput" and "already been loaded" in err["message"]
        async with http.post(url + "/v1/load_lora_adapter", json={**load, "load_inplace": True}) as resp:
            assert resp.status == 200
        async with http.post(url + "/v1/load_lora_adapter", json={"lora_name": "", "lora_path": "/x"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
        async with http.post(url + "/v1/chat/completions", json=chat("late-lora")) as resp:
            assert resp.status == 200 and (await resp.json())["model"] == "late-lora"
        async with http.get(url + "/v1/models") as resp:
            assert [c["id"] for c in (await resp.json())["data"]] == [BASE, "late-lora"]
        async with http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late-lora"}) as resp:
            assert resp.status == 200
            assert await resp.text() == "Success: LoRA adapter 'late-lora' removed successfully."
        async with http.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late-lora"}) as resp:
            err = (await resp.json())["error"]
            assert resp.status == 404 and err == {"message": "The lora adapter 'late-lora' cannot be found.",
                                                  "type": "NotFoundError", "param": None, "code": 404}
        async with http.post(url + "/v1/unload_lora_adapter", json={}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "body.lora_name"


async def test_a_runtime_load_finds_no_adapter_where_vllm_finds_none(http, tmp_path):
    async with SimFleet("h100-llama70b-awq", port=0, speed=50, model_names=[BASE], runtime_lora=True) as fleet:
        url = fleet.urls[0]
        # no such folder; a folder without adapter_config.json (under /tmp, which vLLM's messages hide)
        for path, shown in (("/adapters/nowhere", "/adapters/nowhere"), (str(tmp_path), "<path>")):
            async with http.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}) as resp:
                assert resp.status == 404 and (await resp.json())["error"] == {
                    "message": f"Loading lora x failed: No adapter found for {shown}", "type": "NotFoundError",
                    "param": None, "code": 404}
        # a name that is no local path is a hub id: vLLM downloads it; the simulator, without a hub, loads it
        async with http.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "org/x"}) as resp:
            assert resp.status == 200
        async with http.get(url + "/v1/models") as resp:
            assert [c["id"] for c in (await resp.json())["data"]] == [BASE, "x"]


def test_lora_module_forms():
    assert parse_module("a=/p") == parse_module(json.dumps({"name": "a", "path": "/p"}))
    assert parse_module('{"name": "a", "path": "/p", "base_model_name": "b"}').base == "b"
    for bad in ("a", "=p", "a=", '{"name": "a"}'):
        with pytest.raises(ValueError):
            parse_module(bad)


def test_max_loras_passes_over_requests_for_another_adapter_as_vllm_does():
    from extproc.tools.sim.engine import Engine
    from extproc.tools.sim.profile import load_profile

    def running_after_one_step(max_loras):
        engine = Engine(load_profile("h100-llama70b-awq"), max_loras=max_loras)
        for lora in (1, 2, 1, 0, 2):
            engine.add_request(16, 4, 0.0, natural_tokens=4, lora=lora)
        engine.end_iteration(engine.begin_iteration(0.0))
        return sorted(s.lora for s in engine.running), sorted(s.lora for s in engine.waiting), engine

    running, waiting, engine = running_after_one_step(1)
    # adapter 2 waits behind adapter 1 (the base model's request is no adapter and goes by), in its order
    assert (running, waiting) == ([0, 1, 1], [2, 2]) and [s.id for s in engine.waiting] == [1, 4]
    t = 0.0
    while any(s.lora == 1 for s in engine.running):  # until adapter 1's requests end
        t += engine.begin_iteration(t)
        engine.end_iteration(t)
    engine.begin_iteration(t)
    assert sorted(s.lora for s in engine.running if s.lora) == [2, 2]
    assert running_after_one_step(2)[:2] == ([0, 1, 1, 2, 2], [])
    assert running_after_one_step(None)[:2] == ([0, 1, 1, 2, 2], [])


async def test_a_fleet_serving_adapters_runs_one_adapter_at_a_time_by_default(http):
    async with SimFleet("h100-llama70b-awq", port=0, speed=5, model_names=[BASE],
                        lora_modules=["a=/a", "b=/b"]) as fleet:
        replica = fleet.replicas[0]
        assert replica.engine.max_loras == 1 and replica.loras.ids == {"a": 1, "b": 2}
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "ignore_eos": True}
        calls = [http.post(fleet.urls[0] + "/v1/chat/completions", json={**body, "model": m}) for m in "ab"]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0.1)
        state = replica.state()
        assert (state["running"], state["waiting"]) == (1, 1)
        for t in tasks:
            (await t).release()


def test_requests_held_back_by_the_lora_budget_are_waiting_for_reason_deferred():
    from extproc.tools.sim.engine import Engine
    from extproc.tools.sim.metrics import ReplicaMetrics
    from extproc.tools.sim.profile import load_profile

    engine = Engine(load_profile("h100-llama70b-awq"), max_loras=1)
    for lora in (1, 2, 3):
        engine.add_request(16, 4, 0.0, lora=lora)
    engine.begin_iteration(0.0)
    text = ReplicaMetrics(BASE).render(engine)
    assert 'vllm:num_requests_waiting{engine="0",model_name="llama-70b"} 2.0' in text
    assert 'reason="deferred"} 2.0' in text and 'reason="capacity"} 0.0' in text


def test_requests_passed_over_stay_deferred_when_the_running_adapter_is_aborted_between_steps():
    """vLLM keeps a request the LoRA budget passed over in its skipped-waiting queue until a schedule takes it: an
    abort between two steps does not turn the others into requests waiting for capacity (read as saturation)."""
    from extproc.tools.sim.engine import Engine
    from extproc.tools.sim.metrics import ReplicaMetrics
    from extproc.tools.sim.profile import load_profile

    engine = Engine(load_profile("h100-llama70b-awq"), max_loras=1)
    first = engine.add_request(16, 400, 0.0, lora=1)
    for lora in (2, 3):
        engine.add_request(16, 400, 0.0, lora=lora)
    engine.begin_iteration(0.0)
    engine.abort(first, 0.01)
    assert (len(engine.running), engine.deferred) == (0, 2)
    assert 'reason="deferred"} 2.0' in ReplicaMetrics(BASE).render(engine)
    engine.end_iteration(0.02)
    engine.begin_iteration(0.02)  # the next step takes one of them: the other is still passed over
    assert (len(engine.running), engine.deferred) == (1, 1)


def test_an_unloaded_adapters_id_is_not_given_to_the_next_one_loaded():
    # vLLM numbers adapters from a counter that never goes back: the requests of an unloaded adapter still running
    # must not share their id (what --max-loras and the scheduler count) with an adapter loaded after it.
    from extproc.tools.sim.lora import Adapter, LoraRegistry

    registry = LoraRegistry((BASE,), [Adapter("a", "/a")])
    registry.load(json.dumps({"lora_name": "b", "lora_path": "hub/b"}).encode())
    held_by_b = registry.ids["b"]
    registry.unload(json.dumps({"lora_name": "b"}).encode())
    registry.load(json.dumps({"lora_name": "c", "lora_path": "hub/c"}).encode())
    assert registry.ids == {"a": 1, "c": 3} and registry.ids["c"] != held_by_b
    registry.load(json.dumps({"lora_name": "c", "lora_path": "hub/c2", "load_inplace": True}).encode())
    assert registry.ids["c"] == 3  # a load in place keeps its id


def test_max_loras_below_one_is_refused_at_start_up():
    # --max-loras 0 passed over every adapter request forever (the engine parked with them waiting); vLLM refuses it.
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_loras"):
            SimFleet("h100-llama70b-awq", lora_modules=["a=/a"], max_loras=bad)
    assert SimFleet("h100-llama70b-awq", max_loras=0).replicas[0].engine.max_loras is None  # LoRA off: unused


def test_load_inplace_is_read_as_a_lax_boolean():
    # bool("false") is True: a reload asking not to be in place replaced the adapter instead of vLLM's 400.
    from extproc.tools.sim.lora import LoraRegistry
    from extproc.tools.sim.openai_api import ApiError

    registry = LoraRegistry((BASE,))
    registry.load(json.dumps({"lora_name": "b", "lora_path": "hub/b"}).encode())
    for inplace in ("false", 0, "no"):
        with pytest.raises(ApiError, match="already been loaded"):
            registry.load(json.dumps({"lora_name": "b", "lora_path": "hub/b2", "load_inplace": inplace}).encode())
    assert registry.adapters["b"].path == "hub/b"
    registry.load(json.dumps({"lora_name": "b", "lora_path": "hub/b2", "load_inplace": "true"}).encode())
    assert registry.adapters["b"].path == "hub/b2"
