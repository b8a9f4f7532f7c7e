"""OpenAI wire format: read the facts admission needs from a request body, and write OpenAI-style error bodies."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

# Endpoints whose requests are admitted; anything else passes through untouched.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

# Larger max_tokens values mean nothing for any model, and past ~1e308 they cannot even become a float for the
# cost estimate (an OverflowError there failed the stream, and Envoy's failure_mode_allow let the request through
# unadmitted).
MAX_TOKENS_CEILING = 2**31 - 1

_ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 499: "client_closed_request", 503: "service_unavailable_error"}


class BadRequest(Exception):
    """A request body we refuse with 400 before admission; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_body"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class GenerationBody:
    """The fields of a chat/completions body that admission reads, and the body to forward."""

    __slots__ = ("model", "max_tokens", "stream", "claimed_class", "doc", "rewrite")

    def __init__(self, doc: dict[str, Any]):
        self.doc = doc
        self.model: str | None = None
        self.max_tokens: int | None = None
        self.stream = False
        self.claimed_class: str | None = None
        self.rewrite = False      # the body must be re-serialised before it goes upstream


def parse_generation_body(raw: bytes, class_field: str, class_names: frozenset[str] | set[str]) -> GenerationBody:
    """Parse and type-check the admission-relevant fields. Raises BadRequest with an OpenAI-style message."""
    if not raw:
        raise BadRequest("The request body is empty; expected a JSON object.")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_json")
    body = GenerationBody(doc)
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("You must provide a model parameter (a non-empty string).", "model")
    body.model = model
    for field in ("max_tokens", "max_completion_tokens"):
        value = doc.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(f"`{field}` must be a positive integer, got {json.dumps(value)[:40]}.", field)
        if value > MAX_TOKENS_CEILING:
            raise BadRequest(f"`{field}` must be at most {MAX_TOKENS_CEILING}, got {str(value)[:40]}.", field)
        body.max_tokens = value if body.max_tokens is None else min(body.max_tokens, value)
    stream = doc.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false.", "stream")
    body.stream = bool(stream)
    claim = doc.get(class_field)
    if isinstance(claim, str):
        # A class name is ours, not vLLM's (vLLM's `priority` is an integer): strip it before forwarding.
        body.claimed_class = claim.strip().lower()
        del doc[class_field]
        body.rewrite = True
    elif claim is not None and (not isinstance(claim, int) or isinstance(claim, bool)):
        # Integers are vLLM's own scheduling priority and pass through; anything else is a mistake.
        raise BadRequest(f"`{class_field}` must be a class name ({', '.join(sorted(class_names))}).", class_field)
    return body


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """{"error": {...}} as OpenAI (and vLLM) shape it."""
    return json.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"),
                                 "param": param, "code": code}}, separators=(",", ":")).encode()


def degrade_body(body: GenerationBody, model: str | None, max_tokens: int | None, stream: bool | None) -> list[str]:
    """Apply a degrade to the forwarded body in place; return what changed (for x-extproc-degraded)."""
    doc, changed = body.doc, []
    if model is not None and model != body.model:
        doc["model"] = model
        changed.append(f"model={model}")
    if max_tokens is not None and (body.max_tokens is None or body.max_tokens > max_tokens):
        for field in ("max_tokens", "max_completion_tokens"):
            if field in doc or field == "max_tokens":
                doc[field] = max_tokens
        changed.append(f"max_tokens={max_tokens}")
    if stream is False and body.stream:
        doc["stream"] = False
        doc.pop("stream_options", None)
        changed.append("stream=off")
    if changed:
        body.rewrite = True
    return changed


def canned_body(path: str, body: GenerationBody, text: str) -> tuple[bytes, str]:
    """A complete OpenAI-shaped answer carrying `text`, as JSON or as an SSE stream: (bytes, content-type)."""
    chat = path.startswith("/v1/chat/")
    created = int(time.time())
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    model = body.model
    if not body.stream:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": "stop"} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"})
        doc = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": model, "choices": [choice],
               "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        return json.dumps(doc, separators=(",", ":")).encode(), "application/json"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict) -> str:
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                      "choices": [choice]}, separators=(",", ":")) + "\n\n"

    if chat:
        events = [event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}),
                  event({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": "stop"})]
    else:
        events = [event({"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"})]
    return ("".join(events) + "data: [DONE]\n\n").encode(), "text/event-stream; charset=utf-8"
