"""The pool limit's onset guard (`pools.<name>.limit.onset_guard`).

At a surge's onset the limit is where the calm phase left it: calm bursts bind it with the latency in target, so it
rises, and the surge's first window runs at a level set by calm latency (issue 19, docs/overload.md). The guard
tells the two apart by the first class's arrivals, not by latency: a Poisson CUSUM test for ONSET_RATIO times their
recent rate (self-calibrating: the rate it tests against is the class's own, over ONSET_MEMORY_S, and the
threshold is set by a false-alarm rate in time, ONSET_FALSE_ALARM_S, not fitted to any workload). While it says "sustained surge", the limit is capped at
the load where the class's served quantile meets `target` x its SLO, learned from (time-averaged pool load over a
request's life, its service time) pairs. The cap is released when the latency loop cuts (it then reads the surge's
own latency) or when the test's statistic is back at zero (the surge is over).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

# The rate ratio the test looks for: a surge is at least twice the recent rate.
ONSET_RATIO = 2.0
# The test's threshold: about one false alarm in this many seconds of arrivals at a steady rate, whatever the rate
# (a threshold per arrival, ln 10^4, read a surge into calm traffic of 50 a second every few minutes).
ONSET_FALSE_ALARM_S = 10_000.0
# The recent rate is an average over this long (and the test waits this long after the first arrival).
ONSET_MEMORY_S = 30.0
# The load curve: the last CURVE_SAMPLES completions of the first class, in CURVE_BINS equal-count bins by load.
CURVE_SAMPLES = 1024
CURVE_BINS = 8
# Load samples (the pool's in-flight integral) kept this long: a request that ran longer gives no pair.
AREA_MEMORY_S = 300.0


class SurgeTest:
    """A Poisson CUSUM on one class's arrivals: log-likelihood of ONSET_RATIO x the recent rate against the recent
    rate, floored at 0 and capped at the threshold (set by the false-alarm rate in time); a surge from when it reaches the threshold until it is back at 0."""

    __slots__ = ("rate", "stat", "first", "last", "surge")

    STEP = math.log(ONSET_RATIO)

    def __init__(self):
        self.rate = 0.0          # decaying sum of arrivals / ONSET_MEMORY_S, as of `last`
        self.stat = 0.0
        self.first: float | None = None
        self.last: float | None = None
        self.surge = False

    def recent_rate(self, now: float) -> float:
        """Arrivals a second over the last ONSET_MEMORY_S (corrected for a shorter history)."""
        if self.first is None or now <= self.first:
            return 0.0
        decayed = self.rate * math.exp(-(now - self.last) / ONSET_MEMORY_S)
        return decayed / (1.0 - math.exp(-(now - self.first) / ONSET_MEMORY_S))

    def advance(self, now: float) -> None:
        """Time passing without arrivals: the statistic drifts down by (ratio - 1) x the arrivals the recent rate
        expects meanwhile (the rate decaying over the gap, integrated: a long gap drains it)."""
        if self.last is None or now <= self.last:
            return
        decay = math.exp(-(now - self.last) / ONSET_MEMORY_S)
        drift = (ONSET_RATIO - 1.0) * self.recent_rate(self.last) * ONSET_MEMORY_S * (1.0 - decay)
        self.rate *= decay
        self.last = now
        self.stat = max(0.0, self.stat - drift)
        if self.stat == 0.0:
            self.surge = False

    def arrival(self, now: float) -> None:
        if self.first is None:
            self.first = self.last = now
        self.advance(now)
        self.rate += 1.0 / ONSET_MEMORY_S
        if now - self.first >= ONSET_MEMORY_S:
            threshold = self.threshold(now)
            self.stat = min(threshold, self.stat + self.STEP)
            if self.stat >= threshold:
                self.surge = True

    def threshold(self, now: float) -> float:
        """ln of the arrivals expected in ONSET_FALSE_ALARM_S at the recent rate (a CUSUM's mean run to a false
        alarm grows as e^threshold arrivals), at least ln 100."""
        return math.log(max(100.0, self.recent_rate(now) * ONSET_FALSE_ALARM_S))


class LoadCurve:
    """The first class's service times against the pool's load over each request's life; `level` is the load
    where a line through the bins' quantiles meets the target (None: too few samples, no rise with load, or the
    target missed at the lightest load seen)."""

    def __init__(self):
        self.pairs: deque[tuple[float, float]] = deque(maxlen=CURVE_SAMPLES)
        self.times: deque[float] = deque()   # when each area sample was taken
        self.areas: deque[float] = deque()   # the pool's in-flight integral then
        self.held = 0.0                      # in flight since the last sample

    def sample(self, now: float, inflight: float) -> None:
        if self.times:
            if now <= self.times[-1]:
                self.held = inflight
                return
            area = self.areas[-1] + self.held * (now - self.times[-1])
        else:
            area = 0.0
        self.times.append(now)
        self.areas.append(area)
        self.held = inflight
        while now - self.times[0] > AREA_MEMORY_S:
            self.times.popleft()
            self.areas.popleft()

    def _area(self, t: float) -> float | None:
        times = self.times
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            return None
        if i == len(times) - 1:
            return self.areas[i] + self.held * (t - times[i])
        rate = (self.areas[i + 1] - self.areas[i]) / (times[i + 1] - times[i])
        return self.areas[i] + rate * (t - times[i])

    def observe(self, admitted_at: float, now: float, service_s: float) -> None:
        if now <= admitted_at:
            return
        start, end = self._area(admitted_at), self._area(now)
        if start is None or end is None:
            return
        self.pairs.append(((end - start) / (now - admitted_at), service_s))

    def level(self, budget_s: float, q: float, min_samples: int) -> float | None:
        if len(self.pairs) < CURVE_BINS * min_samples:
            return None
        pairs = sorted(self.pairs)
        size = len(pairs) / CURVE_BINS
        xs, ys = [], []
        for b in range(CURVE_BINS):
            part = pairs[round(b * size):round((b + 1) * size)]
            served = sorted(s for _, s in part)
            xs.append(sum(x for x, _ in part) / len(part))
            ys.append(nearest_rank(served, q))
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
        if slope <= 0.0:
            return None
        at = mx + (budget_s - my) / slope
        return at if at >= xs[0] else None


class OnsetGuard:
    """The surge test on the first class's arrivals and its load curve; `cap` is the level to hold the limit
    under now (None: no cap)."""

    def __init__(self):
        self.test = SurgeTest()
        self.curve = LoadCurve()
        self.released = False   # the latency loop cut during this surge: it reads the surge itself
        self.level: float | None = None

    def arrival(self, now: float) -> None:
        self.test.arrival(now)

    def cap(self, now: float, budget_s: float, q: float, min_samples: int) -> float | None:
        self.test.advance(now)
        if not self.test.surge:
            self.released = False
            self.level = None
            return None
        if self.released:
            return None
        if self.level is None:  # read once at the onset: the surge's own completions are not the calm curve's
            self.level = self.curve.level(budget_s, q, min_samples)
        return self.level


def nearest_rank(ordered: list[float], q: float) -> float:
    """The q-quantile of `ordered` (ascending, not empty) by nearest rank: the pool limit's readings
    (pool.RecentLatencies) and the onset curve's bins read their quantiles alike."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
