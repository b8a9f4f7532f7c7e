"""vLLM's OpenAI-compatible request validation and response bodies (JSON and SSE), without any I/O."""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Container, Iterable
from dataclasses import dataclass

from extproc.tools.sim.tokens import FILLER_WORDS, estimate_chat_tokens, estimate_text_tokens, filler_text

CHAT, COMPLETIONS, RESPONSES = "chat", "completions", "responses"
SIM_VERSION = "0.32.0-sim"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM 0.32 reads a request's priority from this header before the body's `priority` (an unparsable value falls
# back to the body): whoever can send it can reorder the engine's queue under --scheduling-policy priority.
PRIORITY_HEADER = "x-vllm-priority"
# vLLM's bound on a request's `n` (envs.VLLM_MAX_N_SEQUENCES, default 16384, read from the environment as vLLM
# reads it): past it SamplingParams refuses the request with 400. Without it the simulator took `n: 1000000` and
# ran a million sequences on one replica for minutes (every other request of the pool waited behind them) until
# Envoy's stream_idle_timeout cut the client off, where vLLM answers at once.
MAX_N_SEQUENCES_ENV, MAX_N_SEQUENCES = "VLLM_MAX_N_SEQUENCES", 16384
# Likewise the prompts of one completions request (envs.VLLM_MAX_COMPLETION_PROMPTS, default 1024), refused by the
# request model's last `before` validator, so ahead of every other check.
MAX_PROMPTS_ENV, MAX_PROMPTS = "VLLM_MAX_COMPLETION_PROMPTS", 1024


def vllm_bound(env: str, default: int) -> int:
    """One of vLLM's bounds from the environment, as vLLM's envs reads it at the request (tests set it)."""
    return int(os.environ.get(env, str(default)))


def _check_prompt_list_length(body: dict) -> None:
    """vLLM's CompletionRequest.validate_prompt_list_length: a list of prompts (not one prompt of token ids) longer
    than VLLM_MAX_COMPLETION_PROMPTS is 400."""
    most = vllm_bound(MAX_PROMPTS_ENV, MAX_PROMPTS)
    for field in ("prompt", "prompt_embeds"):
        value = body.get(field)
        if not isinstance(value, list) or len(value) <= most:
            continue
        if field == "prompt" and all(isinstance(x, int) for x in value):
            continue
        raise ApiError(400, f"{field} list length {len(value)} exceeds the maximum allowed count of {most}. To "
                            f"increase this limit, set the {MAX_PROMPTS_ENV} environment variable. "
                            f"(parameter={field})", param=field)


def _check_messages_iterable(body: dict) -> None:
    """vLLM 0.32's ChatCompletionRequest.check_system_message_content_type, its last `before` validator (so ahead of
    every other check), loops over `messages` (absent: []): a number, boolean or null there raises Python's
    TypeError, which vLLM answers 400 BadRequestError, param null (a string or an object goes on to pydantic's
    list_type error)."""
    messages = body.get("messages", [])
    if not isinstance(messages, str | list | dict):
        raise ApiError(400, f"'{type(messages).__name__}' object is not iterable")


# The error type of a request-validation failure (pydantic's ValidationError, validation_error()): on /invocations
# it only rules that request type out.
VALIDATION_ERROR = "Bad Request"


UNSUPPORTED_MEDIA_TYPE = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"


def check_json_request(headers: dict[str, str], raw: bytes, body_param: bool = True) -> None:
    """vLLM 0.32's validate_json_request, a dependency of every JSON POST route (chat, completions, responses,
    /invocations, tokenize, the LoRA updates): a Content-Type whose media type is not exactly `application/json`
    (lower-cased; parameters after `;` ignored; none at all included) is answered 400 "Unsupported Media Type", type
    "Bad Request", param null, whatever the body. FastAPI reads a route's body parameter before its dependencies,
    and parses it as JSON for an `application/*+json` type, so there (not on /invocations, which has no body
    parameter) a body that is not JSON gets the JSON decode error instead."""
    content_type = headers.get("content-type", "").lower()
    media_type = content_type.split(";", 1)[0]
    if media_type == "application/json":
        return
    main, _, sub = media_type.strip().partition("/")
    if body_param and raw and main == "application" and sub.endswith("+json"):
        try:
            json.loads(raw)
        except json.JSONDecodeError:
            _json_body(raw)  # its json_invalid answer
        except ValueError:
            pass
    raise ApiError(400, UNSUPPORTED_MEDIA_TYPE, VALIDATION_ERROR)


class ApiError(Exception):
    """An error vLLM would return: status plus the OpenAI error object."""

    def __init__(self, status: int, message: str, error_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, str(self), self.error_type, self.param)


def vllm_json(doc) -> bytes:
    """A JSON body as vLLM's web server writes one: without spaces (recorded content-lengths, tests/fixtures/vllm)."""
    return json.dumps(doc, separators=(",", ":")).encode()


def error_body(status: int, message: str, error_type: str, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code"}}` as vLLM writes it."""
    return vllm_json({"error": {"message": message, "type": error_type, "param": param, "code": status}})


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
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    requested_model: str = ""  # the served name the client asked for (`model` is what the responses say)
    priority: int = 0  # the body's `priority` (lower first under --scheduling-policy priority; fcfs ignores it)
    # A completions prompt list: each prompt's tokens and clamped max_tokens (prompt_tokens, max_tokens: the sum
    # and the first's). vLLM runs n sequences per prompt, each a request of its own in the engine.
    prompts: tuple[int, ...] = ()
    limits: tuple[int, ...] = ()
    n: int = 1
    echoed: dict | None = None  # the Responses API's request fields its response repeats
    # Completions `echo`: each prompt's text, which its choices' text starts with. echo_only: `max_tokens: 0` with
    # echo, where vLLM samples one token (counted in usage) and answers the prompt alone.
    echo: tuple[str, ...] | None = None
    echo_only: bool = False
    logprobs: int | None = None  # alternatives a token's logprobs list (completions `logprobs`, chat `top_logprobs`)
    json_output: bool = False  # response_format json_object: the text is a JSON object

    def __post_init__(self):
        self.prompts = self.prompts or (self.prompt_tokens,)
        self.limits = self.limits or (self.max_tokens,)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def sequence(self, choice: int) -> tuple[int, int]:
        """(prompt tokens, max_tokens) of choice number `choice`: vLLM numbers prompt p's outputs p * n ..
        p * n + n - 1."""
        p = choice // self.n
        return self.prompts[p], self.limits[p]


def validation_error(kind: str, loc: str, msg: str, value, ctx: dict | None = None) -> ApiError:
    """A request-validation failure as vLLM reports it: type "Bad Request", param "body.<field>", and a
    pydantic-style message (vLLM's own semantic checks use BadRequestError instead)."""
    detail = {"type": kind, "loc": loc, "msg": msg, "input": _input_repr(value)}
    if ctx:
        detail["ctx"] = ctx
    return ApiError(400, f"1 validation error:\n  {detail!r}", VALIDATION_ERROR, loc)


def _input_repr(value) -> str:
    """The `input` of a validation error as vLLM 0.32 shows it: a container by its size, anything else as text
    (`'input': '5'`, `'None'`: tests/fixtures/vllm/differential.json)."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def _priority_field(body: dict) -> int:
    """`priority`: a (lax) integer within int64, default 0. vLLM 0.32 does not refuse a non-zero one under fcfs,
    whatever its field description says: the FCFS queue and victim ignore it."""
    value = _int_field(body, "priority")
    if value is None:
        return 0
    if value < INT64_MIN:
        raise validation_error("greater_than_equal", "body.priority", f"Input should be greater than or equal to "
                               f"{INT64_MIN}", value, {"ge": INT64_MIN})
    if value > INT64_MAX:
        raise validation_error("less_than_equal", "body.priority", f"Input should be less than or equal to "
                               f"{INT64_MAX}", value, {"le": INT64_MAX})
    return value


def header_priority(value: str | None, body_priority: int) -> int:
    """The priority vLLM 0.32 schedules by: the `X-Vllm-Priority` header when it parses as an integer, else the
    body's."""
    if value is not None:
        try:
            return int(value)
        except ValueError:
            pass
    return body_priority


def _float_field(body: dict, name: str) -> float | None:
    """Pydantic's lax number: ints, floats and numeric strings; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise validation_error("float_parsing", f"body.{name}", "Input should be a valid number, unable to "
                                   "parse string as a number", value) from None
    raise validation_error("float_type", f"body.{name}", "Input should be a valid number", value)


# vLLM 0.32's SamplingParams defaults for the fields whose range it checks.
SAMPLING_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                     "temperature": 1.0, "top_p": 1.0, "min_p": 0.0}


def _sampling_fields(body: dict) -> dict:
    """The sampling fields whose range vLLM checks, read with pydantic's types (a wrong type is refused while the
    body is validated, before the model lookup); absent or null: vLLM's default."""
    values = {name: _float_field(body, name) for name in SAMPLING_DEFAULTS}
    values = {name: default if values[name] is None else values[name] for name, default in SAMPLING_DEFAULTS.items()}
    top_k = _int_field(body, "top_k")
    values["top_k"] = 0 if top_k is None else top_k
    _int_field(body, "seed")  # any integer will do; it only has to be one
    return values


def _check_sampling(values: dict) -> None:
    """SamplingParams._verify_args' ranges, in its order and with its messages (only temperature and top_p name
    their parameter)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= values[name] <= 2.0:
            raise ApiError(400, f"{name} must be in [-2, 2], got {values[name]}.")
    if not values["repetition_penalty"] > 0.0:
        raise ApiError(400, f"repetition_penalty must be greater than zero, got {values['repetition_penalty']}.")
    temperature = values["temperature"]
    if temperature < 0.0:
        raise _semantic_error(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise _semantic_error(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if not 0.0 < values["top_p"] <= 1.0:
        raise _semantic_error(f"top_p must be in (0, 1], got {values['top_p']}.", "top_p", values["top_p"])
    if values["top_k"] < -1:
        raise ApiError(400, f"top_k must be 0 (disable), or at least 1, got {values['top_k']}.")
    if not 0.0 <= values["min_p"] <= 1.0:
        raise ApiError(400, f"min_p must be in [0, 1], got {values['min_p']}.")


def _semantic_error(message: str, param: str, value) -> ApiError:
    """vLLM's checks after validation: BadRequestError, with "(parameter=..., value=...)" appended."""
    return ApiError(400, f"{message} (parameter={param}, value={value})", "BadRequestError", param)


def _int_field(body: dict, name: str) -> int | None:
    """Pydantic's lax integer (_lax_int) of a field; None when absent or null."""
    value = body.get(name)
    return None if value is None else _lax_int(value, f"body.{name}")


# What pydantic 2 parses as an integer from a string: ASCII digits with `_` between them, a sign, a fraction of zeros
# ("٣", "1e3" and "20." it refuses; Python's int() took the first, and "20." split at its point).
_WHOLE = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0+)?")


