"""Reading admission facts from OpenAI bodies; bad bodies are 400s with the offending field."""

import json
from pathlib import Path

import pytest

from extproc.policy.cost import CostModel
from extproc.policy.schema import CostSpec
from extproc.server.openai import (CHAT, COMPLETIONS, ENDPOINTS, RESPONSES, BadRequest, degrade_body, error_body,
                                  min_output_of, parse_body)

HI = [{"role": "user", "content": "hi"}]  # a chat request is a list of messages: one will do

CLASSES = {"interactive", "batch"}


def parse(doc):
    """A chat body (one message unless it sets its own) as the gateway reads it."""
    raw = doc if isinstance(doc, bytes) else json.dumps({"messages": HI, **doc}).encode()
    return parse_body(raw, CHAT, "priority", CLASSES)


def test_reads_model_max_tokens_and_stream():
    b = parse({"model": "m", "max_tokens": 7, "stream": True, "messages": HI})
    assert (b.model, b.max_tokens, b.stream, b.rewrite) == ("m", 7, True, False)


def test_max_completion_tokens_wins_over_max_tokens_as_in_vllm():
    # vLLM's chat request reads `max_completion_tokens or max_tokens`: charging the smaller of the two let a
    # client pay for 1 token and generate 3,000.
    assert parse({"model": "m", "max_completion_tokens": 9}).max_tokens == 9
    assert parse({"model": "m", "max_tokens": 1, "max_completion_tokens": 3000}).max_tokens == 3000
    assert parse({"model": "m", "max_tokens": 20, "max_completion_tokens": 9}).max_tokens == 9


# vLLM 0.32's chat request obeys max_completion_tokens unless it is null and only reads max_tokens as an integer
# then (tests/fixtures/vllm/differential.json, chat:max_completion_tokens=...,max_tokens=...): a cap vLLM ignores is
# no reason to refuse, and the one it obeys is the one charged, and named in errors.
@pytest.mark.parametrize("doc,cap,field", [
    ({"max_completion_tokens": 3, "max_tokens": 0}, 3, "max_completion_tokens"),
    ({"max_completion_tokens": 3, "max_tokens": -1}, 3, "max_completion_tokens"),
    ({"max_completion_tokens": 3, "max_tokens": 10**20}, 3, "max_completion_tokens"),
    ({"max_completion_tokens": "3", "max_tokens": 4096.0}, 3, "max_completion_tokens"),
    ({"max_completion_tokens": None, "max_tokens": 5}, 5, "max_tokens"),
    ({"max_completion_tokens": 7, "max_tokens": None}, 7, "max_completion_tokens"),
])
def test_the_cap_vllm_obeys_is_the_one_read_and_the_other_is_only_type_checked(doc, cap, field):
    b = parse({"model": "m", **doc})
    assert (b.max_tokens, b.max_tokens_field) == (cap, field)


