"""Drive the engine alone in simulated time: closed-loop sweeps in milliseconds, for fitting and what-if runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.tools.sim.engine import Engine, Sequence
from extproc.tools.sim.profile import Profile
from extproc.tools.stats import percentile


@dataclass
class SweepPoint:
    """Closed-loop result at one concurrency: aggregate output tokens/s and the measured (post-warm-up) requests."""

    concurrency: int
    tokens_per_s: float
    preemptions: int
    sequences: list[Sequence] = field(repr=False)

    def latencies_s(self, generated: int | None = None, preempted: bool | None = None) -> list[float]:
        """Sorted end-to-end latencies of the measured requests, optionally only those that generated exactly
        `generated` tokens and/or were (or were never) preempted."""
        return sorted(s.finished - s.arrival for s in self.sequences
                      if (generated is None or s.generated == generated)
                      and (preempted is None or (s.preemptions > 0) == preempted))

    @property
    def p50_s(self) -> float:
        return percentile(self.latencies_s(), 50)

    @property
    def p99_s(self) -> float:
        return percentile(self.latencies_s(), 99)

    @property
    def mean_output_tokens(self) -> float:
        return sum(s.generated for s in self.sequences) / len(self.sequences)


def closed_loop(profile: Profile, concurrency: int, prompt_tokens: int, max_tokens: int,
                requests: int = 2000, warmup: int | None = None, seed: int = 0) -> SweepPoint:
    """Keep `concurrency` requests in the engine; a finished one is replaced at once by a new one."""
    engine = Engine(profile, seed=seed)
    warmup = concurrency * 2 if warmup is None else warmup
    now = 0.0
    for _ in range(concurrency):
        engine.add_request(prompt_tokens, max_tokens, now)
    started = concurrency
    measured: list[Sequence] = []
    window_start: tuple[float, int] | None = None  # (time, tokens generated) once warm-up requests are all in
    while len(measured) < requests:
        duration = engine.begin_iteration(now)
        now += duration
        for emission in engine.end_iteration(now):
            if emission.finish_reason is None:
                continue
            seq = emission.seq
            if seq.id >= warmup:
                measured.append(seq)
            engine.add_request(prompt_tokens, max_tokens, now)
            started += 1
            if started == warmup:
                window_start = (now, engine.stats.generation_tokens)
    t0, tokens0 = window_start or (0.0, 0)
    rate = (engine.stats.generation_tokens - tokens0) / (now - t0)
    return SweepPoint(concurrency, rate, engine.stats.preemptions, measured)