def _lax_int(value, loc: str) -> int:
    """Pydantic's lax integer: ints, booleans, integral floats and strings of an integer (" 5 ", "1_0", "5.0":
    differential.json's completions:prompt=[...]), or its validation error."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise validation_error("int_from_float", loc, "Input should be a valid integer, got a number with a "
                               "fractional part", value)
    if isinstance(value, str):
        text = value.strip(" \t\n\r")
        if _WHOLE.fullmatch(text):
            return int(text.split(".")[0])
        raise validation_error("int_parsing", loc, "Input should be a valid integer, unable to parse string "
                               "as an integer", value)
    raise validation_error("int_type", loc, "Input should be a valid integer", value)


_TRUE, _FALSE = {"true", "1", "yes", "on", "t", "y"}, {"false", "0", "no", "off", "f", "n"}


def _bool_field(body: dict, name: str, prefix: str = "body") -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, str | int | float):  # pydantic tried to read it as a boolean
        raise validation_error("bool_parsing", f"{prefix}.{name}", "Input should be a valid boolean, unable to "
                               "interpret input", value)
    raise validation_error("bool_type", f"{prefix}.{name}", "Input should be a valid boolean", value)


def ignores_eos(body: dict) -> bool:
    """The body's `ignore_eos` (a lax boolean): the answer runs to its max_tokens, the end-of-sequence token
    ignored. The simulator's server, the what-if and the capacity measurement all read it here."""
    return _bool_field(body, "ignore_eos")


def samples_per_prompt(body: dict) -> int:
    """The body's `n` (chat, completions): the sequences the server runs for each prompt, each a request of its own
    in the engine (sharing the prompt's blocks), their usage summed in the answer (the prompt counted once). The
    what-if and the capacity measurement read it here, as they read ignore_eos; an ApiError where the server
    answers 400 for it."""
    n = _int_field(body, "n")
    n = 1 if n is None else n
    _check_n(n)
    _check_greedy_n(n, body)
    return n


