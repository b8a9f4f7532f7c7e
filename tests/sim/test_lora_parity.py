"""The simulator's LoRA serving against real vLLM 0.32: tests/fixtures/vllm/lora*.json replayed, in order.

The fixtures were recorded from a real server (--enable-lora --max-loras 1, adapter a1 at start-up, a2 loaded and
unloaded at runtime; see tests/fixtures/vllm/README.md). The same requests go to a simulated replica started the
same way, with the adapters' folders recreated under tmp_path ("<repo>" in the files). Compared: statuses, JSON
shapes, every error body, the load/unload texts, the `model` an adapter is answered under, and the `/v1/models`
cards (ids, parent, max_model_len, an adapter's root), and the content-length of identical bodies. Not compared: token counts and generated text (the
simulator has no tokenizer) and the web server's own headers. A mismatch is a simulator bug, not a fixture to edit.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp

from extproc.tools.sim.fleet import SimFleet
from scripts.vllm.fixture_format import shape

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vllm"
PROFILE = "cpu-tiny-llama"


def load(name: str):
    return json.loads((FIX / name).read_text())


def here(value, repo: Path):
    """A recorded value with the recording checkout ("<repo>") replaced by this test's folder."""
    return json.loads(json.dumps(value).replace("<repo>", str(repo)))


def lora_fleet(fx: dict, repo: Path) -> SimFleet:
    args = here(fx["server_args"], repo)
    start = args.index("--lora-modules") + 1
    modules = args[start:next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))]
    for name in ("lora-a1", "lora-a2"):  # what scripts/vllm/build_lora.py leaves for the server to read
        folder = repo / ".cache" / "vllm-model" / name
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    return SimFleet(PROFILE, port=0, speed=20, lora_modules=modules, runtime_lora=True,
                    max_loras=int(args[args.index("--max-loras") + 1]))


def cards(doc: dict, roots: dict) -> list:
    return [(c["id"], c["parent"], c["max_model_len"], roots[c["id"]] if c["parent"] else None)
            for c in doc["data"]]


async def test_lora_cases_answer_as_the_real_vllm_did(tmp_path):
    fx = load("lora.json")
    async with lora_fleet(fx, tmp_path) as fleet, aiohttp.ClientSession() as http:
        for case, rec in fx.items():
            if case.startswith("server_"):
                continue
            req = here(rec["request"], tmp_path)
            async with http.request(req["method"], fleet.urls[0] + req["path"], json=req["body"]) as r:
                status, payload, length = r.status, await r.read(), r.headers.get("content-length")
            assert status == rec["status"], f"{case}: {status} {payload[:200]!r}"
            if rec["shape"] is None:  # plain text: the load/unload success
                assert payload.decode() == rec["text"] and length == rec["headers"]["content-length"], case
                continue
            doc = json.loads(payload)
            assert shape(doc) == rec["shape"], f"{case}: shape differs"
            real = here(rec["body"], tmp_path)
            if "error" in real:
                assert doc == real, case
                assert length == rec["headers"]["content-length"], f"{case}: the same body written otherwise"
            elif "data" in real:
                roots = {c["id"]: c["root"] for c in doc["data"]}
                assert cards(doc, roots) == cards(real, here(rec["roots"], tmp_path)), case
            else:
                assert doc["model"] == real["model"], case


def families(lines: list[str]) -> dict:
    """{family: (HELP text, sorted label names of its samples)} from /metrics lines."""
    out: dict = {}
    for line in lines:
        if line.startswith("# HELP "):
            name, _, text = line[7:].partition(" ")
            out[name] = (text, set())
        elif line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            if name in out:
                out[name][1].update(k for k in re.findall(r'(\w+)="', rest.partition("}")[0]) if k != "engine")
    return {k: (text, sorted(labels)) for k, (text, labels) in out.items() if k.startswith("vllm:")}


async def test_lora_metrics_are_named_and_labelled_as_the_real_vllm_did(tmp_path):
    fx, recorded = load("lora.json"), load("lora_metrics.json")
    real = recorded["deferred"]["while_both_held"]
    async with lora_fleet(fx, tmp_path) as fleet, aiohttp.ClientSession() as http:
        url = fleet.urls[0]
        a2 = here(fx["load_a2"]["request"]["body"], tmp_path)
        async with http.post(url + "/v1/load_lora_adapter", json=a2) as r:
            assert r.status == 200
        # the recorder's two long streams, a1 then a2: one runs, the other waits for the --max-loras 1 slot
        held = [asyncio.ensure_future(http.post(url + req["path"], json=req["body"]))
                for req in recorded["deferred"]["requests"]]
        text = ""
        for _ in range(100):
            await asyncio.sleep(0.02)
            async with http.get(url + "/metrics") as r:
                text = await r.text()
            if 'reason="deferred"} 1.0' in text and "vllm:num_requests_running{" in text:
                break
        for task in held:
            task.cancel()
    lines = text.splitlines()
    want, got = families(real["lines"]), families(lines)
    assert {name: got.get(name) for name in want} == want  # names, HELP texts, label names
    running = {ln.split(" ")[0] for ln in lines if ln.startswith("vllm:lora_requests_info{")}
    newest = max((ln for ln in real["lines"] if ln.startswith("vllm:lora_requests_info{")),
                 key=lambda ln: float(ln.rsplit(" ", 1)[1]))
    # the adapter running is both labels' value; the one deferred for the LoRA budget is in neither (as vLLM)
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="a1",waiting_lora_adapters="a1"}' in running
    assert "a2" not in " ".join(running) and 'running_lora_adapters="a1"' in newest
    assert real["num_requests_waiting_by_reason"] == {"reason=capacity": 0.0, "reason=deferred": 1.0}
    assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="deferred"} 1.0' in lines