@pytest.mark.parametrize("doc,param", [
    ({"max_completion_tokens": 0, "max_tokens": 3}, "max_completion_tokens"),  # vLLM: max_tokens must be at least 1
    ({"max_completion_tokens": -1, "max_tokens": 3}, "max_completion_tokens"),
    ({"max_completion_tokens": None, "max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 3, "max_tokens": "x"}, "max_tokens"),  # pydantic refuses it either way
    ({"max_completion_tokens": 3, "max_tokens": 2.5}, "max_tokens"),
    ({"max_completion_tokens": 3, "max_tokens": [3]}, "max_tokens"),
    ({"max_completion_tokens": "x", "max_tokens": 3}, "max_completion_tokens"),
    ({"max_completion_tokens": 10**20, "max_tokens": 3}, "max_completion_tokens"),
])
def test_a_cap_pair_vllm_refuses_is_400_naming_the_field(doc, param):
    with pytest.raises(BadRequest) as e:
        parse({"model": "m", **doc})
    assert (e.value.status, e.value.param) == (400, param)


@pytest.mark.parametrize("echo,cap,read", [(True, 0, 1), ("yes", "0", 1), (True, 0.0, 1), (True, False, 1),
                                           (False, 3, 3), (True, None, 16), (True, 3, 3)])
def test_a_completions_cap_with_echo_is_read_as_vllm_reads_it(echo, cap, read):
    # max_tokens 0 (or what pydantic reads as 0) with echo scores the prompt: one token per prompt.
    raw = json.dumps({"model": "m", "prompt": "p", "echo": echo, "max_tokens": cap}).encode()
    assert parse_body(raw, COMPLETIONS, "priority", CLASSES).max_tokens == read


@pytest.mark.parametrize("prompt,sequences", [
    ("one", 1), (["one"], 1), (["a", "b", "c"], 3), ([1, 2, 3], 1), ([[1, 2], [3], [4]], 3)])
def test_a_batch_of_prompts_is_charged_one_generation_per_prompt(prompt, sequences):
    b = parse_body(json.dumps({"model": "m", "prompt": prompt, "n": 2}).encode(), COMPLETIONS, "priority", CLASSES)
    assert b.sequences == 2 * sequences


@pytest.mark.parametrize("doc,prompts", [
    ({"prompt_embeds": "AAAA"}, 1), ({"prompt_embeds": ["AAAA"] * 3}, 3), ({"prompt": "p", "prompt_embeds": "AAAA"}, 2),
    ({"prompt": ["a", "b"], "prompt_embeds": ["AAAA"] * 3}, 5), ({"prompt": [1, 2], "prompt_embeds": None}, 1)])
def test_each_prompt_embeds_is_a_prompt_of_its_own(doc, prompts):
    # vLLM (--enable-prompt-embeds) runs each of a completions body's prompt_embeds as a prompt, before those of
    # `prompt`: a list of 100 was charged one generation and ran 100.
    b = parse_body(json.dumps({"model": "m", **doc, "n": 2}).encode(), COMPLETIONS, "priority", CLASSES)
    assert (b.prompts, b.sequences) == (prompts, 2 * prompts)


@pytest.mark.parametrize("n", [8, 0])
def test_a_responses_api_body_generates_one_answer_whatever_its_n(n):
    # vLLM's Responses API has no `n` (an ignored extra field, one answer generated): read as chat's, n 8 was
    # charged 8 answers and n 0 refused 400.
    b = parse_body(json.dumps({"model": "m", "input": "hi", "n": n}).encode(), RESPONSES, "priority", CLASSES)
    assert b.sequences == 1


@pytest.mark.parametrize("doc,written", [
    ({"max_completion_tokens": 100}, {"max_completion_tokens": 8}),
    ({"max_tokens": 100, "max_completion_tokens": 100}, {"max_tokens": 8, "max_completion_tokens": 8}),
    ({}, {"max_tokens": 8}),
])
def test_a_degrade_clamps_every_output_cap_the_client_set(doc, written):
    b = parse({"model": "m", "messages": HI, **doc})
    degrade_body(b, None, 8, None)
    assert {k: v for k, v in b.doc.items() if k.startswith("max_")} == written



@pytest.mark.parametrize("min_tokens,written,note", [(20, 8, "max_tokens=8,min_tokens=8"), (20.0, 8, None),
                                                     (5, 5, "max_tokens=8"), (None, None, "max_tokens=8")])
def test_a_degrade_brings_min_tokens_down_to_the_clamp(min_tokens, written, note):
    # vLLM answers min_tokens > max_tokens with a 400: a clamp below the client's floor made its valid request one.
    b = parse({"model": "m", "messages": HI, "max_tokens": 100, "min_tokens": min_tokens})
    changed = degrade_body(b, None, 8, None)
    assert b.doc["min_tokens"] == written and b.doc["max_tokens"] == 8
    assert note is None or ",".join(changed) == note


def test_a_degrade_brings_a_min_tokens_written_as_a_string_down_too():
    # vLLM's pydantic model reads "20" as 20 (lax mode) and then refuses min_tokens > max_tokens with a 400.
    b = parse({"model": "m", "messages": HI, "max_tokens": 100, "min_tokens": "20"})
    assert degrade_body(b, None, 8, None) == ["max_tokens=8", "min_tokens=8"]
    assert b.doc["min_tokens"] == 8


@pytest.mark.parametrize("doc", [{}, {"max_tokens": None}])
def test_a_completion_without_max_tokens_is_capped_at_the_apis_16(doc):
    # OpenAI's and vLLM 0.32's completions default; chat's is the rest of the context (left to the policy).
    b = parse_body(json.dumps({"model": "m", "prompt": "p", **doc}).encode(), COMPLETIONS, "priority", CLASSES)
    assert b.max_tokens == 16
    assert parse({"model": "m", "messages": HI, **doc}).max_tokens is None
    # A degrade to more than 16 leaves it as it was: writing its ceiling would raise what the request generates.
    assert degrade_body(b, None, 256, None) == [] and b.doc.get("max_tokens") is None
    assert degrade_body(b, None, 8, None) == ["max_tokens=8"] and b.doc["max_tokens"] == 8


@pytest.mark.parametrize("echo", [1, "true", 1.0])
def test_a_prompt_scoring_request_is_read_with_echo_as_vllms_lax_boolean(echo):
    # vLLM's pydantic model reads echo 1 or "true" as true and serves max_tokens 0 as a prompt-scoring request: the
    # gateway answered it 400 ("`max_tokens` must be a positive integer").
    b = parse_body(json.dumps({"model": "m", "prompt": "p", "echo": echo, "max_tokens": 0}).encode(), COMPLETIONS,
                   "priority", CLASSES)
    assert (b.max_tokens, b.min_output) == (1, None)


def test_a_completion_scoring_its_prompt_runs_one_token_and_keeps_its_max_tokens_0():
    b = parse_body(json.dumps({"model": "m", "prompt": "p", "echo": True, "max_tokens": 0}).encode(), COMPLETIONS,
                   "priority", CLASSES)
    assert b.max_tokens == 1  # what vLLM runs (and counts as completion_tokens) per prompt
    assert b.min_output is None  # all of it, always: never learned as an answer's natural length
    assert degrade_body(b, None, 8, None) == [] and b.doc["max_tokens"] == 0
    for refused in ({"echo": False, "max_tokens": 0}, {"max_tokens": 0}):  # vLLM's 400 too
        with pytest.raises(BadRequest):
            parse_body(json.dumps({"model": "m", "prompt": "p", **refused}).encode(), COMPLETIONS, "priority",
                       CLASSES)
    with pytest.raises(BadRequest):
        parse({"model": "m", "messages": HI, "echo": True, "max_tokens": 0})


@pytest.mark.parametrize("doc,ceiling,written", [
    ({"max_tokens": 16_000}, None, 8192), ({"max_tokens": 16_000}, 64, 64), ({"max_tokens": 4000}, None, 4000),
    ({"max_completion_tokens": 16_000}, None, 8192), ({}, None, None)])
def test_a_degrade_to_a_smaller_context_caps_max_tokens_at_it(doc, ceiling, written):
    # vLLM answers max_tokens > max_model_len with a 400; within it, it clamps to the room the prompt leaves.
    b = parse({"model": "big", "messages": HI, **doc})
    degrade_body(b, "small", ceiling, None, context=8192)
    assert b.doc.get("max_completion_tokens", b.doc.get("max_tokens")) == written

def test_class_name_in_the_body_is_claimed_and_stripped():
    b = parse({"model": "m", "priority": "Batch"})
    assert b.claimed_class == "batch" and b.rewrite and "priority" not in b.doc


def test_a_client_sent_vllm_priority_never_reaches_vllm():
    """vLLM's `--scheduling-policy priority` runs lower values first: a client must not pick its own."""
    b = parse({"model": "m", "priority": -100})
    assert b.claimed_class is None and b.rewrite and "priority" not in b.doc


@pytest.mark.parametrize("doc,param", [
    ({"model": "m", "max_tokens": "lots"}, "max_tokens"),
    ({"model": "m", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "max_tokens": False}, "max_tokens"),
    ({"model": "m", "max_tokens": 1.5}, "max_tokens"),
    ({"model": "m", "max_tokens": "1.5"}, "max_tokens"),
    ({"model": "m", "n": "0"}, "n"),
    ({"model": "m", "stream": "maybe"}, "stream"),
    ({"model": "m", "stream": 2}, "stream"),
    ({"model": 5}, "model"),
    ({"messages": HI}, "model"),
    ({"model": "m", "priority": ["x"]}, "priority"),
])
def test_wrong_types_are_400_naming_the_field(doc, param):
    with pytest.raises(BadRequest) as e:
        parse(doc)
    assert e.value.param == param


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n"])
@pytest.mark.parametrize("value,read", [("8", 8), (" 8 ", 8), ("8.0", 8), (8.0, 8), (True, 1)])
def test_counts_and_caps_are_read_as_vllms_lax_integers(field, value, read):
    # vLLM 0.32's pydantic models read "8", 8.0 and true as 8, 8 and 1 (tests/fixtures/vllm/body_readings.json):
    # refused here, vLLM would have run them.
    b = parse({"model": "m", "messages": HI, field: value})
    assert (b.max_tokens if field != "n" else b.sequences) == read



@pytest.mark.parametrize("value", ["٣", "１２", "1e3", "20.", ".0", "٣.0", "20.5", "inf", "_1"])
def test_strings_vllms_pydantic_refuses_as_integers_are_refused(value):
    # Python's int() reads Arabic-Indic and full-width digits ("٣" is 3) and float() an exponent; pydantic 2's lax
    # integer refuses them (checked against pydantic 2.14), so vLLM answers 400: the gateway says so first instead
    # of holding a slot for that answer (a hostile-client audit).
    with pytest.raises(BadRequest) as e:
        parse({"model": "m", "messages": HI, "max_tokens": value})
    assert e.value.param == "max_tokens"
    assert parse({"model": "m", "messages": HI, "max_tokens": "1_000"}).max_tokens == 1000  # pydantic takes this


@pytest.mark.parametrize("value,stream", [("yes", True), ("true", True), (1, True), ("on", True), ("no", False),
                                          ("false", False), (0, False), ("off", False), (None, False)])
def test_stream_is_read_as_vllms_lax_boolean(value, stream):
    # vLLM 0.32 streams `"stream": "yes"` or 1 and answers "false" or 0 whole (its pydantic model's lax bool): both
    # were refused here (tests/fixtures/vllm/body_readings.json).
    assert parse({"model": "m", "messages": HI, "stream": value}).stream is stream


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b"\xff\xfe", b'"text"', b"null"])
def test_malformed_bodies_are_400(raw):
    with pytest.raises(BadRequest):
        parse(raw)


