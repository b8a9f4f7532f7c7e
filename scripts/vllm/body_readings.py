#!/usr/bin/env python3
"""Record how vLLM 0.32 reads generated OpenAI request bodies into tests/fixtures/vllm/body_readings.json.

    .cache/vllm-venv/bin/python scripts/vllm/body_readings.py          # (make vllm-setup first; ~20 s)

For every body (seeded, so a re-run writes the same file for the same vLLM): the bytes, as vLLM's server gets
them, go through what its server does before the engine: json.loads (Starlette), the request model's pydantic
validation (lax mode, as FastAPI validates), for /invocations the first request type that validates (chat, then
completions, vLLM's order for a generative model), build_tok_params (a cap beyond the context), get_max_tokens,
to_sampling_params or to_beam_search_params (SamplingParams' own checks), and for completions the prompts its
renderer runs (prompt_to_seq of prompt_embeds, then of prompt). What is recorded is what admission must not read
cheaper: `sequences` each prompt generates, `prompts`, `max_tokens` the body sets or the API defaults to (null:
none, the rest of the context; `runs_tokens`: the cap in a MAX_MODEL_LEN context), `min_output` each sequence
decodes at least (null: the whole cap, under ignore_eos or beam search), `truncate_prompt_tokens`, `stream`. A
body vLLM refuses is recorded with `refused`.

No server, model or tokenizer runs: the prompt is taken as PROMPT_TOKENS tokens in a MAX_MODEL_LEN context, so
checks that need a tokenizer (prompt too long, a chat template) are not made. tests/unit/test_vllm_body_parity.py
reads the file and compares extproc.server.openai.parse_body's reading with it (without vLLM).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "vllm" / "body_readings.json"
SEED = 45
CASES_PER_ENDPOINT = 300
MAX_MODEL_LEN = 2048
PROMPT_TOKENS = 8

ABSENT = object()  # a field left out of the body

MESSAGES = [{"role": "user", "content": "hi"}]
# Values a lax pydantic int may read (and some it refuses): whole floats, strings of numbers, booleans.
TOKENS = [ABSENT, None, 1, 7, 50, 50.0, "50", " 50 ", "50.0", True, False, 0, -1, 1.5, "abc", [], 2**31, 2**40]
COUNTS = [ABSENT, None, 1, 2, 3, 3.0, "3", "2.0", True, False, 0, -2, 2.5, "x"]
FLOORS = [ABSENT, None, 0, 5, "5", 5.0, " 5", -1, 40, 5.5]
BOOLS = [ABSENT, None, True, False, 1, 0, 1.0, "true", "false", "yes", "no", "on", "off", "1", "0", "t", "f", "x"]
TRUNCATIONS = [ABSENT, None, -1, 0, 5, "5", 5.0, -2, "x"]
PRIORITIES = [ABSENT, None, 0, 5, -5, "5", 1.0, "high"]
STREAM_OPTIONS = [ABSENT, None, {}, {"include_usage": True}, {"include_usage": "false"}, "yes"]
PROMPTS = [ABSENT, None, "hi", "", ["a", "b"], ["a"], [1, 2, 3], [[1, 2], [3]], [], [[]], ["a", [1]], [1, "a"],
           {"prompt": "hi"}, 5, [-1, 2]]
EMBEDS = [ABSENT, None, "AAAA", ["AAAA", "AAAA"], [], 5]

FIELDS = {
    "chat": {"messages": [MESSAGES] * 6 + [ABSENT, None, "hi", [], [{"role": "nobody", "content": "x"}]],
             "max_tokens": TOKENS, "max_completion_tokens": TOKENS, "n": COUNTS, "best_of": COUNTS,
             "use_beam_search": BOOLS, "min_tokens": FLOORS, "ignore_eos": BOOLS, "stream": BOOLS,
             "stream_options": STREAM_OPTIONS, "priority": PRIORITIES, "truncate_prompt_tokens": TRUNCATIONS,
             "temperature": [ABSENT, 0, 0.0, 1.0]},
    "completions": {"prompt": PROMPTS, "prompt_embeds": EMBEDS, "max_tokens": TOKENS, "n": COUNTS,
                    "best_of": COUNTS, "use_beam_search": BOOLS, "min_tokens": FLOORS, "ignore_eos": BOOLS,
                    "echo": BOOLS, "stream": BOOLS, "stream_options": STREAM_OPTIONS, "priority": PRIORITIES,
                    "truncate_prompt_tokens": TRUNCATIONS, "temperature": [ABSENT, 0, 1.0]},
    "responses": {"input": [ABSENT, "hi", [{"role": "user", "content": "hi"}], None, 5],
                  "max_output_tokens": TOKENS, "n": COUNTS, "min_tokens": FLOORS, "ignore_eos": BOOLS,
                  "stream": BOOLS, "background": [ABSENT, False, None, "false", 0], "priority": PRIORITIES,
                  "truncation": [ABSENT, None, "auto", "disabled", "x"]},
}
# /invocations: a body of either kind, or both at once (vLLM takes the first request type that validates).
FIELDS["invocations"] = {**FIELDS["completions"], **FIELDS["chat"],
                         "messages": [ABSENT, ABSENT, MESSAGES, MESSAGES, None, "hi", 5, [5]],
                         "prompt": [ABSENT, ABSENT, "hi", ["a", "b", "c"], [[1], [2]], None, ""],
                         "input": [ABSENT, "hi"]}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "invocations": "/invocations"}
BASES = {"chat": [{"model": "m", "messages": MESSAGES}], "completions": [{"model": "m", "prompt": "hi"}],
         "responses": [{"model": "m", "input": "hi"}],
         "invocations": [{"model": "m", "messages": MESSAGES}, {"model": "m", "prompt": ["a", "b"]}, {"model": "m"}]}
# Bytes a generator of dicts would not write: duplicate keys (json.loads keeps the last), spacing, UTF-16.
RAW = [
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_tokens": 900}'),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1, "n": 9}'),
    ("completions", b'{"model": "m", "prompt": "hi", "prompt": ["a", "b", "c", "d"]}'),
    ("completions", b'{"model": "m", "prompt": ["a", "b"], "max_tokens": 3, "max_tokens": null}'),
    ("chat", '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}'
             .encode("utf-16")),
    ("chat", b'\xef\xbb\xbf{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 4}'),
    # A chat reading that fails validation runs as completions; prompt_embeds alone is a completions body.
    ("invocations", b'{"model": "m", "messages": "hi", "prompt": ["a", "b", "c", "d", "e", "f"], "max_tokens": 9}'),
    ("invocations", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "bogus", '
                    b'"prompt": ["a", "b", "c", "d"]}'),
    ("invocations", b'{"model": "m", "prompt_embeds": ["AAAA", "AAAA", "AAAA"], "input": "x", "max_tokens": 500}'),
    # Fields that decide together: max_completion_tokens wins over max_tokens, whichever is smaller.
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, '
             b'"max_completion_tokens": 300}'),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, '
             b'"max_completion_tokens": 9}'),
    ("completions", b'{"model": "m", "prompt": ["a", "b", "c"], "echo": true, "max_tokens": 0}'),
    ("completions", b'{"model": "m", "prompt": ["a", "b"], "prompt_embeds": ["AAAA", "AAAA", "AAAA"], "n": 2}'),
    ("completions", b'{"model": "m", "prompt": "hi", "min_tokens": "700", "max_tokens": 700}'),
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": true}'),
    ("responses", b'{"model": "m", "input": "hi", "n": 8, "max_output_tokens": 30, "ignore_eos": 1}'),
    # Beam search: n beams, every one to its cap.
    ("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": true, "n": 4}'),
    ("completions", b'{"model": "m", "prompt": ["a", "b"], "use_beam_search": true, "n": 3, "max_tokens": 100, '
                    b'"min_tokens": 5}'),
]


def main() -> int:
    readers = _readers()
    rng = random.Random(SEED)
    cases = []
    for kind, raw in RAW:
        cases.append(_case(kind, raw, readers))
    for kind, fields in FIELDS.items():
        for _ in range(CASES_PER_ENDPOINT):
            doc = dict(rng.choice(BASES[kind]))
            for name in rng.sample(sorted(fields), rng.randint(1, 3 if kind == "invocations" else 5)):
                value = rng.choice(fields[name])
                if value is ABSENT:
                    doc.pop(name, None)
                else:
                    doc[name] = value
            cases.append(_case(kind, json.dumps(doc).encode(), readers))
    import vllm
    head = {"vllm": vllm.__version__, "max_model_len": MAX_MODEL_LEN, "prompt_tokens": PROMPT_TOKENS,
            "regenerate": ".cache/vllm-venv/bin/python scripts/vllm/body_readings.py"}
    cases = _unique(cases)
    lines = ",\n".join(json.dumps(c, ensure_ascii=False) for c in cases)  # one case a line, for readable diffs
    OUT.write_text(json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [\n' + lines + "\n]}\n")
    refused = sum("refused" in c["vllm"] for c in cases)
    print(f"{len(cases)} bodies ({refused} refused by vLLM) -> {OUT.relative_to(ROOT)}")
    return 0


def _unique(cases: list[dict]) -> list[dict]:
    seen, out = set(), []
    for c in cases:
        key = (c["path"], c["body"])
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _case(kind: str, raw: bytes, readers) -> dict:
    try:
        body = raw.decode("utf-8")
        stored = {"body": body}
    except UnicodeDecodeError:
        stored = {"body": raw.decode("latin-1"), "encoding": "latin-1"}  # the bytes, one char each
    return {"path": PATHS[kind], **stored, "vllm": _reading(kind, raw, readers)}


def _readers():
    from pydantic import TypeAdapter

    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    return {"chat": TypeAdapter(ChatCompletionRequest), "completions": TypeAdapter(CompletionRequest),
            "responses": TypeAdapter(ResponsesRequest)}


def _reading(kind: str, raw: bytes, readers) -> dict:
    """What vLLM's server makes of the body before its engine runs it, or {"refused": why}."""
    try:
        doc = json.loads(raw)
    except ValueError as e:
        return {"refused": f"json: {e}"[:120]}
    from pydantic import ValidationError

    kinds = ["chat", "completions"] if kind == "invocations" else [kind]
    errors = []
    for k in kinds:
        try:
            request = readers[k].validate_python(doc)
        except ValidationError as e:  # /invocations tries the next request type on this error only
            errors.append(f"{k}: {type(e).__name__}: {str(e).splitlines()[0]}"[:160])
            continue
        except Exception as e:  # noqa: BLE001 - vLLM's own before validators: the server's 400 (or 500)
            return {"kind": k, "refused": f"{type(e).__name__}: {e}"[:160]}
        try:
            return {"kind": k, **_run(k, request)}
        except Exception as e:  # noqa: BLE001 - what the server answers 400 (VLLMValidationError, ValueError)
            return {"kind": k, "refused": f"{type(e).__name__}: {e}"[:160]}
    return {"refused": "; ".join(errors)}


