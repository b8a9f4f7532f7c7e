"""The simulator against real vLLM on what it long refused or ignored: tests/fixtures/vllm/api.json,
api_streams.json and responses_stream.json (`python3 -m scripts.vllm.record_fixtures --only-api`).

Compared as in test_parity.py: JSON shapes, the recorded value formats, error statuses, types, params and messages
(exact), SSE framing, event kinds and shapes; and what a client counts on: one choice per sequence with its
`index`, usage summed over them, exactly one finish per choice in a stream. Generated text and token counts are not
compared (the simulator has no tokenizer), except where `ignore_eos` fixes them.
"""

from __future__ import annotations

import json

import pytest

from scripts.vllm.fixture_format import shape
from scripts.vllm.record_fixtures import classify, compress, parse_sse, usage_state
from tests.sim.test_parity import assert_formats, assert_headers, load, request, sim  # noqa: F401 (a fixture)

API = load("api.json")
STREAMS = load("api_streams.json")


def case_params(names: list[str]) -> list:
    return [pytest.param(name, id=name) for name in names]


N_AND_LISTS = ["chat_n2", "chat_n2_default_temperature", "completions_n2", "completions_prompt_list",
               "completions_prompt_list_n2", "completions_token_lists", "prompt_list_with_empty",
               "chat_n2_greedy", "completions_n2_greedy", "chat_n0", "prompt_empty_list"]


async def replay(sim, name: str):
    url, http, _ = sim
    fx = API[name]
    status, headers, payload = await request(http, url, fx["request"], fx["request"]["body"])
    assert status == fx["status"], f"{name}: {status} {payload[:300]!r}"
    doc = json.loads(payload)
    assert shape(doc) == fx["shape"], f"{name}: shape differs"
    if status != 200:
        assert doc == fx["body"], f"{name}: body differs"
        return fx, doc
    assert_formats(fx["formats"], doc, name)
    assert_headers({k: v for k, v in fx["headers"].items() if k != "content-length"} | {"content-length": "<int>"},
                   headers, name)
    return fx, doc


