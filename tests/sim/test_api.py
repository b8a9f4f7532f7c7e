"""OpenAI API parity: JSON shapes, SSE framing, error bodies, admin endpoints, against an in-process fleet."""

import asyncio
import json
import math

import aiohttp
import pytest

from extproc.tools.sim.fleet import SimFleet

MODEL = "meta-llama/Llama-3.1-70B-Instruct-AWQ"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there, how are you"}], "max_tokens": 7}
COMPLETION = {"model": MODEL, "prompt": "once upon a time", "max_tokens": 7}


@pytest.fixture
async def fleet():
    async with SimFleet("h100-llama70b-awq", replicas=2, port=0, speed=50) as running:
        yield running


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    text = (await resp.read()).decode()
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


async def test_fleet_reports_ephemeral_ports_and_health(fleet, http):
    assert len(set(fleet.ports)) == 2 and all(p > 0 for p in fleet.ports)
    for url in fleet.urls:
        async with http.get(url + "/health") as resp:
            assert resp.status == 200 and await resp.read() == b""


async def test_models_and_version(fleet, http):
    async with http.get(fleet.urls[0] + "/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list" and body["data"][0]["id"] == MODEL
    async with http.get(fleet.urls[0] + "/version") as resp:
        assert "version" in await resp.json()


async def test_chat_completion_shape(fleet, http):
    async with http.post(fleet.urls[0] + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200 and resp.content_type == "application/json"
        body = await resp.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and choice["logprobs"] is None
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 7
    assert len(choice["message"]["content"].split()) == usage["completion_tokens"]


async def test_text_completion_shape(fleet, http):
    async with http.post(fleet.urls[0] + "/v1/completions", json=COMPLETION) as resp:
        body = await resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 4  # 16 characters
    assert len(body["choices"][0]["text"].split()) == body["usage"]["completion_tokens"]


async def test_ignore_eos_generates_exactly_max_tokens(fleet, http):
    async with http.post(fleet.urls[0] + "/v1/completions", json={**COMPLETION, "ignore_eos": True}) as resp:
        body = await resp.json()
    assert body["usage"]["completion_tokens"] == 7 and body["choices"][0]["finish_reason"] == "length"


async def test_a_completion_without_max_tokens_stops_at_16_like_vllm(fleet, http):
    # vLLM 0.32 (CompletionRequest.max_tokens = 16; a null reads as unset); chat runs on to the context's end.
    for cap in ({}, {"max_tokens": None}):
        body = {k: v for k, v in COMPLETION.items() if k != "max_tokens"}
        async with http.post(fleet.urls[0] + "/v1/completions", json={**body, **cap, "ignore_eos": True}) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 16


async def test_chat_stream_with_usage(fleet, http):
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    async with http.post(fleet.urls[0] + "/v1/chat/completions", json=request) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert resp.headers["transfer-encoding"] == "chunked"
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = chunks[1:-1]
    assert len(deltas) == 7 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(len(c["choices"][0]["delta"]["content"].split()) == 1 for c in deltas)  # one token each
    assert [c["choices"][0]["finish_reason"] for c in deltas] == [None] * 6 + ["length"]
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 7
    assert usage_chunk["usage"]["prompt_tokens"] == 3 + 4 + 6  # template + message overhead + 24 chars


@pytest.mark.parametrize("options, usage", [({}, False), ({"continuous_usage_stats": True}, False),
                                             ({"include_usage": "true"}, True), ({"include_usage": "false"}, False),
                                             ({"include_usage": None}, False)])
def test_stream_options_ask_for_usage_only_with_include_usage(options, usage):
    # vLLM 0.32's StreamOptions: include_usage defaults to false, `{}` too (recorded: tests/fixtures/vllm/
    # differential.json); the simulator sent a usage chunk for `{}` and for continuous_usage_stats alone
    from extproc.tools.sim.openai_api import CHAT as CHAT_KIND, parse_generation
    body = json.dumps({**CHAT, "stream": True, "stream_options": options}).encode()
    assert parse_generation(CHAT_KIND, body, (CHAT["model"],), 4096, 16).include_usage is usage


def test_tool_choice_none_needs_no_tools():
    # vLLM 0.32's check_tool_usage returns at once for tool_choice "none"; the simulator refused it without tools
    # ("When using `tool_choice`, `tools` must be set"), recorded 200 in tests/fixtures/vllm/differential.json
    from extproc.tools.sim.openai_api import CHAT as CHAT_KIND, parse_generation
    body = json.dumps({**CHAT, "tool_choice": "none"}).encode()
    assert parse_generation(CHAT_KIND, body, (CHAT["model"],), 4096, 16).n == 1


@pytest.mark.parametrize("fields, answer", [
    ({"top_logprobs": 0}, None),
    ({"top_logprobs": "x"}, "`top_logprobs` must be an integer. (parameter=top_logprobs, value=x)"),
    ({"top_logprobs": -2, "logprobs": True}, "`top_logprobs` must be a positive value or -1. "
                                             "(parameter=top_logprobs, value=-2)"),
    ({"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)")])
def test_top_logprobs_checked_as_vllm(fields, answer):
    # vLLM 0.32's check_logprobs (tests/fixtures/vllm/differential.json): top_logprobs 0 without logprobs is served
    # with no logprobs; the simulator refused it, and read "x" or -2 with pydantic's messages or not at all
    from extproc.tools.sim.openai_api import CHAT as CHAT_KIND, parse_generation
    if answer is None:
        body = json.dumps({**CHAT, **fields}).encode()
        assert parse_generation(CHAT_KIND, body, (CHAT["model"],), 4096, 16).logprobs is None
        return
    refused = chat_refusal(fields)
    assert (str(refused), refused.error_type) == (answer, "BadRequestError")


def chat_refusal(fields: dict):
    """The ApiError the simulator refuses CHAT with `fields` set with."""
    from extproc.tools.sim.openai_api import CHAT as CHAT_KIND, ApiError, parse_generation
    with pytest.raises(ApiError) as refused:
        parse_generation(CHAT_KIND, json.dumps({**CHAT, **fields}).encode(), (CHAT["model"],), 4096, 16)
    return refused.value


@pytest.mark.parametrize("fields, detail", [
    ({"model": 5}, "{'type': 'string_type', 'loc': 'body.model', 'msg': 'Input should be a valid string', "
                   "'input': '5'}"),
    ({"ignore_eos": 2}, "{'type': 'bool_parsing', 'loc': 'body.ignore_eos', 'msg': 'Input should be a valid "
                        "boolean, unable to interpret input', 'input': '2'}"),
    ({"stream": "maybe"}, "{'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid "
                          "boolean, unable to interpret input', 'input': 'maybe'}"),
    ({"n": 1.5}, "{'type': 'int_from_float', 'loc': 'body.n', 'msg': 'Input should be a valid integer, got a "
                 "number with a fractional part', 'input': '1.5'}")])
def test_validation_messages_written_as_vllm(fields, detail):
    # vLLM 0.32 shows a validation error's input as text and says "unable to interpret input" for any scalar that
    # is no boolean (tests/fixtures/vllm/differential.json); the simulator showed the raw value (`'input': 5`)
    # and a bool_type error without that phrase for 2
    refused = chat_refusal(fields)
    assert str(refused) == f"1 validation error:\n  {detail}"


@pytest.mark.parametrize("fields, message", [
    ({"stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    ({"stream_options": "x", "n": "x"},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
    ({"stream_options": "x", "stream": True},
     "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body.stream_options', 'msg': 'Input should "
     "be a valid dictionary or object to extract fields from', 'input': 'x'}")])
def test_stream_options_refused_as_vllm(fields, message):
    # vLLM 0.32 checks stream_options without stream on the raw body before any field is validated, its message
    # naming the parameter (tests/fixtures/vllm/differential.json); the simulator checked it last, without
    # "(parameter=stream_options)", and wrote another pydantic error for a stream_options that is no object
    refused = chat_refusal(fields)
    assert str(refused) == message


@pytest.mark.parametrize("kind, fields", [("chat", {"max_completion_tokens": 0}),
                                          ("responses", {"max_output_tokens": -1})])
def test_max_tokens_below_one_named_max_tokens_whichever_field_set_it(kind, fields):
    # vLLM 0.32 refuses it on the sampling parameters, whose field is max_tokens (tests/fixtures/vllm/
    # differential.json); the simulator named max_completion_tokens / max_output_tokens
    from extproc.tools.sim.openai_api import ApiError, parse_generation
    body = {**CHAT, **fields} if kind == "chat" else {"model": MODEL, "input": "hi", **fields}
    with pytest.raises(ApiError) as refused:
        parse_generation(kind, json.dumps(body).encode(), (MODEL,), 4096, 16)
    value = next(iter(fields.values()))
    assert (str(refused.value), refused.value.param) == (
        f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})", "max_tokens")


@pytest.mark.parametrize("fields, message", [
    ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)"),
    ({"temperature": -1}, "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
    ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
    ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
    ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5."),
    ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0."),
    ({"temperature": "hot"}, "1 validation error:\n  {'type': 'float_parsing', 'loc': 'body.temperature', 'msg': "
                             "'Input should be a valid number, unable to parse string as a number', 'input': 'hot'}"),
    ({"seed": 1.5}, "1 validation error:\n  {'type': 'int_from_float', 'loc': 'body.seed', 'msg': 'Input should "
                    "be a valid integer, got a number with a fractional part', 'input': '1.5'}")])
def test_sampling_parameters_checked_as_vllm(fields, message):
    # vLLM 0.32 types these fields and checks their ranges in SamplingParams (tests/fixtures/vllm/
    # differential.json); the simulator ignored them and served temperature 2.5, top_p 0, top_k -2, ...
    refused = chat_refusal(fields)
    assert str(refused) == message


def test_n_past_vllms_bound_is_refused_at_once(monkeypatch):
    # `n: 1000000` through a platform engineer's stack (2026-12-06): the simulator ran a million sequences on the
    # code pool's one replica for five minutes until Envoy's stream_idle_timeout answered the client 504. vLLM 0.32
    # refuses n past VLLM_MAX_N_SEQUENCES (16384 unless the environment says) with 400 (sampling_params.py).
    from extproc.tools.sim.openai_api import CHAT as CHAT_KIND, parse_generation
    refused = chat_refusal({"n": 1_000_000, "temperature": 1.0})
    assert (refused.status, str(refused), refused.error_type, refused.param) == (
        400, "n must be at most 16384, got 1000000. To increase this limit, set the VLLM_MAX_N_SEQUENCES "
             "environment variable.", "BadRequestError", None)
    body = json.dumps({**CHAT, "n": 16384, "temperature": 1.0}).encode()
    assert parse_generation(CHAT_KIND, body, (CHAT["model"],), 4096, 16).n == 16384
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    assert str(chat_refusal({"n": 5, "temperature": 1.0})).startswith("n must be at most 4, got 5.")


def test_a_completions_prompt_list_past_vllms_bound_is_refused_at_once(monkeypatch):
    # The same for a list of 2,000 prompts (vLLM: VLLM_MAX_COMPLETION_PROMPTS, 1024): the simulator ran them all.
    from extproc.tools.sim.openai_api import COMPLETIONS as COMPLETIONS_KIND, ApiError, parse_generation

    def refusal(prompt, **fields):
        with pytest.raises(ApiError) as refused:
            parse_generation(COMPLETIONS_KIND, json.dumps({**COMPLETION, "prompt": prompt, **fields}).encode(),
                             (MODEL,), 4096, 16)
        return refused.value

    refused = refusal(["a"] * 1025, stream_options={"include_usage": True})  # ahead of vLLM's other checks
    assert (refused.status, str(refused), refused.param) == (
        400, "prompt list length 1025 exceeds the maximum allowed count of 1024. To increase this limit, set the "
             "VLLM_MAX_COMPLETION_PROMPTS environment variable. (parameter=prompt)", "prompt")
    served = parse_generation(COMPLETIONS_KIND, json.dumps({**COMPLETION, "prompt": ["a"] * 1024}).encode(),
                              (MODEL,), 4096, 16)
    assert len(served.prompts) == 1024
    ids = json.dumps({**COMPLETION, "prompt": [7] * 2000}).encode()  # one prompt of token ids, not a list of them
    assert len(parse_generation(COMPLETIONS_KIND, ids, (MODEL,), 4096, 16).prompts) == 1
    monkeypatch.setenv("VLLM_MAX_COMPLETION_PROMPTS", "2")
    assert str(refusal(["a", "b", "c"])).startswith("prompt list length 3 exceeds the maximum allowed count of 2.")


def test_sampling_parameters_in_range_are_served():
    from extproc.tools.sim.openai_api import CHAT as CHAT_KIND, parse_generation
    fields = {"temperature": "0.5", "top_p": 1, "top_k": -1, "min_p": 0, "presence_penalty": 2, "seed": -1,
              "repetition_penalty": 1.2, "frequency_penalty": None}
    assert parse_generation(CHAT_KIND, json.dumps({**CHAT, **fields}).encode(), (CHAT["model"],), 4096, 16).n == 1


@pytest.mark.parametrize("kind, field, error", [("chat", "ignore_eos", "bool_type"), ("chat", "min_tokens", "int_type"),
                                                ("chat", "priority", "int_type"), ("completions", "n", "int_type")])
def test_an_explicit_null_is_refused_where_vllm_types_no_none(kind, field, error):
    # vLLM 0.32 declares these without None (chat's n is nullable, completions' is not): a null is pydantic's type
    # error (tests/fixtures/vllm/differential.json); the simulator read it as the default and served the body
    from extproc.tools.sim.openai_api import ApiError, parse_generation
    body = {**(CHAT if kind == "chat" else COMPLETION), field: None}
    with pytest.raises(ApiError) as refused:
        parse_generation(kind, json.dumps(body).encode(), (MODEL,), 4096, 16)
    assert (refused.value.error_type, refused.value.param) == ("Bad Request", f"body.{field}")
    assert f"'type': '{error}', 'loc': 'body.{field}'" in str(refused.value) and "'input': 'None'" in str(refused.value)


def test_a_null_chat_n_is_served():
    from extproc.tools.sim.openai_api import parse_generation
    assert parse_generation("chat", json.dumps({**CHAT, "n": None}).encode(), (MODEL,), 4096, 16).n == 1


@pytest.mark.parametrize("prompt", ["<absent>", None, ""])
def test_a_completion_without_a_prompt_is_refused_as_vllm(prompt):
    # vLLM 0.32's before-validator answers an absent or null prompt as an empty one, ahead of other fields' type
    # errors (tests/fixtures/vllm/differential.json); the simulator wrote pydantic's "Field required" or a
    # value_error with type "Bad Request" and param "body.prompt"
    from extproc.tools.sim.openai_api import ApiError, parse_generation
    body = {k: v for k, v in COMPLETION.items() if k != "prompt"} | ({} if prompt == "<absent>" else {"prompt": prompt})
    with pytest.raises(ApiError) as refused:
        parse_generation("completions", json.dumps(body | {"top_p": "x"}).encode(), (MODEL,), 4096, 16)
    assert (str(refused.value), refused.value.error_type, refused.value.param) == (
        "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", "BadRequestError",
        "prompt")


@pytest.mark.parametrize("kind, body", [("chat", {**CHAT, "messages": []}),
                                        ("responses", {"model": MODEL, "input": []})])
def test_an_empty_conversation_is_refused_as_vllm_refuses_it(kind, body):
    # vLLM 0.32 refuses it when applying the chat template, after the model lookup: BadRequestError, param null
    # (tests/fixtures/vllm/differential.json); the simulator wrote a pydantic value_error for chat and served an
    # empty Responses input
    from extproc.tools.sim.openai_api import ApiError, parse_generation
    with pytest.raises(ApiError) as refused:
        parse_generation(kind, json.dumps(body).encode(), (MODEL,), 4096, 16)
    assert (str(refused.value), refused.value.error_type, refused.value.param) == (
        "Cannot apply chat template to an empty conversation. Provide at least one message.", "BadRequestError", None)
    with pytest.raises(ApiError) as unknown:  # the model is looked up first
        parse_generation(kind, json.dumps(body | {"model": "nope"}).encode(), (MODEL,), 4096, 16)
    assert unknown.value.status == 404


@pytest.mark.parametrize("body, answer", [
    ({"model": MODEL, "prompt": ""}, 200),
    ({"model": MODEL, "prompt": []}, "{'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid "
                                     "string', 'input': '<list of 0 items>'}"),
    ({"model": MODEL, "prompt": [[]]}, "{'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a "
                                       "valid string', 'input': '<list of 1 items>'}"),
    ({"model": MODEL}, "{'type': 'missing', 'loc': 'body.prompt', 'msg': 'Field required', 'input': "
                       "'<dict of 1 items>'}")])
async def test_tokenize_reads_its_prompt_as_a_string_as_vllm(fleet, http, body, answer):
    # vLLM 0.32's /tokenize types `prompt` as a string ("" is the BOS alone) and refuses anything else against both
    # of its body models (tests/fixtures/vllm/differential.json); the simulator refused "" and dropped the
    # connection on `[]` and `[[]]` (an IndexError in its handler)
    async with http.post(fleet.urls[0] + "/tokenize", json=body) as resp:
        status, doc = resp.status, await resp.json()
    if answer == 200:
        assert (status, doc["count"]) == (200, 1)
        return
    assert status == 400 and doc["error"]["param"] == "body.prompt" and doc["error"]["type"] == "Bad Request"
    first, second = doc["error"]["message"].split("\n")[1:]
    assert first.strip() == answer and "'loc': 'body.messages'" in second


async def test_completion_stream_without_usage(fleet, http):
    async with http.post(fleet.urls[0] + "/v1/completions", json={**COMPLETION, "stream": True}) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_keep_alive_serves_many_requests_on_one_connection(fleet):
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(3):
            async with session.post(fleet.urls[0] + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
                await r.read()
            async with session.post(fleet.urls[0] + "/v1/completions", json=COMPLETION) as r:
                assert r.status == 200
        assert len(connector._conns) == 1 or sum(len(v) for v in connector._conns.values()) == 1


# vLLM 0.32 (tests/fixtures/vllm/errors.json): its semantic checks answer BadRequestError, request validation
# (wrong types, missing fields, bad JSON) answers type "Bad Request" with param "body.<field>".
@pytest.mark.parametrize("path,body,status,error_type", [
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "NotFoundError"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 100_000}, 400, "BadRequestError"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400, "Bad Request"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "Bad Request"),
    ("/v1/completions", {**COMPLETION, "stream_options": {"include_usage": True}}, 400, "BadRequestError"),
    # A message content that is neither text nor content parts of text is a validation error, not a dropped
    # connection (the estimate called str methods on it, the handler raised, no answer came).
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "Bad Request"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": {"text": "hi"}}]}, 400,
     "Bad Request"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                           "text": None}]}]},
     400, "Bad Request"),
    ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": 5}]}, 400, "Bad Request"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": True}]}, 400, "Bad Request"),
    # vLLM's SamplingParams: "min_tokens must be greater than or equal to 0, got -1." (served 200 here)
    ("/v1/completions", {**COMPLETION, "min_tokens": -1}, 400, "BadRequestError"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": -3}, 400, "BadRequestError"),
])
async def test_errors_are_shaped_like_vllm(fleet, http, path, body, status, error_type):
    async with http.post(fleet.urls[0] + path, json=body) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["code"] == status


