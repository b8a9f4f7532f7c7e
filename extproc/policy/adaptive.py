"""Adaptive per-class limits: move the cap by itself, anchored to the class's latency SLO and the replicas' load.

Why AIMD with an SLO band rather than Envoy's gradient (measured: docs/adaptive.md):
a gradient on the minimum RTT targets "a multiple of the fastest latency seen", never the SLO, drifts up while it
does not bind, and re-measures its baseline by pinning concurrency low. Here the target is the SLO itself:
 - the latency is the service time the replicas give (our own queue wait left out: under overload the wait is at
   its bound whatever the cap, and a limit that read it cut itself to its floor, issue 20 (1));
 - cut multiplicatively the moment the replicas say they are saturated (requests waiting in vLLM, KV cache nearly
   full, preemptions, or stale metrics; again only once what is in flight is back under the cap: a queue that
   does not drain must not cut it to its floor), or the short-window p95 approaches the SLO: reacts within one interval
   (also when the cap is far above what is in flight: a cap that starts too high must come down to where it binds;
   cutting only while it binds left the shifted-fleet what-if over its SLO, docs/adaptive.md);
 - after a latency cut, only requests admitted after it count: one slow period cuts once, not once per interval
   for a whole window;
 - lower classes yield first: while the classes below hold more than their floors on its pools, a slow class asks
   them to come down (each at its next move, to under what it holds) instead of cutting itself;
 - raise additively only while p95 is well under the SLO, the replicas have headroom, and the limit actually binds
   (in-flight near it) - so an idle class does not drift to its maximum;
 - hold in between (the hysteresis band keeps a steady load from oscillating), except to recover: while the cap
   binds, the replicas are not saturated and the p95 is within LOAD_TOLERANCE of the class's calm p95 (taken
   while the cap did not bind), load is not what makes it slow, so the cap rises a step per window. A mix whose
   p95 sits inside the band at any load (256-token answers: 1.4 s of a 2 s SLO) otherwise kept a spike's cuts
   for good and refused at 60% load afterwards (docs/adaptive.md);
 - probe upward when the window has too few completions to judge (a low cap completes few requests: at 2 slots
   and 1.5 s each, a 5 s window never reaches 10 samples, and a cap cut to its floor during a slowdown stayed
   there after capacity returned), if the cap binds, the replicas are not saturated, and none of the (at least
   min_samples / 2) samples it has is slow. One more slot at a time: the completions it brings decide the next.
"""

from __future__ import annotations

from .breakers import LatencyWindow
from .schema import AdaptiveSpec

# The p95 counts as calm (not slowed by load) within this factor of the calm p95 (as the pool limit's baseline).
LOAD_TOLERANCE = 1.15
CALM_DRIFT = 0.01  # per move: the calm p95 follows a slower mix within a minute or two
RECOVER_WINDOWS = 1.0  # inside the band, at most one raise per this share of the window: its effect must show


class PoolSaturation:
    """The replicas' own view of load, as last scraped (fed by the server's scraper)."""

    __slots__ = ("saturated", "down", "fleeting", "kv_usage", "waiting", "running", "preempting", "stalled",
                 "stalled_requests", "slow", "working", "loras", "updated_at")

    def __init__(self) -> None:
        self.saturated = False
        # No replica to read: every one refused the connection or failed its /health (dead, restarting, not up
        # yet), or none is listed (scaled to zero). Saturated for the gauge and the alert, but no word on load:
        # the limits do not move on it (LimitMoves.load_reading). Read as load, a pool down for 30 s cut the pool
        # limit to its floor (1 token), and the replicas' return met ~2 minutes of max_raise steps back up.
        self.down = False
        # Saturated only by waiting requests that were not waiting at the replica's previous scrape, where one
        # waiting request is already over PASSING_STEPS (server.saturation): the pool limit does not count it
        # while its latency is under half its target (policy.pool).
        self.fleeting = False
        self.kv_usage = 0.0
        self.waiting = 0.0
        self.running = 0.0
        self.preempting = False
        self.stalled = 0  # replicas that hold requests but make no progress (server.saturation, `stall_ms`)
        self.stalled_requests = 0.0  # the requests those replicas hold (running + waiting there)
        self.slow = 0  # replicas markedly slower than the pool's fastest (policy.replica_speed)
        # While some replica is stalled or slow: (Envoy's address, running + waiting, pace) of each one that works,
        # to send new requests to (policy.steering; pace over 1: slow); empty otherwise.
        self.working: tuple[tuple[str, float, float], ...] = ()
        # Where the replicas export vllm:lora_requests_info: (Envoy's address, running + waiting, max_lora, adapters
        # running) of each working one (policy.steering prefers one running a request's adapter); empty otherwise.
        self.loras: tuple[tuple[str, float, int, frozenset[str]], ...] = ()
        self.updated_at = -1.0


