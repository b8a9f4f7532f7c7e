"""OpenAI wire format: read the facts admission needs from a request body, and write OpenAI-style error bodies."""

from __future__ import annotations

import json
import re
import time
import uuid
from array import array
from bisect import bisect_right
from itertools import accumulate, chain
from typing import Any

import orjson

from ..policy.cost import score_sides
from ..policy.reasons import R_JSON_TOO_DEEP, R_JSON_TOO_MANY, R_JSON_TOO_MANY_STRINGS, error_type, say

# Larger max_tokens values mean nothing for any model, and past ~1e308 they cannot even become a float for the
# cost estimate (an OverflowError there failed the stream, and Envoy's failure_mode_allow let the request through
# unadmitted).
MAX_TOKENS_CEILING = 2**31 - 1
# Deepest JSON nesting we accept. Real bodies stay far below it (a tool's parameter schema rarely passes 20
# levels); deeper ones could exhaust the recursion of a JSON encoder later (orjson refuses past ~250) and must be
# refused here, as a 400, before anything else touches them.
MAX_JSON_DEPTH = 64
# Most JSON objects and arrays a body may hold (outside strings). Parsing and walking cost per container: 1.4
# million empty arrays in 4 MiB took the parse and the walks over a second of the event loop, past Envoy's
# message_timeout (failure_mode_allow then forwards requests unadmitted). A real request has a few per message,
# part or tool: this many is beyond any context window.
MAX_JSON_CONTAINERS = 20_000
# Most JSON strings (keys included) a body may hold. Each one is a Python object the parse makes and the prompt
# walks visit: a completions `prompt` of 1.36 million empty strings (4 MiB) took ~180 ms of the event loop, and
# eight such bodies a second held other clients' requests past message_timeout. A chat message needs four and a
# content part or prompt at least two: this many is far past what a context window holds.
MAX_JSON_STRINGS = 100_000
# Most values of a token-id list read one by one as vLLM's lax integers ("5", 5.0): a list of plain integers is
# checked whatever its length, at C speed, and a longer one holding anything else is left for vLLM to judge (read
# here, two million of them would take the event loop half a second).
MAX_LAX_TOKEN_IDS = 20_000


class Endpoint:
    """One of vLLM's compute endpoints: how its body is read, and what a fallback may do with it."""

    __slots__ = ("group", "kind", "token_fields", "canned", "default_max_tokens", "takes")

    def __init__(self, group: str, kind: str, token_fields: tuple[str, ...] = (), canned: bool = False,
                 default_max_tokens: int | None = None, takes: tuple = ()):
        self.group = group                # the policy's `endpoints.<group>` switch
        self.kind = kind                  # chat | completions | responses | input (prefill only, no output)
        # Body fields that cap the output, the one the server obeys first when several are set (empty: the
        # endpoint generates none); the last is the one a degrade writes when the client set none (the oldest,
        # which every server version reads).
        self.token_fields = token_fields
        self.canned = canned              # a canned answer can take this endpoint's shape
        # The cap the API itself sets when the body sets none (None: the rest of the context, as vLLM does).
        self.default_max_tokens = default_max_tokens
        # A pooling route's request types, each as the fields it needs and the JSON types each may have (None:
        # any); empty: not checked here (_check_pooling)
        self.takes = takes


# vLLM's chat request: `max_tokens = max_completion_tokens or max_tokens` (OpenAI deprecated the older field).
CHAT = Endpoint("chat", "chat", ("max_completion_tokens", "max_tokens"), canned=True)
# The completions API caps output at 16 tokens when max_tokens is unset or null (OpenAI's default, and vLLM 0.32's
# CompletionRequest): costed at the policy's default_max_tokens it was charged 64 times what it could generate.
COMPLETIONS = Endpoint("completions", "completions", ("max_tokens",), canned=True, default_max_tokens=16)
RESPONSES = Endpoint("responses", "responses", ("max_output_tokens",))
# The pooling routes, all under the policy's `endpoints.embeddings`: what vLLM 0.32's request models for each take
# (their unions; str, list and dict stand for the JSON types a field's types accept).
_TEXT_OR_TOKENS, _MESSAGES = ("input", (str, list)), ("messages", (list,))
_SCORE_INPUT = (str, list, dict)
POOLING = Endpoint("embeddings", "input", takes=((_TEXT_OR_TOKENS,), (_MESSAGES,)))  # /v1/embeddings, /classify
POOLING_ROUTE = Endpoint("embeddings", "input", takes=((_TEXT_OR_TOKENS,), (_MESSAGES,), (("data", None),)))
SCORE = Endpoint("embeddings", "input", takes=tuple(((a, _SCORE_INPUT), (b, _SCORE_INPUT)) for a, b in (
    ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))))
RERANK = Endpoint("embeddings", "input", takes=((("query", (str, dict)), ("documents", _SCORE_INPUT)),))
TOKENIZE = Endpoint("tokenize", "input")
AUDIO = Endpoint("audio", "input")
INVOCATIONS = Endpoint("invocations", "invocations")  # vLLM picks chat/completions/embeddings by the body

