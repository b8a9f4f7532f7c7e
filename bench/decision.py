"""What one admission decision costs in the sans-IO core: decide() + finish() (+ report()), no gRPC, no I/O.

Run:  python bench/decision.py   (prints a markdown table; medians of repeated timings on this machine)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.policy.admission import AdmissionController, RequestFacts  # noqa: E402
from extproc.policy.limits import Completion, Outcome  # noqa: E402
from extproc.policy.schema import load_policy_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = {"model": "llama-70b", "max_tokens": 256, "stream": True,
       "messages": [{"role": "system", "content": "You are helpful." * 10}, {"role": "user", "content": "hi " * 200}]}


def per_call(fn, n: int = 20000) -> float:
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n)
    return statistics.median(runs)


def main() -> int:
    rows = ["| policy | path | per request |", "|---|---|---:|"]
    for name in ("default.yaml", "demo-full.yaml"):
        core = AdmissionController(load_policy_file(str(ROOT / "policies" / name)))
        facts = RequestFacts(api_key="sk-chat-1", model="llama-70b", max_tokens=256, stream=True, doc=DOC)
        done = Completion(Outcome.OK, 200, 0.3, 2.0)

        def lifecycle():
            d = core.decide(facts)
            core.finish(d.ticket, Outcome.OK)
            core.report(d.ticket.id, done)

        def refused():
            core.decide(RequestFacts(api_key="sk-chat-1", model="nope"))

        rows.append(f"| {name} | accept: decide + finish + report | {per_call(lifecycle) * 1e6:.1f} µs |")
        rows.append(f"| {name} | unknown model (404) | {per_call(refused) * 1e6:.1f} µs |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
