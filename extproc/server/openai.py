"""OpenAI wire format: read the facts admission needs from a request body, and write OpenAI-style error bodies."""

from __future__ import annotations

import json
from typing import Any

# Endpoints whose requests are admitted; anything else passes through untouched.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

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
