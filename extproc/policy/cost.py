"""Request facts -> GPU-seconds estimate, per model profile; corrected online from real usage and durations."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

import orjson

from .schema import CostSpec

# Tokens a chat template adds per message (role markers, separators), and what a non-text part costs.
MESSAGE_OVERHEAD_TOKENS = 4
IMAGE_PART_TOKENS = 768
AUDIO_PART_TOKENS = 512
VIDEO_PART_TOKENS = 32 * 128  # vLLM samples 32 frames of a video by default; ~128 tokens a frame after merging
# Characters of prompt text a configured tokenizer counts; the rest is extrapolated (CostModel._tokenized). The
# tokenizer runs on the event loop and holds the GIL, at a few MB/s: a 4 MB prompt held every other request's
# decision for 2-4 s, past Envoy's 0.5 s message_timeout, and those went through unadmitted. This many cost ~3 ms.
TOKENIZE_MAX_CHARS = 16_384


class CostEstimate:
    """What admission counts for one request."""

    __slots__ = ("prompt_tokens", "max_tokens", "expected_output", "gpu_seconds", "tokens", "most_output",
                 "sequences", "prompts", "min_output", "forced")

    def __init__(self, prompt_tokens: int, max_tokens: int, expected_output: float, gpu_seconds: float,
                 most_output: int = 0):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens          # requested (or defaulted), clamped to the context
        self.expected_output = expected_output
        self.gpu_seconds = gpu_seconds
        self.tokens = prompt_tokens + max_tokens  # prompt + requested output: the worst case a token limit charges
        # The most output a replica can really produce: the client's cap, else the context (vLLM's own default
        # is the rest of it; the policy's default_max_tokens is only an assumption). 0: unknown.
        self.most_output = most_output
        self.sequences = 1  # outputs it was made for (a degrade's clamp is per output), and prompts among them
        self.prompts = 1
        self.min_output: int | None = 0  # what it was made for: see CostModel.estimate
        self.forced = 0     # output tokens the request will produce whatever the model says (all its sequences)


def prompt_size(doc: dict[str, Any]) -> tuple[int, int]:
    """(characters of text, tokens known without a tokenizer) of a chat, completions or Responses API body.

    Walks messages and parts, not bytes: string lengths are O(1), so a 1 MB body costs as much as its number
    of messages and parts, not its size. Token-id prompts count exactly.
    """
    texts: list[str | bytes] = []
    tokens = _prompt_texts(doc, texts)
    return sum(map(len, texts)), tokens


def _prompt_texts(doc: dict[str, Any], out: list[str | bytes], media: dict[str, int] | None = None) -> int:
    """Appends to `out` every text of a generation body that reaches the model's prompt (the body's own strings,
    not copies; tool schemas serialised), so the fast estimate and the tokenizer count the same texts. Returns
    the tokens known without a tokenizer (token ids, media parts at `media`'s counts, per-message overhead)."""
    media = MEDIA_PART_TOKENS if media is None else media
    tokens = 0
    if isinstance(doc.get("instructions"), str):  # the Responses API's system message
        out.append(doc["instructions"])
    # chat; completions; Responses API (and embeddings) input, and a Responses body's earlier harmony messages
    for key in ("messages", "prompt", "input", "previous_input_messages"):
        value = doc.get(key)
        if value is not None:
            tokens += _prompt_like(value, out, media)
    for key in ("tools", "functions", "documents"):
        if doc.get(key):
            # tool schemas, and a chat body's RAG documents, go into the prompt through the template
            out.append(orjson.dumps(doc[key]))
    kwargs = doc.get("chat_template_kwargs")
    if type(kwargs) is dict:
        # vLLM hands these to the chat template, any that it names and any standard one (`documents`): a template
        # that writes documents into the prompt writes those sent here too. Flags and numbers are left out.
        texts = {k: v for k, v in kwargs.items() if type(v) in (str, list, dict)}
        if texts:
            out.append(orjson.dumps(texts))
    suffix = doc.get("suffix")
    if type(suffix) is str and suffix:
        # A completions suffix (fill-in-the-middle): vLLM renders it into every text prompt of the body, on a model
        # whose renderer has FIM (DeepSeek V4 in 0.32; others refuse it, so counting it costs them nothing).
        out.extend([suffix] * _text_prompts(doc.get("prompt")))
    return tokens


def _text_prompts(prompt: Any) -> int:
    """The text prompts of a completions `prompt`: one string, or each of a list of strings."""
    if type(prompt) is str:
        return 1
    return len(prompt) if type(prompt) is list and all(type(p) is str for p in prompt) else 0


def utf8_size(text: str) -> int:
    """The fast estimate's size of a text: its UTF-8 bytes. Tokenizers give about 4 bytes of English a token, and
    within ~1.4x of that for other scripts (CJK about 3 bytes, a character, a token; Cyrillic 2-3 per character,
    about 3 characters a token; an emoji 4 bytes, one or more tokens), where counting characters put CJK and emoji
    3-4x low. (str.isascii() is O(1); callers skip this for ASCII, where bytes are characters.) Lone surrogates,
    which a JSON body may carry as \\u escapes, count 3 bytes as in CESU."""
    return len(text.encode("utf-8", "surrogatepass"))


def _fast_size(text: str | bytes) -> int:
    """A prompt text's size as the fast estimate counts it (a serialised tool schema: its bytes)."""
    return len(text) if type(text) is bytes or text.isascii() else utf8_size(text)


def text_size(doc: Any, media: dict[str, int] | None = None) -> tuple[int, int]:
    """(UTF-8 bytes, token ids) of every string and integer list anywhere in a body, a media part (an image, ...)
    at its tokens as in a chat: the estimate for endpoints whose inputs are spread over their own fields
    (embeddings, score, rerank, classify, tokenize). The body's
    depth is bounded before it gets here (extproc.server.openai.MAX_JSON_DEPTH).

    A list that starts with an integer is counted as token ids by its length, not visited: 2 million ids in
    20,000 lists took the visit 90 ms of the event loop. vLLM's typed fields refuse a list that mixes ids with
    anything else, so nothing it would run is missed."""
    media_tokens = MEDIA_PART_TOKENS if media is None else media
    chars = tokens = 0
    stack = [doc]
    while stack:
        node = stack.pop()
        for v in (node.values() if type(node) is dict else node):
            if type(v) is str:
                chars += len(v) if v.isascii() else utf8_size(v)
            elif type(v) is int:
                tokens += 1
            elif type(v) is list and v and type(v[0]) is int:
                tokens += len(v)
            elif type(v) is dict:
                part = media_tokens.get(_part_kind(v))
                if part is None:
                    stack.append(v)
                else:
                    tokens += part  # an image's base64 data URL is not text (as in a chat's parts)
            elif type(v) is list:
                stack.append(v)
    return chars, tokens


# A score or rerank body's two sides (vLLM 0.32's score and rerank requests; `queries` with `items` is one of its
# score requests too).
SCORE_QUERY_FIELDS = ("query", "queries", "text_1", "data_1")
SCORE_DOCUMENT_FIELDS = ("documents", "items", "text_2", "data_2")


def score_sides(doc: dict[str, Any]) -> tuple[Any, Any]:
    """A score or rerank body's query side and document side: the first field of each that is set, else None."""
    return (next((doc[k] for k in SCORE_QUERY_FIELDS if doc.get(k) is not None), None),
            next((doc[k] for k in SCORE_DOCUMENT_FIELDS if doc.get(k) is not None), None))


def _paired_query(doc: dict[str, Any]) -> tuple[Any, int]:
    """The one query of a score or rerank body and how many more times than once the replica runs it: vLLM pairs
    a single query with each document, and a cross-encoder prefills every pair whole (a bi-encoder embeds the
    query once: counted per document it is overcounted, the safe side). (None, 0) when nothing repeats."""
    query, documents = score_sides(doc)
    if type(query) is list:
        if len(query) != 1:
            return None, 0                       # as many queries as documents, paired one to one (or none)
        query = query[0]
    if type(documents) is dict:
        documents = documents.get("content")     # multimodal documents: one part a document
    if query is None or type(documents) is not list or len(documents) < 2:
        return None, 0
    return query, len(documents) - 1


def _prompt_like(value: Any, out: list[str | bytes], media: dict[str, int]) -> int:
    """A string, token ids, a list of either, or a list of messages (chat) or items (Responses API)."""
    if isinstance(value, str):
        out.append(value)
        return 0
    if not isinstance(value, list) or not value:
        return 0
    if isinstance(value[0], int):
        return len(value)                        # token ids
    tokens = 0
    for item in value:
        if type(item) is dict:
            tokens += _message_texts(item, out, media)
        elif type(item) is str:
            out.append(item)
        elif type(item) is list:
            tokens += len(item)                  # a batch of token-id prompts
    return tokens


# Fields of a chat message or Responses input item whose text vLLM puts into the prompt: content; an assistant
# turn's reasoning (vLLM reads `reasoning`, else `reasoning_content`) and tool calls; a Responses reasoning item's
# summary, a function_call's arguments, a custom_tool_call's input and a function_call_output's output. Never
# encrypted_content or ids.
_TEXT, _REASONING_CONTENT, _TOOL_CALLS, _CUSTOM_INPUT = 0, 1, 2, 3
MESSAGE_FIELDS = {"content": _TEXT, "output": _TEXT, "arguments": _TEXT, "summary": _TEXT, "reasoning": _TEXT,
                  "reasoning_content": _REASONING_CONTENT, "tool_calls": _TOOL_CALLS, "input": _CUSTOM_INPUT}


def _message_texts(m: dict[str, Any], out: list[str | bytes], media: dict[str, int]) -> int:
    # Over the message's own keys (two or three), not over every field it might have: this runs per message.
    tokens = MESSAGE_OVERHEAD_TOKENS
    for key, value in m.items():
        field = MESSAGE_FIELDS.get(key)
        if field is None:
            continue
        if field is _CUSTOM_INPUT and m.get("type") != "custom_tool_call":
            continue  # only a Responses custom tool call's input is its arguments, written into the prompt
        if type(value) is str:
            if field is not _REASONING_CONTENT or not m.get("reasoning"):
                out.append(value)
        elif type(value) is list:
            if field is _TOOL_CALLS:
                _tool_call_texts(value, out)
            else:
                tokens += _parts_texts(value, out, media)
    return tokens


# What a non-text part costs, by type. Its payload (a URL, base64 data) is never counted as text.
# vLLM 0.32's media part types (its chat parser's map), the embeds among them: precomputed embeddings still fill
# the prompt with their positions.
MEDIA_PART_TOKENS = {"image_url": IMAGE_PART_TOKENS, "image": IMAGE_PART_TOKENS, "input_image": IMAGE_PART_TOKENS,
                     "image_pil": IMAGE_PART_TOKENS, "image_embeds": IMAGE_PART_TOKENS,
                     "input_audio": AUDIO_PART_TOKENS, "audio_url": AUDIO_PART_TOKENS,
                     "audio_embeds": AUDIO_PART_TOKENS,
                     "video_url": VIDEO_PART_TOKENS, "video_embeds": VIDEO_PART_TOKENS}
_MEDIA_KIND = {kind: ("image" if "image" in kind else "audio" if "audio" in kind else "video")
               for kind in MEDIA_PART_TOKENS}


def media_part_tokens(spec: CostSpec) -> dict[str, int]:
    """MEDIA_PART_TOKENS at the model's own counts (cost.image_tokens, audio_tokens, video_tokens): what one part
    fills of the prompt depends on the model's encoder (a dynamic-resolution one takes thousands for a large
    image), and the default ones are shared, not copied, for a model that keeps them."""
    counts = {"image": spec.image_tokens, "audio": spec.audio_tokens, "video": spec.video_tokens}
    if counts == {"image": IMAGE_PART_TOKENS, "audio": AUDIO_PART_TOKENS, "video": VIDEO_PART_TOKENS}:
        return MEDIA_PART_TOKENS
    return {kind: counts[what] for kind, what in _MEDIA_KIND.items()}


# Where a text part keeps its text when not in `text` (text, input_text, output_text, summary_text, ...).
TEXT_PART_FIELD = {"refusal": "refusal", "thinking": "thinking"}


def _parts_texts(parts: list[Any], out: list[str | bytes], media_tokens: dict[str, int]) -> int:
    tokens = 0
    for part in parts:
        if isinstance(part, str):
            out.append(part)                     # vLLM takes a bare string in a content list as a text part
            continue
        if not isinstance(part, dict):
            continue
        kind = _part_kind(part)
        media = media_tokens.get(kind)
        if media is not None:
            tokens += media
            continue
        text = part.get(TEXT_PART_FIELD.get(kind, "text"))
        if isinstance(text, str):
            out.append(text)
    return tokens


def _part_kind(part: dict[str, Any]) -> str:
    """A content part's type: its `type`, else the media key it holds."""
    kind = part.get("type")
    if kind is None:
        return _untyped_kind(part)
    return kind if isinstance(kind, str) else ""  # (a list as a type would not hash)


def _untyped_kind(part: dict[str, Any]) -> str:
    """A part without `type`: vLLM takes it by the media key it holds (`{"image_url": ...}`), as it does here."""
    for key in part:
        if key in MEDIA_PART_TOKENS:
            return key
    return ""


def _tool_call_texts(calls: list[Any], out: list[str | bytes]) -> None:
    """An assistant turn's tool calls: the template writes each one's name and arguments."""
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            continue
        for key in ("name", "arguments"):
            value = fn.get(key)
            if isinstance(value, str):
                out.append(value)
            elif isinstance(value, (dict, list)):
                out.append(orjson.dumps(value))  # arguments sent as an object rather than a JSON string


class CostModel:
    """One model's cost profile: GPU-seconds at the policy's coefficients (what fairness, budgets and GPU-second
    caps count), and a service-time fit for the SLO's prediction (service_s). learn() corrects the output ratio
    and the service-time fit, the latter bounded to [1/4, 4] times the configured coefficients so a run of
    outliers cannot run away with it.

    The GPU-second coefficients are not learned from service times: a request's service time is how long it held
    a place in the replica's batch (about its output length times the whole batch's step time), not its share of
    the GPU. Fitted to service times, the prompt coefficient ran to its bound and the fair queue gave a tenant of
    short answers half its due of the engine's time (docs/reliability.md, item 28)."""

    LEARNING_RATE = 0.05
    RATIO_RATE = 0.05
    # Where answers end by themselves (under their cap): the last NATURAL_SAMPLES such lengths, one sequence each,
    # and the longest of them once NATURAL_MIN are in, recomputed every NATURAL_EVERY. The longest, not a quantile:
    # a model serving chat and a few reasoning requests must not expect the reasoning answers at the chat's tail
    # (an estimate too low admits more than the GPU has; one too high only waits).
    NATURAL_SAMPLES = 256
    NATURAL_MIN = 32
    NATURAL_EVERY = 16

    def __init__(self, spec: CostSpec):
        self.spec = spec
        self.prefill_per_token = spec.prefill_s_per_1k_tokens / 1000.0
        self.decode_per_token = spec.decode_s_per_token
        self.context_per_token = spec.decode_s_per_1k_context / 1000.0  # per output token, per token of context
        # The service-time fit (learn(), service_s): seconds per prompt and per output token of one sequence.
        self.service_prefill = self.prefill_per_token
        self.service_decode = self.decode_per_token
        self.output_ratio = 1.0           # actual / requested output tokens; starts pessimistic
        # The longest a sequence's answer is expected to run (the longest of those that ended by themselves lately):
        # the ratio alone expected a summary asking 32,768 tokens to write 7.4K where answers end at ~150
        # (scenarios/audit-long-context.yaml). Unbounded until learned.
        self.natural_ceiling = math.inf
        self._natural: deque[float] = deque(maxlen=self.NATURAL_SAMPLES)
        self._natural_new = 0
        self.samples = 0
        self._tokenizer = _load_tokenizer(spec.tokenizer) if spec.tokenizer else None
        self.media = media_part_tokens(spec)
        self.learned_context: int | None = None  # what the replicas' /v1/models list (learn_context)
        self.context_tokens = spec.max_context_tokens  # the context estimates clamp to: configured, else learned

    def learn_context(self, tokens: int | None) -> None:
        """The model's context length as its replicas list it (PolicyState, from /v1/models; None: unknown). Held
        as one attribute, set when the listings change, so the estimate reads it at no cost per request; the
        policy's `max_context_tokens` wins."""
        self.learned_context = tokens
        self.context_tokens = self.spec.max_context_tokens or tokens

    def prompt_tokens(self, doc: dict[str, Any], generates: bool = True) -> int:
        """Prompt tokens of a generation body (its prompt fields), or of any other body (all its text)."""
        if not generates:
            chars, tokens = text_size(doc, self.media)
            query, repeats = _paired_query(doc)
            if repeats:
                q_chars, q_tokens = text_size([query], self.media)
                chars, tokens = chars + repeats * q_chars, tokens + repeats * q_tokens
        else:
            texts: list[str | bytes] = []
            tokens = _prompt_texts(doc, texts, self.media)
            if self._tokenizer is not None and texts:
                return tokens + self._tokenized(texts)
            chars = sum(map(_fast_size, texts))
        return tokens + int(chars / self.spec.chars_per_token + 0.999)

    def truncated(self, prompt_tokens: int, cap: int | None, prompts: int = 1) -> int:
        """The prompt tokens a replica runs when it keeps each of `prompts` prompts' last `cap` tokens (vLLM's
        truncate_prompt_tokens; -1: as many as the context holds, unknown without a context length)."""
        if cap == -1:
            cap = self.context_tokens
        return min(prompt_tokens, cap * max(prompts, 1)) if cap else prompt_tokens

    def _tokenized(self, texts: list[str | bytes]) -> int:
        """Tokens of the texts: exact for the first TOKENIZE_MAX_CHARS characters, the rest at the larger of the
        head's rate and the fast estimate (a cheap head must not make a long tail cheap: the fast estimate counts
        UTF-8 bytes, so a CJK tail after an ASCII head is not taken at 4 characters a token)."""
        head, rest, rest_size = _head(texts, TOKENIZE_MAX_CHARS)
        counted = len(self._tokenizer.encode(head, add_special_tokens=False).ids)
        if rest <= 0:
            return counted
        tail = max(rest * counted / max(len(head), 1), rest_size / self.spec.chars_per_token)
        return counted + int(tail + 0.999)

    def estimate(self, prompt_tokens: int, max_tokens: int | None, sequences: int = 1,
                 generates: bool = True, prompts: int = 1, min_output: int | None = 0) -> CostEstimate:
        """`sequences` outputs (n, times the prompts of a list) of up to `max_tokens` each; none for
        prefill-only endpoints. `prompt_tokens` is all `prompts` together. `min_output`: tokens each output
        produces at least (vLLM's min_tokens), None for all of its cap (ignore_eos)."""
        spec = self.spec
        if not generates:
            gpu = self.prefill_per_token * prompt_tokens * (1.0 + spec.variance_margin)
            return CostEstimate(prompt_tokens, 0, 0.0, gpu)
        requested = max_tokens if max_tokens is not None else spec.default_max_tokens
        room = None  # the output a prompt's context leaves: vLLM's own cap when the body sets none
        context = self.context_tokens  # configured, else the replicas' own: vLLM clamps to its own either way
        if context:
            # vLLM clamps likewise, each prompt of a list in its own context: against the prompts' sum a list
            # clamped to almost nothing. The mean prompt gives an upper bound of the per-prompt clamps (min is
            # concave), which is the safe side of an estimate.
            room = max(context - math.ceil(prompt_tokens / max(prompts, 1)), 1)
            requested = max(min(requested, room), 1)
        if max_tokens is None and min_output != 0:
            # default_max_tokens only assumes where answers end: output that cannot end there (ignore_eos runs to
            # the cap, min_tokens to its floor) runs on under vLLM's cap, the rest of the context.
            forced_to = room if min_output is None else min(min_output, room or min_output)
            requested = max(requested, forced_to or 0)
        # Output the model cannot end early is expected in full, not at the learned ratio: an ignore_eos request
        # (benchmarks) runs to its cap, 1 / output_ratio times what the ratio alone expected.
        floor = requested if min_output is None else min(min_output, requested)
        # every sequence decodes; the prompt is prefilled once and shared: vLLM's prefix cache (on by default) gives
        # the other samples its full blocks (docs/simulator.md, "The engine model")
        requested *= sequences
        expected, gpu = self._priced(prompt_tokens, requested, floor * sequences, sequences, prompts)
        # Not clamped by the prompt estimate, which may be high: the replica counts the real prompt.
        most = (max_tokens if max_tokens is not None else context or 0) * sequences
        est = CostEstimate(prompt_tokens, requested, expected, gpu, most)
        est.sequences, est.prompts = sequences, prompts
        est.min_output, est.forced = min_output, floor * sequences
        return est

    def repriced(self, est: CostEstimate) -> float:
        """An estimate made earlier, at the coefficients and output ratio now (what it would estimate today)."""
        return self._priced(est.prompt_tokens, est.max_tokens, est.forced, est.sequences, est.prompts)[1]

    def _priced(self, prompt_tokens: int, requested: int, forced: int, sequences: int = 1,
                prompts: int = 1) -> tuple[float, float]:
        """(expected output, GPU-seconds with the variance margin) of a prompt and `requested` output tokens (all
        `sequences` together), of which `forced` are produced whatever the model says."""
        expected = max(min(requested * self.output_ratio, self.natural_ceiling * sequences), forced)
        gpu = self.actual(prompt_tokens, expected, sequences, prompts) * (1.0 + self.spec.variance_margin)
        return expected, gpu

    def service_s(self, est: CostEstimate) -> float:
        """How long the request is expected to take, with the variance margin: the service-time fit at one
        sequence's output, since its sequences (n, a list's prompts) decode side by side (learn() fits it so)."""
        per_sequence = est.expected_output / max(est.sequences, 1)
        return self._service(est.prompt_tokens, per_sequence) * (1.0 + self.spec.variance_margin)

    def _service(self, prompt_tokens: float, completion_tokens: float) -> float:
        """The service-time fit: seconds for a prompt and one sequence's output."""
        return self.service_prefill * prompt_tokens + self.service_decode * completion_tokens

    def actual(self, prompt_tokens: int, completion_tokens: float, sequences: int = 1, prompts: int = 1) -> float:
        """GPU-seconds of `completion_tokens` output (all `sequences` together) to `prompt_tokens` of prompt (all
        `prompts` together), at the configured coefficients."""
        gpu = self.prefill_per_token * prompt_tokens + self.decode_per_token * completion_tokens
        if self.context_per_token:
            # Each output token attends its own prompt (a list's prompts are one a sequence; n sequences share
            # theirs) and the output before it, on average half its sequence's.
            context = prompt_tokens / max(prompts, 1) + completion_tokens / max(sequences, 1) / 2.0
            gpu += self.context_per_token * completion_tokens * context
        return gpu

    def learn(self, est: CostEstimate, prompt_tokens: int, completion_tokens: int,
              service_s: float | None) -> None:
        """Correct the output ratio from usage, and the service-time fit from the measured service time."""
        if not self.spec.learn or est.max_tokens == 0:
            return  # a prefill-only request says nothing about output ratios or decode cost
        self.samples += 1
        if not est.forced:  # a forced length (ignore_eos, min_tokens) says nothing about where answers end
            ratio = min(max(completion_tokens / max(est.max_tokens, 1), 0.0), 1.0)
            self.output_ratio += self.RATIO_RATE * (ratio - self.output_ratio)
            self.output_ratio = min(max(self.output_ratio, 0.05), 1.0)
            if completion_tokens < est.max_tokens:  # ended by itself, under its cap
                self._learn_natural(completion_tokens / max(est.sequences, 1))
        if service_s is None or service_s <= 0 or prompt_tokens + completion_tokens == 0:
            return
        # Normalised LMS on service_s ~ a * prompt + b * completion, with the residual clipped to the
        # prediction (Huber-like) so one stalled request moves the coefficients by at most a few percent.
        # The completion of one sequence: n sequences (a list's prompts) decode side by side, so the request lasts
        # as long as one of them, while its usage counts them all (fitted to the sum, n=4 taught a quarter).
        p, c = float(prompt_tokens), completion_tokens / max(est.sequences, 1)
        predicted = self._service(p, c)
        residual = max(min(service_s - predicted, predicted), -predicted) if predicted > 0 else service_s
        norm = p * p + c * c
        self.service_prefill = _bounded(self.service_prefill + self.LEARNING_RATE * residual * p / norm,
                                        self.spec.prefill_s_per_1k_tokens / 1000.0)
        self.service_decode = _bounded(self.service_decode + self.LEARNING_RATE * residual * c / norm,
                                       self.spec.decode_s_per_token)

    def _learn_natural(self, length: float) -> None:
        self._natural.append(length)
        self._natural_new += 1
        # A longer answer raises it at once; it comes down as the long ones leave the window (every NATURAL_EVERY).
        if len(self._natural) >= self.NATURAL_MIN and (self._natural_new >= self.NATURAL_EVERY
                                                       or length > self.natural_ceiling):
            self._natural_new = 0
            self.natural_ceiling = max(max(self._natural), 1.0)


def _bounded(value: float, configured: float) -> float:
    if configured <= 0:
        # [1/4, 4] times 0 is 0: unbounded, a 0 coefficient ran away with the first stalled request (its residual
        # is not clipped while the prediction is 0) and kept growing 5% per outlier after.
        return 0.0
    return min(max(value, configured / 4.0), configured * 4.0)


def _head(texts: list[str | bytes], limit: int) -> tuple[str, int, int]:
    """The texts joined by newlines, cut at `limit` characters, how many characters were left out (bytes,
    serialised tool schemas, count one per byte, as in the fast estimate), and their size as the fast estimate
    counts it (_fast_size)."""
    parts: list[str] = []
    room = limit
    for i, t in enumerate(texts):
        cut = t[:room]
        parts.append(cut if isinstance(cut, str) else cut.decode(errors="ignore"))  # a split UTF-8 tail dropped
        room -= len(cut) + 1
        if room <= 0 or len(cut) < len(t):
            after = texts[i + 1:]
            tail = t[len(cut):]
            return ("\n".join(parts), len(tail) + sum(map(len, after)) + len(after),
                    _fast_size(tail) + sum(map(_fast_size, after)) + len(after))
    return "\n".join(parts), 0, 0


def _load_tokenizer(path: str):
    """A `tokenizers` tokenizer, or None when the package or the file is missing (fast estimate then, said once
    in the log: a mistyped path would otherwise cost its accuracy without a word)."""
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - optional accuracy, never a reason to fail admission
        logging.getLogger("extproc.cost").warning(
            "cost.tokenizer %s cannot be loaded (%s): prompt sizes are estimated from characters", path, e)
        return None
