"""The simulator's LoRA serving against real vLLM 0.32: tests/fixtures/vllm/lora*.json replayed, in order.

The fixtures were recorded from a real server (--enable-lora --max-loras 1, adapter a1 at start-up, a2 loaded and
unloaded at runtime; see tests/fixtures/vllm/README.md). The same requests go to a simulated replica started the
same way, with the adapters' folders recreated under tmp_path ("<repo>" in the files). Compared: statuses, JSON
shapes, every error body, the load/unload texts, the `model` an adapter is answered under, and the `/v1/models`
cards (ids, parent, max_model_len, an adapter's root). Not compared: token counts and generated text (the
simulator has no tokenizer) and the web server's own headers. A mismatch is a simulator bug, not a fixture to edit.
"""

from __future__ import annotations

import json
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
    modules = [args[i + 1] for i, a in enumerate(args) if a == "--lora-modules"]
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
                status, payload = r.status, await r.read()
            assert status == rec["status"], f"{case}: {status} {payload[:200]!r}"
            if rec["shape"] is None:  # plain text: the load/unload success
                assert payload.decode() == rec["text"], case
                continue
            doc = json.loads(payload)
            assert shape(doc) == rec["shape"], f"{case}: shape differs"
            real = here(rec["body"], tmp_path)
            if "error" in real:
                assert doc == real, case
            elif "data" in real:
                roots = {c["id"]: c["root"] for c in doc["data"]}
                assert cards(doc, roots) == cards(real, here(rec["roots"], tmp_path)), case
            else:
                assert doc["model"] == real["model"], case
