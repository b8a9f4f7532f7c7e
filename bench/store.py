"""What the shared store adds per decision: the in-process store vs Redis (loopback), same core, same requests.

One decision here is what the servicer does for an admitted request: decide() (and, with Redis, the global
acquire: one round trip) then, when the request ends, finish() and the release (one round trip, in the background).
Caps are high so nothing waits: this measures the fast path. Run:  python bench/store.py [--decisions 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from extproc.policy.admission import AdmissionController, RequestFacts  # noqa: E402
from extproc.policy.limits import Outcome  # noqa: E402
from extproc.policy.schema import load_policy  # noqa: E402
from extproc.store import open_store  # noqa: E402
from extproc.tools.local_redis import RedisServer  # noqa: E402
from extproc.store.shared_slots import SharedSlots  # noqa: E402


def policy(store: dict):
    return load_policy({"classes": {"interactive": {"max_concurrency": 100_000, "max_inflight_gpu_seconds": 1e9}},
                        "models": {"llama-70b": {"cluster": "vllm_llama70b"}}, "store": store})


FACTS = RequestFacts(header_class="interactive", model="llama-70b", max_tokens=64,
                     doc={"messages": [{"role": "user", "content": "Say hello in five words."}]})


async def run(store: dict, decisions: int, concurrency: int) -> dict:
    core = AdmissionController(policy(store))
    backend = open_store(core.policy.store)
    shared = SharedSlots(core, backend) if backend.shared else None
    if shared is not None:
        await shared.start()
    latencies: list[float] = []

    async def one() -> None:
        t0 = time.perf_counter()
        d = core.decide(FACTS)
        if shared is not None and core.gated(d):
            d = await shared.try_now(d) or await shared.wait(d)
        latencies.append(time.perf_counter() - t0)
        core.finish(d.ticket, Outcome.OK)
        if shared is not None:
            shared.release(d.ticket)

    async def worker(n: int) -> None:
        for _ in range(n):
            await one()

    for _ in range(200):  # warm-up: connections, script caches
        await one()
    latencies.clear()
    started = time.perf_counter()
    await asyncio.gather(*[worker(decisions // concurrency) for _ in range(concurrency)])
    elapsed = time.perf_counter() - started
    if shared is not None:
        await shared.close()  # lets the queued releases land first
    latencies.sort()
    n = len(latencies)
    return {"decisions": n, "per_s": n / elapsed, "mean_us": statistics.fmean(latencies) * 1e6,
            "p50_us": latencies[n // 2] * 1e6, "p99_us": latencies[int(n * 0.99)] * 1e6}


async def ping_floor(url: str, n: int = 2000) -> dict:
    """The floor: a bare redis-py asyncio PING round trip on the same loop and machine."""
    import redis.asyncio as aioredis
    client = aioredis.Redis.from_url(url)
    for _ in range(100):
        await client.ping()
    latencies = []
    for _ in range(n):
        t0 = time.perf_counter()
        await client.ping()
        latencies.append(time.perf_counter() - t0)
    await client.aclose()
    latencies.sort()
    return {"p50_us": latencies[n // 2] * 1e6, "p99_us": latencies[int(n * 0.99)] * 1e6}


def commands(url: str) -> dict[str, int]:
    stats = redis.Redis.from_url(url).info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        redis_store = {"kind": "redis", "url": server.url, "timeout_ms": 1000}
        print(f"{'store':<8} {'clients':>7} {'decisions/s':>12} {'mean µs':>9} {'p50 µs':>8} {'p99 µs':>8} "
              f"{'scripts/decision':>17}")
        for conc in args.concurrency:
            for name, store in (("memory", {"kind": "memory"}), ("redis", redis_store)):
                before = commands(server.url)
                r = asyncio.run(run(store, args.decisions, conc))
                after = commands(server.url)
                scripts = sum(after.get(c, 0) - before.get(c, 0) for c in ("evalsha", "eval"))
                per = f"{scripts / (r['decisions'] + 200):.2f}"  # acquire + release, warm-up included
                print(f"{name:<8} {conc:>7} {r['per_s']:>12,.0f} {r['mean_us']:>9.1f} {r['p50_us']:>8.1f} "
                      f"{r['p99_us']:>8.1f} {per if name == 'redis' else '-':>17}", flush=True)
        floor = asyncio.run(ping_floor(server.url))
        print(f"redis-py PING round trip, same machine: p50 {floor['p50_us']:.0f} µs, p99 {floor['p99_us']:.0f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