def test_error_body_is_openai_shaped():
    doc = json.loads(error_body(429, "class 'interactive' is at capacity", "queue_full"))
    assert doc == {"error": {"message": "class 'interactive' is at capacity", "type": "rate_limit_error",
                             "param": None, "code": "queue_full"}}


TEXT = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize("raw", [("\ufeff" + TEXT).encode("utf-8"), TEXT.encode("utf-16"), TEXT.encode("utf-16-le"),
                                 TEXT.encode("utf-32")])
def test_json_in_the_other_unicode_encodings_vllm_reads_is_read_the_same_way(raw):
    assert parse(raw).model == "m"


def test_a_body_that_is_not_utf8_is_refused_in_words():
    with pytest.raises(BadRequest) as e:
        parse(b'{"model": "m\xff"}')
    assert "not valid UTF-8" in e.value.message and "surrogates" not in e.value.message


@pytest.mark.parametrize("doc,min_output", [({}, 0), ({"min_tokens": 7}, 7), ({"min_tokens": 7.0}, 7),
                                            ({"min_tokens": "x"}, 0), ({"ignore_eos": True}, None),
                                            ({"ignore_eos": "true", "min_tokens": 7}, None),
                                            ({"ignore_eos": False, "min_tokens": 7}, 7), ({"ignore_eos": 0}, 0)])
