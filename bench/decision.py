"""What one admission decision costs in the sans-IO core: decide() + finish() (+ report()), no gRPC, no I/O.

Each policy is timed twice: the core alone (no event listener), and with the Telemetry listener `extproc serve`
attaches (Prometheus metrics and the sampled decision log), which is what a served request pays.

Run:  python bench/decision.py   (prints a markdown table; medians of repeated timings on this machine)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry  # noqa: E402

from extproc.policy.admission import AdmissionController, RequestFacts  # noqa: E402
from extproc.policy.limits import Completion, Outcome  # noqa: E402
from extproc.policy.schema import load_policy_file  # noqa: E402
from extproc.telemetry import Telemetry  # noqa: E402

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
    rows = ["| policy | path | core alone | with telemetry |", "|---|---|---:|---:|"]
    for name in ("default.yaml", "demo-full.yaml"):
        alone = AdmissionController(load_policy_file(str(ROOT / "policies" / name)))
        served = AdmissionController(load_policy_file(str(ROOT / "policies" / name)),
                                     events=Telemetry(registry=CollectorRegistry()))
        timings = {path: [] for path in ("accept: decide + finish + report", "unknown model (404)")}
        for core in (alone, served):
            timings["accept: decide + finish + report"].append(per_call(accepted(core)))
            timings["unknown model (404)"].append(per_call(refused(core)))
        for path, (bare, full) in timings.items():
            rows.append(f"| {name} | {path} | {bare * 1e6:.1f} µs | {full * 1e6:.1f} µs |")
    print("\n".join(rows))
    return 0


def accepted(core: AdmissionController):
    """One admitted request's whole life in the core: the decision, the end of its stream, its access-log report."""
    facts = RequestFacts(api_key="sk-chat-1", model="llama-70b", max_tokens=256, stream=True, doc=DOC)
    done = Completion(Outcome.OK, 200, 0.3, 2.0)

    def lifecycle():
        d = core.decide(facts)
        core.finish(d.ticket, Outcome.OK)
        core.report(d.ticket.id, done)

    return lifecycle


def refused(core: AdmissionController):
    return lambda: core.decide(RequestFacts(api_key="sk-chat-1", model="nope"))


if __name__ == "__main__":
    sys.exit(main())
