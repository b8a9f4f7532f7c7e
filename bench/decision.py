"""What one admission decision costs in the sans-IO core: decide() + finish() (+ report()), no gRPC, no I/O.

Each path is timed without events (the core alone) and with the ext_proc's Telemetry fed by the core's events
(Prometheus counters and histograms, the decision log off), side by side in one run.

Run:  python bench/decision.py   (prints a markdown table; medians of repeated timings on this machine)
      python bench/decision.py --calls   (Python function calls per request instead, under cProfile: the same on
      every machine and run, so a change's cost can be read on a noisy one)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.policy.admission import AdmissionController, RequestFacts  # noqa: E402
from extproc.policy.limits import Completion, Outcome  # noqa: E402
from extproc.policy.schema import load_policy, load_policy_file  # noqa: E402
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


def calls_per(fn, n: int = 2000) -> float:
    """Python function calls per call of fn (after a warm-up: first-use paths are not the steady state)."""
    for _ in range(200):
        fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        fn()
    profile.disable()
    return pstats.Stats(profile).total_calls / n


def policies():
    for name in ("default.yaml", "demo-full.yaml"):
        yield name, load_policy_file(str(ROOT / "policies" / name))
    # The same default policy with a tenant rate limit that never bites: the rate-limit check and its metrics run.
    data = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    for tenant in data["tenants"]:
        if tenant["name"] == "chat-frontend":
            tenant.update(requests_per_minute=10**9, tokens_per_minute=10**12)
    yield "default.yaml + tenant rate limit", load_policy(data)


def main(calls: bool = False) -> int:
    measure, unit = (calls_per, "{:.0f} calls") if calls else (lambda fn: per_call(fn) * 1e6, "{:.1f} µs")
    rows = ["| policy | path | core alone | with telemetry |", "|---|---|---:|---:|"]
    for name, policy in policies():
        cores = [AdmissionController(policy), AdmissionController(policy, events=Telemetry())]
        facts = RequestFacts(api_key="sk-chat-1", model="llama-70b", max_tokens=256, stream=True, doc=DOC)
        done = Completion(Outcome.OK, 200, 0.3, 2.0)

        def lifecycle(core):
            d = core.decide(facts)
            core.finish(d.ticket, Outcome.OK)
            core.report(d.ticket.id, done)

        def refused(core):
            core.decide(RequestFacts(api_key="sk-chat-1", model="nope"))

        for path, fn in (("accept: decide + finish + report", lifecycle), ("unknown model (404)", refused)):
            alone, telemetry = (unit.format(measure(lambda: fn(core))) for core in cores)
            rows.append(f"| {name} | {path} | {alone} | {telemetry} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", action="store_true", help="Python function calls per request, not µs")
    sys.exit(main(parser.parse_args().calls))