@pytest.mark.parametrize("message, detail", [
    ("hi", "{'type': 'dict_type', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam', 'msg': 'Input should "
           "be a valid dictionary', 'input': 'hi'}"),
    ({"content": "hi"}, "{'type': 'missing', 'loc': 'body.messages.0.ChatCompletionDeveloperMessageParam.role', "
                        "'msg': 'Field required', 'input': '<dict of 1 items>'}"),
    ({"role": 5, "content": "hi"}, "{'type': 'literal_error', 'loc': 'body.messages.0.ChatCompletionDeveloperMessage"
                                   "Param.role', 'msg': \"Input should be 'developer'\", 'input': '5', 'ctx': "
                                   "{'expected': \"'developer'\"}}")])
def test_a_message_that_is_no_message_object_is_refused_as_vllm_refuses_it(message, detail):
    # vLLM 0.32 refuses each with its message union's validation errors, the developer message's first (recorded:
    # differential.json chat:messages=['hi'], =[{'content': 'hi'}]); the simulator served a message without a role.
    from extproc.tools.sim.openai_api import ApiError, parse_generation
    with pytest.raises(ApiError) as refused:
        parse_generation("chat", json.dumps({**CHAT, "messages": [message]}).encode(), (MODEL,), 4096, 16)
    assert (refused.value.status, refused.value.error_type) == (400, "Bad Request")
    assert str(refused.value) == f"1 validation error:\n  {detail}"
    harmony = {"author": {"role": "user"}, "content": [{"type": "text", "text": "hi"}]}  # openai_harmony's Message
    assert parse_generation("chat", json.dumps({**CHAT, "messages": [harmony]}).encode(), (MODEL,), 4096, 16)