def _run(kind: str, request) -> dict:
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.renderers.inputs.preprocess import prompt_to_seq
    from vllm.sampling_params import BeamSearchParams

    prompts = 1
    if kind == "chat":
        cap = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        truncate = request.truncate_prompt_tokens
    elif kind == "completions":
        cap, truncate = request.max_tokens, request.truncate_prompt_tokens
        seq = []
        if request.prompt_embeds is not None:
            seq += list(prompt_to_seq(request.prompt_embeds))
        if request.prompt is not None:
            seq += list(prompt_to_seq(request.prompt))
        prompts = len(seq)
        if request.stream and request.use_beam_search:
            raise ValueError("Streaming is not currently supported with beam search")
    else:
        cap, truncate = request.max_output_tokens, -1 if request.truncation != "disabled" else None
        if request.background:
            raise ValueError("background (vLLM: needs its response store; the gateway refuses it)")
    request.build_tok_params(SimpleNamespace(max_model_len=MAX_MODEL_LEN))  # its checks of the output cap
    max_tokens = get_max_tokens(MAX_MODEL_LEN, cap, PROMPT_TOKENS, {}, None, truncate_prompt_tokens=truncate)
    beam = getattr(request, "use_beam_search", False)
    params = request.to_beam_search_params(max_tokens, {}) if beam else request.to_sampling_params(max_tokens, {})
    if isinstance(params, BeamSearchParams):
        n, floor, ignore_eos, ran = params.beam_width, 0, params.ignore_eos, params.max_tokens
    else:
        n, floor, ignore_eos, ran = params.n, params.min_tokens, params.ignore_eos, params.max_tokens
    if kind == "completions" and request.echo and request.max_tokens == 0:
        cap = 1  # echo without generation: one token a prompt
    # Beam search (vllm/entrypoints/generate/beam_search/online.py) runs max_tokens steps of n beams whatever EOS
    # says: like ignore_eos, every beam decodes its whole cap (and min_tokens is not read).
    whole_cap = ignore_eos or beam
    return {"sequences": n, "prompts": prompts, "max_tokens": cap, "runs_tokens": ran,
            "min_output": None if whole_cap else floor, "beam_search": beam,
            "truncate_prompt_tokens": truncate, "stream": bool(request.stream)}


if __name__ == "__main__":
    sys.exit(main())