def _check_n(n: int) -> None:
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.")
    if n > (max_n := vllm_bound(MAX_N_SEQUENCES_ENV, MAX_N_SEQUENCES)):
        raise ApiError(400, f"n must be at most {max_n}, got {n}. To increase this limit, set the "
                            f"{MAX_N_SEQUENCES_ENV} environment variable.")


def _check_greedy_n(n: int, body: dict) -> None:
    if n > 1 and _greedy(body):
        raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}.")


# vLLM 0.32's CompletionRequest caps a completion without max_tokens (or with null) at 16 tokens, as OpenAI's API
# does; a chat request without one may generate the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def requested_max_tokens(kind: str, max_tokens: int | None) -> int | None:
    """The max_tokens a request of `kind` (chat | completions) runs with: its own, else its API's default (None:
    the server's, the rest of the context)."""
    if max_tokens is None and kind == COMPLETIONS:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    return max_tokens


def sent_max_tokens(kind: str, body: dict, default: int | None) -> int | None:
    """The max_tokens (requested_max_tokens) of a request whose extra `body` fields are sent over a `max_tokens` of
    `default` (a workload kind: LoadClient.body), as the server obeys it: chat's `max_completion_tokens` when not
    null, else the body's own `max_tokens` (a lax integer; null: none), else `default`. The what-if and the
    capacity measurement read a kind's cap here."""
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        return _int_field(body, "max_completion_tokens")
    return requested_max_tokens(kind, _int_field(body, "max_tokens") if "max_tokens" in body else default)


def clamp_max_tokens(max_tokens: int | None, prompt_tokens: int, max_model_len: int, default_max_tokens: int) -> int:
    """The output tokens a request may generate: its max_tokens (unset: `default_max_tokens`), clamped to the
    context left after the prompt. vLLM 0.32 clamps silently rather than refusing."""
    room = max_model_len - prompt_tokens
    return min(room, default_max_tokens if max_tokens is None else max_tokens)


def fixed_output_tokens(max_tokens: int, ignore_eos: bool) -> int | None:
    """Engine.add_request's `natural_tokens` for a request: its (clamped) max_tokens under ignore_eos, else None
    (the profile draws the length at which the model would stop by itself)."""
    return max_tokens if ignore_eos else None


def _prompts(prompt) -> list:
    """vLLM 0.32's CompletionRequest prompt, `list[int >= 0] | list[list[int >= 0]] | str | list[str]` with lax
    integers ("5", 5.0 and true are token ids), as the prompts it runs: strings and lists of token ids (an empty
    one is the engine's to refuse). Anything else fits none of its types."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        if all(isinstance(p, str) for p in prompt):
            return prompt
        try:
            if all(isinstance(p, list) for p in prompt):
                return [[_token_id(t) for t in p] for p in prompt]
            return [[_token_id(t) for t in prompt]]
        except ApiError:
            pass
    raise validation_error("value_error", "body.prompt", "Value error, prompt must be a string, a list of token "
                           "ids, or a list of those", prompt)


def _token_id(value) -> int:
    if isinstance(value, list | dict) or value is None:
        raise validation_error("int_type", "body.prompt", "Input should be a valid integer", value)
    token = _lax_int(value, "body.prompt")
    if token < 0:
        raise validation_error("greater_than_equal", "body.prompt", "Input should be greater than or equal to 0",
                               value)
    return token


EMPTY_CONVERSATION = "Cannot apply chat template to an empty conversation. Provide at least one message."


def _no_prompt() -> ApiError:
    """vLLM 0.32's before-validator for a completions body whose prompt is absent, null or "" (no prompt_embeds
    served): ahead of every field's type check."""
    return ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                    param="prompt")


def _prompt_tokens(kind: str, body: dict) -> tuple[int, ...]:
    """The token count of each prompt: one for chat and a single completions prompt, one per entry of a prompt
    list (strings or token-id lists); () for an empty list or an empty conversation, which vLLM refuses after the
    model lookup."""
    if kind == RESPONSES:
        messages = _checked_contents(_responses_messages(body), "body.input", body["input"])
        return (estimate_chat_tokens(messages),) if messages else ()
    if kind == CHAT:
        if "messages" not in body:
            raise validation_error("missing", "body.messages", "Field required", body)
        messages = body["messages"]
        if not isinstance(messages, list):
            raise validation_error("list_type", "body.messages", "Input should be a valid list", messages)
        if not messages:
            return ()  # refused once the model is known, as vLLM's chat template refuses it
        _check_roles(messages)
        return (estimate_chat_tokens(_checked_contents(messages, "body.messages", messages)),)
    # Each prompt (an empty string is served: the BOS alone; an empty list of token ids is refused by the engine,
    # differential.json's completions:prompt=[[]]).
    prompts = _prompts(body.get("prompt"))
    if [] in prompts:
        raise ApiError(400, "The decoder prompt cannot be empty")
    return tuple(estimate_text_tokens(p) if isinstance(p, str) else len(p) for p in prompts)


def _check_roles(messages: list) -> None:
    """vLLM 0.32's message union: every member is an object, and every one needs a string `role` but
    openai_harmony's Message, which needs an `author` instead. Its first error is the developer message's
    (differential.json: chat:messages=['hi'], =[{'content': 'hi'}])."""
    for i, message in enumerate(messages):
        loc = f"body.messages.{i}.ChatCompletionDeveloperMessageParam"
        if not isinstance(message, dict):
            raise validation_error("dict_type", loc, "Input should be a valid dictionary", message)
        if "author" in message:
            continue
        if "role" not in message:
            raise validation_error("missing", f"{loc}.role", "Field required", message)
        if not isinstance(message["role"], str):
            raise validation_error("literal_error", f"{loc}.role", "Input should be 'developer'", message["role"],
                                   {"expected": "'developer'"})


def _checked_contents(messages: list[dict], loc: str, value) -> list[dict]:
    """The messages, once each content is text, null or a list of content parts whose `text` is text: anything else
    is vLLM's validation error (the token estimate would raise on it, and the client get no answer at all)."""
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, str) or content == {}:  # (an empty object is read as no parts)
            continue
        if content is None:
            if message.get("role") in ("assistant", "function"):  # the only message types whose content may be null
                continue
            raise validation_error("string_type", loc, "Input should be a valid string", value)
        if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text", ""), str)
                                             for p in content):
            continue
        raise validation_error("value_error", loc, "Value error, a message's content must be a string or a list "
                               "of content parts", value)
    return messages