class AdaptiveLimit:
    """One class's limit controller. `update()` runs once per interval; `observe()` per completed request, with
    its service time (our queue wait left out)."""

    def __init__(self, spec: AdaptiveSpec, slo_s: float, initial: int):
        self.spec = spec
        self.slo_s = slo_s
        self.limit = float(min(max(initial, spec.min_limit), spec.max_limit))
        self.window = LatencyWindow(spec.window_s, n_slices=5)
        self._last = None
        self._cut_at = float("-inf")
        self._yield_due = False
        self.calm_p95: float | None = None  # the p95 while the cap did not bind: what this mix costs unloaded
        self._recovered_at = float("-inf")
        self.last_action = "hold"

    @property
    def floor(self) -> float:
        return self.spec.min_limit

    def carry_from(self, old: AdaptiveLimit) -> None:
        """A reload changed the knobs or the SLO: go on from what `old` learned, the cap within the new bounds.
        Restarting at `max_concurrency` undid an incident's cuts when an operator only tuned `cut_at` (found by
        test_adaptive_model), as the pool-wide limit does not (PoolLimit.respec). Its samples too while the window
        is as long: they are service times, whatever the SLO they are judged against."""
        self.limit = float(min(max(old.limit, self.spec.min_limit), self.spec.max_limit))
        if old.spec.window_s == self.spec.window_s:
            self.window = old.window
        self.calm_p95 = old.calm_p95
        self._last, self._cut_at, self._recovered_at = old._last, old._cut_at, old._recovered_at
        self.last_action = old.last_action
        self._yield_due = old._yield_due  # asked to yield since its last move: it still does at its next

    def observe(self, now: float, latency_s: float, admitted_at: float | None = None) -> None:
        if admitted_at is not None and admitted_at < self._cut_at:
            return  # it ran under the limit before the last cut: it says nothing about the one after
        self.window.add(now, latency_s)

    def update(self, now: float, inflight: int, saturation: PoolSaturation | None, yielding: bool = False,
               lower_excess: float = 0.0) -> int:
        """Move the limit if an interval has passed; return the current (whole) limit. `yielding`: a higher class
        on one of this class's pools is over its latency SLO, and lower classes give way first. `lower_excess`:
        requests the lower classes on this class's pools hold over their floors. Slow latency asks them to yield
        ("ask_yield"), and cuts this class too only when they hold less than its cut would free."""
        spec = self.spec
        self._yield_due = self._yield_due or yielding  # asked between two moves: it yields at the next
        if self._last is not None and now - self._last < spec.interval_s:
            return int(self.limit)
        yielding, self._yield_due = self._yield_due, False
        self._last = now
        enough = self.window.count(now) >= spec.min_samples
        p95 = self.window.quantile(now, 0.95) if enough else 0.0
        saturated = saturation is not None and saturation.saturated
        # A fraction of the cap the class is held to (the whole slots), not of the fraction a cut left: a full cap
        # of 2 after 4 -> 3.2 -> 2.56 read 2 of 2.56 as under 80%, and never rose again.
        binding = inflight >= spec.binding * int(self.limit)
        slow = enough and p95 > spec.cut_at * self.slo_s
        if enough and not binding and not saturated:
            self.calm_p95 = p95 if self.calm_p95 is None else min(p95, self.calm_p95 * (1 + CALM_DRIFT))
        if yielding:  # strict priority: down to under what it holds at once, not a step at a time
            self.limit = max(spec.min_limit, min(self.limit, inflight) * spec.decrease)
            self.last_action = "cut_yield"
        elif saturated and inflight > self.limit:
            self.last_action = "hold"  # the last cut has not drained yet (see PoolLimit.update)
        elif saturated:
            self.limit = max(spec.min_limit, self.limit * spec.decrease)
            self.last_action = "cut_saturated"
        elif slow:
            if lower_excess > 0 and lower_excess >= min(self.limit, inflight) * (1 - spec.decrease):
                self.last_action = "ask_yield"
            else:
                self.limit = max(spec.min_limit, self.limit * spec.decrease)
                self.last_action = "cut_latency"
            # Judge what follows on its own requests: the slow ones still in the window made it cut once per
            # interval for a whole window (12 to 2 in 10 s, issue 20 (1)).
            self.window.clear()
            self._cut_at = now
        elif enough and binding and p95 < spec.raise_below * self.slo_s:
            self.limit = min(spec.max_limit, self.limit + spec.increase)
            self.last_action = "raise"
        elif not enough and binding and not saturated and self._no_slow_sample(now):
            self.limit = min(spec.max_limit, self.limit + spec.increase)
            self.last_action = "probe"
        elif enough and binding and not saturated and self._calm(p95) \
                and now - self._recovered_at >= RECOVER_WINDOWS * spec.window_s:
            self.limit = min(spec.max_limit, self.limit + spec.increase)
            self._recovered_at = now
            self.last_action = "recover"
        else:
            self.last_action = "hold"
        return int(self.limit)

    def _calm(self, p95: float) -> bool:
        """The p95 is what this mix costs without load (within LOAD_TOLERANCE): a lower cap would not make it
        faster, only refuse."""
        return self.calm_p95 is not None and p95 <= LOAD_TOLERANCE * self.calm_p95

    def _no_slow_sample(self, now: float) -> bool:
        """At least half the samples a raise needs, and the slowest under the raise threshold: no evidence of
        overload. (One or two fast completions say little: a probe on them pushed the replica-removed what-if
        over its SLO.)"""
        return (2 * self.window.count(now) >= self.spec.min_samples
                and self.window.quantile(now, 1.0) < self.spec.raise_below * self.slo_s)
