"""What Python's cyclic garbage collector costs the event loop, with a big policy, with and without gc.freeze.

Each variant runs in a child process of its own (the collector's state is the process's), in process as
bench/reload.py does it (uvloop, `Server` and its servicer, streams fed as grpc.aio feeds them, no gRPC), with a
generated policy (`--generate`, default 2,000 tenants): the server as `serve` starts it (with its housekeeping,
its control ticks, and a completion report for each request as Envoy's access log sends it), then

1. `steady`: `--seconds` of `--rate` requests a second, each held `--hold-ms` after its answer, no reloads;
2. `reloads`: the same, with a reload (Server.start_reload, what SIGHUP calls) every `--every` seconds, each
   applied: its read hands over a fresh copy of the policy, unpickled in the reload's thread as the child process
   of a real parse hands it over (the child's YAML, in another process, is left out: nothing of this heap);

and for each: the collections of each generation (counted by gc.callbacks, in whatever thread ran them: a
collection holds the GIL, so the loop waits for one in the reload's thread too), their pauses (CPU time; p50 /
p99 / max, all generations together), the gen-2 ones' p50 / max, the pauses' sum a second, what one more gen-2
costs at the phase's end (a gc.collect(): what the next one walks, whenever it comes), and the decisions' latency
(bench/reload.py's: from when the request was due to its body's answer) p50 / p99 / max. Then `leak`:
`--applies` reloads one after another, read as in 2., and after the 10th and the last the objects the collector
tracks (after a full collection; frozen ones included) and the RSS.

Variants: `as-is`, the server without FrozenHeap.settle (no gc.freeze: the code before it); `freeze`, the server
(at start and after each applied reload: collect what is not frozen, then gc.freeze; once the frozen objects grew
by 25%, gc.unfreeze and a full collection first); `start-only` (freeze at start, never after); `full-each` (the
unfreeze and full collection after every reload); `no-unfreeze` (leak only: never unfreeze, which keeps cycles
that died frozen for good).
Run:  python bench/gc_pauses.py [--generate 2000,20,10] [--seconds 8] [--every 0.5] [--variants as-is,freeze,...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload import decisions, generated, server_for  # noqa: E402

from extproc.policy.limits import Completion, Outcome  # noqa: E402
from extproc.policy.schema import load_policy  # noqa: E402
from extproc.server import main  # noqa: E402


def variant(name: str) -> None:
    """This process's server as `name` has it."""
    settle = main.FrozenHeap.settle
    if name == "as-is":
        main.FrozenHeap.settle = lambda self: None
    elif name == "start-only":
        main.FrozenHeap.settle = lambda self: settle(self) if self._full_at is None else None
    elif name == "full-each":
        main.FrozenHeap.settle = lambda self: (setattr(self, "_full_at", None), settle(self))
    elif name == "no-unfreeze":
        main.FrozenHeap.REGROWTH = float("inf")


VARIANTS = ("as-is", "freeze", "start-only", "full-each", "no-unfreeze")


