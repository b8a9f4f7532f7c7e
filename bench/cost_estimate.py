"""What a cost estimate costs: parse + prompt count + GPU-seconds estimate, on 1 KB, 100 KB and 1 MB bodies.

Run:  python bench/cost_estimate.py   (prints a markdown table; medians of repeated timings on this machine)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.policy.cost import CostModel  # noqa: E402
from extproc.policy.schema import CostSpec  # noqa: E402
from extproc.server.openai import CHAT, parse_body  # noqa: E402


def chat_body(size: int, turns: int) -> bytes:
    """A chat body of about `size` bytes spread over `turns` messages (an agent transcript, say)."""
    per = max(size // turns - 40, 1)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "lorem ipsum " * (per // 12)}
            for i in range(turns)]
    return json.dumps({"model": "llama-70b", "messages": msgs, "max_tokens": 256, "stream": True}).encode()


def timeit(fn, budget_s: float = 1.0) -> float:
    """Median seconds per call over batches that fill about `budget_s`."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        fn()
        n += 1
    batches = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        batches.append((time.perf_counter() - t) / n)
    return statistics.median(batches)


def main() -> int:
    model = CostModel(CostSpec())
    rows = ["| body | messages | parse (json.loads + checks) | prompt count + estimate | total |",
            "|---|---:|---:|---:|---:|"]
    for label, size, turns in (("1 KB", 1 << 10, 4), ("100 KB", 100 << 10, 40), ("1 MB", 1 << 20, 200)):
        raw = chat_body(size, turns)
        parsed = parse_body(raw, CHAT, "priority", {"interactive"})
        t_parse = timeit(lambda: parse_body(raw, CHAT, "priority", {"interactive"}))
        t_est = timeit(lambda: model.estimate(model.prompt_tokens(parsed.doc), parsed.max_tokens))
        rows.append(f"| {label} ({len(raw):,} B) | {turns} | {t_parse * 1e6:,.1f} µs | {t_est * 1e6:,.1f} µs | "
                    f"{(t_parse + t_est) * 1e6:,.1f} µs |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    sys.exit(main())