def _responses_messages(body: dict) -> list[dict]:
    """The Responses API's `input` (a string, or a list of message items) and `instructions` (a system message)
    as the chat messages the prompt is templated from."""
    if "input" not in body:
        # vLLM 0.32's ResponsesRequest adds a field before validation: its message counts one item more than the
        # body holds (api.json responses_no_input: 2 sent, "<dict of 3 items>").
        raise validation_error("missing", "body.input", "Field required", {**body, None: None})
    value = body["input"]
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        messages = [item for item in value if isinstance(item, dict)]
        # Every item type of vLLM's union is typed or a message, and a message has content (differential.json's
        # responses:input=[{}] and =[{'role': 'user'}]).
        if any("role" not in item and "type" not in item or "role" in item and "content" not in item
               for item in messages):
            raise validation_error("missing", "body.input", "Field required", value)
    else:
        raise validation_error("string_type", "body.input", "Input should be a valid string", value)
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    return messages


# vLLM's --max-logprobs default: the most logprobs a token may come with.
MAX_LOGPROBS = 20


def _check_logprobs(kind: str, body: dict) -> int | None:
    """vLLM's request checks on logprobs, made while the body is validated (before the model is looked up): chat's
    `top_logprobs` needs `logprobs: true`, and neither API gives more than MAX_LOGPROBS a token. (-1, "the whole
    vocabulary", is not modelled.) Returns the alternatives each token lists, None when no logprobs are asked for
    (chat: `logprobs: true` alone lists none)."""
    field = "top_logprobs" if kind == CHAT else "logprobs"
    raw = body.get(field)
    if raw is not None and not isinstance(raw, int | float):
        raise _semantic_error(f"`{field}` must be an integer.", field, raw)
    wanted = _int_field(body, field)
    if wanted is not None and wanted < -1:
        raise _semantic_error(f"`{field}` must be a positive value or -1.", field, wanted)
    # vLLM refuses top_logprobs > 0 (or -1) without logprobs; 0 is served (and lists none)
    if kind == CHAT and wanted and not _bool_field(body, "logprobs"):
        raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
                       param="top_logprobs")
    if wanted is not None and wanted > MAX_LOGPROBS:
        raise _semantic_error(f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                              f"{MAX_LOGPROBS}", "logprobs", wanted)
    if kind == CHAT:
        return (wanted or 0) if _bool_field(body, "logprobs") else None
    return wanted


