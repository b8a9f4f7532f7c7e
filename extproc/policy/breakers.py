"""Latency and error circuit breakers: rolling windows with a closed -> open -> half-open -> closed cycle."""

from __future__ import annotations

import math

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}   # the extproc_breaker_state gauge


class _Slices:
    """A rolling window cut into time slices, each a vector of counters; the total is kept incrementally."""

    __slots__ = ("width", "slices", "total", "_cursor", "_n")

    def __init__(self, window_s: float, n_slices: int, n_counters: int):
        self.width = window_s / n_slices
        self._n = n_counters
        self.slices = [[0] * n_counters for _ in range(n_slices)]
        self.total = [0] * n_counters
        self._cursor = -1    # index (in slice widths since t=0) of the newest slice

    def advance(self, now: float) -> None:
        """Drop the slices that fell out of the window. O(slices) at most, usually O(1)."""
        idx = math.floor(now / self.width)
        if self._cursor < 0:
            self._cursor = idx
            return
        if idx <= self._cursor:
            return
        for i in range(max(self._cursor + 1, idx - len(self.slices) + 1), idx + 1):
            old = self.slices[i % len(self.slices)]
            for k, v in enumerate(old):
                if v:
                    self.total[k] -= v
                    old[k] = 0
        self._cursor = idx

    def add(self, now: float, counter: int, n: int = 1) -> None:
        self.advance(now)
        self.slices[self._cursor % len(self.slices)][counter] += n
        self.total[counter] += n

    def clear(self) -> None:
        for s in self.slices:
            for k in range(len(s)):
                s[k] = 0
        self.total = [0] * self._n


class LatencyWindow:
    """Latency samples over a rolling window in log-spaced buckets: O(1) per sample, percentiles in O(buckets)."""

    LOW_S, RATIO, BUCKETS = 0.001, 1.08, 180   # 1 ms .. ~1 h, each bucket 8% wide (quantile error under 4%)

    def __init__(self, window_s: float, n_slices: int = 10):
        self._slices = _Slices(window_s, n_slices, self.BUCKETS)
        self._log_ratio = math.log(self.RATIO)

    def add(self, now: float, seconds: float) -> None:
        b = 0 if seconds <= self.LOW_S else int(math.log(seconds / self.LOW_S) / self._log_ratio) + 1
        self._slices.add(now, min(b, self.BUCKETS - 1))

    def count(self, now: float) -> int:
        self._slices.advance(now)
        return sum(self._slices.total)

    def quantile(self, now: float, q: float) -> float:
        """The q-quantile (upper edge of its bucket), or 0.0 with no samples."""
        self._slices.advance(now)
        total = self._slices.total
        n = sum(total)
        if n == 0:
            return 0.0
        rank = q * n
        seen = 0
        for b, c in enumerate(total):
            seen += c
            if seen >= rank:
                return self.LOW_S * self.RATIO ** b
        return self.LOW_S * self.RATIO ** (self.BUCKETS - 1)

    def clear(self) -> None:
        self._slices.clear()


class ErrorWindow:
    """Good and bad outcomes over a rolling window."""

    def __init__(self, window_s: float, n_slices: int = 10):
        self._slices = _Slices(window_s, n_slices, 2)

    def add(self, now: float, bad: bool) -> tuple[int, int]:
        """Count one outcome; returns counts(now) with it (the window is at `now` already: not advanced again)."""
        self._slices.add(now, 1 if bad else 0)
        good, bad = self._slices.total
        return good + bad, bad

    def counts(self, now: float) -> tuple[int, int]:
        """(total, bad)"""
        self._slices.advance(now)
        good, bad = self._slices.total
        return good + bad, bad

    def clear(self) -> None:
        self._slices.clear()


