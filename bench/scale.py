"""Does the per-request cost stay small with a large deployment's policy? In-process, no gRPC, no I/O.

A policy built programmatically: T tenants (each an API key; every 10th with a weight, every 5th with rate limits
that never bite), M model names (a model per pool, the rest aliases and LoRA adapters of them), P pools of 16
replicas each (listed, not scraped here), three classes (interactive, a `fair` class shared by the tenants, batch).

- decide + finish: one request through the core on an idle fleet (nobody waits), by tenants, models and pools,
  without and with pool-wide limits.
- grant: a flood in the fair class: N tenants each with requests waiting, the class full; each step one request
  ends (finish: its slot goes to the next waiter) and the granted tenant sends another (decide: it queues). The
  cost of a step, by N and fairness mode, under the class's own cap and under a full pool-wide limit (where a
  flow still owed its share of the pool goes in over it).
- scrape: parsing one replica's /metrics body (tests/fixtures/vllm/metrics.txt), and that times the replicas at
  the default scrape interval as a share of one core (the ext_proc's event loop runs it, between decisions).

Run:  python bench/scale.py            (prints markdown tables; medians of repeated timings on this machine)
      python bench/scale.py --profile  (cProfile of the largest grant case, top functions)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.policy.admission import AdmissionController, RequestFacts  # noqa: E402
from extproc.policy.decision import ACCEPT, QUEUE  # noqa: E402
from extproc.policy.limits import Outcome  # noqa: E402
from extproc.policy.schema import load_policy  # noqa: E402
from decision import per_call  # noqa: E402  (bench/decision.py: the median of five timed loops)

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 16
DOC = {"model": "m0", "max_tokens": 256, "messages": [{"role": "user", "content": "hi " * 200}]}


class Clock:
    """A clock that stands still unless moved: nothing waits past its deadline while a case is timed."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def build(tenants: int, models: int, pools: int, *, mode: str = "fair", fair_cap: int = 1000,
          fair_queue: int = 20, limit: bool = False, limit_requests: int | None = None) -> dict:
    """The policy as YAML would give it (a dict for load_policy)."""
    pool_names = [f"pool{p}" for p in range(pools)]
    model_map: dict[str, dict] = {}
    for m in range(pools):  # one model per pool; the other names are its aliases / adapters
        model_map[f"m{m}"] = {"cluster": pool_names[m], "aliases": []}
    for m in range(pools, models):
        model_map[f"m{m % pools}"]["aliases"].append(f"m{m}")
    pool_map = {}
    for p, name in enumerate(pool_names):
        spec: dict = {"replicas": [f"10.{p}.0.{r}:8000" for r in range(REPLICAS)]}
        if limit:
            spec["limit"] = {"enabled": True, "unit": "requests"}
            if limit_requests is not None:  # a limit that stays where it is put (a full pool)
                spec["limit"].update(initial=limit_requests, min=limit_requests, max=limit_requests)
        pool_map[name] = spec
    tenant_list = []
    for t in range(tenants):
        spec = {"name": f"t{t}", "api_keys": [f"sk-{t}"], "default_class": "shared"}
        if t % 10 == 0:
            spec["weight"] = 2.0
        if t % 5 == 0:
            spec.update(requests_per_minute=10**9, tokens_per_minute=10**12)
        tenant_list.append(spec)
    return {
        "classes": {
            "interactive": {"max_concurrency": 1000, "max_queue": 20, "max_wait_ms": 200},
            "shared": {"max_concurrency": fair_cap, "max_queue": fair_queue, "max_wait_ms": 29000,
                       "early_reject": True, "fairness": {"mode": mode}, "min_share": 0.1},
            "batch": {"max_concurrency": 1000, "max_queue": 20, "max_wait_ms": 5000, "min_share": 0.05},
        },
        "default_class": "shared",
        "tenants": tenant_list,
        "models": model_map,
        "pools": pool_map,
        "shed": {},
    }


def decision_cost(tenants: int, models: int, pools: int, limit: bool) -> float:
    """decide + finish of an admitted request, rotating over every tenant and model name (µs)."""
    core = AdmissionController(load_policy(build(tenants, models, pools, limit=limit)))
    facts = [RequestFacts(api_key=f"sk-{i % tenants}", model=f"m{i % models}", max_tokens=256, doc=DOC)
             for i in range(max(tenants, models))]
    i = 0

    def step():
        nonlocal i
        d = core.decide(facts[i])
        i = (i + 1) % len(facts)
        assert d.kind == ACCEPT, d.reason
        core.finish(d.ticket, Outcome.OK)

    return per_call(step, 5000) * 1e6


