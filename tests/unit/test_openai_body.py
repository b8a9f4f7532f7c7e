"""Reading admission facts from OpenAI bodies; bad bodies are 400s with the offending field."""

import json

import pytest

from extproc.server.openai import CHAT, BadRequest, error_body, parse_body

CLASSES = {"interactive", "batch"}


def parse(doc):
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return parse_body(raw, CHAT, "priority", CLASSES)


def test_reads_model_max_tokens_and_stream():
    b = parse({"model": "m", "max_tokens": 7, "stream": True, "messages": []})
    assert (b.model, b.max_tokens, b.stream, b.rewrite) == ("m", 7, True, False)


def test_max_completion_tokens_counts_and_the_smaller_limit_wins():
    assert parse({"model": "m", "max_completion_tokens": 9}).max_tokens == 9
    assert parse({"model": "m", "max_tokens": 20, "max_completion_tokens": 9}).max_tokens == 9


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
    ({"model": "m", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "max_tokens": 1.5}, "max_tokens"),
    ({"model": "m", "stream": "yes"}, "stream"),
    ({"model": 5}, "model"),
    ({"messages": []}, "model"),
    ({"model": "m", "priority": ["x"]}, "priority"),
])
def test_wrong_types_are_400_naming_the_field(doc, param):
    with pytest.raises(BadRequest) as e:
        parse(doc)
    assert e.value.param == param


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b"\xff\xfe", b'"text"', b"null"])
def test_malformed_bodies_are_400(raw):
    with pytest.raises(BadRequest):
        parse(raw)


def test_error_body_is_openai_shaped():
    doc = json.loads(error_body(429, "class 'interactive' is at capacity", "queue_full"))
    assert doc == {"error": {"message": "class 'interactive' is at capacity", "type": "rate_limit_error",
                             "param": None, "code": "queue_full"}}