class Breaker:
    """The shared cycle. Closed: watch the window. Open: fail fast until `cooldown_s`. Half-open: let a
    `trickle` fraction through for `trickle_s`; one bad trickle request re-opens, a clean period closes."""

    kind = ""

    def __init__(self, cooldown_s: float, trickle: float, trickle_s: float):
        self.cooldown_s = cooldown_s
        self.trickle = trickle
        self.trickle_s = trickle_s
        self.state = CLOSED
        self.since = 0.0
        self._credit = 0.0
        self.on_change = None  # callable(breaker, new_state), set by the owner for metrics

    def poll(self, now: float) -> str:
        """The state at `now`: open -> half-open -> closed by time, each when it fell due. Moved on only by a
        request, a class whose traffic stopped while its breaker was open read as open (the state gauge) for ever."""
        if self.state == OPEN and now - self.since >= self.cooldown_s:
            self._set(HALF_OPEN, self.since + self.cooldown_s)
        if self.state == HALF_OPEN and now - self.since >= self.trickle_s:
            self._close(self.since + self.trickle_s)
        return self.state

    def opens_in(self, now: float) -> float:
        """Seconds until an open breaker half-opens (0 when it is not open)."""
        return max(0.0, self.since + self.cooldown_s - now) if self.poll(now) == OPEN else 0.0

    def allow(self, now: float) -> tuple[bool, bool]:
        """(may this request go to the pool, is it a trickle probe). Moves open -> half-open -> closed by time."""
        if self.state == CLOSED:
            return True, False  # the usual case: time moves an open or half-open breaker only (poll)
        state = self.poll(now)
        if state == OPEN:
            return False, False
        if state == HALF_OPEN:
            # A deterministic trickle: exactly `trickle` of the traffic, evenly spread. Within a float's noise of
            # a whole probe is one: ten trickles of 0.1 sum to 0.9999999999999999, and the first probe came late.
            self._credit += self.trickle
            if self._credit >= 1.0 - 1e-9:
                self._credit -= 1.0
                return True, True
            return False, False
        return True, False

    def observe(self, now: float, sample, trickle: bool) -> None:
        """A completed request's sample. Only trickle probes count while half-open; nothing counts while open. In
        the state time has moved it to: unasked since its cooldown and trickle period ran out, a breaker still read
        open (a sample that counts, dropped) or half-open (a slow probe back after the clean period re-opened it),
        and what a sample did hung on whether a request or a scrape had asked it in between."""
        state = CLOSED if self.state == CLOSED else self.poll(now)  # time moves an open or half-open one only
        if state == CLOSED:
            if self._record_trips(now, sample):
                self._set(OPEN, now)
        elif state == HALF_OPEN and trickle and self._bad(sample):
            self._set(OPEN, now)

    def take_state(self, old: Breaker | None, now: float) -> None:
        """Go on from `old`'s open or half-open state at `now` (a reload rebuilt the breaker with new knobs): the new
        cooldown or trickle period counts from when it began. Its window starts empty: the new knobs judge new
        samples. Its state as time has moved it: one that had closed by time but was not asked since read as open,
        and a reload with a longer cooldown opened it again for nothing."""
        if old is not None and old.poll(now) != CLOSED:
            self.state, self.since = old.state, old.since

    def reset(self, now: float) -> None:
        """Closed with an empty window: what tripped it has been dealt with another way (lower classes yielded)."""
        self._close(now)

    def _close(self, now: float) -> None:
        self._clear()
        self._set(CLOSED, now)

    def _set(self, state: str, now: float) -> None:
        self.state = state
        self.since = now
        self._credit = 0.0
        if self.on_change is not None:
            self.on_change(self, state)

    # subclass hooks
    def _record_trips(self, now: float, sample) -> bool: ...  # count a closed breaker's sample: does it trip now?
    def _bad(self, sample) -> bool: ...
    def _clear(self) -> None: ...


class LatencyBreaker(Breaker):
    """Trips when the window's p95 exceeds the SLO with at least `min_samples` samples."""

    kind = "latency"

    def __init__(self, slo_s: float, window_s: float = 30.0, min_samples: int = 50, quantile: float = 0.95,
                 cooldown_s: float = 10.0, trickle: float = 0.05, trickle_s: float = 60.0):
        super().__init__(cooldown_s, trickle, trickle_s)
        self.slo_s = slo_s
        self.min_samples = min_samples
        self.q = quantile
        self.window = LatencyWindow(window_s)
        # (within, over the SLO) exactly: the window's quantile is its bucket's upper edge, up to 8% over the truth,
        # and requests all within the SLO but in the bucket holding it read over it and tripped the breaker.
        self._over = ErrorWindow(window_s)

    def _record_trips(self, now: float, seconds: float) -> bool:
        self.window.add(now, seconds)
        total, over = self._over.add(now, seconds > self.slo_s)
        # The q-quantile is over the SLO exactly when fewer than q of the samples are within it.
        return total >= self.min_samples and total > 0 and (total - over) / total < self.q

    def _bad(self, seconds: float) -> bool:
        return seconds > self.slo_s

    def _clear(self) -> None:
        self.window.clear()
        self._over.clear()

    def p95(self, now: float) -> float:
        return self.window.quantile(now, self.q)


class ErrorBreaker(Breaker):
    """Trips when the share of failed requests (5xx, resets, timeouts) in the window reaches `max_error_ratio`
    with at least `min_requests` requests."""

    kind = "error"

    def __init__(self, max_error_ratio: float = 0.5, window_s: float = 30.0, min_requests: int = 20,
                 cooldown_s: float = 10.0, trickle: float = 0.05, trickle_s: float = 60.0):
        super().__init__(cooldown_s, trickle, trickle_s)
        self.max_error_ratio = max_error_ratio
        self.min_requests = min_requests
        self.window = ErrorWindow(window_s)

    def _record_trips(self, now: float, bad: bool) -> bool:
        total, bad = self.window.add(now, bad)
        # bad / total, not ratio * total: 0.14 * 50 is 7.000000000000001, so 7 failures of 50 never reached 0.14.
        return total >= self.min_requests and total > 0 and bad / total >= self.max_error_ratio

    def _bad(self, bad: bool) -> bool:
        return bad

    def _clear(self) -> None:
        self.window.clear()

    def error_ratio(self, now: float) -> float:
        total, bad = self.window.counts(now)
        return bad / total if total else 0.0