@pytest.mark.parametrize("name", case_params(N_AND_LISTS))
async def test_n_and_prompt_lists(sim, name):
    """One choice per sequence (prompt p's outputs at p * n .. p * n + n - 1), usage summed over them; greedy
    sampling with n > 1, n < 1 and an empty prompt list refused as vLLM refuses them."""
    fx, doc = await replay(sim, name)
    if fx["status"] != 200:
        return
    real = fx["body"]
    assert [c["index"] for c in doc["choices"]] == [c["index"] for c in real["choices"]]
    u = doc["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if fx["request"]["body"].get("ignore_eos"):  # else the length is the profile's draw
        assert [c["finish_reason"] for c in doc["choices"]] == [c["finish_reason"] for c in real["choices"]]
        assert u["completion_tokens"] == real["usage"]["completion_tokens"]  # max_tokens per choice


STREAMED = ["chat_stream_n2", "completions_stream_list_n2", "completions_stream_list", "completions_stream_echo"]


@pytest.mark.parametrize("name", case_params(STREAMED))
async def test_streamed_choices(sim, name):
    """Each chunk carries one choice and its index; each choice finishes once; the usage chunk (when asked for)
    sums all of them, and the fingerprint rides where vLLM puts it (each finish, or the usage chunk)."""
    url, http, _ = sim
    fx = STREAMS[name]
    status, headers, raw = await request(http, url, fx["request"], fx["request"]["body"])
    assert status == fx["status"]
    assert_headers(fx["headers"], headers, name)
    framing, events = parse_sse(raw)
    assert framing == fx["framing"]
    kinds = [classify(e) for e in events]
    real_kinds = [e["kind"] for e in fx["events"]]
    assert sorted(kinds) == sorted(real_kinds), f"{name}: event kinds differ"
    assert compress(kinds)[-2:] == compress(real_kinds)[-2:]
    for kind in dict.fromkeys(real_kinds):
        if kind == "done":
            continue
        real_shapes = {json.dumps(e["shape"], sort_keys=True) for e in fx["events"] if e["kind"] == kind}
        mine = {json.dumps(shape(e), sort_keys=True) for e, k in zip(events, kinds) if k == kind}
        assert mine == real_shapes, f"{name}: {kind} shape"
        assert {usage_state(e) for e, k in zip(events, kinds) if k == kind} == \
            {e["usage"] for e in fx["events"] if e["kind"] == kind}
    per_kind = {}
    for e, k in zip(events, kinds):
        if k in ("role", "content", "finish"):
            per_kind.setdefault(k, []).append(e["choices"][0]["index"])
    real_per_kind = {}
    for e in fx["events"]:
        if e["kind"] in ("role", "content", "finish"):
            real_per_kind.setdefault(e["kind"], []).append(e["index"])
    assert {k: sorted(v) for k, v in per_kind.items()} == {k: sorted(v) for k, v in real_per_kind.items()}
    if fx["request"]["body"].get("echo"):  # the first chunk starts with the prompt
        assert events[0]["choices"][0]["text"].startswith(fx["request"]["body"]["prompt"])
    if "usage" in kinds:
        usage = events[kinds.index("usage")]["usage"]
        assert usage["completion_tokens"] == sum(1 for k in kinds if k in ("content", "finish"))


async def test_a_client_leaving_an_n2_stream_aborts_every_sequence(sim):
    """vLLM runs each choice as a request of its own (vllm:num_requests_running counts them) and a disconnect
    aborts them all."""
    import asyncio

    from tests.sim.test_parity import _metrics, _sample

    url, http, _ = sim
    body = {"model": "tiny-llama", "prompt": ["a b c", "d e"], "n": 2, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    async with http.post(url + "/v1/completions", json=body) as r:
        await r.content.readuntil(b"\n\n")
        assert _sample(await _metrics(http, url), "vllm:num_requests_running") == 4
        r.close()
    for _ in range(100):
        if _sample(await _metrics(http, url), "vllm:num_requests_running") == 0:
            break
        await asyncio.sleep(0.02)
    assert _sample(await _metrics(http, url), "vllm:num_requests_running") == 0


RESPONSES_CASES = ["responses", "responses_messages", "responses_unknown_model", "responses_no_input"]


@pytest.mark.parametrize("name", case_params(RESPONSES_CASES))
async def test_responses(sim, name):
    """/v1/responses: the response object vLLM writes (a max_output_tokens cut: status "incomplete" with its
    reason), usage as input/output tokens, and the same refusals as the other generation paths."""
    fx, doc = await replay(sim, name)
    if fx["status"] != 200:
        return
    real = fx["body"]
    for key in ("object", "status", "incomplete_details", "instructions", "max_output_tokens", "temperature"):
        assert doc[key] == real[key], key
    u = doc["usage"]
    assert u["output_tokens"] == real["usage"]["output_tokens"] == fx["request"]["body"]["max_output_tokens"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert doc["output"][0]["content"][0]["text"]


async def test_responses_stream(sim):
    """Streamed: vLLM's typed events in order (the deltas may be fewer: real vLLM batched tokens on a busy CPU),
    numbered from 0, each with the recorded shape; response.completed last, with the whole text and usage."""
    url, http, _ = sim
    fx = load("responses_stream.json")
    status, headers, raw = await request(http, url, fx["request"], fx["request"]["body"])
    assert status == fx["status"]
    assert_headers(fx["headers"], headers, "responses_stream")
    blocks = raw.decode().split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        lines = block.split("\n")
        assert [ln.split(":", 1)[0] for ln in lines] == ["event", "data"]
        events.append((lines[0][len("event: "):], json.loads(lines[1][len("data: "):])))
    real = fx["events"]
    assert compress([e for e, _ in events]) == compress([e["event"] for e in real])
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    real_shapes = {e["event"]: e["shape"] for e in real}
    for kind, doc in events:
        assert doc["type"] == kind and shape(doc) == real_shapes[kind], kind
    assert_formats(real[-1]["formats"], events[-1][1], "response.completed")
    completed = events[-1][1]["response"]
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert completed["output"][0]["content"][0]["text"] == text
    assert completed["usage"]["output_tokens"] == fx["request"]["body"]["max_output_tokens"]
    assert completed["status"] == real[-1]["body"]["response"]["status"] == "incomplete"


TOKENIZE_CASES = ["tokenize", "tokenize_chat", "tokenize_no_special", "tokenize_unknown_model", "detokenize",
                  "detokenize_unknown_model"]


@pytest.mark.parametrize("name", case_params(TOKENIZE_CASES))
async def test_tokenize(sim, name):
    """/tokenize and /detokenize: vLLM's bodies; a count is what the generation paths count for the same prompt
    (the simulator's estimate, not the real tokenizer's), and detokenized ids give text."""
    url, http, _ = sim
    fx, doc = await replay(sim, name)
    if fx["status"] != 200:
        return
    body = fx["request"]["body"]
    if name == "detokenize":
        assert doc["prompt"]
        return
    assert doc["count"] == len(doc["tokens"]) and doc["max_model_len"] == fx["body"]["max_model_len"]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    gen = {k: v for k, v in body.items() if k != "add_special_tokens"} | {"max_tokens": 1}
    status, _, payload = await request(http, url, {"method": "POST", "path": path}, gen)
    prompt_tokens = json.loads(payload)["usage"]["prompt_tokens"]
    real_diff = API["tokenize"]["body"]["count"] - API["tokenize_no_special"]["body"]["count"]
    assert doc["count"] == prompt_tokens - (real_diff if body.get("add_special_tokens") is False else 0)


ECHO_CASES = ["echo", "echo_max_tokens_0", "max_tokens_0", "suffix"]


@pytest.mark.parametrize("name", case_params(ECHO_CASES))
async def test_echo_and_suffix(sim, name):
    """`echo`: the text starts with the prompt; with `max_tokens: 0` it is the prompt alone, and vLLM still samples
    (and counts) one token; `max_tokens: 0` without echo and `suffix` (no FIM model) are refused."""
    fx, doc = await replay(sim, name)
    if fx["status"] != 200:
        return
    prompt, real = fx["request"]["body"]["prompt"], fx["body"]
    text = doc["choices"][0]["text"]
    assert text.startswith(prompt) and (text == prompt) == (name == "echo_max_tokens_0")
    assert doc["usage"]["completion_tokens"] == real["usage"]["completion_tokens"]
    assert doc["choices"][0]["finish_reason"] == real["choices"][0]["finish_reason"] == "length"


LOGPROBS_CASES = ["completions_logprobs", "chat_logprobs", "chat_logprobs_only"]


def _top_counts(doc) -> list[int]:
    """How many alternatives each token lists."""
    logprobs = doc["choices"][0]["logprobs"]
    if "content" in logprobs:
        return [len(t["top_logprobs"]) for t in logprobs["content"]]
    return [len(t) for t in logprobs["top_logprobs"]]


def masked(doc):
    """The doc with completions logprobs' top_logprobs keys (tokens: the vocabulary's, not comparable) numbered."""
    if isinstance(doc, dict):
        out = {k: masked(v) for k, v in doc.items()}
        if isinstance(out.get("text_offset"), list) and isinstance(out.get("top_logprobs"), list):
            out["top_logprobs"] = [{f"<token {i}>": v for i, v in enumerate(t.values())} if t else t
                                   for t in out["top_logprobs"]]
        return out
    return [masked(v) for v in doc] if isinstance(doc, list) else doc


def same_logprobs_shapes(doc, real_shape, real_body, where: str) -> None:
    """doc's shape equals the recorded one, with the logprobs objects compared on masked tokens (the recorded
    body keeps them real)."""
    def without(tree):
        tree = json.loads(json.dumps(tree))
        for choice in tree["choices"]:
            choice["logprobs"] = "null"
        return tree
    assert without(shape(doc)) == without(real_shape), where
    for mine, real in zip(doc["choices"], real_body["choices"]):
        assert shape(masked(mine["logprobs"])) == shape(masked(real["logprobs"])), where


@pytest.mark.parametrize("name", case_params(LOGPROBS_CASES))
async def test_logprobs(sim, name):
    """A logprobs object when asked for: vLLM's keys, one entry per output token, as many alternatives a token."""
    url, http, _ = sim
    fx = API[name]
    status, _, payload = await request(http, url, fx["request"], fx["request"]["body"])
    doc = json.loads(payload)
    assert status == fx["status"]
    same_logprobs_shapes(doc, fx["shape"], fx["body"], name)
    assert_formats(fx["formats"], doc, name)
    assert _top_counts(doc) == _top_counts(fx["body"])


@pytest.mark.parametrize("name", case_params(["completions_stream_logprobs", "chat_stream_logprobs"]))
async def test_streamed_logprobs(sim, name):
    """Streamed: each token's chunk carries its own token's logprobs (completions: its text offset in the whole
    text), with the recorded shapes."""
    url, http, _ = sim
    fx = STREAMS[name]
    status, _, raw = await request(http, url, fx["request"], fx["request"]["body"])
    _, events = parse_sse(raw)
    kinds = [classify(e) for e in events]
    assert kinds == [e["kind"] for e in fx["events"]]
    for e, real in zip(events[:-1], fx["events"][:-1]):
        same_logprobs_shapes(e, real["shape"], real["body"], real["kind"])
    offsets = [e["choices"][0]["logprobs"].get("text_offset", [None])[0] for e in events[:-1]
               if e["choices"][0]["logprobs"]]
    texts = [e["choices"][0].get("text", "") for e in events[:-1]]
    if "completions" in name:
        assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


@pytest.mark.parametrize("name", case_params(["chat_json_object", "completions_json_object"]))
async def test_json_object_output_is_json(sim, name):
    """response_format json_object: the text is a JSON object, as vLLM's guided output is; streamed, the deltas
    put together are one."""
    url, http, _ = sim
    fx, doc = await replay(sim, name)
    choice = doc["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert isinstance(json.loads(text), dict)
    body = fx["request"]["body"] | {"stream": True}
    _, _, raw = await request(http, url, fx["request"], body)
    _, events = parse_sse(raw)
    streamed = "".join(c.get("delta", {}).get("content") or c.get("text", "") for e in events[:-1]
                       for c in e["choices"])
    assert isinstance(json.loads(streamed), dict)