def test_the_output_floor_is_read_as_vllm_reads_ignore_eos_and_min_tokens(doc, min_output):
    assert min_output_of(doc) == min_output
    assert min_output_of(doc, chat_or_completions=False) == (None if min_output is None else 0)  # Responses


@pytest.mark.parametrize("doc,min_output", [({"min_tokens": "700", "max_tokens": 700}, 700),
                                            ({"min_tokens": " 7 "}, 7), ({"ignore_eos": 1.0}, None)])
def test_the_output_floor_is_read_in_pydantics_lax_mode_as_vllm_reads_it(doc, min_output):
    # vLLM's pydantic model reads "700" as min_tokens 700 and 1.0 as ignore_eos true: read as no floor, such a
    # request was expected at the learned output ratio (a few % of its cap) while the replica ran all of it.
    assert min_output_of(doc) == min_output
    assert parse({"model": "m", "messages": HI, **doc}).min_output == min_output


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("beam", [True, "yes", 1])
def test_beam_search_runs_every_beam_to_its_cap(endpoint, beam):
    # vLLM 0.32's beam search runs max_tokens steps of n beams whatever EOS says (an ended beam is replaced by the
    # next candidate): read as an ordinary request, it was expected at the learned output ratio of a cap that
    # defaulted to default_max_tokens, while the replica ran n beams to the end of the context.
    doc = {"model": "m", "messages": HI, "prompt": "p", "use_beam_search": beam, "n": 4, "min_tokens": 3}
    b = parse_body(json.dumps(doc).encode(), endpoint, "priority", CLASSES)
    assert (b.min_output, b.sequences) == (None, 4)
    model = CostModel(CostSpec(default_max_tokens=256, max_context_tokens=2048))
    est = model.estimate(8, b.max_tokens, b.sequences, prompts=b.prompts, min_output=b.min_output)
    assert est.forced == 4 * (b.max_tokens or 2048 - 8)  # completions' own default cap is 16
    assert parse_body(json.dumps({**doc, "input": "x"}).encode(), RESPONSES, "priority", CLASSES).min_output == 0


