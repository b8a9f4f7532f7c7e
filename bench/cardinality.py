"""What one decision costs, and what the core keeps, as the things clients and large deployments control grow.

Each row drives the sans-IO core directly (no gRPC, no telemetry) on an injected clock, as bench/decision.py and the
unit tests do, with N = 1, 100 and 10,000 of one cardinality: tenants in the policy, fairness ids from the header,
session ids, unknown API keys, unknown model names, requests waiting in a class queue (fifo, fair), flows waiting in
a fair class, arrivals at a full fair queue, replicas of a steered pool, reloads. Per row: the median µs of one
step (a decide + finish + report lifecycle unless the row says otherwise) over repeated timings, its ratio to N = 1,
and the bytes the core (extproc/) allocated and still holds once made for N and N steps ran, every id of the row
seen (tracemalloc, after a gc; rows of steps over a millisecond stop after ~1 s of them). A second table: the
bytes retained after 100,000 fresh ids, each seen once.

Run:  python bench/cardinality.py            (about 10 minutes; prints two markdown tables)
      python bench/cardinality.py --quick    (N up to 1,000, and 10,000 fresh ids: a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import extproc  # noqa: E402
from extproc.policy.adaptive import PoolSaturation  # noqa: E402
from extproc.policy.admission import ACCEPT, AdmissionController, RequestFacts  # noqa: E402
from extproc.policy.limits import Completion, Outcome  # noqa: E402
from extproc.policy.schema import load_policy  # noqa: E402

HEADER = "x-gateway-inference-fairness-id"
DONE = Completion(Outcome.OK, 200, 0.1, 0.5)
DOC = {"model": "llama", "max_tokens": 64, "messages": [{"role": "user", "content": "hi " * 50}]}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def policy(tenants: int = 1, cap: int = 1000, queue: int = 100, mode: str = "fifo", key: str = "tenant",
           sessions: bool = False, steered: bool = False, weight: float = 1.0, max_sessions: int = 100_000):
    doc = {"classes": {"interactive": {"max_concurrency": cap, "max_queue": queue, "max_wait_ms": 29_000,
                                       "early_reject": False, "fairness": {"mode": mode, "key": key}}},
           "default_class": "interactive",
           "tenants": [{"name": f"t{i}", "api_keys": [f"sk-t{i}"], **({"weight": weight} if weight != 1.0 else {})}
                       for i in range(tenants)],
           "anonymous": {"max_class": "interactive"},
           "models": {"llama": {"cluster": "pool_a"}}}
    if key == "header":
        doc["classify"] = {"fairness_header": HEADER}
    if sessions:
        doc["sessions"] = {"max_inflight_gpu_seconds": 10_000.0, "gpu_seconds_per_minute": 100_000.0,
                           "max_sessions": max_sessions}
    if steered:
        doc["pools"] = {"pool_a": {"replicas": ["10.0.0.1:8000"]}}
    return load_policy(doc)


def facts(**kw) -> RequestFacts:
    kw.setdefault("model", "llama")
    return RequestFacts(max_tokens=64, doc=DOC, **kw)


def lifecycle(core: AdmissionController, f: RequestFacts) -> None:
    d = core.decide(f)
    if d.ticket is not None:
        core.finish(d.ticket, Outcome.OK)
        core.report(d.ticket.id, DONE)


# --- the rows: each makes a core for N and returns (step(i), the core) ---

def tenants_in_policy(n: int):
    core = AdmissionController(policy(tenants=n, mode="fair", weight=2.0), clock=Clock())
    asks = [facts(api_key=f"sk-t{i}") for i in range(n)]
    return lambda i: lifecycle(core, asks[i % n]), core


def fairness_ids(n: int):
    core = AdmissionController(policy(mode="fair", key="header"), clock=Clock())
    asks = [facts(fairness_id=f"flow-{i}") for i in range(n)]
    return lambda i: lifecycle(core, asks[i % n]), core


def session_ids(n: int):
    core = AdmissionController(policy(sessions=True), clock=Clock())
    asks = [facts(api_key="sk-t0", session_id=f"session-{i}") for i in range(n)]
    return lambda i: lifecycle(core, asks[i % n]), core


def busy_sessions(n: int):
    """N sessions with a request running, on a table of max_sessions 100: each step is a fresh session id."""
    core = AdmissionController(policy(cap=n + 10, sessions=True, max_sessions=100), clock=Clock())
    running = [core.decide(facts(api_key="sk-t0", session_id=f"busy-{i}")).ticket for i in range(n)]
    return (lambda i: lifecycle(core, facts(api_key="sk-t0", session_id=f"fresh-{i}"))), (core, running)


def unknown_keys(n: int):
    core = AdmissionController(policy(), clock=Clock())
    asks = [facts(api_key=f"sk-unknown-{i}") for i in range(n)]
    return lambda i: lifecycle(core, asks[i % n]), core


def unknown_models(n: int):
    core = AdmissionController(policy(), clock=Clock())
    asks = [facts(api_key="sk-t0", model=f"no-such-model-{i}") for i in range(n)]
    return lambda i: lifecycle(core, asks[i % n]), core


def request_ids(n: int):
    core = AdmissionController(policy(), clock=Clock())
    asks = [facts(api_key="sk-t0", request_id=f"req-{i}") for i in range(n)]
    return lambda i: lifecycle(core, asks[i % n]), core


class Queue:
    """One request running on a cap of 1 and one waiter per ask: each step ends the running request (its slot goes
    to the queue's next waiter) and queues that waiter's ask again, so the queue stays at len(asks)."""

    def __init__(self, core: AdmissionController, asks: list[RequestFacts]):
        self.core, self.granted = core, []
        first = core.decide(asks[0])
        assert first.kind == ACCEPT
        self.running = first.ticket
        for f in asks:
            self.enqueue(f)

    def enqueue(self, f: RequestFacts) -> None:
        d = self.core.decide(f)
        d.waiter.notify(lambda result: self.granted.append((result, f)))

    def step(self, i: int) -> None:
        core, t = self.core, self.running
        core.finish(t, Outcome.OK)
        core.report(t.id, DONE)
        d, f = self.granted.pop()
        self.running = d.ticket
        self.enqueue(f)


def waiters(mode: str):
    def make(n: int):
        core = AdmissionController(policy(cap=1, queue=n, mode=mode), clock=Clock())
        q = Queue(core, [facts(api_key="sk-t0")] * n)
        return q.step, core
    make.__name__ = f"waiters ({mode}, one tenant)"
    return make


def waiting_flows(n: int):
    """N fairness ids, one waiter each, in a fair class (the anonymous tenant's flows, nested in its group)."""
    core = AdmissionController(policy(cap=1, queue=n, mode="fair", key="header"), clock=Clock())
    q = Queue(core, [facts(fairness_id=f"flow-{i}") for i in range(n)])
    return q.step, core


def waiting_tenants(n: int):
    """N tenants, one waiter each, in a fair class (each its own group)."""
    core = AdmissionController(policy(tenants=n, cap=1, queue=n, mode="fair"), clock=Clock())
    q = Queue(core, [facts(api_key=f"sk-t{i}") for i in range(n)])
    return q.step, core


def full_queue(n: int):
    """A fair class's queue full of N fairness ids' waiters (the anonymous tenant's), one id with two: each step is
    one arrival of a tenant with none waiting, which takes the place of that id's last waiter (crowded_out_by), then
    leaves (client gone), and the id queues again."""
    core = AdmissionController(policy(tenants=1, cap=1, queue=n + 1, mode="fair", key="header"), clock=Clock())
    Queue(core, [facts(fairness_id=f"flow-{i}") for i in range(n)] + [facts(fairness_id="flow-0")])
    tenant, again = facts(api_key="sk-t0"), facts(fairness_id="flow-0")

    def step(i: int) -> None:
        d = core.decide(tenant)
        core.abandon(d.waiter, timed_out=False)
        core.decide(again)
    return step, core


def replicas(n: int):
    """A pool with one stalled replica and N working ones: each step is one decision that names them."""
    core = AdmissionController(policy(steered=True), clock=Clock())
    sat = PoolSaturation()
    sat.stalled = 1
    sat.working = tuple((f"10.0.{i // 250}.{i % 250}:8000", float(i % 7), 1.0) for i in range(n))
    core.set_saturation("pool_a", sat)
    ask = facts(api_key="sk-t0")

    def step(i: int) -> None:
        d = core.decide(ask)
        core.replicas_for("pool_a", d.cls)
        core.finish(d.ticket, Outcome.OK)
        core.report(d.ticket.id, DONE)
    return step, core


def reloads(n: int):
    """N reloads first (alternating two policies of 10 tenants: a tenant added, then removed); a step is one
    decision after them."""
    a, b = policy(tenants=10, mode="fair"), policy(tenants=11, mode="fair")
    core = AdmissionController(a, clock=Clock())
    for i in range(n):
        core.apply(b if i % 2 == 0 else a)
    core.apply(a)
    ask = facts(api_key="sk-t1")
    return lambda i: lifecycle(core, ask), core


ROWS = [("tenants in the policy", tenants_in_policy), ("fairness ids", fairness_ids), ("session ids", session_ids),
        ("fresh session ids, N sessions running (max_sessions 100)", busy_sessions),
        ("unknown API keys", unknown_keys), ("unknown models (404)", unknown_models), ("request ids", request_ids),
        ("waiters, fifo (step: finish + grant + queue)", waiters("fifo")),
        ("waiters, fair, one tenant (step: finish + grant + queue)", waiters("fair")),
        ("waiting tenants, fair (step: finish + grant + queue)", waiting_tenants),
        ("waiting fairness ids, fair (step: finish + grant + queue)", waiting_flows),
        ("arrivals at a full fair queue of N ids (step: crowd out + leave + queue)", full_queue),
        ("replicas of a stalled pool (step: lifecycle + replicas_for)", replicas),
        ("reloads before (step: lifecycle)", reloads)]
# Fresh ids, each seen once: what the core keeps of 100,000 of them.
FRESH = [("fairness ids", lambda i: facts(fairness_id=f"fresh-{i}"), dict(mode="fair", key="header")),
         ("session ids", lambda i: facts(api_key="sk-t0", session_id=f"fresh-{i}"), dict(sessions=True)),
         ("unknown API keys", lambda i: facts(api_key=f"sk-fresh-{i}"), {}),
         ("unknown models (404)", lambda i: facts(api_key="sk-t0", model=f"fresh-{i}"), {}),
         ("request ids", lambda i: facts(api_key="sk-t0", request_id=f"fresh-{i}"), {})]


def median_us(step: Callable[[int], None], runs: int = 5) -> float:
    """The median over `runs` timings of as many steps as take ~50 ms (20 to 2,000), in µs a step."""
    t = time.perf_counter()
    step(1)
    reps = max(20, min(2000, int(0.05 / max(time.perf_counter() - t, 1e-6))))
    times, i = [], 2
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(reps):
            step(i)
            i += 1
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times) * 1e6


CORE_FILES = [tracemalloc.Filter(True, str(Path(extproc.__file__).resolve().parent / "*"))]


def retained(make: Callable[[], tuple], steps: int) -> int:
    """Bytes the core (extproc/) allocated and still holds after it was made and `steps` steps ran: not the asks
    the bench made beforehand, nor its ids (the core keeps references to them, counted where it keeps them)."""
    gc.collect()
    tracemalloc.start()
    step, kept = make()
    for i in range(steps):
        step(i)
    gc.collect()
    held = sum(s.size for s in tracemalloc.take_snapshot().filter_traces(CORE_FILES).statistics("filename"))
    tracemalloc.stop()
    del step, kept
    return held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N up to 1,000 and 10,000 fresh ids (a smoke run)")
    args = ap.parse_args()
    sizes = (1, 100, 1000) if args.quick else (1, 100, 10_000)
    fresh = 10_000 if args.quick else 100_000
    median_us(fairness_ids(100)[0])  # the interpreter warm before the first row
    print("| cardinality | N | µs per step (median) | x N = 1 | retained (after N steps) |")
    print("|---|---:|---:|---:|---:|")
    for name, make in ROWS:
        base = None
        for n in sizes:
            step, core = make(n)
            step(0)  # warm: first-use state (a flow, a session, a breaker) made before the timing
            us = median_us(step)
            base = base or us
            # every id of the row seen; rows of steps over a millisecond (replicas) stop after ~1 s of them
            held = retained(lambda: make(n), n if us < 1000 else max(100, int(1e6 / us)))
            print(f"| {name} | {n:,} | {us:.1f} | {us / base:.2f} | {held / 1024:,.0f} KiB |", flush=True)
    print()
    print("| fresh ids, each seen once | ids | retained | bytes per id |")
    print("|---|---:|---:|---:|")
    for name, ask, kw in FRESH:
        def make(kw=kw, ask=ask):
            core = AdmissionController(policy(**kw), clock=Clock())
            return (lambda i: lifecycle(core, ask(i))), core
        held = retained(make, fresh) - retained(make, 1)
        print(f"| {name} | {fresh:,} | {held / 1024:,.0f} KiB | {held / fresh:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