@pytest.mark.parametrize("messages, name", [(5, "int"), (1.5, "float"), (True, "bool"), (None, "NoneType")])
def test_chat_messages_that_are_not_iterable_are_refused_as_vllm_refuses_them(messages, name):
    # vLLM 0.32's last `before` validator of ChatCompletionRequest loops over `messages`: a number, boolean or null
    # there is Python's TypeError, answered 400 BadRequestError with param null, ahead of every other check (here
    # stream_options without stream, and the model). Checked against a real vLLM 0.32 server. The simulator
    # answered pydantic's list_type error ("Bad Request"), which on /invocations also let the body through to
    # completions where vLLM refuses it.
    from extproc.tools.sim.openai_api import ApiError, parse_generation
    body = {"model": "nope", "messages": messages, "stream_options": {"include_usage": True}}
    with pytest.raises(ApiError) as refused:
        parse_generation("chat", json.dumps(body).encode(), (MODEL,), 4096, 16)
    assert (refused.value.status, str(refused.value), refused.value.error_type, refused.value.param) == (
        400, f"'{name}' object is not iterable", "BadRequestError", None)


CANNOT_DISPATCH = "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest']"
NO_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"


# What a real vLLM 0.32 server (the tiny model, 2026-12-06) answered on /invocations: the body runs as chat when
# vLLM's ChatCompletionRequest validates it, else as completions when CompletionRequest does, else 400; an error a
# request model's own validator raises (completions' missing prompt) is the answer as it is; the body's `model` is
# overwritten by the SageMaker adapter header's value (null without it). The simulator answered 404
# {"detail": "Not Found"} to all of them, while the gateway admits /invocations.
@pytest.mark.parametrize("body, headers, status, answer", [
    (CHAT, {}, 200, "chat.completion"),
    (COMPLETION, {}, 200, "text_completion"),
    ({**CHAT, "prompt": "hi"}, {}, 200, "chat.completion"),             # both valid: chat first
    ({**COMPLETION, "messages": "hi"}, {}, 200, "text_completion"),     # chat's reading fails validation
    ({**COMPLETION, "model": "nope"}, {}, 200, "text_completion"),      # the body's model is not read
    ({**COMPLETION, "max_tokens": "many"}, {}, 400, ("BadRequestError", None, CANNOT_DISPATCH)),
    ({**CHAT, "n": "x", "prompt": "hi"}, {}, 400, ("BadRequestError", None, CANNOT_DISPATCH)),
    ({**CHAT, "max_tokens": "many"}, {}, 400, ("BadRequestError", "prompt", NO_PROMPT)),
    ({"input": "hi"}, {}, 400, ("BadRequestError", "prompt", NO_PROMPT)),
    ({**COMPLETION, "messages": 5}, {}, 400, ("BadRequestError", None, "'int' object is not iterable")),
    ({**CHAT, "stream_options": {"include_usage": True}}, {}, 400,
     ("BadRequestError", "stream_options", "Stream options can only be defined when `stream=True`. "
                                           "(parameter=stream_options)")),
    ({**COMPLETION, "max_tokens": 9000}, {}, 400,
     ("BadRequestError", "max_tokens", "max_tokens=9000 cannot be greater than max_model_len=8192. Please request "
                                       "fewer output tokens. (parameter=max_tokens, value=9000)")),
    (COMPLETION, {"X-Amzn-SageMaker-Adapter-Identifier": "nope"}, 404,
     ("NotFoundError", "model", f"The model `nope` does not exist. Valid aliases: {MODEL}.")),
    (b"not json", {}, 400, ("Bad Request", None, "JSON decode error: Expecting value: line 1 column 1 (char 0)")),
    (b"[1, 2]", {}, 400, ("BadRequestError", None, "list indices must be integers or slices, not str")),
    (b"null", {}, 400, ("BadRequestError", None, "argument of type 'NoneType' is not iterable")),
])
async def test_invocations_runs_the_body_as_vllm_dispatches_it(fleet, http, body, headers, status, answer):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(fleet.urls[0] + "/invocations", data=data,
                         headers={"content-type": "application/json", **headers}) as resp:
        assert resp.status == status
        doc = await resp.json()
    if status == 200:
        assert doc["object"] == answer and doc["model"] == MODEL
        return
    assert (doc["error"]["type"], doc["error"]["param"], doc["error"]["message"]) == answer
    assert doc["error"]["code"] == status