# The paths on which vLLM 0.32 makes a replica compute that the gateway admits. envoy/envoy.yaml routes exactly
# these through the ext_proc; each is admitted under the policy's `endpoints` switch for its group, or refused
# with a clear 404. vLLM 0.32 computes on a few more (its /openapi.json: the Anthropic /v1/messages and
# /v1/messages/count_tokens, /v1/chat/completions/batch, /generative_scoring): Envoy's default route refuses those.
ENDPOINTS: dict[str, Endpoint] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/v1/responses": RESPONSES,
    "/invocations": INVOCATIONS,
    **dict.fromkeys(("/v1/embeddings", "/classify"), POOLING),
    "/pooling": POOLING_ROUTE,
    **dict.fromkeys(("/score", "/v1/score"), SCORE),
    **dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), RERANK),
    **dict.fromkeys(("/tokenize", "/detokenize"), TOKENIZE),
    **dict.fromkeys(("/v1/audio/transcriptions", "/v1/audio/translations"), AUDIO),
}


class BadRequest(Exception):
    """A request we refuse before admission (400 unless `status` says otherwise); `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_body", status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status


class RequestBody:
    """The fields of a request body that admission reads, and the body to forward."""

    __slots__ = ("endpoint", "model", "max_tokens", "max_tokens_field", "sequences", "prompts", "stream",
                 "claimed_class", "doc", "rewrite", "min_output", "prompt_cap", "beam_search")

    def __init__(self, doc: dict[str, Any], endpoint: Endpoint = CHAT):
        self.doc = doc
        self.endpoint = endpoint
        self.model: str | None = None
        self.max_tokens: int | None = None
        # The body field max_tokens was read from, named in errors about it as vLLM names it (max_completion_tokens,
        # the Responses API's max_output_tokens); when the body has none, the endpoint's own (its last) name for it
        self.max_tokens_field = endpoint.token_fields[-1] if endpoint.token_fields else "max_tokens"
        self.sequences = 1        # output sequences generated (n, per prompt): each one decodes
        self.prompts = 1          # prompts in the body (a completions list): each has a context of its own
        self.min_output: int | None = 0  # output each sequence produces at least; None: all of it (ignore_eos)
        self.prompt_cap: int | None = None  # tokens vLLM keeps of each prompt (truncate_prompt_tokens); -1: context
        self.stream = False
        self.claimed_class: str | None = None
        self.rewrite = False      # the body must be re-serialised before it goes upstream
        # vLLM's beam search: its usage counts the beams it answers with, not the n x max_tokens steps it ran
        self.beam_search = False

    @property
    def generates(self) -> bool:
        return bool(self.endpoint.token_fields)


def json_media_type(content_type: bytes | None) -> bool:
    """Whether vLLM 0.32 takes a body sent with this Content-Type. Its validate_json_request, a dependency of every
    route the gateway admits (chat, completions, responses, /invocations, the pooling and tokenize routes; audio,
    multipart, is never admitted), refuses with 400 "Unsupported Media Type" whatever the body holds unless the media
    type, lower-cased and cut at the first `;`, is exactly `application/json`: `application/json; charset=utf-8` and
    `Application/JSON` pass; a missing header, `text/plain`, `application/json ;x` and `application/x+json` do not.
    Read on the first Content-Type, as its server (Starlette) reads it."""
    return content_type is not None and content_type.lower().split(b";", 1)[0] == b"application/json"


def parse_body(raw: bytes, endpoint: Endpoint, class_field: str,
               class_names: frozenset[str] | set[str] | dict) -> RequestBody:
    """Parse and type-check the admission-relevant fields. Raises BadRequest with an OpenAI-style message."""
    doc = load_json_object(raw)
    route = endpoint
    if endpoint is INVOCATIONS:
        endpoint = _invocation_kind(doc)
    body = RequestBody(doc, endpoint)
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("You must provide a model parameter (a non-empty string).", "model")
    body.model = model
    if route is not INVOCATIONS or "input" not in doc:  # (with `input`, a pooling model may serve it as embeddings)
        if endpoint.kind == "chat":
            _check_messages(doc)
        elif endpoint.kind == "completions":
            _check_prompt(doc)
        elif endpoint.kind == "responses":
            _check_input(doc)
        elif endpoint.takes and route is not INVOCATIONS:  # (a pooling model's /invocations: its own reading)
            _check_pooling(doc, endpoint.takes)
    scores_prompt = _scores_prompt_only(doc, endpoint)
    # vLLM 0.32 obeys the first cap field that is not null (chat's max_completion_tokens, then its deprecated
    # max_tokens) and only reads the others as integers: `max_tokens: 0` or `-1` beside `max_completion_tokens: 5`
    # runs 5 tokens, and `max_completion_tokens: 0` beside `max_tokens: 5` is refused (differential.json).
    obeyed = next((field for field in endpoint.token_fields if doc.get(field) is not None), None)
    for field in endpoint.token_fields:
        if field != obeyed:
            _integer(doc, field)
    if obeyed is not None:
        body.max_tokens = 1 if scores_prompt else _positive_int(doc, obeyed)
        body.max_tokens_field = obeyed
    else:
        body.max_tokens = endpoint.default_max_tokens
    if endpoint.token_fields:
        # Not best_of: vLLM 0.32 has none (an ignored field, one sequence generated); counted, it overcharged. Nor
        # the Responses API's n, which vLLM's Responses request does not have either.
        body.sequences = 1 if endpoint.kind == "responses" else _positive_int(doc, "n") or 1
        if endpoint.kind == "completions":
            body.prompts = _prompt_count(doc)
            body.sequences *= body.prompts
        # A prompt-scoring request's one token is forced too: it says nothing about where answers end.
        body.min_output = None if scores_prompt else min_output_of(doc, endpoint.kind != "responses")
        body.beam_search = endpoint.kind != "responses" and lax_true(doc.get("use_beam_search"))
    if endpoint.kind in ("chat", "completions"):
        body.prompt_cap = _truncation(doc.get("truncate_prompt_tokens"))
    elif endpoint.kind == "responses" and doc.get("truncation", "disabled") in ("auto", None):
        # vLLM's Responses API truncates to what the context holds unless truncation is "disabled", its default:
        # an explicit null truncates too.
        body.prompt_cap = -1
    elif endpoint is SCORE or endpoint is RERANK:
        # vLLM 0.32's pooling requests read truncate_prompt_tokens as chat does: here each pair (a cross-encoder's
        # query and document together) or text (a bi-encoder's) kept to N tokens.
        body.prompt_cap = _truncation(doc.get("truncate_prompt_tokens"))
        body.prompts = _scored_texts(doc)
    elif endpoint.group == "embeddings" and ("input" in doc or "messages" in doc):
        # ... and on embeddings, classify and pooling each input (not a /pooling `data`: an IO processor's own)
        body.prompt_cap = _truncation(doc.get("truncate_prompt_tokens"))
        body.prompts = _input_count(doc.get("input"))
    if endpoint.kind == "responses" and lax_true(doc.get("background")):
        # vLLM (with its response store on) answers a background request at once, "queued", and generates after
        # the request has ended: its slot was free again while the replica ran it (a class capped at 1 let 4
        # through), and GET /v1/responses/{id}, the only way to its answer, is not routed here.
        raise BadRequest("`background` responses are not served through this gateway: they would run after "
                         "the request ends, outside its admission, and their result cannot be fetched here. "
                         "Send the request without `background` (streaming, if it is long).", "background")
    stream = doc.get("stream")
    if stream is not None and not lax_true(stream) and not lax_false(stream):
        raise BadRequest("`stream` must be true or false.", "stream")
    body.stream = lax_true(stream)  # as vLLM reads it: "yes" or 1 streams, "false" or 0 does not
    # Checked here, as vLLM would, so the answer does not depend on whether the gateway rewrites it (a learned
    # stream gets include_usage added): `"stream_options": "yes"` got 200 or 400 by chance.
    if doc.get("stream_options") is not None and not isinstance(doc["stream_options"], dict):
        raise BadRequest(f"`stream_options` must be an object, got {_show(doc['stream_options'])}.",
                         "stream_options")
    _read_claim(body, class_field, class_names)
    return body


def empty_body() -> BadRequest:
    return BadRequest("The request body is empty; expected a JSON object.")


def load_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object no deeper than MAX_JSON_DEPTH, or BadRequest."""
    if not raw:
        raise empty_body()
    # Counted on UTF-8 only: a UTF-16/32 body's code units hold quote and bracket bytes (丢 is 0x4E22), so it is
    # counted once re-encoded (_loads_other_unicode), and its depth then checked whatever its count.
    containers = MAX_JSON_CONTAINERS
    if json.detect_encoding(raw) == "utf-8":
        containers = _bound_containers(raw)
        _bound_strings(raw)
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        doc, raw = _loads_other_unicode(raw, e)
    if not isinstance(doc, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_json")
    # Depth cannot exceed the number of brackets: only bodies with many of them need reading for it.
    if containers > MAX_JSON_DEPTH and _depth(doc, raw) > MAX_JSON_DEPTH:
        raise BadRequest(say(R_JSON_TOO_DEEP, depth=MAX_JSON_DEPTH), code=R_JSON_TOO_DEEP)
    return doc


def _bound_containers(raw: bytes) -> int:
    """Refuse a body with more than MAX_JSON_CONTAINERS objects and arrays before it is parsed, in C-speed passes
    over the bytes: brackets are counted outside strings only when the raw count is over the limit (source code in
    a prompt has many). UTF-16/32 bodies are counted once decoded. Returns the count (an upper bound on depth)."""
    count = raw.count(b"{") + raw.count(b"[")
    if count <= MAX_JSON_CONTAINERS:
        return count
    outside = _outside_strings(raw)
    count = outside.count(b"{") + outside.count(b"[")
    if count > MAX_JSON_CONTAINERS:
        raise BadRequest(say(R_JSON_TOO_MANY, count=count, limit=MAX_JSON_CONTAINERS), code=R_JSON_TOO_MANY)
    return count


def _bound_strings(raw: bytes) -> None:
    """Refuse a body with more than MAX_JSON_STRINGS strings before it is parsed: two quotes a string, escaped
    ones left out only when the raw count is over the limit (UTF-16/32 bodies are counted once decoded)."""
    if len(raw) < 3 * MAX_JSON_STRINGS or raw.count(b'"') <= 2 * MAX_JSON_STRINGS:
        return  # (a string and its comma take three bytes at least)
    count = _unescaped(raw).count(b'"') // 2
    if count > MAX_JSON_STRINGS:
        raise BadRequest(say(R_JSON_TOO_MANY_STRINGS, count=count, limit=MAX_JSON_STRINGS),
                         code=R_JSON_TOO_MANY_STRINGS)


def _unescaped(raw: bytes) -> bytes:
    """The JSON text without its escaped backslashes, then its escaped quotes: every quote left delimits a string
    (valid JSON has no backslash outside strings)."""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


def _outside_strings(raw: bytes) -> bytes:
    """The JSON text with its strings' contents removed."""
    return b"".join(_unescaped(raw).split(b'"')[0::2])


def _loads_other_unicode(raw: bytes, error: orjson.JSONDecodeError) -> tuple[Any, bytes]:
    """A body orjson (UTF-8 only) refused: vLLM's server reads JSON bytes as Python's json does, which also takes
    UTF-8 with a BOM and UTF-16/32, so read those the same way; anything else is refused, saying why. Returns the
    parsed body and its text as UTF-8."""
    encoding = json.detect_encoding(raw)
    if encoding != "utf-8":
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError:
            text = None
        if text is not None:
            utf8 = text.encode("utf-8")
            _bound_containers(utf8)
            _bound_strings(utf8)
            try:
                return orjson.loads(utf8), utf8
            except orjson.JSONDecodeError:
                pass
    if "UTF-8" in str(error):
        raise BadRequest("The request body is not valid UTF-8 (JSON bodies must be UTF-8, or UTF-16/32 with a "
                         "byte order mark).", code="invalid_json") from None
    raise BadRequest(f"The request body is not valid JSON: {error}", code="invalid_json") from None


# Values a depth walk of the parsed body visits before it hands over to reading the brackets (~2 ms of walk).
DEPTH_WALK_BUDGET = 50_000
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _depth(doc: Any, raw: bytes) -> int:
    """The body's nesting depth by the cheaper way: walking the parsed body visits every value (20,000 token-id
    lists of 100 took it 70 ms), reading the brackets costs ~2 ms per MB of text whatever it holds."""
    depth = json_depth(doc, DEPTH_WALK_BUDGET)
    return depth if depth is not None else bracket_depth(raw)


def json_depth(doc: Any, budget: int | None = None) -> int | None:
    """Nesting depth of parsed JSON, without recursion (a scalar is 0, `{}` is 1); None once the walk has visited
    more than `budget` values."""
    if type(doc) is not dict and type(doc) is not list:
        return 0
    deepest, stack = 0, [(doc, 1)]
    visited = 0
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                return deepest
        visited += len(node)
        if budget is not None and visited > budget:
            return None
        children = node.values() if type(node) is dict else node
        for child in children:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return deepest


def bracket_depth(raw: bytes) -> int:
    """Nesting depth of a valid JSON text, from its brackets outside strings: at most 2 x MAX_JSON_CONTAINERS of
    them once _bound_containers has passed."""
    depth = deepest = 0
    for c in _outside_strings(raw).translate(None, _NOT_BRACKETS):
        if c == 91 or c == 123:  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
    return deepest


def _invocation_kind(doc: dict[str, Any]) -> Endpoint:
    """/invocations serves chat, completions or embeddings depending on the body, as vLLM does. vLLM 0.32 runs the
    body as the first request type that validates (chat, then completions, on a generative model), so a body that
    carries both `messages` and a prompt is refused: one whose chat reading fails vLLM's validation anywhere (a
    `messages` of 5, an unknown `tool_choice`) runs as completions, with every prompt of its list generating, while
    it was charged one chat answer. A `messages` that is null, a number or a boolean is refused as vLLM refuses it:
    its chat request's first check loops over `messages`, and the TypeError that raises is not a validation error,
    so vLLM answers 400 rather than try completions. Only a body read as embeddings (`input`, no prompt) goes on:
    a pooling model, which has no chat request, serves it."""
    messages = doc.get("messages")
    chat = isinstance(messages, (list, str, dict))  # vLLM's chat request needs a list there
    completions = _has_prompt(doc)
    if "messages" in doc and not chat and (completions or "input" not in doc):
        raise _messages_not_a_list(messages, " /invocations reads a body with `messages` as a chat request: send "
                                             "a list of messages, or leave `messages` out of a completions body.")
    if chat and completions:
        raise BadRequest("/invocations got both `messages` (chat) and `prompt` or `prompt_embeds` (completions): "
                         "send one of them.", "messages")
    if chat:
        return CHAT
    if completions:
        return COMPLETIONS
    if "input" in doc:
        return POOLING
    raise BadRequest("/invocations needs a chat (`messages`), completions (`prompt`) or embeddings (`input`) "
                     "body.", code="invalid_body")


def _messages_not_a_list(messages: Any, hint: str = "") -> BadRequest:
    return BadRequest(f"`messages` must be a list of messages, got {_excerpt(messages)}.{hint}", "messages")


def _check_messages(doc: dict[str, Any]) -> None:
    """Refuse, as vLLM 0.32 refuses with 400, a chat body whose `messages` its chat request cannot take
    (tests/fixtures/vllm/differential.json): admitted, it held a slot until the replica answered that 400. They
    must be present and a list (null, a number or a boolean fail its first check, which loops over them; a string
    or an object, pydantic's list_type), not empty (its chat template refuses an empty conversation) unless the body
    carries its prompt's token ids (`kv_transfer_params.prompt_token_ids`, a disaggregated decode's, which vLLM runs
    without rendering the messages), and each an object with a string `role` (every OpenAI message type and vLLM's
    custom one) or an `author` (openai_harmony's Message, which vLLM's union takes too), and a role's message its
    `content` as _check_content says. The rest of a message (its tool calls, the fields of a content part, a role
    vLLM's template does not know) is vLLM's to judge."""
    if "messages" not in doc:
        raise BadRequest("`messages` is required: a chat request is a list of messages.", "messages")
    messages = doc["messages"]
    if type(messages) is not list:
        raise _messages_not_a_list(messages)
    if not messages:
        transfer = doc.get("kv_transfer_params")
        if not isinstance(transfer, dict) or transfer.get("prompt_token_ids") is None:
            raise BadRequest("`messages` is empty: vLLM cannot apply a chat template to an empty conversation. Send "
                             "at least one message.", "messages")
    for i, message in enumerate(messages):
        if type(message) is not dict:
            raise BadRequest(f"`messages[{i}]` must be a message object, got {_excerpt(message)}.", "messages")
        if "author" in message:
            continue  # openai_harmony's Message: its content is its own
        role = message.get("role")
        if type(role) is not str:
            raise BadRequest(f"`messages[{i}]` needs a `role` (a string, such as \"user\").", "messages")
        content = message.get("content", "")
        if type(content) is not str:
            _check_content(content, role, i)


# Roles whose message vLLM's union takes with a null `content` (OpenAI's assistant and function messages).
_CONTENT_MAY_BE_NULL = frozenset(("assistant", "function"))


def _check_content(content: Any, role: str, i: int) -> None:
    """Refuse a message `content` (not a string) that no message type of vLLM 0.32's union takes
    (tests/fixtures/vllm/differential.json, chat:messages=[{'role': ..., 'content': ...}]): a number or a boolean;
    null but in an assistant or function message; a non-empty object (the types whose content may be an iterable
    read its keys as parts, and a key is no part; an empty one is read as no parts, and served); a list holding
    anything but objects and strings (a part is one or the other). Which parts a role takes, and what a part holds,
    is vLLM's to judge: a custom role takes ["hi"], which the OpenAI roles refuse."""
    if content is None:
        if role in _CONTENT_MAY_BE_NULL:
            return
        raise BadRequest(f"`messages[{i}].content` is null: only an assistant (or function) message's may be.",
                         "messages")
    if type(content) is list:
        j = _first_not_of(content, (dict, str))
        if j is None:
            return
        raise BadRequest(f"`messages[{i}].content[{j}]` must be a content part (an object such as "
                         f"{{\"type\": \"text\", \"text\": \"...\"}}), got {_excerpt(content[j])}.", "messages")
    if type(content) is dict and not content:
        return
    raise BadRequest(f"`messages[{i}].content` must be a string or a list of content parts, got "
                     f"{_excerpt(content)}.", "messages")


def _check_input(doc: dict[str, Any]) -> None:
    """Refuse, as vLLM 0.32 refuses with 400, a Responses body whose `input` its request cannot take
    (tests/fixtures/vllm/differential.json, responses:input=...): absent, neither a string nor a list (null, a
    number, a boolean, an object), empty (its chat template refuses an empty conversation), or holding anything but
    objects (every input item type is one). What an item holds is vLLM's to judge."""
    if "input" not in doc:
        raise BadRequest("`input` is required: a string, or a list of input items.", "input")
    value = doc["input"]
    if type(value) is str:
        return
    if type(value) is not list:
        raise BadRequest(f"`input` must be a string or a list of input items, got {_excerpt(value)}.", "input")
    if not value:
        raise BadRequest("`input` is empty: vLLM cannot apply a chat template to an empty conversation. Send a "
                         "string or at least one input item.", "input")
    i = _first_not_of(value, (dict,))
    if i is not None:
        raise BadRequest(f"`input[{i}]` must be an input item (an object such as {{\"role\": \"user\", "
                         f"\"content\": \"...\"}}), got {_excerpt(value[i])}.", "input")


def _check_pooling(doc: dict[str, Any], takes: tuple) -> None:
    """Refuse, as vLLM 0.32's request models for a pooling route refuse with 400, a body that none of its request
    types takes (Endpoint.takes; checked against those models on generated bodies, tests/unit/test_openai_body.py):
    one whose fields are missing or of a JSON type none of theirs accepts (null, a number, a boolean, an object where
    a string or a list is wanted). What is inside a field is vLLM's to judge."""
    for fields in takes:
        if all(f in doc and (types is None or type(doc[f]) in types) for f, types in fields):
            return
    closest = max(takes, key=lambda fields: sum(f in doc for f, _ in fields))
    field = next(f for f, types in closest if f not in doc or type(doc[f]) not in types)
    wanted = " or ".join(" and ".join(f"`{f}`" for f, _ in fields) for fields in takes)
    raise BadRequest(f"This route needs {wanted}: a string or a list each (an object where vLLM takes one), not "
                     f"null, a number or a boolean.", field)


_PROMPT_TYPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _check_prompt(doc: dict[str, Any]) -> None:
    """Refuse, as vLLM 0.32 refuses with 400, a completions body with nothing its request can run
    (tests/fixtures/vllm/differential.json): a `prompt` that is none of _PROMPT_TYPES (_check_prompt_list), or
    none to run (absent, null, "" or []) with no `prompt_embeds` (absent, null or [] is none)."""
    prompt, embeds = doc.get("prompt"), doc.get("prompt_embeds")
    if type(prompt) is list:
        if prompt:
            _check_prompt_list(prompt)
    elif prompt is not None and type(prompt) is not str:
        raise BadRequest(f"`prompt` must be {_PROMPT_TYPES}, got {_excerpt(prompt)}.", "prompt")
    if (prompt is None or prompt == "" or prompt == []) and (embeds is None or embeds == []):
        raise BadRequest("Either `prompt` or `prompt_embeds` must be provided and non-empty.", "prompt")


def _check_prompt_list(prompt: list) -> None:
    """A non-empty prompt list as vLLM 0.32's CompletionRequest takes it (tests/fixtures/vllm/differential.json,
    completions:prompt=[...]): all strings (each a prompt; "" too), else token ids (_bad_token_id), else lists of
    them, none empty (its engine refuses an empty prompt: "The decoder prompt cannot be empty", a 400, or an error
    event in a 200 stream, before anything runs). A list mixing strings with what is no token id (`[5, "a"]`), lists
    with anything else (`[[5], "a"]`), or nested deeper fits none of its types. Token ids past the vocabulary are
    the replica's to refuse: their bound is the model's."""
    if _first_not_of(prompt, (str,)) is None:
        return
    if type(prompt[0]) is list:
        i = _first_not_of(prompt, (list,))
        if i is None:
            if [] in prompt:
                raise BadRequest(f"`prompt[{prompt.index([])}]` is an empty list of token ids: vLLM cannot run an "
                                 "empty prompt.", "prompt")
            j = _bad_token_id(list(chain.from_iterable(prompt)))
            if j is None:
                return
            i = bisect_right(list(accumulate(map(len, prompt))), j)
        raise BadRequest(f"`prompt[{i}]` must be a list of token ids (integers >= 0), got {_excerpt(prompt[i])}: a "
                         f"prompt is {_PROMPT_TYPES}.", "prompt")
    j = _bad_token_id(prompt)
    if j is not None:
        raise BadRequest(f"`prompt[{j}]` must be a token id (an integer >= 0), got {_excerpt(prompt[j])}: a prompt "
                         f"is {_PROMPT_TYPES}.", "prompt")


def _bad_token_id(values: list) -> int | None:
    """The index of a value that is no token id as vLLM's CompletionRequest reads one (an integer >= 0, or what its
    lax integer field reads as one: 5.0, "5", " 5 ", true), or None. Integers (a JSON body's numbers are not
    bounded in count: 4 MiB holds two million) are checked at C speed, ~5 ns each; from the first other value on,
    the list is read value by value (~250 ns each) only if MAX_LAX_TOKEN_IDS values or fewer are left, and a longer
    rest is vLLM's to judge."""
    try:
        array("Q", values)  # every value an integer (a boolean too) from 0 to 2**64 - 1
        return None
    except (TypeError, OverflowError):
        pass
    first = _first_not_unsigned(values)
    if type(values[first]) is int and values[first] < 0:
        return first
    if len(values) - first > MAX_LAX_TOKEN_IDS:
        return None
    return next((i for i, t in enumerate(map(_lax_int, values[first:]), first) if type(t) is not int or t < 0),
                None)


def _first_not_unsigned(values: list) -> int:
    """The index of the first value of `values` (one exists) that array("Q") does not hold, found by halving the
    part it is in: about one more conversion of the list, at C speed."""
    lo, hi = 0, len(values)  # values[:lo] convert, and the first that does not is in values[lo:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            array("Q", values[lo:mid])
            lo = mid
        except (TypeError, OverflowError):
            hi = mid
    return lo


def _first_not_of(values: list, types: tuple[type, ...]) -> int | None:
    """The index of the first value whose type is none of `types` (exactly), or None. It walks the values up to the
    first other one: for strings and containers, at most MAX_JSON_STRINGS + MAX_JSON_CONTAINERS of them."""
    return next((i for i, v in enumerate(values) if type(v) not in types), None)


def _has_prompt(doc: dict[str, Any]) -> bool:
    """A body vLLM's completions request takes: a prompt or prompt_embeds that is not null or empty."""
    return doc.get("prompt") not in (None, "") or doc.get("prompt_embeds") not in (None, [])


# Strings pydantic (vLLM's request models) reads as true, and as false, in a boolean field.
_TRUE_STRINGS = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE_STRINGS = frozenset(("0", "off", "f", "false", "n", "no"))


def lax_true(value: Any) -> bool:
    """Whether vLLM's pydantic models read `value` as true in a boolean field."""
    return value is True or (type(value) in (int, float) and value == 1) or \
        (isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS)


def lax_false(value: Any) -> bool:
    """Whether vLLM's pydantic models read `value` as false in a boolean field."""
    return value is False or (type(value) in (int, float) and value == 0) or \
        (isinstance(value, str) and value.strip().lower() in _FALSE_STRINGS)


def min_output_of(doc: dict[str, Any], chat_or_completions: bool = True) -> int | None:
    """The output each sequence produces at least: None (all of its cap) under vLLM's ignore_eos or its beam search,
    else its min_tokens (vLLM checks the value: anything else is 0 here). vLLM's Responses API reads neither
    min_tokens nor use_beam_search."""
    if lax_true(doc.get("ignore_eos")):
        return None
    if chat_or_completions and lax_true(doc.get("use_beam_search")):
        # vLLM 0.32's beam search runs max_tokens steps of n beams whatever EOS says (a beam that ends is set aside
        # and another candidate takes its place), one engine request per beam and step: every beam decodes the
        # whole cap, the rest of the context when the body sets none.
        return None
    min_tokens = _lax_int(doc.get("min_tokens")) if chat_or_completions else None
    return min(min_tokens, MAX_TOKENS_CEILING) if type(min_tokens) is int and min_tokens > 0 else 0


def _truncation(value: Any) -> int | None:
    """vLLM's truncate_prompt_tokens as its model reads it (a lax integer): N >= 1 keeps each prompt's last N
    tokens, -1 as many as the context holds. Anything else truncates nothing here (vLLM refuses it)."""
    value = _lax_int(value)
    return value if type(value) is int and (value >= 1 or value == -1) else None


def _scores_prompt_only(doc: dict[str, Any], endpoint: Endpoint) -> bool:
    """A completions request with echo and max_tokens 0: it asks for its prompt's logprobs, not for output
    (lm-evaluation-harness's loglikelihood requests). vLLM runs it with one output token per prompt, and refuses
    max_tokens 0 without echo, as the gateway does."""
    return endpoint.kind == "completions" and lax_true(doc.get("echo")) and _lax_int(doc.get("max_tokens")) == 0


def _prompt_count(doc: dict[str, Any]) -> int:
    """Prompts in a completions body: vLLM runs a list of strings, or of token-id lists, as one request each, and
    each of its prompt_embeds (one base64 tensor or a list; --enable-prompt-embeds) as one more."""
    embeds = doc.get("prompt_embeds")
    count = len(embeds) if type(embeds) is list else int(embeds is not None)
    prompt = doc.get("prompt")
    if type(prompt) is list and prompt and all(type(p) is str or type(p) is list for p in prompt):
        return count + len(prompt)
    return count + 1 if prompt is not None or not count else count  # one string, or one prompt of token ids


def _input_count(value: Any) -> int:
    """Inputs of a pooling body: vLLM embeds each string, or token-id list, of an `input` list on its own."""
    if type(value) is list and value and all(type(p) is str or type(p) is list for p in value):
        return len(value)
    return 1


def _scored_texts(doc: dict[str, Any]) -> int:
    """Texts of a score or rerank body, both sides together: at least as many as it has pairs (a cross-encoder runs
    each query with its document) or texts (a bi-encoder embeds each once), so N tokens each bounds what runs."""
    count = 0
    for side in score_sides(doc):
        if type(side) is dict:
            side = side.get("content", side)  # multimodal documents: one part a document
        count += len(side) if type(side) is list and side and type(side[0]) is not int else 1
    return count


def _integer(doc: dict[str, Any], field: str) -> None:
    """A field vLLM reads as an integer and then ignores (a cap beside the one it obeys): any lax integer or null."""
    value = _lax_int(doc.get(field))
    if value is not None and type(value) is not int:
        raise BadRequest(f"`{field}` must be an integer, got {_show(doc.get(field))}.", field)


def _positive_int(doc: dict[str, Any], field: str) -> int | None:
    """A count or cap of the body, read as vLLM reads it (lax: "8", 8.0 and true are 8, 8 and 1 to it, so to the
    gateway too: refused here, vLLM would have run them)."""
    value = _lax_int(doc.get(field))
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise BadRequest(f"`{field}` must be a positive integer, got {_show(doc.get(field))}.", field)
    if value > MAX_TOKENS_CEILING:
        raise BadRequest(f"`{field}` must be at most {MAX_TOKENS_CEILING}, got {str(value)[:40]}.", field)
    return value


def _excerpt(value: Any) -> str:
    """A JSON value as the body had it, cut at 40 characters."""
    return orjson.dumps(value).decode()[:40]


def _show(value: Any) -> str:
    """A scalar as _excerpt shows it; a container by its type's name."""
    return _excerpt(value) if isinstance(value, (str, int, float, bool)) else type(value).__name__


def _whole(value: Any) -> Any:
    """A whole-number float (`10.0`) as the int it is: vLLM's pydantic models take it, so the gateway does too."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# A string pydantic (2.x, lax mode) reads as a whole number: ASCII digits, `_` between them, a sign, and a fraction of
# zeros only ("20.0" is 20; "1e3", "20.", "٣" and "１２" it refuses, where Python's int() and float() took them).
_LAX_WHOLE = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0+)?")


def _lax_int(value: Any) -> Any:
    """`value` as the int vLLM's pydantic models read in an integer field (lax mode): a whole float, a string
    of one ("20", " 20 ", "20.0", "1_000"), or a boolean (1 or 0); anything else as it is."""
    if type(value) is bool:
        return int(value)
    if isinstance(value, str):
        text = value.strip(" \t\n\r")
        return int(text.split(".")[0]) if _LAX_WHOLE.fullmatch(text) else value
    return _whole(value)


def _read_claim(body: RequestBody, class_field: str, class_names) -> None:
    """The class a body claims, and vLLM's `priority`: both are ours, so neither reaches vLLM as sent."""
    doc = body.doc
    claim = _whole(doc.get(class_field))
    if isinstance(claim, str):
        body.claimed_class = claim.strip().lower()
    elif claim is not None and (not isinstance(claim, int) or isinstance(claim, bool)):
        raise BadRequest(f"`{class_field}` must be a class name ({', '.join(sorted(class_names))}).", class_field)
    for field in {class_field, "priority"}:
        # A client-sent scheduling priority would let any tenant jump vLLM's queue (--scheduling-policy
        # priority): strip it; the policy sets its own per class (`classes.<name>.vllm_priority`).
        if field in doc:
            del doc[field]
            body.rewrite = True


def dump_json(doc: Any) -> bytes:
    return orjson.dumps(doc)


MODELS_PATH = "/v1/models"  # GET: the ext_proc lists every name the edge admits (docs/envoy-integration.md §3)


def model_card(name: str, fields: dict, created: int) -> dict:
    """One name of policy.served.catalog as vLLM 0.32's /v1/models card (tests/fixtures/vllm/models.json)."""
    return {"id": name, "object": "model", "created": created, **fields,
            "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}


def models_body(catalog: dict[str, dict], created: int) -> bytes:
    """GET /v1/models as vLLM answers it, for the catalog's names."""
    return orjson.dumps({"object": "list", "data": [model_card(n, f, created) for n, f in catalog.items()]})


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """{"error": {...}} as OpenAI (and vLLM) shape it."""
    return orjson.dumps({"error": {"message": message, "type": error_type(status),
                                   "param": param, "code": code}})


def degrade_body(body: RequestBody, model: str | None, max_tokens: int | None, stream: bool | None,
                 context: int | None = None) -> list[str]:
    """Apply a degrade to the forwarded body in place; return what changed (for x-extproc-degraded). `context`:
    the fallback model's context length, if known."""
    doc, changed = body.doc, []
    if context is not None and body.max_tokens is not None and body.max_tokens > context:
        # vLLM refuses a max_tokens beyond its max_model_len (400): a request sized for a larger model's context
        # is capped at the smaller one's, where vLLM clamps it to the room its prompt leaves.
        max_tokens = min(max_tokens or context, context)
    if model is not None and model != body.model:
        doc["model"] = model
        changed.append(f"model={model}")
    fields = body.endpoint.token_fields
    if fields and max_tokens is not None and (body.max_tokens is None or body.max_tokens > max_tokens):
        present = [f for f in fields if doc.get(f) is not None]
        for field in present or fields[-1:]:
            doc[field] = max_tokens
        changed.append(f"max_tokens={max_tokens}")
        # vLLM refuses min_tokens above max_tokens (400): the floor the client set comes down with the cap.
        min_tokens = _lax_int(doc.get("min_tokens"))  # "20" is 20 to vLLM, which then checks it
        if type(min_tokens) is int and min_tokens > max_tokens:
            doc["min_tokens"] = max_tokens
            changed.append(f"min_tokens={max_tokens}")
    # Only where the answer can be turned back into the stream the client reads (sse_from_answer): a Responses API
    # stream is a sequence of typed events, not chunks, and keeps streaming.
    if stream is False and body.stream and body.endpoint.canned:
        doc["stream"] = False
        doc.pop("stream_options", None)
        changed.append("stream=off")
    if changed:
        body.rewrite = True
    return changed


def canned_body(body: RequestBody, text: str) -> tuple[bytes, str]:
    """A complete OpenAI-shaped chat or completions answer carrying `text`, as JSON or as an SSE stream:
    (bytes, content-type). One choice per sequence the client asked for (`n`, per prompt of a completions list),
    since clients read choices[i]; a stream ends with the usage chunk when the client asked for it."""
    chat = body.endpoint.kind == "chat"
    created = int(time.time())
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    model = body.model
    choices = range((_positive_int(body.doc, "n") or 1) * body.prompts)
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    if not body.stream:
        doc = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": model, "choices": [
                   {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": "stop"} if chat else
                   {"index": i, "text": text, "logprobs": None, "finish_reason": "stop"} for i in choices],
               "usage": usage}
        return orjson.dumps(doc), "application/json"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict | None, **extra) -> str:
        return "data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                        "choices": [choice] if choice else [], **extra}).decode() + "\n\n"

    events = []
    for i in choices:
        if chat:
            events += [event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}),
                       event({"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": "stop"})]
        else:
            events.append(event({"index": i, "text": text, "logprobs": None, "finish_reason": "stop"}))
    if wants_stream_usage(body):
        events.append(event(None, usage=usage))
    return ("".join(events) + "data: [DONE]\n\n").encode(), "text/event-stream; charset=utf-8"