@pytest.mark.parametrize("truncation, cap", [("auto", -1), ("disabled", None), (None, -1), ("x", None)])
def test_a_responses_api_truncation_auto_keeps_what_the_context_holds(truncation, cap):
    # vLLM runs `truncation: "auto"` with truncate_prompt_tokens -1: a conversation longer than the context is cut
    # to it, and was charged whole (all of its prefill, none of it run). vLLM 0.32 truncates unless it reads
    # "disabled" (its default), so an explicit null truncates too (body_readings.json); "x" is vLLM's 400.
    b = parse_body(json.dumps({"model": "m", "input": "x", "truncation": truncation}).encode(), RESPONSES,
                   "priority", CLASSES)
    assert b.prompt_cap == cap
    assert parse_body(b'{"model": "m", "input": "x"}', RESPONSES, "priority", CLASSES).prompt_cap is None


@pytest.mark.parametrize("value, cap", [(50, 50), (50.0, 50), (" 50", 50), (-1, -1), (0, None), (-2, None),
                                        ("all", None), (True, 1), (None, None)])
def test_truncate_prompt_tokens_is_read_as_vllm_reads_it(value, cap):
    # N >= 1 keeps each prompt's last N tokens and -1 as many as the context holds (vLLM 0.32 took "50" and 50.0
    # too); 0 and below -1 are vLLM's own 400s, charged in full here. The Responses API does not read it.
    doc = {"model": "m", "messages": HI, "truncate_prompt_tokens": value}
    assert parse(doc).prompt_cap == cap
    assert parse_body(json.dumps({**doc, "input": "x"}).encode(), RESPONSES, "priority", CLASSES).prompt_cap is None


# vLLM 0.32 answers each of these 400 before it runs anything (tests/fixtures/vllm/differential.json: chat:messages=
# None, ='x', =[], =['hi'], =[{'content': 'hi'}], absent; completions:prompt=None, =5, ={'a': 1}, =[], absent).
# Admitted, each held a slot until the replica's 400.
@pytest.mark.parametrize("doc", [{}, {"messages": None}, {"messages": "hi"}, {"messages": 5}, {"messages": True},
                                 {"messages": {"role": "user", "content": "hi"}}, {"messages": []},
                                 {"messages": ["hi"]}, {"messages": [None]}, {"messages": [[]]},
                                 {"messages": [{"content": "hi"}]}, {"messages": [{"role": None, "content": "hi"}]},
                                 {"messages": [{"role": 5, "content": "hi"}]}, {"messages": [*HI, 5]}])
def test_a_chat_body_whose_messages_vllm_refuses_is_400_before_admission(doc):
    with pytest.raises(BadRequest) as e:
        parse_body(json.dumps({"model": "m", **doc}).encode(), CHAT, "priority", CLASSES)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_body", "messages")
    assert "messages" in e.value.message


