"""vLLM's OpenAI-compatible request validation and response bodies (JSON and SSE), without any I/O."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from extproc.sim.tokens import FILLER_WORDS, estimate_chat_tokens, estimate_text_tokens, filler_text

CHAT, COMPLETIONS = "chat", "completions"
SIM_VERSION = "0.32.0-sim"


class ApiError(Exception):
    """An error vLLM would return: status plus the OpenAI error object."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, str(self), self.error_type, self.param)


def error_body(status: int, message: str, error_type: str, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as vLLM writes it."""
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": status}}).encode()


@dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request, reduced to what the engine needs."""

    kind: str
    model: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool


def _int_field(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name}: Input should be a valid integer", param=name)
    if value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}.", param=name)
    return value


def _bool_field(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: Input should be a valid boolean", param=name)
    return value


def _prompt_tokens(kind: str, body: dict) -> int:
    if kind == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages: Field required and must be a non-empty list of messages", param="messages")
        return estimate_chat_tokens(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return len(prompt)  # token ids
    raise ApiError(400, "prompt: must be a string, a list of token ids, or a list of one of those", param="prompt")


def parse_generation(kind: str, raw: bytes, served: tuple[str, ...], max_model_len: int,
                     default_max_tokens: int) -> GenerationRequest:
    """Validate a request body like vLLM does, or raise ApiError with vLLM's status and message."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "Input should be a valid dictionary or object")
    model = body.get("model") or served[0]
    if not isinstance(model, str):
        raise ApiError(400, "model: Input should be a valid string", param="model")
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    n = _int_field(body, "n", 1)
    if n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported by the simulator", param="n")
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options: Input should be a valid dictionary", param="stream_options")
    if options and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    include_usage = bool(options and _bool_field(options, "include_usage"))
    prompt_tokens = _prompt_tokens(kind, body)
    max_tokens = _int_field(body, "max_tokens", 1)
    if kind == CHAT:
        max_tokens = _int_field(body, "max_completion_tokens", 1) or max_tokens
    if prompt_tokens >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your request "
                            f"has {prompt_tokens} input tokens. Please reduce the length of the input messages.",
                       param="input_tokens")
    if max_tokens is None:
        max_tokens = min(max_model_len - prompt_tokens, default_max_tokens)
    elif prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{max_tokens} output tokens and your prompt contains {prompt_tokens} input tokens, for "
                            f"a total of {prompt_tokens + max_tokens} tokens. Please reduce the length of the input "
                            f"prompt or the number of requested output tokens.", param="max_tokens")
    return GenerationRequest(kind, model, prompt_tokens, max_tokens, stream, include_usage,
                             _bool_field(body, "ignore_eos"))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


class ResponseRenderer:
    """Builds one request's bodies; SSE token events come from precomputed templates (they run per token)."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        chat = request.kind == CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        head = (f'{{"id":"{self.id}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
                f'"created":{self.created},"model":{json.dumps(request.model)},"choices":[{{"index":0,')
        # Filler words are plain ASCII letters: they can be spliced into JSON without escaping.
        if chat:
            self._token_head = (head + '"delta":{"content":"').encode()
            self._token_mid = b'"},"logprobs":null,"finish_reason":'
        else:
            self._token_head = (head + '"text":"').encode()
            self._token_mid = b'","logprobs":null,"finish_reason":'
        self._token_tail = b',"stop_reason":null}]}\n\n' if not chat else b"}]}\n\n"
        self._words = [w.encode() for w in FILLER_WORDS]

    def role_event(self) -> bytes:
        """Chat streams open with an empty assistant delta."""
        r = self.request
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": r.model,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def token_event(self, index: int, finish_reason: str | None) -> bytes:
        """The SSE event carrying output token number `index` (0-based); the last one carries finish_reason."""
        words = self._words
        reason = b"null" if finish_reason is None else b'"%b"' % finish_reason.encode()
        return b"data: " + self._token_head + words[index % len(words)] + self._token_mid + reason + self._token_tail

    def closing_events(self, completion_tokens: int) -> bytes:
        """The optional usage chunk, then [DONE]."""
        tail = b"data: [DONE]\n\n"
        if not self.request.include_usage:
            return tail
        r = self.request
        chunk = {"id": self.id, "object": "chat.completion.chunk" if r.kind == CHAT else "text_completion",
                 "created": self.created, "model": r.model, "choices": [],
                 "usage": _usage(r.prompt_tokens, completion_tokens)}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n" + tail

    def full_response(self, completion_tokens: int, finish_reason: str) -> bytes:
        """The non-streaming response body."""
        r = self.request
        text = filler_text(completion_tokens)
        if r.kind == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None,
                                              "annotations": None, "audio": None, "function_call": None,
                                              "tool_calls": [], "reasoning_content": None},
                      "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": r.model, "choices": [choice],
                "usage": _usage(r.prompt_tokens, completion_tokens)}
        return json.dumps(body).encode()


def models_body(served: tuple[str, ...], max_model_len: int) -> bytes:
    """/v1/models as vLLM lists its served model names."""
    created = int(time.time())
    data = [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": served[0],
             "parent": None, "max_model_len": max_model_len, "permission": []} for name in served]
    return json.dumps({"object": "list", "data": data}).encode()