def wants_stream_usage(body: RequestBody) -> bool:
    """The client asked for the usage chunk at the end of its stream (read before the gateway rewrites the body):
    as vLLM 0.32 reads stream_options, whose include_usage defaults to false (`{}` and `{"continuous_usage_stats":
    true}` get no usage: recorded in tests/fixtures/vllm/differential.json; until 2026-12-06 the gateway took it to
    default to true, so such a learned stream lost its sample and a restreamed answer got a chunk vLLM does not
    send), with pydantic's lax bool ("true", 1)."""
    opts = body.doc.get("stream_options")
    return body.stream and isinstance(opts, dict) and lax_true(opts.get("include_usage"))


def sse_from_answer(kind: str, raw: bytes, include_usage: bool) -> bytes | None:
    """A complete non-streamed chat or completions answer as the event stream its client asked for: one chunk per
    choice carrying the whole choice, the usage chunk if asked, then [DONE]. A degrade that turned streaming off
    answers this way, since an OpenAI client library reading a stream finds no events in a JSON body and returns an
    empty answer without an error. None: not an answer of that shape (it is passed on as it is)."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list):
        return None
    chat = kind == "chat"
    head = {"id": doc.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": doc.get("created"), "model": doc.get("model")}
    events = []
    for i, choice in enumerate(doc["choices"]):
        if not isinstance(choice, dict):
            return None
        events.append({**head, "choices": [_chunk_choice(choice, i, chat)]})
    if include_usage and doc.get("usage") is not None:
        events.append({**head, "choices": [], "usage": doc["usage"]})
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def sse_error(message: str, code: str) -> bytes:
    """An event stream that ends with an error, as vLLM ends a stream that failed: the openai SDK raises it."""
    return b"data: " + error_body(500, message, code) + b"\n\ndata: [DONE]\n\n"


def _chunk_choice(choice: dict, i: int, chat: bool) -> dict:
    """A non-streamed choice as the one stream chunk that carries all of it."""
    out = {"index": choice.get("index", i), "logprobs": choice.get("logprobs"),
           "finish_reason": choice.get("finish_reason")}
    if "stop_reason" in choice:
        out["stop_reason"] = choice["stop_reason"]
    if not chat:
        out["text"] = choice.get("text", "")
        return out
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    delta = {k: v for k, v in message.items() if v is not None}
    calls = delta.get("tool_calls")
    if isinstance(calls, list):  # a stream's tool call deltas say which call they extend
        delta["tool_calls"] = [{"index": n, **c} if isinstance(c, dict) else c for n, c in enumerate(calls)]
    out["delta"] = delta
    return out
