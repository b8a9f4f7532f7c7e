#!/usr/bin/env python3
"""Record real vLLM's answers to the generated bodies of scripts/vllm/differential_cases.py into
tests/fixtures/vllm/differential.json (standard library only), for tests/sim/test_parity_generated.py.

    python3 -m scripts.vllm.record_differential                 # starts vLLM (scripts/vllm/serve.py), records, stops
    python3 -m scripts.vllm.record_differential --url http://127.0.0.1:8000   # against a running server

Per JSON case: status, the body's shape, and the error body verbatim (errors are deterministic) or, for a 200, the
finish reasons and choice indexes. Per stream case: status, framing, the run-length event kinds, each event's usage
state and the finish reasons. `metrics` (after all of them): each vllm: family's type and label names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.vllm.differential_cases import all_cases
from scripts.vllm.fixture_format import dumps, shape
from scripts.vllm.record_fixtures import OUT, Client, classify, compress, get_metrics, parse_metrics, parse_sse, \
    usage_state
from scripts.vllm.serve import VLLMServer


def finish_reasons(doc: dict) -> list | None:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return None
    return [c.get("finish_reason") for c in choices]


def without_alternatives(doc):
    """The body with each token's alternatives (completions' `top_logprobs`, a dict keyed by token text) as one
    placeholder: their keys are generated text, not shape."""
    for choice in doc.get("choices") or [] if isinstance(doc, dict) else []:
        logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        if isinstance(logprobs, dict) and isinstance(logprobs.get("top_logprobs"), list):
            logprobs["top_logprobs"] = ["<alternatives>" for _ in logprobs["top_logprobs"]]
    return doc


def json_answer(status: int, payload: bytes) -> dict:
    """What the test compares of a JSON answer."""
    try:
        doc = json.loads(payload)
    except ValueError:
        return {"status": status, "text": payload.decode(errors="replace")}
    out = {"status": status, "shape": shape(without_alternatives(doc))}
    if status != 200:
        out["body"] = doc
    elif isinstance(doc, dict):
        out["finish_reasons"] = finish_reasons(doc)
        out["status_field"] = doc.get("status")  # the Responses API's completed / incomplete
    return out


def stream_answer(status: int, raw: bytes) -> dict:
    """What the test compares of a stream: framing, event kinds, usage states, finish reasons."""
    if status != 200:
        return json_answer(status, raw)
    framing, events = parse_sse(raw)
    kinds = [classify(e) for e in events]
    finishes = [c.get("finish_reason") for e in events if e != "[DONE]" for c in e.get("choices") or []
                if c.get("finish_reason") is not None]
    return {"status": status, "framing": framing, "sequence": compress(kinds),
            "usage": compress([f"{k}:{usage_state(e)}" for k, e in zip(kinds, events)]),
            "finish_reasons": sorted(finishes)}


def record(client: Client) -> dict:
    cases, streams = all_cases()
    out: dict = {"cases": {}, "streams": {}}
    for name, case in cases.items():
        status, _, payload, _ = client.request("POST", case["path"], body=case["body"])
        out["cases"][name] = {"request": case} | json_answer(status, payload)
    for name, case in streams.items():
        status, _, raw, _ = client.stream(case["path"], case["body"])
        out["streams"][name] = {"request": case} | stream_answer(status, raw)
    families = parse_metrics(get_metrics(client))
    out["metrics"] = {k: {"type": v["type"], "labels": v["labels"]} for k, v in sorted(families.items())
                      if k.startswith("vllm:")}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="use a running server instead of starting one")
    ap.add_argument("--out", type=Path, default=OUT / "differential.json")
    args = ap.parse_args(argv)
    if args.url:
        doc = record(Client(args.url))
    else:
        with VLLMServer() as server:
            print(f"[record] vLLM healthy after {server.startup_seconds:.1f}s at {server.url}")
            doc = record(Client(server.url))
    args.out.write_text(dumps(doc))
    print(f"[record] {args.out} ({len(doc['cases'])} cases, {len(doc['streams'])} streams)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