@pytest.mark.parametrize("doc", [
    {"messages": [{"role": "narrator", "content": "hi"}]},  # a role vLLM's custom message type takes
    {"messages": [{"role": "user"}]},  # no content: served (differential.json)
    {"messages": [{"author": {"role": "user"}, "content": [{"type": "text", "text": "hi"}]}]},  # openai_harmony's
    {"messages": [], "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}},  # a disaggregated decode: not rendered
])
def test_a_chat_body_vllm_takes_is_not_refused_for_its_messages(doc):
    assert parse_body(json.dumps({"model": "m", **doc}).encode(), CHAT, "priority", CLASSES).endpoint is CHAT


@pytest.mark.parametrize("doc", [{}, {"prompt": None}, {"prompt": ""}, {"prompt": []}, {"prompt": 5},
                                 {"prompt": 1.5}, {"prompt": True}, {"prompt": {"a": 1}},
                                 {"prompt": None, "prompt_embeds": None}, {"prompt": [], "prompt_embeds": []}])
def test_a_completions_body_with_no_prompt_vllm_can_run_is_400_before_admission(doc):
    with pytest.raises(BadRequest) as e:
        parse_body(json.dumps({"model": "m", **doc}).encode(), COMPLETIONS, "priority", CLASSES)
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_body", "prompt")


@pytest.mark.parametrize("doc", [{"prompt": "hi"}, {"prompt": ["a", ""]}, {"prompt": [1, 2]}, {"prompt": [[1], [2]]},
                                 {"prompt": [True]},  # pydantic's lax int: vLLM runs it (differential.json)
                                 {"prompt_embeds": "AAAA"}, {"prompt": [], "prompt_embeds": ["AAAA"]},
                                 {"prompt": None, "prompt_embeds": "AAAA"}])
def test_a_completions_body_vllm_takes_is_not_refused_for_its_prompt(doc):
    assert parse_body(json.dumps({"model": "m", **doc}).encode(), COMPLETIONS, "priority", CLASSES).generates


def _refusal(raw_doc: dict, endpoint) -> BadRequest | None:
    try:
        parse_body(json.dumps(raw_doc).encode(), endpoint, "priority", CLASSES)
    except BadRequest as e:
        return e
    return None


@pytest.mark.parametrize("prompt,index", [
    ([[]], "prompt[0]"), ([[5], []], "prompt[1]"), ([5, "a"], "prompt[1]"), (["a", 5], "prompt[0]"),
    ([-1, 2], "prompt[0]"), ([5, "-1"], "prompt[1]"), ([5, None], "prompt[1]"), ([1.5], "prompt[0]"),
    ([[5], "a"], "prompt[1]"), (["a", [5]], "prompt[0]"), ([[[5]]], "prompt[0]"), ([[5, -1]], "prompt[0]"),
    ([[5], [6, "x"]], "prompt[1]"), ([{}], "prompt[0]"),
])
def test_a_prompt_list_vllm_cannot_run_is_refused_naming_its_entry(prompt, index):
    # vLLM 0.32 answers each with 400 (differential.json: its prompt union, or "The decoder prompt cannot be
    # empty"); admitted, each held a slot until then.
    e = _refusal({"model": "m", "prompt": prompt}, COMPLETIONS)
    assert e is not None and (e.status, e.code, e.param) == (400, "invalid_body", "prompt")
    assert e.message.startswith(f"`{index}`")


@pytest.mark.parametrize("prompt,prompts", [
    ([5, "6"], 1), (["5", 6], 1), ([True, 5.0, " 5 ", "5.0"], 1), ([-0.0, 5], 1), ([[5, "6"], [True]], 2),
    (["a", ""], 2), ([""], 1), (list(range(10, 5000)), 1), ([[5]] * 3, 3),
])
def test_a_prompt_list_vllm_runs_is_admitted(prompt, prompts):
    # vLLM reads a token id as a lax integer: "5", 5.0 and true are token ids to it (differential.json).
    b = parse_body(json.dumps({"model": "m", "prompt": prompt}).encode(), COMPLETIONS, "priority", CLASSES)
    assert b.prompts == prompts


@pytest.mark.parametrize("message", [
    {"role": "user", "content": 5}, {"role": "user", "content": True}, {"role": "system", "content": 1.5},
    {"role": "user", "content": None}, {"role": "tool", "content": None}, {"role": "bogus", "content": None},
    {"role": "user", "content": {"type": "text", "text": "hi"}}, {"role": "user", "content": [5]},
    {"role": "user", "content": [None]}, {"role": "bogus", "content": [["hi"]]},
])
def test_a_message_content_no_message_type_takes_is_refused(message):
    e = _refusal({"model": "m", "messages": [{"role": "user", "content": "hi"}, message]}, CHAT)
    assert e is not None and (e.status, e.code, e.param) == (400, "invalid_body", "messages")
    assert e.message.startswith("`messages[1].content")


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": None}, {"role": "function", "name": "f", "content": None},
    {"role": "user", "content": {}}, {"role": "user", "content": []}, {"role": "bogus", "content": ["hi"]},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "user"},
    {"author": {"role": "user"}, "content": 5},
])
def test_a_message_content_vllm_takes_is_admitted(message):
    assert _refusal({"model": "m", "messages": [{"role": "user", "content": "hi"}, message]}, CHAT) is None