async def test_invocations_streams_as_the_endpoint_it_dispatches_to(fleet, http):
    async with http.post(fleet.urls[0] + "/invocations", json={**CHAT, "stream": True}) as resp:
        events = await sse_events(resp)
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
    async with http.get(fleet.urls[0] + "/invocations") as resp:
        assert resp.status == 405


async def test_malformed_json_is_400(fleet, http):
    async with http.post(fleet.urls[0] + "/v1/chat/completions", data=b'{"model": ',
                         headers={"content-type": "application/json"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "Bad Request" and error["param"] == "body.10"  # vLLM: the offset of the error


UNSUPPORTED = {"message": "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
               "type": "Bad Request", "param": None, "code": 400}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/invocations",
                                  "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content_type, body, error", [
    ("text/plain", CHAT, UNSUPPORTED),
    (None, CHAT, UNSUPPORTED),                                  # none at all
    ("application/x-www-form-urlencoded", CHAT, UNSUPPORTED),
    ("application/json ;charset=utf-8", CHAT, UNSUPPORTED),     # the media type is read up to `;`, unstripped
    ("application/vnd.api+json", CHAT, UNSUPPORTED),
    ("text/plain", b'{"model": ', UNSUPPORTED),                  # ahead of the body's own errors
    ("application/vnd.api+json", b'{"model": ', "json_invalid"),  # FastAPI parses a +json body first
])
async def test_a_body_not_sent_as_application_json_is_refused_as_vllm_refuses_it(fleet, http, path, content_type,
                                                                                  body, error):
    # vLLM 0.32's validate_json_request, a dependency of every JSON POST route, answers 400 "Unsupported Media
    # Type" (its RequestValidationError handler: type "Bad Request", param null) unless the media type is
    # application/json (checked with vLLM 0.32's own dependency and handlers in its FastAPI app). The simulator
    # read any body as JSON whatever its Content-Type.
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {} if content_type is None else {"content-type": content_type}
    skip = ("content-type",) if content_type is None else ()  # else aiohttp sends application/octet-stream
    async with http.post(fleet.urls[0] + path, data=raw, headers=headers, skip_auto_headers=skip) as resp:
        assert resp.status == 400
        got = (await resp.json())["error"]
    if error == "json_invalid":
        if path == "/invocations":  # no body parameter there: the dependency answers first
            assert got == UNSUPPORTED
        else:
            assert "json_invalid" in got["message"] and got["param"] == "body.10", got
    else:
        assert got == error


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
async def test_application_json_with_parameters_or_in_capitals_is_served(fleet, http, content_type):
    async with http.post(fleet.urls[0] + "/v1/chat/completions", data=json.dumps(CHAT).encode(),
                         headers={"content-type": content_type}) as resp:
        assert resp.status == 200, await resp.text()


async def test_unknown_fields_are_ignored(fleet, http):
    body = {**CHAT, "priority": 5, "user": "u1", "temperature": 0.2, "something_new": {"x": 1}}
    async with http.post(fleet.urls[0] + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200


async def test_client_disconnect_aborts_the_sequence(fleet, http):
    body = {**COMPLETION, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with http.post(fleet.urls[1] + "/v1/completions", json=body) as resp:
        await resp.content.readline()
        resp.close()
    for _ in range(100):
        async with http.get(fleet.urls[1] + "/sim/state") as r:
            state = await r.json()
        if state["finished"]["abort"] == 1:
            break
        await asyncio.sleep(0.01)
    assert state["finished"]["abort"] == 1 and state["running"] == 0 and state["kv_cache_usage"] == 0.0


async def test_fault_injection_error_rate_and_reset(fleet, http):
    url = fleet.urls[0]
    async with http.post(url + "/sim/fault", json={"error_rate": 1.0}) as resp:
        assert (await resp.json())["error_rate"] == 1.0
    async with http.post(url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 500 and (await resp.json())["error"]["code"] == 500
    async with http.post(url + "/sim/fault", json={"reset": True}) as resp:
        assert resp.status == 200
    async with http.post(url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200


async def test_a_misspelt_fault_is_refused_not_ignored(fleet, http):
    async with http.post(fleet.urls[0] + "/sim/fault", json={"slow_down": 3}) as resp:
        assert resp.status == 400 and "unknown fault 'slow_down'" in (await resp.json())["error"]["message"]
    async with http.get(fleet.urls[0] + "/sim/state") as resp:
        assert (await resp.json())["faults"]["slowdown"] == 1.0


async def test_a_draining_replica_fails_its_health_check_and_still_serves(fleet, http):
    url = fleet.urls[0]
    async with http.post(url + "/sim/fault", json={"draining": 1}) as resp:
        assert (await resp.json())["draining"] == 1.0
    async with http.get(url + "/health") as resp:
        assert resp.status == 503  # Envoy's health check takes it out of the load balancer
    async with http.get(url + "/ping") as resp:
        assert resp.status == 503  # as vLLM, /ping is /health (the gateway overlay routes it to the replicas)
    async with http.post(url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200  # what was already sent to it is still served
    async with http.post(url + "/sim/fault", json={"reset": True}) as resp:
        assert resp.status == 200
    for path in ("/health", "/ping"):
        async with http.get(url + path) as resp:
            assert resp.status == 200


async def test_fault_injection_extra_latency(fleet, http):
    url = fleet.urls[0]
    async with http.post(url + "/sim/fault", json={"extra_latency_s": 10.0}) as resp:  # 0.2 s real at speed 50
        assert resp.status == 200
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with http.post(url + "/v1/completions", json={**COMPLETION, "max_tokens": 1}) as resp:
        assert resp.status == 200
    assert loop.time() - start >= 0.19


async def test_a_hung_engine_holds_its_requests_with_its_counters_still_and_goes_on_when_released(fleet, http):
    url = fleet.urls[0]
    async with http.post(url + "/sim/fault", json={"hang": 1}) as resp:
        assert (await resp.json())["hang"] == 1.0
    request = asyncio.ensure_future(http.post(url + "/v1/completions", json=COMPLETION))
    await asyncio.sleep(0.3)  # 15 simulated seconds: a 7-token answer takes well under one
    assert not request.done()
    async with http.get(url + "/sim/state") as resp:
        state = await resp.json()
    assert state["waiting"] + state["running"] == 1 and state["generation_tokens"] == 0
    async with http.get(url + "/health") as resp:
        assert resp.status == 200  # the server answers: only the engine is stuck
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    assert 'vllm:generation_tokens_total{engine="0"' in text and "vllm:prompt_tokens_total" in text
    counters = [line for line in text.splitlines() if line.startswith(("vllm:generation_tokens_total",
                                                                       "vllm:prompt_tokens_total"))]
    assert all(line.endswith(" 0.0") or line.endswith(" 0") for line in counters), counters
    async with http.post(url + "/sim/fault", json={"reset": True}) as resp:
        assert resp.status == 200
    async with await asyncio.wait_for(request, 5) as resp:
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 7


async def test_continuous_usage_of_a_prompt_list_counts_each_choices_own_prompt(fleet, http):
    # vLLM's completions stream: each chunk's usage is its own prompt's tokens and its choice's tokens so far (the
    # final usage chunk sums the prompts); every chunk showed the sum of all the prompts.
    body = {**COMPLETION, "prompt": ["a" * 40, "b" * 400], "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with http.post(fleet.urls[0] + "/v1/completions", json=body) as resp:
        chunks = [json.loads(e) for e in (await sse_events(resp))[:-1]]
    *tokens, final = chunks
    assert final["choices"] == [] and final["usage"]["prompt_tokens"] == 10 + 100
    seen = {0: 0, 1: 0}
    for chunk in tokens:
        index = chunk["choices"][0]["index"]
        seen[index] += 1
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == (10, 100)[index] and usage["completion_tokens"] == seen[index]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert seen == {0: 3, 1: 3}


@pytest.mark.parametrize("raw", [b'{"slowdown": NaN}', b'{"slowdown": -1}', b'{"extra_latency_s": Infinity}',
                                 b'{"error_rate": NaN}', b'{"hang": NaN}'])
async def test_a_fault_that_is_not_a_finite_non_negative_number_is_refused(fleet, http, raw):
    # Python's JSON reader takes NaN and Infinity: a NaN slowdown made the engine's clock NaN for good (a reset
    # could not bring it back: max(nan, now) is nan), a negative one ran it backwards.
    url = fleet.urls[0]
    async with http.post(url + "/sim/fault", data=raw) as resp:
        assert resp.status == 400 and "bad fault" in (await resp.json())["error"]["message"]
    async with http.get(url + "/sim/state") as resp:
        assert (await resp.json())["faults"] == {"extra_latency_s": 0.0, "error_rate": 0.0, "slowdown": 1.0,
                                                 "draining": 0.0, "hang": 0.0}
    async with http.post(url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200
    async with http.get(url + "/metrics") as resp:
        samples = [line.rsplit(" ", 1)[1] for line in (await resp.text()).splitlines() if not line.startswith("#")]
    assert all(math.isfinite(float(value)) for value in samples)
