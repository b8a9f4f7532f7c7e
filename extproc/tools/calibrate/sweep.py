"""The calibration sweep as a state machine with no I/O: it says which concurrency to measure next, is told each
step's result, and ends with a cap (and the reason for it) or a refusal.

The ritual it automates: double the concurrency from `start` while p95 holds the SLO; at the first step over the
SLO, bisect between the last good and the first bad concurrency; the knee is the last good one; the cap is the knee
less the safety margin. A step whose error rate is over the limit ends the sweep without a cap: latencies measured
while the target fails say nothing about its capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum


class Verdict(str, Enum):
    """What one step says about its concurrency."""

    GOOD = "good"  # p95 within the SLO
    OVER = "over"  # p95 over the SLO
    FAILED = "failed"  # too many errors (or no successful request): the target, not the load, is the problem


class Status(str, Enum):
    """How a sweep ended."""

    RUNNING = "running"
    CAP = "cap"  # a cap was chosen
    TARGET_FAILED = "target_failed"  # a step's error rate was over the limit
    SLO_MISSED_AT_START = "slo_missed_at_start"  # the first step was already over the SLO
    INTERRUPTED = "interrupted"  # the operator stopped it (set by the caller)


@dataclass(frozen=True)
class StepResult:
    """One closed-loop step at a fixed concurrency; latencies in seconds of the target's time."""

    concurrency: int
    requests: int
    ok: int
    errors: dict[str, int]
    latency_p50: float
    latency_p95: float
    latency_p99: float
    ttft_p95: float
    tokens_per_s: float
    phase: str = "double"  # double | bisect (the sweep's `phase` when the step was planned)
    stopped_early: bool = False  # cut short: p95 far over the SLO, or errors over the limit

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float:
        return self.error_count / self.requests if self.requests else 1.0

    @classmethod
    def from_summary(cls, concurrency: int, summary: dict, phase: str = "double",
                     stopped_early: bool = False) -> StepResult:
        """From `extproc.tools.loadgen.summarize` output (errors are counted by kind; HTTP errors by their type)."""
        return cls(concurrency=concurrency, requests=summary["requests"], ok=summary["ok"],
                   errors=dict(summary["errors"]), latency_p50=summary["latency_p50"],
                   latency_p95=summary["latency_p95"], latency_p99=summary["latency_p99"],
                   ttft_p95=summary["ttft_p95"], tokens_per_s=summary["output_tokens_per_s"], phase=phase,
                   stopped_early=stopped_early)


@dataclass(frozen=True)
class SweepConfig:
    """The sweep's knobs; times in seconds of the target's time."""

    slo_p95_s: float
    start: int = 1
    max_concurrency: int = 256
    margin: float = 0.2  # fraction taken off the knee
    far_factor: float = 2.0  # a step whose p95 passes far_factor x SLO may be cut short
    max_error_rate: float = 0.05
    bisect_steps: int = 3

    def __post_init__(self) -> None:
        if self.slo_p95_s <= 0:
            raise ValueError("the SLO must be positive")
        if not 1 <= self.start <= self.max_concurrency:
            raise ValueError("need 1 <= start <= max_concurrency")
        if not 0 <= self.margin < 1:
            raise ValueError("the margin must be in [0, 1)")
        if not 0 <= self.max_error_rate < 1:
            raise ValueError("the error-rate limit must be in [0, 1)")
        if self.bisect_steps < 0 or self.far_factor <= 1:
            raise ValueError("bisect_steps must be >= 0 and far_factor > 1")

    def verdict(self, step: StepResult) -> Verdict:
        if step.ok == 0 or step.error_rate > self.max_error_rate:
            return Verdict.FAILED
        return Verdict.OVER if step.latency_p95 > self.slo_p95_s else Verdict.GOOD

    def far_over(self, p95: float) -> bool:
        """Whether a p95 is so far over the SLO that measuring the step to its end would add nothing."""
        return p95 > self.far_factor * self.slo_p95_s


def apply_margin(knee: int, margin: float) -> int:
    """floor(knee x (1 - margin)), at least 1 (a tiny epsilon keeps 20 x 0.8 from flooring to 15)."""
    return max(1, math.floor(knee * (1 - margin) + 1e-9))


