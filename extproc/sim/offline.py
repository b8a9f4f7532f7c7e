"""Drive the engine alone in simulated time: closed-loop sweeps in milliseconds, for fitting and what-if runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.sim.engine import Engine, Sequence
from extproc.sim.profile import Profile
from extproc.sim.stats import percentile


@dataclass
class SweepPoint:
    """Closed-loop result at one concurrency: aggregate output tokens/s and end-to-end latency percentiles."""

    concurrency: int
    tokens_per_s: float
    p50_s: float
    p99_s: float
    mean_output_tokens: float
    preemptions: int
    sequences: list[Sequence] = field(default_factory=list, repr=False)  # the measured (post-warm-up) requests


def closed_loop(profile: Profile, concurrency: int, prompt_tokens: int, max_tokens: int,
                requests: int = 2000, warmup: int | None = None, seed: int = 0) -> SweepPoint:
    """Keep `concurrency` requests in the engine; a finished one is replaced at once by a new one."""
    engine = Engine(profile, seed=seed)
    warmup = concurrency * 2 if warmup is None else warmup
    now = 0.0
    for _ in range(concurrency):
        engine.add_request(prompt_tokens, max_tokens, now)
    started = concurrency
    latencies: list[float] = []
    measured: list[Sequence] = []
    outputs = 0
    window_start: tuple[float, int] | None = None  # (time, tokens generated) once warm-up requests are all in
    while len(latencies) < requests:
        duration = engine.begin_iteration(now)
        now += duration
        for emission in engine.end_iteration(now):
            if emission.finish_reason is None:
                continue
            seq = emission.seq
            if seq.id >= warmup:
                latencies.append(now - seq.arrival)
                measured.append(seq)
                outputs += seq.generated
            engine.add_request(prompt_tokens, max_tokens, now)
            started += 1
            if started == warmup:
                window_start = (now, engine.stats.generation_tokens)
    latencies.sort()
    t0, tokens0 = window_start or (0.0, 0)
    rate = (engine.stats.generation_tokens - tokens0) / (now - t0)
    return SweepPoint(concurrency, rate, percentile(latencies, 50), percentile(latencies, 99),
                      outputs / len(latencies), engine.stats.preemptions, measured)