def _check_tools(body: dict) -> None:
    """vLLM's checks of `tools` and `tool_choice` made while a chat body is validated (before the model lookup)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(tools, list) and not tools:
        raise ApiError(400, "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely. (parameter=tools)", param="tools")
    if choice == "none":  # vLLM checks nothing else about tools then
        return
    if choice is not None and tools is None:
        raise ApiError(400, "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
                       param="tool_choice")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ApiError(400, f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                       f"\"required\" are supported. (parameter=tool_choice)", param="tool_choice")
    named = _named_tool(choice)
    if named is not None and isinstance(tools, list) and named not in {_named_tool(t) for t in tools}:
        raise ApiError(400, "The tool specified in `tool_choice` does not match any of the specified `tools` "
                       "(parameter=tool_choice)", param="tool_choice")


def _named_tool(entry) -> str | None:
    """The function name of a named `tool_choice`, or of a tool."""
    function = entry.get("function") if isinstance(entry, dict) else None
    return function.get("name") if isinstance(function, dict) else None


def _tool_parser_error(body: dict) -> ApiError | None:
    """The simulator serves as vLLM started without --enable-auto-tool-choice and --tool-call-parser (the
    default): any tool choice but "none" is refused, and `tools` without a `tool_choice` means "auto"."""
    if not body.get("tools"):
        return None
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    if choice == "required":
        return ApiError(400, 'tool_choice="required" requires --tool-call-parser to be set')
    if _named_tool(choice) is not None:
        return ApiError(400, f'tool_choice=function "{_named_tool(choice)}" requires --tool-call-parser to be set')
    return None


# Fields vLLM 0.32 types without None: an explicit null is a validation error there, not the default
# (tests/fixtures/vllm/differential.json). Chat's `n` is nullable, completions' is not.
NOT_NULLABLE = {"ignore_eos": ("bool_type", "Input should be a valid boolean"),
                "min_tokens": ("int_type", "Input should be a valid integer"),
                "priority": ("int_type", "Input should be a valid integer")}
NOT_NULLABLE_COMPLETIONS = {"n": ("int_type", "Input should be a valid integer")}


def _refuse_nulls(kind: str, body: dict) -> None:
    fields = NOT_NULLABLE | (NOT_NULLABLE_COMPLETIONS if kind == COMPLETIONS else {})
    for name, (error, message) in fields.items():
        if name in body and body[name] is None:
            raise validation_error(error, f"body.{name}", message, None)


def parse_generation(kind: str, raw: bytes, served: tuple[str, ...], max_model_len: int,
                     default_max_tokens: int, adapters: Container[str] = ()) -> GenerationRequest:
    """Validate a request body like vLLM 0.32 does, or raise ApiError with vLLM's status, type and message.

    Order as in vLLM: JSON and field types (pydantic: 400 "Bad Request", param "body.<field>"), then the model
    (404 NotFoundError), then the semantic checks (400 BadRequestError). A prompt plus max_tokens beyond the context
    is not an error: max_tokens is clamped to the room left (tests/fixtures/vllm/errors.json). `adapters`: the LoRA
    adapter names the replica serves besides its served names.
    """
    body = _json_body(raw)
    if kind == CHAT:
        _check_messages_iterable(body)
    if kind == COMPLETIONS:
        _check_prompt_list_length(body)
    if body.get("stream_options") and not body.get("stream"):
        # vLLM's before-validator, on the raw values: ahead of every type check
        raise ApiError(400, "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                       param="stream_options")
    if kind == COMPLETIONS and body.get("prompt") in (None, ""):
        raise _no_prompt()
    if kind != RESPONSES:
        _refuse_nulls(kind, body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise validation_error("string_type", "body.model", "Input should be a valid string", model)
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise validation_error("model_attributes_type", "body.stream_options", "Input should be a valid "
                               "dictionary or object to extract fields from", options)
    # vLLM 0.32's StreamOptions: include_usage defaults to false (`{}` and continuous_usage_stats alone ask for no
    # usage at all: tests/fixtures/vllm/differential.json), null is off
    include_usage = options is not None and _bool_field(options, "include_usage", "body.stream_options")
    continuous = options is not None and _bool_field(options, "continuous_usage_stats", "body.stream_options")
    prompts = _prompt_tokens(kind, body)
    logprobs = _check_logprobs(kind, body) if kind != RESPONSES else None
    if kind == CHAT:
        _check_tools(body)
    n = _int_field(body, "n") if kind != RESPONSES else None
    max_field = "max_output_tokens" if kind == RESPONSES else "max_tokens"
    max_tokens = _int_field(body, max_field)
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        max_tokens, max_field = _int_field(body, "max_completion_tokens"), "max_completion_tokens"
    ignore_eos = ignores_eos(body)
    priority = _priority_field(body)
    sampling = _sampling_fields(body)
    model = model or served[0]
    if model not in served and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
                       "NotFoundError", "model")
    if not prompts and kind != COMPLETIONS:
        raise ApiError(400, EMPTY_CONVERSATION)
    if not prompts:
        raise ApiError(400, "You must pass at least one prompt")
    if kind == COMPLETIONS and body.get("suffix") is not None:
        raise ApiError(400, "suffix is only supported for models with FIM completion rendering", param="suffix")
    echo = kind == COMPLETIONS and _bool_field(body, "echo")
    echo_only = echo and max_tokens == 0
    if echo_only:
        max_tokens = 1
    tools_refused = _tool_parser_error(body) if kind == CHAT else None
    if tools_refused is not None:
        raise tools_refused
    n = 1 if n is None else n
    _check_n(n)
    if not _bool_field(body, "use_beam_search"):  # beam search builds no SamplingParams (recorded: served)
        _check_sampling(sampling)
    if max_tokens is not None and max_tokens < 1:
        # vLLM checks this on the sampling parameters: whichever field set it, the message says max_tokens
        raise _semantic_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if max_tokens is not None and max_tokens > max_model_len:
        raise _semantic_error(f"{max_field}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                              f"Please request fewer output tokens.", max_field, max_tokens)
    prompt_tokens = max(prompts)
    if prompt_tokens >= max_model_len:
        # vLLM tokenizes at most max_model_len + 1 tokens of an over-long prompt, hence "at least".
        shown = min(prompt_tokens, max_model_len + 1)
        raise _semantic_error(f"This model's maximum context length is {max_model_len} tokens. However, your "
                              f"prompt contains at least {shown} input tokens, which exceeds this limit even "
                              f"without any output tokens. Please reduce the length of the input prompt.",
                              "input_tokens", shown)
    requested = requested_max_tokens(kind, max_tokens)
    limits = tuple(clamp_max_tokens(requested, p, max_model_len, default_max_tokens) for p in prompts)
    max_tokens = min(limits)
    # Against the cap it runs with (clamped to the context: vLLM's message shows that number).
    min_tokens = _int_field(body, "min_tokens")
    if min_tokens is not None and min_tokens < 0:
        raise ApiError(400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if min_tokens is not None and min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    _check_greedy_n(n, body)
    # vLLM 0.32 answers every request with its first served name, whichever alias was asked for
    # (tests/fixtures/vllm/chat_small_model.json): `model` in the responses is served[0]. A LoRA adapter's answers
    # carry the adapter's name (vLLM's OpenAIServingModels.model_name).
    answered = model if model in adapters and model not in served else served[0]
    return GenerationRequest(kind, answered, sum(prompts), limits[0], stream, include_usage, ignore_eos,
                             continuous and include_usage, requested_model=model, priority=priority,
                             prompts=prompts, limits=limits, n=n,
                             echoed=_responses_echo(body, max_tokens) if kind == RESPONSES else None,
                             echo=_prompt_texts(body["prompt"]) if echo else None, echo_only=echo_only,
                             logprobs=logprobs, json_output=_json_object(body))


# vLLM 0.32's SageMaker endpoint (vllm/entrypoints/serve/sagemaker/api_router.py): POST /invocations runs the body
# as the first request type of a generative model's that validates, chat then completions.
INVOCATIONS = "invocations"
INVOCATION_TYPES = ((CHAT, "ChatCompletionRequest"), (COMPLETIONS, "CompletionRequest"))
# The header whose value the SageMaker adapter transform writes into the body's `model` (a LoRA adapter's name).
ADAPTER_HEADER = "x-amzn-sagemaker-adapter-identifier"


def parse_invocation(raw: bytes, adapter: str | None, served: tuple[str, ...], max_model_len: int,
                     default_max_tokens: int, adapters: Container[str] = ()) -> GenerationRequest:
    """POST /invocations as vLLM 0.32 serves it on a generative model (checked against a real server).

    The SageMaker adapter transform reads the JSON first and writes the `X-Amzn-SageMaker-Adapter-Identifier`
    header's value into `model`, null when the header is absent: the body's own `model` is never read (the first
    served name answers). The body then runs as chat if vLLM's ChatCompletionRequest validates it, else as
    completions if CompletionRequest does; a body neither validates is 400 "Cannot find suitable handler". Only
    a validation failure (pydantic's, type "Bad Request") moves on to the next type: an error a request model's
    validator raises itself (`stream_options` without `stream`, completions' missing prompt) and the handler's
    own checks (the context, the model lookup) are the answer as they are.
    """
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"JSON decode error: {exc}", VALIDATION_ERROR) from None
    except ValueError as exc:  # bytes that are not UTF-8: the Python error vLLM's last-resort handler answers 400
        raise ApiError(400, str(exc)) from None
    if not isinstance(doc, dict):  # the transform trips over it: the TypeError vLLM answers 400
        raise ApiError(400, "list indices must be integers or slices, not str" if isinstance(doc, list) else
                       "'str' object does not support item assignment" if isinstance(doc, str) else
                       f"argument of type '{type(doc).__name__}' is not iterable")
    doc["model"] = adapter
    raw = json.dumps(doc).encode()
    for kind, _ in INVOCATION_TYPES:
        try:
            return parse_generation(kind, raw, served, max_model_len, default_max_tokens, adapters)
        except ApiError as exc:
            if exc.error_type != VALIDATION_ERROR:
                raise
    names = [name for _, name in INVOCATION_TYPES]
    raise ApiError(400, f"Cannot find suitable handler for request. Expected one of: {names}")


def _json_object(body: dict) -> bool:
    """`response_format: {"type": "json_object"}`: vLLM's guided decoding makes the output a JSON object (api.json
    chat_json_object: "{}")."""
    fmt = body.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") == "json_object"


# The simulator's JSON output: its filler words as one string member, whatever the length (vLLM's guided output
# cut by max_tokens would be truncated JSON; the simulator's stays valid).
JSON_OPEN, JSON_CLOSE = '{"text":"', '"}'


def json_text(text: str) -> str:
    return JSON_OPEN + text + JSON_CLOSE


def _prompt_texts(prompt) -> tuple[str, ...]:
    """Each (validated) completions prompt as text: token ids as the filler words they stand for."""
    return tuple(p if isinstance(p, str) else ids_text(p) for p in _prompts(prompt))


def _responses_echo(body: dict, max_output_tokens: int | None) -> dict:
    """What a Responses API answer repeats of its request (api.json `responses`). Unset sampling fields show
    their defaults (temperature 1.0: the tiny model's generation config sets none)."""
    def number(name: str, default: float) -> float:
        value = body.get(name)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default
    return {"instructions": body.get("instructions"), "max_output_tokens": max_output_tokens,
            "temperature": number("temperature", 1.0), "top_p": number("top_p", 1.0),
            "presence_penalty": number("presence_penalty", 0.0),
            "frequency_penalty": number("frequency_penalty", 0.0)}


# vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling. Unset is 1.0 (the tiny model's generation
# config sets none; api.json chat_n2_default_temperature).
SAMPLING_EPS = 1e-5


def _greedy(body: dict) -> bool:
    temperature = body.get("temperature")
    return isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature < SAMPLING_EPS


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """A non-streaming response's usage (vLLM writes the two details as explicit nulls)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None,
            "completion_tokens_details": None}


# The simulator's logprobs: the sampled token is the most likely, each alternative one nat less likely than the last.
SAMPLED_LOGPROB = -1.5


def _alternatives(index: int, count: int) -> list[tuple[str, float]]:
    """Output token `index`'s `count` most likely tokens and their logprobs, the sampled one first."""
    words = FILLER_WORDS
    return [(words[(index + j) % len(words)], SAMPLED_LOGPROB - j) for j in range(count)]


# vLLM's fingerprint is "vllm-<version>-<hash of the engine config>", the same for every response of a server.
SYSTEM_FINGERPRINT = f"vllm-{SIM_VERSION}-{hashlib.sha256(SIM_VERSION.encode()).hexdigest()[:16]}"


class ResponseRenderer:
    """Builds one request's bodies with vLLM 0.32's keys (tests/fixtures/vllm/); SSE token events come from
    precomputed templates (they run per token)."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        chat = request.kind == CHAT
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        head = (f'{{"id":"{self.id}","object":"{"chat.completion.chunk" if chat else "text_completion"}",'
                f'"created":{self.created},"model":{json.dumps(request.model)},"choices":[{{"index":').encode()
        # Filler words are plain ASCII letters: they can be spliced into JSON without escaping.
        field = b',"delta":{"content":"' if chat else b',"text":"'
        # One chunk carries one choice (n > 1, prompt lists): a head per choice index.
        self._token_heads = [head + b"%d" % i + field for i in range(request.choices)]
        if chat:
            self._token_mid = b'"},"logprobs":null,"finish_reason":'
            self._choice_tail = b',"token_ids":null}'
            self._choice_tail_last = b',"stop_reason":null,"token_ids":null}'
        else:
            self._token_mid = b'","logprobs":null,"finish_reason":'
            self._choice_tail = b',"stop_reason":null,"prompt_token_ids":null,"token_ids":null}'
            self._choice_tail_last = self._choice_tail
        # The fingerprint rides on the last data chunk: the finish chunk, or the usage chunk when there is one.
        self._last_tail = b"]" + (b"" if request.include_usage else
                                  b',"system_fingerprint":"%b"' % SYSTEM_FINGERPRINT.encode())
        self._words = [w.encode() for w in FILLER_WORDS]
        self._json_open, self._json_close = (json.dumps(x)[1:-1].encode() for x in (JSON_OPEN, JSON_CLOSE))
        self._plain = not (request.echo is not None or request.logprobs is not None or request.json_output)

    def _running_usage(self, completion_tokens: int, choice: int) -> bytes:
        """stream_options.continuous_usage_stats: the cumulative usage every chunk carries, as vLLM counts it: the
        choice's own prompt (of a prompt list) and the choice's tokens so far."""
        p = self.request.sequence(choice)[0]
        return (b',"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
                b'"completion_tokens_details":null}' % (p, p + completion_tokens, completion_tokens))

    def role_event(self) -> bytes:
        """Chat streams open with an empty assistant delta, one chunk per choice."""
        r = self.request
        events = []
        for choice in range(r.choices):
            chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": r.model,
                     "choices": [{"index": choice, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}]}
            if r.continuous_usage:
                chunk["usage"] = {"prompt_tokens": r.prompt_tokens, "total_tokens": r.prompt_tokens,
                                  "completion_tokens": 0, "completion_tokens_details": None}
            chunk["prompt_token_ids"] = None
            chunk["prompt_text"] = None
            events.append(b"data: " + vllm_json(chunk) + b"\n\n")
        return b"".join(events)

    def token_event(self, index: int, finish_reason: str | None, choice: int = 0) -> bytes:
        """The SSE event carrying output token number `index` (0-based) of choice number `choice`; a choice's last
        one carries its finish_reason."""
        words = self._words
        if finish_reason is None:
            reason, tail = b"null", self._choice_tail + b"]"
        else:
            reason, tail = b'"%b"' % finish_reason.encode(), self._choice_tail_last + self._last_tail
        if self.request.continuous_usage:
            tail += self._running_usage(index + 1, choice)
        if self._plain:
            return (b"data: " + self._token_heads[choice] + words[index % len(words)] + self._token_mid + reason
                    + tail + b"}\n\n")
        return self._dressed_event(index, finish_reason, choice, reason, tail)

    def _dressed_event(self, index: int, finish_reason: str | None, choice: int, reason: bytes, tail: bytes) -> bytes:
        """token_event under echo, logprobs or json_object (kept off the per-token path of the others)."""
        r = self.request
        word = b"" if r.echo_only else self._words[index % len(self._words)]
        if r.json_output:  # the object opens with the first token and closes with the last
            word = (self._json_open if index == 0 else b"") + word + (self._json_close if finish_reason else b"")
        event = b"data: " + self._token_heads[choice] + word + self._token_mid + reason + tail + b"}\n\n"
        if r.logprobs is not None and not r.echo_only:
            event = event.replace(b'"logprobs":null', b'"logprobs":' + vllm_json(self._logprobs(index, 1, choice)), 1)
        if index == 0 and r.echo is not None:
            return self._echoed(event, choice)
        return event

    def _logprobs(self, first: int, count: int, choice: int) -> dict:
        """The logprobs object of output tokens first .. first + count - 1 (api.json completions_logprobs,
        chat_logprobs): the sampled token is the most likely, `logprobs` alternatives listed (completions: at least
        the sampled one). Text offsets count from the start of the choice's text (its prompt under echo)."""
        r, words, span = self.request, FILLER_WORDS, range(first, first + count)
        tokens = [words[i % len(words)] for i in span]
        if r.kind == CHAT:
            return {"content": [{"token": t, "logprob": SAMPLED_LOGPROB, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())}
                                                  for a, lp in _alternatives(i, r.logprobs)]}
                                for i, t in zip(span, tokens)]}
        start = len(r.echo[choice // r.n]) if r.echo is not None else 0
        return {"text_offset": [start + len(words[0]) * i for i in span],
                "token_logprobs": [SAMPLED_LOGPROB] * count, "tokens": tokens,
                "top_logprobs": [dict(_alternatives(i, max(r.logprobs, 1))) for i in span]}

    def _echoed(self, event: bytes, choice: int) -> bytes:
        """A choice's first chunk under `echo`: its prompt before the token, and (as vLLM, api_streams.json
        completions_stream_echo) the prompt's token ids."""
        r = self.request
        prompt = r.echo[choice // r.n]
        event = event.replace(b'"text":"', b'"text":"' + json.dumps(prompt)[1:-1].encode(), 1)
        ids = vllm_json(text_ids(r.sequence(choice)[0]))
        return event.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":' + ids, 1)

    def opening_events(self) -> bytes:
        """What a stream starts with: chat's role chunks; nothing for completions."""
        return self.role_event() if self.request.kind == CHAT else b""

    def closing_events(self, outputs: list[tuple[int, str]]) -> bytes:
        """The optional usage chunk (`outputs`: each choice's (completion tokens, finish_reason)), then [DONE]."""
        completion_tokens = sum(tokens for tokens, _ in outputs)
        tail = b"data: [DONE]\n\n"
        if not self.request.include_usage:
            return tail
        r = self.request
        p = r.prompt_tokens
        chunk = {"id": self.id, "object": "chat.completion.chunk" if r.kind == CHAT else "text_completion",
                 "created": self.created, "model": r.model, "choices": [],
                 "usage": {"prompt_tokens": p, "total_tokens": p + completion_tokens,
                           "completion_tokens": completion_tokens},
                 "system_fingerprint": SYSTEM_FINGERPRINT}
        return b"data: " + vllm_json(chunk) + b"\n\n" + tail

    def _choice(self, index: int, completion_tokens: int, finish_reason: str) -> dict:
        r = self.request
        shown = 0 if r.echo_only else completion_tokens
        text = json_text(filler_text(shown)) if r.json_output else filler_text(shown)
        if r.echo is not None:
            text = r.echo[index // r.n] + text
        logprobs = self._logprobs(0, shown, index) if r.logprobs is not None else None
        if self.request.kind == CHAT:
            return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None,
                                                "annotations": None, "audio": None, "function_call": None,
                                                "reasoning": None},
                    "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": None, "token_ids": None,
                    "routed_experts": None}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                "routed_experts": None}

    def full_response(self, outputs: list[tuple[int, str]]) -> bytes:
        """The non-streaming response body, with vLLM's explicit nulls: `outputs` holds each choice's
        (completion tokens, finish_reason), in choice order."""
        r = self.request
        obj = "chat.completion" if r.kind == CHAT else "text_completion"
        choices = [self._choice(i, tokens, reason) for i, (tokens, reason) in enumerate(outputs)]
        body = {"id": self.id, "object": obj, "created": self.created, "model": r.model, "choices": choices,
                "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
                "usage": _usage(r.prompt_tokens, sum(tokens for tokens, _ in outputs))}
        if r.kind == CHAT:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return vllm_json(body)


def _json_body(raw: bytes) -> dict:
    """The request body as a dict, or the validation error vLLM answers."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise validation_error("json_invalid", f"body.{exc.pos}", "JSON decode error", {},
                               {"error": exc.msg}) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise validation_error("json_invalid", "body.0", "JSON decode error", {}, {"error": str(exc)}) from None
    if not isinstance(body, dict):
        raise validation_error("model_attributes_type", "body", "Input should be a valid dictionary or object to "
                               "extract fields from", body)
    return body


def _served_model(body: dict, served: tuple[str, ...], adapters: Container[str]) -> str:
    """The body's `model` (unset: the first served name), or vLLM's 404."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise validation_error("string_type", "body.model", "Input should be a valid string", model)
    model = model or served[0]
    if model not in served and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.",
                       "NotFoundError", "model")
    return model