class Collections:
    """gc.callbacks: each collection's generation and pause, in CPU time of the thread that ran it (what it would
    take on a machine of its own: on a shared one, the wall time of the same collection varied 3-5x between runs)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.pauses.append((info["generation"], time.thread_time() - self._started))

    def summary(self, seconds: float) -> dict:
        pauses = sorted(p for _, p in self.pauses) or [0.0]
        q = statistics.quantiles(pauses, n=100, method="inclusive") if len(pauses) > 1 else [pauses[0]] * 99
        return {f"gen{g}": sum(1 for gen, _ in self.pauses if gen == g) for g in range(3)} | {
            "pause_p50_ms": q[49] * 1e3, "pause_p99_ms": q[98] * 1e3, "pause_max_ms": pauses[-1] * 1e3,
            "gen2_p50_ms": statistics.median([p for g, p in self.pauses if g == 2] or [0.0]) * 1e3,
            "gen2_max_ms": max((p for g, p in self.pauses if g == 2), default=0.0) * 1e3,
            "paused_ms_per_s": sum(pauses) * 1e3 / seconds}


def gen2_now() -> float:
    """What a gen-2 collection costs at this moment (CPU time, ms): what the next one, whenever it comes, walks."""
    started = time.thread_time()
    gc.collect()
    return (time.thread_time() - started) * 1e3


def tracked() -> int:
    gc.collect()
    return len(gc.get_objects()) + gc.get_freeze_count()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextlib.contextmanager
def fresh_copies(doc: dict):
    """Each reload's read hands over a fresh copy of `doc`'s policy, unpickled in the reload's thread as
    parse_apart unpickles the child's answer, without the child's second of YAML (another process, another core:
    nothing of this one's heap) and with new bytes each time, so that each reload applies."""
    data = pickle.dumps(load_policy(doc))
    real = main.read_policy
    main.read_policy = lambda path, parsed, apart=True: (os.urandom(32), pickle.loads(data))
    try:
        yield
    finally:
        main.read_policy = real


async def leak(server, applies: int) -> dict:
    """`applies` reloads one after another; the objects tracked and the RSS after the 10th and the last."""
    at: dict = {}
    for i in range(1, applies + 1):
        assert await server.reload()
        await asyncio.gather(*server._reload_tasks)
        if i in (10, applies):
            at[i] = (tracked(), rss_mib())
    (o10, r10), (on, rn) = at[10], at[applies]
    return {"objects_at_10": o10, f"objects_at_{applies}": on, "objects_per_reload": (on - o10) / (applies - 10),
            "rss_at_10_mib": r10, f"rss_at_{applies}_mib": rn}


def as_served(server) -> list[asyncio.Task]:
    """What `serve` runs beside the streams: its housekeeping (leases, reaping) and control ticks, and Envoy's
    completion report for each request, 0.1 s after its stream ended (the access log's flush): without one a
    finished request's ticket waits 5 s for it (REPORT_WAIT_S), and the heap held 5 s of requests."""
    core, loop = server.core, asyncio.get_running_loop()
    finish = core.finish

    def finished(ticket, outcome=Outcome.ENDED) -> bool:
        closed = finish(ticket, outcome)
        if closed:
            loop.call_later(0.1, core.report, ticket.id, Completion(Outcome.OK, 200, 0.02, 0.05))
        return closed

    core.finish = finished
    return [asyncio.create_task(server.housekeeping()), asyncio.create_task(server.control())]


def child(a: argparse.Namespace) -> dict:
    variant(a.child)
    t, c, n = (int(x) for x in a.generate.split(","))
    doc = generated(t, c, n)
    requests = [(f"m{i % n}", f"sk-{i % t}") for i in range(997)]
    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "policy.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))

        async def run() -> None:
            server = server_for(str(path))
            background = as_served(server)
            server.heap.settle()  # as Server.run does before it serves
            if a.child != "no-unfreeze":  # the same as `freeze` until it grew 25%
                for phase, every in (("steady", None), ("reloads", a.every))[:2 if a.every else 1]:
                    seen = Collections()
                    gc.callbacks.append(seen)
                    with fresh_copies(doc):
                        r = await decisions(server, a.seconds, a.rate, a.hold_ms / 1e3, every, requests, False)
                    gc.callbacks.remove(seen)
                    out[phase] = seen.summary(a.seconds) | r | {"gen2_now_ms": gen2_now()}
            with fresh_copies(doc):
                out["leak"] = await leak(server, a.applies)
            for task in background:
                task.cancel()
            await server.scrapers.stop()
            await server.clusters.stop()

        import uvloop
        uvloop.run(run())
    return out


def table(results: dict[str, dict]) -> None:
    cols = [("gen0", "gen-0"), ("gen1", "gen-1"), ("gen2", "gen-2"), ("pause_p50_ms", "pause p50"),
            ("pause_p99_ms", "p99"), ("pause_max_ms", "max"), ("gen2_p50_ms", "gen-2 p50"), ("gen2_max_ms", "max"),
            ("paused_ms_per_s", "ms/s"), ("gen2_now_ms", "gen-2 at the end"), ("p50_ms", "decision p50"),
            ("p99_ms", "p99"), ("max_ms", "max"), ("reloads_applied", "reloads")]
    print("| variant | phase | " + " | ".join(h for _, h in cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for variant, r in results.items():
        for phase in ("steady", "reloads"):
            if phase in r:
                row = r[phase]
                print(f"| {variant} | {phase} | " + " | ".join(
                    f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k, _ in cols) + " |")
    print()
    print("| variant | " + " | ".join(next(iter(results.values()))["leak"]) + " |")
    print("|---|" + "---:|" * len(next(iter(results.values()))["leak"]))
    for variant, r in results.items():
        print(f"| {variant} | " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v)
                                              for v in r["leak"].values()) + " |")


def main_(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--generate", default="2000,20,10", metavar="TENANTS,CLASSES,POOLS")
    p.add_argument("--seconds", type=float, default=8.0, help="of each phase")
    p.add_argument("--rate", type=float, default=500.0, help="new requests a second")
    p.add_argument("--hold-ms", type=float, default=50.0)
    p.add_argument("--every", type=float, default=0.5,
                   help="seconds between reloads in the `reloads` phase (0: no such phase)")
    p.add_argument("--applies", type=int, default=50, help="reloads of the `leak` measure")
    p.add_argument("--variants", default="as-is,freeze,start-only,no-unfreeze")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.applies <= 10:  # the measure is per reload after the 10th: fewer crashed the child on a division by 0
        p.error("--applies: more than 10 (the heap is read after the 10th reload and the last)")
    logging.basicConfig(level=logging.CRITICAL)
    if a.child:
        print(json.dumps(child(a)))
        return
    print(f"policy: generated {a.generate}; {a.rate:g} requests/s held {a.hold_ms:g} ms, {a.seconds:g} s a phase, "
          f"a reload every {a.every:g} s; leak: {a.applies} reloads; gc thresholds {gc.get_threshold()}, "
          f"Python {sys.version.split()[0]}")
    results = {}
    for variant in a.variants.split(","):
        argv_ = [sys.executable, __file__, "--child", variant] + [
            x for k in ("generate", "seconds", "rate", "hold_ms", "every", "applies")
            for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]
        done = subprocess.run(argv_, capture_output=True, text=True, check=True)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    table(results)


if __name__ == "__main__":
    main_()
