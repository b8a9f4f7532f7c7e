"""The simulator against real vLLM: every recorded fixture in tests/fixtures/vllm/ replayed against the simulator.

Fast and offline: the simulator runs in-process with the `cpu-tiny-llama` profile (the e2e suite's real vLLM: the
same two served names and context). Compared: JSON shapes (`shape()`, the fixture format's own rule: key sets at
every level, nulls vs absent), the recorded value formats, SSE framing and event sequences, error statuses, types,
params and messages, `/metrics` families, `/v1/models`, `/health`, `/version`, and what a client abort does to the
metrics. Any mismatch is a simulator bug to fix (extproc/tools/sim/), never a fixture to edit.

What is not compared, on purpose: generated text and token counts (the simulator has no tokenizer: it estimates
~4 characters a token, so requests whose outcome depends on a token count are rebuilt with the same count under
the simulator's estimate), header values owned by the web server (`date`, `server: uvicorn`, `vary`), and
`logit_bias` (no vocabulary: `chat_stop*` are compared on shapes only, not on the early stop).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.tokens import filler_text
from scripts.vllm.fixture_format import shape
from scripts.vllm.record_fixtures import classify, compress, parse_metrics, parse_sse, usage_state

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "vllm"

PROFILE = "cpu-tiny-llama"
WEB_SERVER_HEADERS = {"date", "server", "vary"}  # uvicorn's; not the API's
NON_STREAM = ["chat.json", "chat_stop.json", "chat_small_model.json", "completions.json"]
STREAMS = ["chat_stream.json", "chat_stream_usage.json", "chat_stream_continuous_usage.json",
           "chat_stream_stop.json", "completions_stream.json", "completions_stream_usage.json"]
EOS_STOP = {"chat_stop.json", "chat_stream_stop.json"}  # logit_bias on EOS: real vLLM stops at once


def load(name: str):
    return json.loads((FIX / name).read_text())


@pytest.fixture
async def sim():
    async with SimFleet(PROFILE, replicas=1, port=0, speed=20) as fleet, aiohttp.ClientSession() as http:
        yield fleet.urls[0], http, fleet


async def request(http, url, req: dict, body=None, raw: bytes | None = None):
    method, path = req["method"], req["path"]
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"content-type": "application/json"} if data is not None else {}
    async with http.request(method, url + path, data=data, headers=headers) as r:
        return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()


def assert_headers(fixture_headers: dict, got: dict, where: str) -> None:
    """Same header names (minus the web server's own); same value where the fixture recorded one verbatim."""
    want = {k: v for k, v in fixture_headers.items() if k not in WEB_SERVER_HEADERS}
    have = {k: v for k, v in got.items() if k not in WEB_SERVER_HEADERS}
    assert set(have) == set(want), f"{where}: header names {sorted(have)} != real {sorted(want)}"
    for k, v in want.items():
        if not v.startswith("<"):
            assert have[k] == v, f"{where}: header {k}: {have[k]!r} != real {v!r}"


def values_at(doc, path: str):
    """Values at a fixture `formats` path such as `$.data[].permission[].id`."""
    current = [doc]
    for part in re.findall(r"\.([^.\[\]]+)(\[\])?", path[1:]):
        key, is_list = part
        current = [c[key] for c in current if isinstance(c, dict) and key in c]
        if is_list:
            current = [x for c in current for x in c]
    return current


def assert_formats(formats: dict, doc, where: str) -> None:
    for path, pattern in formats.items():
        found = values_at(doc, path)
        assert found, f"{where}: nothing at {path}"
        for value in found:
            assert re.match(pattern, str(value)), f"{where}: {path} = {value!r} does not match {pattern}"


# ------------------------------------------------------------------------------------------ admin endpoints
async def test_health(sim):
    url, http, _ = sim
    fx = load("health.json")
    status, headers, body = await request(http, url, fx["request"])
    assert status == fx["status"] and body.decode() == fx["body"]
    assert_headers(fx["headers"], headers, "health")


async def test_version(sim):
    url, http, _ = sim
    fx = load("version.json")
    status, headers, body = await request(http, url, fx["request"])
    doc = json.loads(body)
    assert status == fx["status"] and shape(doc) == fx["shape"]
    assert doc["version"].startswith(fx["body"]["version"])  # the simulator says "0.32.0-sim"
    assert_headers(fx["headers"], headers, "version")


async def test_models(sim):
    url, http, _ = sim
    fx = load("models.json")
    status, headers, body = await request(http, url, fx["request"])
    doc = json.loads(body)
    assert status == fx["status"] and shape(doc) == fx["shape"]
    assert [d["id"] for d in doc["data"]] == [d["id"] for d in fx["body"]["data"]]
    assert [d["max_model_len"] for d in doc["data"]] == [d["max_model_len"] for d in fx["body"]["data"]]
    assert doc["data"][0]["permission"][0]["object"] == "model_permission"
    assert_formats(fx["formats"], doc, "models")
    assert_headers(fx["headers"], headers, "models")


# ------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("name", NON_STREAM)
async def test_non_streaming(sim, name):
    url, http, _ = sim
    fx = load(name)
    req = fx["request"]
    status, headers, body = await request(http, url, req, req["body"])
    doc = json.loads(body)
    assert status == fx["status"]
    assert shape(doc) == fx["shape"], f"{name}: shape differs"
    assert_formats(fx["formats"], doc, name)
    assert_headers(fx["headers"], headers, name)
    real = fx["body"]
    # vLLM answers with its first served name even for the alias `tiny-llama-small` (chat_small_model.json).
    assert doc["object"] == real["object"] and doc["model"] == real["model"] == "tiny-llama"
    u = doc["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if name not in EOS_STOP:
        assert doc["choices"][0]["finish_reason"] == real["choices"][0]["finish_reason"]
        assert u["completion_tokens"] == real["usage"]["completion_tokens"]


@pytest.mark.parametrize("name", STREAMS)
async def test_streams(sim, name):
    url, http, _ = sim
    fx = load(name)
    req = fx["request"]
    status, headers, raw = await request(http, url, req, req["body"])
    assert status == fx["status"]
    assert_headers(fx["headers"], headers, name)
    framing, events = parse_sse(raw)
    assert framing == fx["framing"], f"{name}: SSE framing differs"
    kinds = [classify(e) for e in events]
    real_kinds = [e["kind"] for e in fx["events"]]
    if name in EOS_STOP:  # real vLLM sampled EOS first; compare the sequence without the content events
        assert compress([k for k in kinds if k != "content"]) == fx["sequence"]
    else:
        assert compress(kinds) == fx["sequence"] and kinds == real_kinds, f"{name}: event sequence differs"
    for kind in dict.fromkeys(real_kinds):
        real_shapes = {json.dumps(e.get("shape"), sort_keys=True) for e in fx["events"] if e["kind"] == kind}
        real_usage = {e["usage"] for e in fx["events"] if e["kind"] == kind}
        mine = [e for e, k in zip(events, kinds) if k == kind]
        assert mine, f"{name}: no {kind} event"
        if kind != "done":
            assert {json.dumps(shape(e), sort_keys=True) for e in mine} == real_shapes, f"{name}: {kind} shape"
        assert {usage_state(e) for e in mine} == real_usage, f"{name}: {kind} usage presence"
    real_formats = {e["kind"]: e["formats"] for e in fx["events"] if e["kind"] != "done"}
    for e in events[:-1]:
        assert_formats(real_formats.get(classify(e), {}), e, name)
    # Usage arithmetic where the client gets it.
    for e in events[:-1]:
        if e.get("usage"):
            u = e["usage"]
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if "usage" in kinds:
        deltas = sum(1 for k in kinds if k in ("content", "finish"))
        assert events[kinds.index("usage")]["usage"]["completion_tokens"] == deltas


# ------------------------------------------------------------------------------------------ errors
def error_cases():
    return list(load("errors.json"))


def sim_request_body(case: str, fx: dict) -> tuple[dict | None, bytes | None]:
    """The fixture's request; the two whose outcome depends on a prompt's token count are rebuilt with the same
    token count under the simulator's estimate (the real tokenizer makes one token of "admission ")."""
    req = fx["request"]
    if req.get("raw_body") is not None:
        return None, req["raw_body"].encode()
    body = dict(req["body"]) if req["body"] is not None else None
    if case == "prompt_plus_max_tokens_beyond_context":
        real_prompt = fx["body"]["usage"]["prompt_tokens"]  # 1502
        body["prompt"] = filler_text(real_prompt)
    elif case == "prompt_too_long":
        body["prompt"] = filler_text(2100 + 1)  # 2,100 words + BOS: over the 2,048 context
    return body, None


@pytest.mark.parametrize("case", error_cases())
async def test_errors(sim, case):
    url, http, _ = sim
    fx = load("errors.json")[case]
    body, raw = sim_request_body(case, fx)
    status, headers, payload = await request(http, url, fx["request"], body, raw)
    assert status == fx["status"], f"{case}: {status} {payload[:300]!r}"
    assert_headers({k: v for k, v in fx["headers"].items() if k != "content-length"} | {"content-length": "<int>"},
                   headers, case)
    doc = json.loads(payload)
    assert shape(doc) == fx["shape"], f"{case}: shape differs"
    if status == 200:  # clamped, not refused: the context is filled to the last token
        real = fx["body"]
        assert doc["choices"][0]["finish_reason"] == real["choices"][0]["finish_reason"] == "length"
        assert doc["usage"] == real["usage"]
    else:
        assert doc == fx["body"], f"{case}: body differs"


# ------------------------------------------------------------------------------------------ metrics and abort
async def _metrics(http, url) -> str:
    async with http.get(url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def test_metrics_families(sim):
    url, http, _ = sim
    fx = load("metrics.json")
    # Some traffic so that every histogram and counter has samples.
    for req in (load("chat.json")["request"], load("completions.json")["request"]):
        status, _, _ = await request(http, url, req, req["body"])
        assert status == 200
    text = await _metrics(http, url)
    mine = parse_metrics(text)
    real = fx["families"]
    # prometheus_client's process start time is in real vLLM's /metrics too (metrics.txt), outside metrics.json's
    # vllm: families; the scraper reads it to see a restart.
    assert "\nprocess_start_time_seconds " in (FIX / "metrics.txt").read_text()
    mine.pop("process_start_time_seconds")
    for name, fam in mine.items():
        assert name.startswith("vllm:"), f"{name}: real vLLM's families are all vllm:..."
        assert name in real, f"{name}: not a family real vLLM has"
        assert fam["type"] == real[name]["type"], f"{name}: type {fam['type']} != {real[name]['type']}"
        assert fam["labels"] == real[name]["labels"], f"{name}: labels {fam['labels']} != {real[name]['labels']}"
        assert set(fam["samples"]) <= set(real[name]["samples"]), name
    all_samples = {s for f in mine.values() for s in f["samples"]}
    missing = [s for s, present in fx["required_samples"].items() if present and s not in all_samples]
    assert not missing, f"required samples missing: {missing}"
    reasons = set(re.findall(r'^vllm:request_success_total\{[^}]*finished_reason="([^"]+)"', text, flags=re.M))
    assert reasons == set(fx["finished_reasons_seen"])
    labels = dict(re.findall(r'(model_name)="([^"]+)"', text))
    assert labels["model_name"] == "tiny-llama"  # the first served name, as vLLM labels every request


async def test_abort_drops_running_and_is_not_counted(sim):
    """A client closing a stream: running drops back, finished_reason="abort" stays 0 (abort.json)."""
    import asyncio

    url, http, _ = sim
    fx = load("abort.json")
    text = await _metrics(http, url)
    before_abort = _sample(text, "vllm:request_success_total", 'finished_reason="abort"')
    before_tokens = _sample(text, "vllm:generation_tokens_total")
    async with http.post(url + fx["request"]["path"], json=fx["request"]["body"]) as r:
        for _ in range(fx["events_read_before_close"]):
            await r.content.readuntil(b"\n\n")
        assert _sample(await _metrics(http, url), "vllm:num_requests_running") == sum(
            fx["running_while_streaming"].values())
        r.close()
    running = None
    for _ in range(100):
        text = await _metrics(http, url)
        running = _sample(text, "vllm:num_requests_running")
        if running == 0:
            break
        await asyncio.sleep(0.02)
    assert running == sum(fx["num_requests_running_after"].values()) == 0
    assert fx["abort_counted"] is False
    assert _sample(text, "vllm:request_success_total", 'finished_reason="abort"') == before_abort == 0
    assert _sample(text, "vllm:generation_tokens_total") > before_tokens  # what it generated still counts


def _sample(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