# The simulator has no vocabulary: token ids it shows stand for its filler words (id FILLER_ID0 + k is word k), so
# /detokenize of any ids gives text and /tokenize counts what a generation request's usage would count.
FILLER_ID0 = 100


def ids_text(ids: list[int]) -> str:
    words = FILLER_WORDS
    return "".join(words[(t - FILLER_ID0) % len(words)] for t in ids)


def text_ids(count: int) -> list[int]:
    """The ids the simulator shows for a text of `count` tokens."""
    return [FILLER_ID0 + i % len(FILLER_WORDS) for i in range(count)]


def _tokenize_prompt(body: dict) -> int:
    """The token count of /tokenize's `prompt`, which vLLM 0.32 types as a string (`""` is the BOS alone): anything
    else fails both of its body models, the prompt one and the chat one (tests/fixtures/vllm/differential.json)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    size = _input_repr(body)
    first = ({"type": "missing", "loc": "body.prompt", "msg": "Field required", "input": size}
             if "prompt" not in body else
             {"type": "string_type", "loc": "body.prompt", "msg": "Input should be a valid string",
              "input": _input_repr(prompt)})
    second = {"type": "missing", "loc": "body.messages", "msg": "Field required", "input": size}
    raise ApiError(400, f"2 validation errors:\n  {first!r}\n  {second!r}", VALIDATION_ERROR, "body.prompt")


def tokenize_body(raw: bytes, served: tuple[str, ...], max_model_len: int, adapters: Container[str] = ()) -> bytes:
    """POST /tokenize: a `prompt` or chat `messages` counted as the generation paths count them (the estimate of a
    prompt includes the BOS it starts with; `add_special_tokens: false` takes it off), as vLLM 0.32 answers
    (api.json tokenize*). No engine work: vLLM tokenizes on its API server."""
    body = _json_body(raw)
    kind = CHAT if "messages" in body else COMPLETIONS
    counts = _prompt_tokens(CHAT, body) if kind == CHAT else (_tokenize_prompt(body),)
    no_special = body.get("add_special_tokens") is not None and not _bool_field(body, "add_special_tokens")
    _served_model(body, served, adapters)
    if not counts:
        raise ApiError(400, EMPTY_CONVERSATION)
    count = counts[0]
    if kind == COMPLETIONS and no_special:
        count = max(1, count - 1)
    return vllm_json({"count": count, "max_model_len": max_model_len, "tokens": text_ids(count),
                      "token_strs": None})


def detokenize_body(raw: bytes, served: tuple[str, ...], adapters: Container[str] = ()) -> bytes:
    """POST /detokenize: `tokens` back to text (api.json detokenize*)."""
    body = _json_body(raw)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise validation_error("list_type", "body.tokens", "Input should be a valid list", tokens)
    _served_model(body, served, adapters)
    return vllm_json({"prompt": ids_text(tokens)})


def models_body(served: tuple[str, ...], max_model_len: int, root: str | None = None,
                adapters: Iterable[tuple[str, str, str]] = ()) -> bytes:
    """/v1/models as vLLM lists its served model names (root: the model's path; here the first name), then its
    LoRA adapters as (name, path, parent): `root` the adapter's path, `parent` its base model, no max_model_len."""
    created = int(time.time())
    cards = [(name, root or served[0], None, max_model_len) for name in served]
    cards += [(name, path, parent, None) for name, path, parent in adapters]
    data = [{"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": card_root,
             "parent": parent, "max_model_len": length,
             "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                             "created": created, "allow_create_engine": False, "allow_sampling": True,
                             "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                             "allow_fine_tuning": False, "organization": "*", "group": None,
                             "is_blocking": False}]} for name, card_root, parent, length in cards]
    return vllm_json({"object": "list", "data": data})