class Flood:
    """N tenants backlogged in the fair class; step(): one request ends, the granted tenant sends another."""

    def __init__(self, backlogged: int, mode: str, pool_limit: bool, per_tenant: int = 2, cap: int = 16):
        self.clock = Clock()
        queue = backlogged * per_tenant
        policy = build(max(backlogged, 10), 1, 1, mode=mode, fair_cap=cap if not pool_limit else 10 * cap,
                       fair_queue=queue + backlogged, limit=pool_limit, limit_requests=cap if pool_limit else None)
        self.core = AdmissionController(load_policy(policy), clock=self.clock)
        self.facts = [RequestFacts(api_key=f"sk-{t}", model="m0", max_tokens=256, doc=DOC)
                      for t in range(max(backlogged, 10))]
        self.running = []
        lim = self.core.limiters["shared"]
        self.queue = lim.queue
        for i in range(1000):  # the class has been draining 10,000 requests a second, as step() goes on to
            lim.drain.record(self.clock.t - 0.1 + i * 1e-4)
        t = 0
        while len(self.queue) < queue:  # the class (or the pool) fills first, then everyone queues
            d = self.core.decide(self.facts[t % backlogged])
            t += 1
            if d.kind == ACCEPT:
                self.running.append(d.ticket)
            else:
                assert d.kind == QUEUE, (d.kind, d.reason)
                d.waiter.notify(self._granted)
        assert self.running, "nothing runs"

    def _granted(self, d) -> None:
        assert d.kind == ACCEPT, (d.kind, d.reason)
        self.running.append(d.ticket)
        self.last = d.ticket.tenant

    def step(self) -> None:
        self.clock.t += 1e-4
        self.last = None
        ended = self.running.pop(0)
        self.core.finish(ended, Outcome.OK)
        # The granted tenant sends another (under a pool limit held over by owed flows a release may grant nobody:
        # then the one that ended sends it, which queues or, owed its share, goes in).
        d = self.core.decide(self.facts[int((self.last or ended.tenant)[1:])])
        if d.kind == ACCEPT:
            self.running.append(d.ticket)
        else:
            assert d.kind == QUEUE, (d.kind, d.reason)
            d.waiter.notify(self._granted)


def grant_cost(backlogged: int, mode: str, pool_limit: bool) -> float:
    flood = Flood(backlogged, mode, pool_limit)
    for _ in range(200):
        flood.step()  # the drain rate is known: early rejection reads the queue ahead on every arrival
    return per_call(flood.step, 1000 if backlogged <= 100 else 300) * 1e6


def background_cost(inflight: int = 8000) -> tuple[float, float]:
    """The core's periodic work with the large policy (8 pools with limits) and `inflight` requests running: tick()
    (limits move; every tick_s, 25-100 ms) and reap() (lease and deadline safety nets; once a second), µs each."""
    clock = Clock()
    core = AdmissionController(load_policy(build(1000, 100, 8, limit=True, fair_cap=inflight)), clock=clock)
    for i in range(inflight):
        d = core.decide(RequestFacts(api_key=f"sk-{i % 1000}", model=f"m{i % 8}", max_tokens=256, doc=DOC))
        assert d.kind == ACCEPT, d.reason

    def timed(fn) -> float:
        def step():
            clock.t += 0.05
            fn()
        return per_call(step, 50) * 1e6

    return timed(core.tick), timed(core.reap)


def scrape_cost() -> tuple[float, int]:
    """Parse one /metrics body as the scraper does (µs), and the body's size."""
    from extproc.server import saturation

    body = (ROOT / "tests" / "fixtures" / "vllm" / "metrics.txt").read_text()
    parse = saturation.parse_vllm_metrics
    return per_call(lambda: parse(body), 200) * 1e6, len(body.encode())


SERVE = """
import sys
from aiohttp import web
body = open(sys.argv[1], "rb").read()
async def metrics(request):
    return web.Response(body=body, content_type="text/plain")
async def health(request):
    return web.Response(text="ok")
app = web.Application()
app.add_routes([web.get("/metrics", metrics), web.get("/health", health)])
async def main():
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in sys.argv[2:]:
        await web.TCPSite(runner, "127.0.0.1", int(port)).start()
    print("ready", flush=True)
    await asyncio.Event().wait()
import asyncio
asyncio.run(main())
"""


