"""Fleet capacity for a request mix, measured in the engine model alone (closed loop, simulated time)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from extproc.tools.loadgen import Workload
from extproc.tools.sim.engine import Engine
from extproc.tools.sim.profile import Profile
from extproc.tools.stats import percentile


@dataclass
class Capacity:
    """Closed-loop throughput of one replica at a fixed concurrency, for a workload mix."""

    concurrency: int
    requests_per_s: float
    output_tokens_per_s: float
    p50_s: float
    p99_s: float
    preemptions: int
    kv_usage: float  # mean share of KV blocks in use (per iteration)
    running: float  # mean sequences running (holding KV), of `concurrency` in the engine


def closed_loop_mix(profile: Profile, workload: Workload, concurrency: int, requests: int = 3000,
                    seed: int = 0) -> Capacity:
    """Keep `concurrency` requests of the mix in one engine; each one finished is replaced at once. A session
    kind's request is one of its calls, drawn with the context its earlier calls grew (no think time: a closed
    loop)."""
    engine = Engine(profile, seed=seed)
    rng = random.Random(seed)
    now = 0.0

    def earlier_output() -> int:
        return profile.natural_output_tokens(rng)

    def add() -> None:
        kind = workload.pick(rng)
        max_tokens = kind.max_tokens or profile.default_max_tokens
        engine.add_request(kind.sample_call_prompt(rng, lambda: min(max_tokens, earlier_output())), max_tokens, now)

    for _ in range(concurrency):
        add()
    warmup = concurrency * 2
    finished = 0
    latencies: list[float] = []
    t0, tokens0 = 0.0, 0
    kv = running = 0.0
    while len(latencies) < requests:
        step = engine.begin_iteration(now)
        now += step
        if finished >= warmup:
            kv += engine.kv_usage * step
            running += len(engine.running) * step
        for emission in engine.end_iteration(now):
            if emission.finish_reason is None:
                continue
            finished += 1
            if finished == warmup:
                t0, tokens0 = now, engine.stats.generation_tokens
            elif finished > warmup:
                latencies.append(now - emission.seq.arrival)
            add()
    span = now - t0
    latencies.sort()
    return Capacity(concurrency, len(latencies) / span, (engine.stats.generation_tokens - tokens0) / span,
                    percentile(latencies, 50), percentile(latencies, 99), engine.stats.preemptions,
                    kv / span, running / span)
