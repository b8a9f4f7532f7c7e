"""What-if models of the modes without the ext_proc: no admission control (a) and Envoy's adaptive_concurrency
filter (b), as `whatif.Admitter`s, and `admitter_for(mode)` for every mode.

The gradient controller follows Envoy's documentation of the filter (configuration/http/http_filters/
adaptive_concurrency_filter): every `concurrency_update_interval` the latencies of the requests completed in
that interval are summarised by a percentile (sampleRTT), taken as Envoy takes it from a log-linear histogram of
the latencies in wall-clock microseconds (`envoy_quantile`: at the demo's speed the what-if's seconds are a fifth of
that); gradient = (minRTT + minRTT * buffer) / sampleRTT,
clamped to [0.5, 2] (the range of its `gradient` statistic); limit = limit * gradient + sqrt(of that),
truncated to a whole number, within [min_concurrency, max_concurrency_limit]. An interval with no completed
request leaves the limit alone. The limit starts at min_concurrency. A request arriving while the requests in
flight are at the limit gets a 503 at once (Envoy does not queue); a request its client gave up on gives no
sample. With `min_rtt_fixed_s` (the demo's tuning) minRTT is that constant and never re-measured.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from extproc.policy.admission import Admit, RequestFacts
from extproc.policy.decision import REJECT, Decision, Refusal
from extproc.tools.adaptive_concurrency import ENVOY_DEFAULTS, effective
from extproc.tools.loadgen import CLIENT_ERROR, RequestRecord

from .modes import DEFAULT_SPEED, Mode
from .whatif import Admitter, InstancesAdmitter, PolicyAdmitter

GRADIENT_RANGE = (0.5, 2.0)


def _histogram_bin(us: int) -> tuple[float, float]:
    """(left edge, width) of the bin of a circllhist log-linear histogram that holds `us` (>= 0): two significant
    digits, so [100, 110) us, [1000, 1100) us, [1.0, 1.1) s ... (a tenth of the decade's first value wide)."""
    if us <= 0:
        return 0.0, 0.0
    if us < 10:
        return float(us), 0.1
    width = 10 ** (len(str(us)) - 2)
    return float(us // width * width), float(width)


def envoy_quantile(latencies_us: list[int], q: float) -> float:
    """The q-quantile (0..1) Envoy's gradient controller takes of an interval's latency samples (whole
    microseconds): libcircllhist's hist_approx_quantile over their log-linear histogram. It finds the bin the
    q x n-th sample is in and places the k-th of the bin's n samples at k/(n + 1) of its width, whatever the samples
    in it were: 1.01 s latencies read as about 1.09 s at the 90th percentile, 1.05 s at the median, and 1.09 s ones
    as 1.05 s at the median. Off the exact percentile by up to a bin either way: a tenth just above 1, 10, 100 ...
    ms or s, 1% just under them."""
    bins = sorted(Counter(_histogram_bin(us) for us in latencies_us).items())
    target = len(latencies_us) * q
    lower = 0
    for i, ((left, width), n) in enumerate(bins):
        if lower + n >= target or i == len(bins) - 1:
            break
        lower += n
    if width == 0:
        return left
    return left + max(1, math.ceil(target - lower)) / (n + 1) * width


class GradientController:
    """Envoy's adaptive_concurrency gradient controller with a fixed minRTT, sans-IO: the caller says when a
    request is forwarded, when it ends (with its latency, or cancelled) and when an update interval ends.
    `speed`: the caller's seconds per Envoy (wall-clock) second, which Envoy's histogram of the latencies bins."""

    def __init__(self, min_rtt_s: float, buffer_percent: float = ENVOY_DEFAULTS["buffer_percent"],
                 sample_percentile: float = ENVOY_DEFAULTS["sample_aggregate_percentile"],
                 min_concurrency: int = ENVOY_DEFAULTS["min_concurrency"],
                 max_concurrency_limit: int = ENVOY_DEFAULTS["max_concurrency_limit"], speed: float = 1.0):
        self.min_rtt_s = min_rtt_s
        self.buffer = buffer_percent / 100.0
        self.sample_percentile = sample_percentile
        self.min_limit = min_concurrency
        self.max_limit = max_concurrency_limit
        self.speed = speed
        self.limit = min_concurrency
        self.outstanding = 0
        self.samples: list[float] = []
        self.last_sample_rtt: float | None = None
        self.last_gradient: float | None = None

    def try_forward(self) -> bool:
        """True (and counted in flight) when under the limit; False: Envoy answers 503."""
        if self.outstanding < self.limit:
            self.outstanding += 1
            return True
        return False

    def record(self, latency_s: float) -> None:
        """A forwarded request completed after `latency_s`."""
        self.outstanding -= 1
        self.samples.append(latency_s)

    def cancel(self) -> None:
        """A forwarded request ended without a latency sample (its client went away)."""
        self.outstanding -= 1

    def update(self) -> int:
        """The end of an update interval: a new limit from this interval's samples (none: unchanged)."""
        if not self.samples:
            return self.limit
        sample_rtt = self.sample_rtt(self.samples)
        self.samples.clear()
        self.last_sample_rtt = sample_rtt
        self.last_gradient = self.gradient(sample_rtt)
        self.limit = self.next_limit(self.last_gradient)
        return self.limit

    def sample_rtt(self, samples: list[float]) -> float:
        """An interval's latencies summarised as Envoy does: their `sample_percentile` from its histogram of them in
        whole microseconds of its clock (both truncated, as Envoy's durations are)."""
        us = [int(s / self.speed * 1e6) for s in samples]
        return int(envoy_quantile(us, self.sample_percentile / 100.0)) / 1e6 * self.speed

    def gradient(self, sample_rtt: float) -> float:
        """(minRTT + minRTT * buffer) / sampleRTT, clamped to GRADIENT_RANGE."""
        lo, hi = GRADIENT_RANGE
        return max(lo, min(hi, self.min_rtt_s * (1.0 + self.buffer) / sample_rtt)) if sample_rtt > 0 else hi

    def next_limit(self, gradient: float) -> int:
        """The limit after an interval with `gradient`: limit * gradient + its square root, truncated, within
        [min_concurrency, max_concurrency_limit]."""
        scaled = self.limit * gradient
        return max(self.min_limit, min(self.max_limit, int(scaled + math.sqrt(scaled))))


class _Forwarded:
    """The ticket of a request every admitter here forwards: no state."""


class _EnvoyOnly:
    """What a mode without the ext_proc leaves as the client sent it."""

    def engine_priority(self, d: Decision) -> int:
        return 0  # no ext_proc: the client's body goes through (the scenarios send none)

    def replicas_for(self, pool: str, cls: str, model: str | None = None) -> str | None:
        return None  # no ext_proc: Envoy's load balancer picks


class NoAdmission(_EnvoyOnly):
    """Mode a: Envoy forwards everything to the clients' pool (round robin, or least request)."""

    def __init__(self, lb_policy: str = "round_robin"):
        self.lb_policy = lb_policy
        self.limits: list[tuple[float, dict[str, int]]] = []

    def start(self, clock: Callable[[], float], pools) -> list[tuple[float, Callable[[], None]]]:
        return []

    def decide(self, facts: RequestFacts) -> Decision:
        return Admit("forwarded", "", "", None)

    def ended(self, ticket: Any, record: RequestRecord) -> None:
        pass

    def reap(self) -> None:
        pass


class EnvoyAdaptive(_EnvoyOnly):
    """Mode b: Envoy's adaptive_concurrency filter in front of the clients' pool (least request)."""

    lb_policy = "least_request"  # envoy/envoy.yaml's pools (FULL_SCAN); mode b does not override it

    def __init__(self, knobs: dict[str, Any], speed: float = DEFAULT_SPEED):
        """`knobs` in simulated seconds (extproc.tools.adaptive_concurrency; the ones not given: Envoy's defaults, as
        the real stack leaves them to Envoy); `speed`: the real run's, whose wall-clock latencies Envoy bins."""
        self.knobs = effective(knobs)
        if not self.knobs["min_rtt_fixed_s"]:
            raise ValueError("the what-if models adaptive_concurrency with a fixed minRTT only (min_rtt_fixed_s)")
        self.interval_s = float(self.knobs["concurrency_update_interval_s"])
        self.controller = GradientController(
            float(self.knobs["min_rtt_fixed_s"]), float(self.knobs["buffer_percent"]),
            float(self.knobs["sample_aggregate_percentile"]), int(self.knobs["min_concurrency"]),
            int(self.knobs["max_concurrency_limit"]), speed)
        self.limits: list[tuple[float, dict[str, int]]] = []

    def start(self, clock: Callable[[], float], pools) -> list[tuple[float, Callable[[], None]]]:
        c = self.controller
        self.limits.append((0.0, {"adaptive_concurrency": c.limit}))
        first = [True]

        def update() -> None:
            if first[0]:  # the timer's first run is at 0: the first interval ends one interval later
                first[0] = False
                return
            before = c.limit
            if c.update() != before:
                self.limits.append((clock(), {"adaptive_concurrency": c.limit}))
        return [(self.interval_s, update)]

    def decide(self, facts: RequestFacts) -> Decision:
        if self.controller.try_forward():
            return Admit("forwarded", "", "", _Forwarded())
        return Refusal(REJECT, "adaptive_concurrency", "", "", 503, "reached concurrency limit")

    def ended(self, ticket: Any, record: RequestRecord) -> None:
        if record.status != CLIENT_ERROR:  # any answer Envoy encoded to its end is a sample (a 404 too)
            self.controller.record(record.latency)
        else:
            self.controller.cancel()

    def reap(self) -> None:
        pass


def admitter_for(mode: Mode, instances: int = 1) -> Admitter:
    """The what-if's model of `mode`: its policy through the real core (`instances` of it, each its own), or a
    model of the Envoy-only modes."""
    if mode.policy:
        return PolicyAdmitter(mode.policy) if instances == 1 else InstancesAdmitter(mode.policy, instances)
    if mode.stack_mode == "adaptive":
        return EnvoyAdaptive(mode.adaptive)
    if mode.stack_mode == "plain":
        return NoAdmission("round_robin" if mode.lb_policy == "ROUND_ROBIN" else "least_request")
    raise ValueError(f"no what-if model for mode {mode.key} ({mode.stack_mode})")