class ResponsesRenderer:
    """The Responses API's bodies as vLLM 0.32 writes them (api.json `responses`, responses_stream.json): one
    message output item; streamed as numbered typed events (`event: <type>` then `data: <json>`, no [DONE]): created,
    in_progress, the item and its part added, a text delta per token, then the text, part and item done and
    response.completed (also when max_output_tokens cut it: status "incomplete")."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._number = 0  # the stream's sequence_number
        self._words = [w.encode() for w in FILLER_WORDS]
        self._delta_tail = (f'","item_id":"{self.item_id}","logprobs":[],"output_index":0,'
                            f'"sequence_number":').encode()

    def _event(self, kind: str, doc: dict) -> bytes:
        doc["sequence_number"] = self._number
        doc["type"] = kind
        self._number += 1
        return b"event: %b\ndata: %b\n\n" % (kind.encode(), vllm_json(doc))

    def _item(self, text: str | None) -> dict:
        content = [] if text is None else [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
        return {"id": self.item_id, "content": content, "role": "assistant",
                "status": "in_progress" if text is None else "completed", "type": "message", "phase": None}

    def _response(self, outputs: list[tuple[int, str]] | None) -> dict:
        r, echoed = self.request, self.request.echoed or {}
        status, incomplete, output, usage = "in_progress", None, [], None
        if outputs:
            tokens, reason = outputs[0]
            status = "incomplete" if reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
            output = [self._item(filler_text(tokens))]
            usage = {"input_tokens": r.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                              "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                     "output_tokens": tokens,
                     "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                               "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                     "total_tokens": r.prompt_tokens + tokens}
        return {"id": self.id, "created_at": self.created, "incomplete_details": incomplete,
                "instructions": echoed.get("instructions"), "metadata": None, "model": r.model, "object": "response",
                "output": output, "parallel_tool_calls": True, "temperature": echoed.get("temperature", 1.0),
                "tool_choice": "none", "tools": [], "top_p": echoed.get("top_p", 1.0), "background": False,
                "max_output_tokens": echoed.get("max_output_tokens"), "max_tool_calls": None,
                "previous_response_id": None, "prompt": None, "reasoning": None, "service_tier": "auto",
                "status": status, "text": None, "top_logprobs": None, "truncation": "disabled", "usage": usage,
                "user": None, "presence_penalty": echoed.get("presence_penalty", 0.0),
                "frequency_penalty": echoed.get("frequency_penalty", 0.0), "kv_transfer_params": None,
                "ec_transfer_params": None, "input_messages": None, "output_messages": None}

    def opening_events(self) -> bytes:
        part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        return (self._event("response.created", {"response": self._response(None)})
                + self._event("response.in_progress", {"response": self._response(None)})
                + self._event("response.output_item.added", {"item": self._item(None), "output_index": 0})
                + self._event("response.content_part.added", {"content_index": 0, "item_id": self.item_id,
                                                              "output_index": 0, "part": part}))

    def token_event(self, index: int, finish_reason: str | None, choice: int = 0) -> bytes:
        """A text delta: one filler word (plain ASCII letters, spliced into the JSON without escaping)."""
        number = self._number
        self._number += 1
        return (b'event: response.output_text.delta\ndata: {"content_index":0,"delta":"'
                + self._words[index % len(self._words)] + self._delta_tail
                + b'%d,"type":"response.output_text.delta"}\n\n' % number)

    def closing_events(self, outputs: list[tuple[int, str]]) -> bytes:
        text = filler_text(outputs[0][0])
        done = {"content_index": 0, "item_id": self.item_id, "output_index": 0}
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
        return (self._event("response.output_text.done", {"content_index": 0, "item_id": self.item_id,
                                                          "logprobs": [], "output_index": 0, "text": text})
                + self._event("response.content_part.done", done | {"part": part})
                + self._event("response.output_item.done", {"item": self._item(text), "output_index": 0})
                + self._event("response.completed", {"response": self._response(outputs)}))

    def full_response(self, outputs: list[tuple[int, str]]) -> bytes:
        return vllm_json(self._response(outputs))


def renderer_for(request: GenerationRequest) -> ResponseRenderer | ResponsesRenderer:
    return ResponsesRenderer(request) if request.kind == RESPONSES else ResponseRenderer(request)