def scrape_live(seconds: float, pools: int = 8, pattern=None, in_step: bool = False) -> tuple[float, float, float]:
    """The scrapers of `pools` pools of 16 replicas (one local server process on 16 ports, the fixture as every
    replica's /metrics) run for `seconds` in this process's event loop: (share of a core this process used, p99 and
    max event-loop lag in ms, measured by a 1 ms timer). `pools` 0: the timer alone."""
    import asyncio
    import subprocess

    from extproc.server import saturation
    from extproc.tools.stack import free_port

    ports = [free_port() for _ in range(REPLICAS)]
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(ROOT / "tests/fixtures/vllm/metrics.txt"),
                               *map(str, ports)], stdout=subprocess.PIPE)
    saved, scraper = saturation._SAMPLE, saturation.PoolScraper

    class InStep(scraper):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.phase_s = 0.0  # as before the pools' rounds were spread: all at once

    try:
        assert server.stdout.readline().strip() == b"ready"
        if pattern is not None:
            saturation._SAMPLE = pattern
        if in_step:
            saturation.PoolScraper = InStep
        policy = build(10, pools or 1, pools or 1)
        for spec in policy["pools"].values():
            spec["replicas"] = [f"127.0.0.1:{p}" for p in ports]
        core = AdmissionController(load_policy(policy))

        async def run():
            scrapers = saturation.SaturationScrapers(core)
            if pools:
                await scrapers.configure(core.policy.pools)
            await asyncio.sleep(1.0)  # connections made
            lags, cpu, t0 = [], time.process_time(), time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                at = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - at - 0.001)
            share = (time.process_time() - cpu) / (time.perf_counter() - t0)
            await scrapers.stop()
            lags.sort()
            return share, lags[int(len(lags) * 0.99)] * 1e3, lags[-1] * 1e3

        return asyncio.run(run())
    finally:
        saturation._SAMPLE, saturation.PoolScraper = saved, scraper
        server.terminate()
        server.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="cProfile the 1,000-tenant fair grant case")
    ap.add_argument("--quick", action="store_true", help="skip the 1,000-tenant grant cases")
    ap.add_argument("--scrape-live", type=float, metavar="SECONDS",
                    help="run 8 pools x 16 replicas' scrapers against a local server this long and report only that")
    args = ap.parse_args()
    if args.scrape_live:
        import re

        from extproc.server import saturation
        line_start = re.compile(rb"^(" + b"|".join(re.escape(n.encode()) for n in saturation._WANTED)
                                + rb")([{ \t][^\n]*)", re.M)  # the parse's pattern before (tried at every byte)
        print("| scrapers | parse | pools' rounds | process CPU, share of a core | loop lag p99 | loop lag max |")
        print("|---|---|---|---:|---:|---:|")
        for pools, pattern, in_step, name in (
                (0, None, False, "- | -"), (8, line_start, True, "line-start pattern (before) | in step (before)"),
                (8, None, True, "newline + name search | in step (before)"),
                (8, None, False, "newline + name search | spread over the interval")):
            share, p99, worst = scrape_live(args.scrape_live, pools, pattern, in_step)
            print(f"| {pools * REPLICAS} replicas | {name} | {share:.0%} | {p99:.2f} ms | {worst:.2f} ms |")
        return 0
    if args.profile:
        for mode, pool_limit in (("fair", False), ("fair", True), ("round_robin", True)):
            flood = Flood(1000, mode, pool_limit)
            for _ in range(200):
                flood.step()
            prof = cProfile.Profile()
            prof.runcall(lambda: [flood.step() for _ in range(300)])
            print(f"--- {mode}, pool limit {pool_limit}: 300 steps, 1,000 tenants backlogged")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        return 0

    print("decide + finish, idle fleet (µs per request)\n")
    print("| tenants | model names | pools (x16 replicas) | per-class caps | pool-wide limits |")
    print("|---:|---:|---:|---:|---:|")
    for tenants, models, pools in ((10, 1, 1), (100, 10, 1), (1000, 100, 1), (1000, 100, 8)):
        caps, limits = (decision_cost(tenants, models, pools, limit) for limit in (False, True))
        print(f"| {tenants:,} | {models} | {pools} | {caps:.1f} | {limits:.1f} |")

    print("\nfair class flooded: one release (finish + grant) and one arrival (decide: queued), "
          "µs per step\n")
    print("| tenants backlogged | waiting | fifo | round_robin | fair | round_robin, full pool limit "
          "| fair, full pool limit |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (10, 100, 1000) if not args.quick else (10, 100):
        cells = [grant_cost(n, mode, False) for mode in ("fifo", "round_robin", "fair")]
        cells += [grant_cost(n, mode, True) for mode in ("round_robin", "fair")]
        print(f"| {n:,} | {2 * n:,} | " + " | ".join(f"{c:,.1f}" for c in cells) + " |")

    tick_us, reap_us = background_cost()
    print(f"\nbackground, 8 pools with limits, 8,000 requests running: tick() {tick_us:,.0f} µs (every 25-100 ms), "
          f"reap() {reap_us:,.0f} µs (once a second)")

    parse_us, size = scrape_cost()
    replicas, interval_s = 8 * REPLICAS, 0.2
    share = parse_us * 1e-6 * replicas / interval_s
    print(f"\nscrape: parsing one /metrics body ({size / 1024:.0f} KiB) {parse_us:,.0f} µs; "
          f"{replicas} replicas every {interval_s * 1000:.0f} ms: {share:.0%} of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
