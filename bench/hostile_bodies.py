"""What one hostile but valid body costs the ext_proc's event loop: parse + decide + finish, per body shape.

Every body is within the 4 MiB body limit and the JSON limits; each is timed through parse_body and the core's
decide() (the prompt estimate included), the way the ext_proc runs them, on one thread. With --tokenizer the
policy sets `models.<name>.cost.tokenizer` (exact prompt counts); by default the fast estimate is used.

Run:  python bench/hostile_bodies.py [--tokenizer PATH | --train-tokenizer]   (a markdown table; medians of 3)
      --train-tokenizer trains a byte-level BPE (vocabulary 2,000) offline with `tokenizers`, for a machine
      without a model's tokenizer.json.
"""

from __future__ import annotations

import argparse
import statistics
import random
import sys
import tempfile
import time
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.policy.admission import AdmissionController, RequestFacts  # noqa: E402
from extproc.policy.limits import Outcome  # noqa: E402
from extproc.policy.schema import load_policy  # noqa: E402
from extproc.server.openai import ENDPOINTS, BadRequest, parse_body  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MB = 4_000_000
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


def chat(content, **extra) -> dict:
    return {"model": "llama-70b", "max_tokens": 16, "messages": [{"role": "user", "content": content}], **extra}


def bodies():
    """(label, path, raw body)."""
    d = orjson.dumps
    yield "small chat (1 KB)", CHAT, d(chat("hi " * 300))
    yield "4 MB of ASCII words", CHAT, d(chat("the queue " * (MB // 10)))
    yield "4 MB of CJK (1.3M characters)", CHAT, d(chat("漢字" * (MB // 6)))
    yield "4 MB of emoji (1M characters)", CHAT, d(chat("😀" * (MB // 4)))
    escaped = b'"' + b"\\u00e9" * (MB // 6) + b'"'
    yield "4 MB of \\u escapes", CHAT, d(chat("")).replace(b'"content":""', b'"content":' + escaped)
    yield "19,000 one-letter messages", CHAT, d({**chat(""), "messages": [{"role": "user", "content": "x"}] * 19000})
    yield "content: 400,000 string parts", CHAT, d(chat(["x"] * 400_000))
    yield "1,000 tools of 4 KB", CHAT, d(chat("x", tools=[{"type": "function", "function": {
        "name": f"f{i}", "description": "d" * 4000, "parameters": {"type": "object"}}} for i in range(1000)]))
    yield "completions: 400,000 prompts", COMPLETIONS, d({"model": "llama-70b", "max_tokens": 1,
                                                          "prompt": ["ab"] * 400_000})
    yield "completions: 1.36M empty prompts", COMPLETIONS, b'{"model": "llama-70b", "max_tokens": 1, "prompt": [' + \
        b",".join([b'""'] * 1_360_000) + b"]}"
    yield "completions: 500,000 token ids", COMPLETIONS, d({"model": "llama-70b", "max_tokens": 1,
                                                            "prompt": list(range(10, 500_010))})
    yield "embeddings: 20,000 token-id lists", "/v1/embeddings", b'{"model": "llama-70b", "input": [' + \
        b",".join([b"[" + b"1," * 100 + b"1]"] * 19_990) + b"]}"
    yield "responses: 4 MB input", RESPONSES, d({"model": "llama-70b", "max_output_tokens": 16,
                                                 "input": "abcd " * (MB // 5)})


def train_tokenizer(path: Path) -> str:
    """A byte-level BPE (the kind Llama 3 and Qwen ship) trained on generated text: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(1)
    words = "the queue model admission gpu token request latency server prompt cache batch".split()
    corpus = [" ".join(rng.choice(words) + rng.choice(["", "s", "ing", ".", ","]) for _ in range(30))
              for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=2000, min_frequency=2, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


def _parsed(raw: bytes, endpoint, core):
    try:
        return parse_body(raw, endpoint, "priority", core.limiters)
    except BadRequest as e:
        return e


def median_s(fn, reps: int = 3) -> float:
    runs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def main(tokenizer: str | None) -> int:
    data = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    if tokenizer:
        for spec in data["models"].values():
            spec.setdefault("cost", {})["tokenizer"] = tokenizer
    core = AdmissionController(load_policy(data))
    rows = [f"tokenizer: {tokenizer or 'none (fast estimate)'}", "",
            "| body | bytes | parse | decide | prompt tokens estimated |", "|---|---:|---:|---:|---:|"]
    for label, path, raw in bodies():
        endpoint = ENDPOINTS[path]
        parse_s = median_s(lambda: _parsed(raw, endpoint, core))
        body = _parsed(raw, endpoint, core)
        if isinstance(body, BadRequest):
            rows.append(f"| {label} | {len(raw):,} | {parse_s * 1e3:.1f} ms | - | refused: {body.code} |")
            continue
        facts = RequestFacts(api_key="sk-acme-1", model=body.model, max_tokens=body.max_tokens, doc=body.doc)
        facts.sequences, facts.prompts, facts.generates = body.sequences, body.prompts, body.generates

        def decide():
            d = core.decide(facts)
            if getattr(d, "ticket", None) is not None:
                core.finish(d.ticket, Outcome.OK)
            return d

        decide_s = median_s(decide)
        d = decide()
        prompt = f"{d.charge.estimate.prompt_tokens:,}" if d.charge is not None else d.reason
        rows.append(f"| {label} | {len(raw):,} | {parse_s * 1e3:.1f} ms | {decide_s * 1e3:.1f} ms | {prompt} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a tokenizer.json for models.<name>.cost.tokenizer")
    ap.add_argument("--train-tokenizer", action="store_true", help="train a small byte-level BPE and use it")
    args = ap.parse_args()
    if not args.train_tokenizer:
        sys.exit(main(args.tokenizer))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(train_tokenizer(Path(tmp) / "tokenizer.json")))