@pytest.mark.parametrize("doc", [{}, {"input": None}, {"input": 5}, {"input": True}, {"input": {}},
                                 {"input": {"role": "user", "content": "hi"}}, {"input": []}, {"input": ["hi"]},
                                 {"input": [{"role": "user", "content": "hi"}, None]}])
def test_a_responses_input_vllm_cannot_take_is_refused(doc):
    e = _refusal({"model": "m", **doc}, RESPONSES)
    assert e is not None and (e.status, e.code, e.param) == (400, "invalid_body", "input")


@pytest.mark.parametrize("value", ["", "hi", [{"role": "user", "content": "hi"}],
                                   [{"type": "message", "role": "user", "content": "hi"}]])
def test_a_responses_input_vllm_takes_is_admitted(value):
    assert _refusal({"model": "m", "input": value}, RESPONSES) is None


@pytest.mark.parametrize("doc,param", [
    ({"prompt": [[]]}, "prompt"), ({"prompt": [5, "a"]}, "prompt"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"input": ["x"], "prompt": [[]]}, None), ({"input": ["x"], "messages": [{"role": "user", "content": 5}]}, None),
])
def test_invocations_refuses_what_its_chat_or_completions_reading_cannot_run(doc, param):
    # vLLM 0.32's /invocations answered each of the first three 400 ("The decoder prompt cannot be empty", "Cannot
    # find suitable handler for request", and for the third its completions reading's "Either prompt or
    # prompt_embeds must be provided"). Beside an `input`, a pooling model may serve the body: left to it.
    e = _refusal({"model": "m", **doc}, ENDPOINTS["/invocations"])
    assert (e.param if e is not None else None) == param


POOLING_READINGS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "pooling_readings.json")
                              .read_text())


def _inside_left_to_vllm(body: dict) -> bool:
    """What a pooling field holds: an object (a multimodal score input, whose fields vLLM checks), a list holding
    anything but strings (which of token ids, messages or inputs a route takes there), or the messages of a list
    of them (a conversation or a batch of them)."""
    return any(type(v) is dict or (type(v) is list and (k == "messages" or any(type(x) is not str for x in v)))
               for k, v in body.items() if k != "model")


def test_a_pooling_body_is_refused_when_vllms_request_models_take_none_of_its_shapes():
    # Admitted, `{"model": ..., "input": null}` to /v1/embeddings or a /rerank without documents held a slot (and
    # was charged) until vLLM's 400 (tests/fixtures/vllm/pooling_readings.json: vLLM 0.32's own request models).
    assert POOLING_READINGS["vllm"] == "0.32.0" and len(POOLING_READINGS["cases"]) > 500
    refused_taken, admitted_refused = [], []
    for case in POOLING_READINGS["cases"]:
        e = _refusal(case["body"], ENDPOINTS[case["path"]])
        if case["valid"] and e is not None:
            refused_taken.append((case["path"], case["body"], e.message))
        elif not case["valid"] and e is None and not _inside_left_to_vllm(case["body"]):
            admitted_refused.append((case["path"], case["body"]))
        assert e is None or (e.status, e.code) == (400, "invalid_body")
    assert not refused_taken, refused_taken
    assert not admitted_refused, admitted_refused