@dataclass
class Sweep:
    """Doubling, then bisection, then the margin. Drive it with `next_concurrency()` and `record(step)`."""

    config: SweepConfig
    steps: list[StepResult] = field(default_factory=list)
    status: Status = Status.RUNNING
    last_good: StepResult | None = None
    first_bad: StepResult | None = None
    failed_step: StepResult | None = None
    _bisected: int = 0
    _next: int | None = None

    def __post_init__(self) -> None:
        self._next = self.config.start

    @property
    def phase(self) -> str:
        return "double" if self.first_bad is None else "bisect"

    @property
    def done(self) -> bool:
        return self.status is not Status.RUNNING

    def next_concurrency(self) -> int | None:
        """The concurrency to measure next, or None when the sweep has ended."""
        return None if self.done else self._next

    def record(self, step: StepResult) -> Verdict:
        """Take one step's result (for the concurrency `next_concurrency()` asked for) and plan the next."""
        if self.done:
            raise RuntimeError(f"sweep already ended ({self.status.value})")
        if step.concurrency != self._next:
            raise ValueError(f"expected a step at concurrency {self._next}, got {step.concurrency}")
        bisecting = self.first_bad is not None
        self.steps.append(step)
        verdict = self.config.verdict(step)
        if verdict is Verdict.FAILED:
            self.failed_step = step
            self.status = Status.TARGET_FAILED
            return verdict
        if verdict is Verdict.GOOD:
            self.last_good = step
        else:
            self.first_bad = step
        if self.last_good is None:
            self.status = Status.SLO_MISSED_AT_START
        elif self.first_bad is not None:
            self._plan_bisection(counted=bisecting)
        else:
            self._plan_doubling()
        return verdict

    def _plan_doubling(self) -> None:
        current = self.last_good.concurrency
        if current >= self.config.max_concurrency:
            self.status = Status.CAP  # the SLO held all the way up: the knee is at least the ceiling
            return
        self._next = min(2 * current, self.config.max_concurrency)

    def _plan_bisection(self, counted: bool) -> None:
        self._bisected += counted
        good, bad = self.last_good.concurrency, self.first_bad.concurrency
        if bad - good <= 1 or self._bisected >= self.config.bisect_steps:
            self.status = Status.CAP
            return
        self._next = (good + bad) // 2

    def interrupt(self) -> None:
        """The operator stopped the sweep: whatever was measured stays, no cap is chosen."""
        if not self.done:
            self.status = Status.INTERRUPTED

    def outcome(self, margin: float | None = None) -> Outcome:
        """The knee, the cap and why; `margin` overrides the configured one (the MoE margin)."""
        return Outcome.of(self, self.config.margin if margin is None else margin)


@dataclass(frozen=True)
class Outcome:
    """The sweep's answer: a cap with its reason, or why there is none."""

    status: Status
    reason: str
    knee: int | None = None
    cap: int | None = None
    margin: float | None = None

    @property
    def has_cap(self) -> bool:
        return self.cap is not None

    @classmethod
    def of(cls, sweep: Sweep, margin: float) -> Outcome:
        slo = sweep.config.slo_p95_s
        status = sweep.status
        if status is Status.RUNNING:
            raise RuntimeError("the sweep has not ended")
        if status is Status.INTERRUPTED:
            return cls(status, f"interrupted after {len(sweep.steps)} step(s); no cap chosen")
        if status is Status.TARGET_FAILED:
            s = sweep.failed_step
            kinds = ", ".join(f"{k} x{n}" for k, n in sorted(s.errors.items(), key=lambda kv: -kv[1])) or "none"
            return cls(status, f"target failed at step {len(sweep.steps)} (concurrency {s.concurrency}): "
                               f"{s.error_count} of {s.requests} requests failed ({s.error_rate:.0%} > limit "
                               f"{sweep.config.max_error_rate:.0%}; {kinds}); no cap chosen")
        if status is Status.SLO_MISSED_AT_START:
            s = sweep.first_bad
            return cls(status, f"p95 {s.latency_p95:.2f} s > SLO {slo:.2f} s already at the start concurrency "
                               f"{s.concurrency}; no cap chosen (lower --start, or the SLO is out of reach)")
        good = sweep.last_good
        knee = good.concurrency
        cap = apply_margin(knee, margin)
        arithmetic = f"cap = floor({knee} x {1 - margin:.2f}) = {cap}"
        if sweep.first_bad is None:
            why = (f"p95 {good.latency_p95:.2f} s <= SLO {slo:.2f} s up to --max-concurrency {knee} "
                   f"(the knee is at or above it)")
        else:
            bad = sweep.first_bad
            why = (f"p95 {bad.latency_p95:.2f} s > SLO {slo:.2f} s at {bad.concurrency}; last good {knee} "
                   f"(p95 {good.latency_p95:.2f} s)")
        return cls(status, f"{why}; {arithmetic}", knee=knee, cap=cap, margin=margin)
