"""Which replicas of a pool run markedly slower than the fastest: a throttled GPU, a noisy neighbour on the host.

Envoy balances by requests in flight, not by speed, so a replica at half speed keeps its share of the pool's
requests and every one of them takes twice as long: the class with the tightest SLO misses it on that replica
alone, and the pool-wide limit, which sees one latency for the pool, cuts the healthy replicas' admissions for
it. vLLM counts its own inter-token latency (the `vllm:inter_token_latency_seconds` histogram); its sum and count
over the last few seconds give each replica's pace, and the replicas of one pool, balanced to about the same
load, should show about the same. One whose pace is `ratio` times the fastest's is slow: the classes with an SLO
are sent to the others while it is (policy.steering), the rest still go to it. It stops being slow once back
within half that margin, or after a window without tokens (it gets nothing to be judged on otherwise).

The window is long (server.saturation: 100 scrapes, 20 s by default) because a replica's inter-token latency
also depends on its mix: a replica prefilling long prompts decodes slower for a few seconds. Over 5 s, healthy
replicas of the long-prompt scenario (scenarios/kv-agents.yaml) read 1.5x apart; over 20 s none did, on any seed.
"""

from __future__ import annotations

import math
from collections import deque

MIN_TOKENS = 50  # inter-token observations in the window before a replica's pace is judged


class TokenPace:
    """One replica's mean inter-token latency over a window, from the histogram's cumulative sum and count."""

    __slots__ = ("window_s", "_last", "_steps", "slow", "relative")

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._last: tuple[float, float] | None = None  # (sum, count) as last read
        self._steps: deque[tuple[float, float, float]] = deque()  # (when, sum added, count added)
        self.slow = False
        self.relative = 1.0  # its inter-token latency over the pool's fastest, as last judged (1: unknown)

    def add(self, now: float, total_s: float, count: float) -> None:
        """A reading of the cumulative counters (NaN: the replica does not export them)."""
        last, self._last = self._last, (total_s, count)
        if math.isnan(total_s) or math.isnan(count):
            self._last = None
        elif last is not None and count >= last[1] and total_s >= last[0]:
            self._steps.append((now, total_s - last[0], count - last[1]))
        else:  # first reading, or the counters went back (a restarted replica): start over
            self._steps.clear()
        self._trim(now)

    @property
    def factor(self) -> float:
        """How much longer a request should take here than on the fastest replica, for steering: 1 unless slow."""
        return self.relative if self.slow else 1.0

    def seconds_per_token(self, now: float) -> float | None:
        """The mean inter-token latency over the window; None with fewer than MIN_TOKENS observations."""
        self._trim(now)
        count = sum(step[2] for step in self._steps)
        if count < MIN_TOKENS:
            return None
        return sum(step[1] for step in self._steps) / count

    def _trim(self, now: float) -> None:
        steps = self._steps
        while steps and now - steps[0][0] > self.window_s:
            steps.popleft()


def judge_slow(paces: list[TokenPace], now: float, ratio: float) -> list[TokenPace]:
    """Update each pace's `slow` against the fastest of them; returns those whose verdict changed. `ratio` <= 1:
    nothing is slow. A replica without a pace (idle, or not exporting it) is not slow: it is judged again once
    it has served a window's tokens."""
    if ratio <= 1.0:
        return [p for p in paces if _set(p, False)]
    seen = [(p, p.seconds_per_token(now)) for p in paces]
    known = [s for _, s in seen if s is not None]
    fastest = min(known) if len(known) >= 2 else None
    release = 1.0 + (ratio - 1.0) / 2  # hysteresis: a slow replica must be well back before it is trusted again
    changed = []
    for pace, s in seen:
        if s is None or fastest is None:
            slow, pace.relative = False, 1.0
        else:
            pace.relative = s / fastest
            slow = pace.relative > (release if pace.slow else ratio)
        if _set(pace, slow):
            changed.append(pace)
    return changed


def _set(pace: TokenPace, slow: bool) -> bool:
    changed, pace.slow = pace.slow != slow, slow
    return changed