@pytest.mark.parametrize("path,doc,param", [
    ("/v1/embeddings", {}, "input"), ("/v1/embeddings", {"input": None}, "input"), ("/classify", {"input": 5}, "input"),
    ("/pooling", {"messages": "hi"}, "messages"), ("/score", {"queries": "q"}, "documents"),
    ("/v1/score", {"text_1": "a", "text_2": None}, "text_2"), ("/v2/rerank", {"documents": ["d"]}, "query"),
    ("/rerank", {"query": ["q"], "documents": ["d"]}, "query"),
])
def test_a_pooling_body_names_a_field_its_request_needs(path, doc, param):
    e = _refusal({"model": "m", **doc}, ENDPOINTS[path])
    assert e is not None and e.param == param, e and e.message


@pytest.mark.parametrize("at", [0, 1, 999_999, 1_999_999])
def test_a_negative_token_id_anywhere_in_a_long_list_is_found_and_named(at):
    # The list is checked at C speed (array("Q")); the negative one is then found by halving.
    prompt = [5] * 2_000_000
    prompt[at] = -1
    e = _refusal({"model": "m", "prompt": prompt}, COMPLETIONS)
    assert e is not None and e.message.startswith(f"`prompt[{at}]`")


@pytest.mark.parametrize("inputs, prompts", [("x " * 20_000, 1), (["x " * 20_000, "y " * 20_000], 2),
                                             ([list(range(20_000)), list(range(9_000))], 2),
                                             (list(range(20_000)), 1)])
def test_an_embeddings_input_vllm_truncates_is_charged_what_vllm_keeps(inputs, prompts):
    # vLLM 0.32's pooling requests (/v1/embeddings, /classify, /pooling) read truncate_prompt_tokens as chat and
    # completions do (PoolingBasicRequestMixin): each input keeps its last 50 tokens. The gateway charged every
    # input whole: a 20,000-token document embedded at 50 tokens was refused by a 2,000 tokens-per-minute tenant.
    doc = {"model": "m", "input": inputs, "truncate_prompt_tokens": 50}
    b = parse_body(json.dumps(doc).encode(), ENDPOINTS["/v1/embeddings"], "priority", CLASSES)
    assert (b.prompt_cap, b.prompts) == (50, prompts)
    m = CostModel(CostSpec(max_context_tokens=512))
    assert m.truncated(m.prompt_tokens(doc, generates=False), b.prompt_cap, b.prompts) <= 50 * prompts
    b = parse_body(json.dumps({**doc, "truncate_prompt_tokens": -1}).encode(), ENDPOINTS["/pooling"], "priority",
                   CLASSES)
    assert m.truncated(m.prompt_tokens(doc, generates=False), b.prompt_cap, b.prompts) <= 512 * prompts
    whole = parse_body(json.dumps({"model": "m", "input": inputs}).encode(), ENDPOINTS["/v1/embeddings"],
                       "priority", CLASSES)
    assert whole.prompt_cap is None  # without it, all of each input is charged


@pytest.mark.parametrize("path, sides", [("/rerank", {"query": "q " * 20_000, "documents": ["d " * 20_000] * 3}),
                                         ("/score", {"queries": ["q " * 20_000] * 2, "documents": ["d " * 20_000] * 2}),
                                         ("/v1/score", {"text_1": "q " * 20_000, "text_2": "d " * 20_000})])
def test_a_score_or_rerank_body_vllm_truncates_is_charged_at_most_what_vllm_keeps(path, sides):
    # Score and rerank requests take truncate_prompt_tokens too (vLLM 0.32's ScoringRequestMixin): a cross-encoder
    # keeps N tokens of each query-document pair, a bi-encoder N of each text. Charged whole before: a rerank of three
    # 10-page documents at 50 tokens each was ~80,000 tokens (its query counted per document) to the gateway.
    doc = {"model": "m", **sides, "truncate_prompt_tokens": 50}
    b = parse_body(json.dumps(doc).encode(), ENDPOINTS[path], "priority", CLASSES)
    texts = sum(len(v) if type(v) is list else 1 for v in sides.values())
    assert (b.prompt_cap, b.prompts) == (50, texts)
    m = CostModel(CostSpec())
    assert m.truncated(m.prompt_tokens(doc, generates=False), b.prompt_cap, b.prompts) <= 50 * texts
    assert parse_body(json.dumps(sides | {"model": "m"}).encode(), ENDPOINTS[path], "priority",
                      CLASSES).prompt_cap is None
