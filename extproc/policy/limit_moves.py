"""Time passing: each class's limit, then each pool-wide limit, moved by its own controller at AdmissionController's
tick, with the replicas' saturation readings they heed and the order in which classes give way.

Per-class limits without a pool-wide limit keep issue 19's order themselves: where a class misses its latency SLO
(it asked the lower classes to yield, cut itself, or its latency breaker is not closed), the classes below it on
that pool yield first, each at its own next move. A pool-wide limit orders its classes itself (pool.py).
"""

from __future__ import annotations

from typing import Callable

from .adaptive import PoolSaturation
from .breakers import CLOSED, LatencyBreaker
from .decision import AdmissionEvents
from .limits import ClassLimiter
from .state import PolicyState

# A pool's saturation reading not refreshed for this many `stale_ms` is ignored (LimitMoves.pool_reading).
STALE_READINGS = 3


class LimitMoves:
    """The limits' moves. `saturation` is the controller's pool -> last reading map (its scrapers set it)."""

    def __init__(self, state: PolicyState, events: AdmissionEvents, saturation: dict[str, PoolSaturation]):
        self.state = state
        self.events = events
        self.saturation = saturation
        # Ungated pool -> the highest class (rank) that asked the classes below it there to yield at the next tick:
        # by pool alone, an ask made between ticks read as the first class's, and the classes between it and the
        # one that asked (the asker included) yielded too.
        self.yield_asked: dict[str, int] = {}

    def tick(self, now: float, grant: Callable[[ClassLimiter, float], None]) -> None:
        """Move every limit whose interval has passed; `grant` hands the room of a raised limit to waiters (at
        once, before the next class's limit moves, as a release would)."""
        struggling: set[str] = set()  # pools where a class above the one being moved misses its latency SLO
        for lim in self.state.ranked:
            yielding = bool(struggling) and not lim.pools.isdisjoint(struggling)
            controller = lim.controller
            excess = self.lower_excess(lim, lim.pools)
            new = controller.update(now, lim.inflight, self._class_saturation(lim, now), yielding, excess)
            # Its latest move found it slow (it asked, or cut itself): until its next move, the classes below that
            # are over their floors are asked to yield, each at its own next move (_yield_due).
            if excess and getattr(controller, "last_action", None) in ("ask_yield", "cut_latency"):
                self.ask_yield(lim.pools, lim.rank)
            struggling |= self._struggling_pools(lim, now)
            if new != lim.limit:
                raised = new > lim.limit
                lim.limit = lim.queue.capacity = new
                if raised:
                    grant(lim, now)
        self.yield_asked.clear()
        raised = False
        for gate in self.state.gates.values():
            before = gate.limit
            raised = gate.update(now, self.pool_reading(gate.name, now)) or raised
            if gate.limit != before:
                self.events.pool_limit_moved(gate.name, gate.controller.last_action, before, gate.limit,
                                             gate.controller.sized_on, gate.inflight - gate.stuck)
        if raised:
            grant(self.state.ranked[0], now)

    def ask_yield(self, pools, rank: int) -> None:
        """The classes below `rank` on these pools (those without a pool-wide limit) yield at the next tick."""
        for pool in self._ungated(pools):
            self.yield_asked[pool] = min(rank, self.yield_asked.get(pool, rank))

    def pending_asks(self) -> dict[str, str]:
        """Pool -> the class whose ask to yield there waits for the next tick (by name: a reload may re-rank it)."""
        return {pool: self.state.ranked[rank].name for pool, rank in self.yield_asked.items()}

    def restore_asks(self, asks: dict[str, str]) -> None:
        """After a reload: the asks of classes it kept stand, at their new ranks. Dropped, a breaker reset for the
        classes below to yield (or a latency ask) just before a reload left them at their caps (found by
        test_adaptive_model)."""
        limiters = self.state.limiters
        self.yield_asked = {pool: limiters[name].rank for pool, name in asks.items() if name in limiters}

    def lower_excess(self, lim: ClassLimiter, pools) -> float:
        """What the classes below `lim` hold over their floors, on those of these pools without a pool-wide
        limit (a lower class above its floor can still yield)."""
        pools = self._ungated(pools)
        if not pools:
            return 0.0
        return sum(max(0.0, low.inflight - low.controller.floor) for low in self.state.ranked[lim.rank + 1:]
                   if not low.pools.isdisjoint(pools))

    def pool_reading(self, pool: str, now: float) -> PoolSaturation | None:
        """The pool's last saturation reading; None (unknown: the limits go by latency alone) when the scraper has
        not refreshed it for STALE_READINGS times the pool's `stale_ms`. A replica that does not answer counts as
        saturated (the scraper's rule); a reading nobody refreshes means the scraper itself is stuck or gone,
        which says nothing about the replicas, and must not hold a limit on what they said minutes ago."""
        sat = self.saturation.get(pool)
        spec = self.state.policy.pools.get(pool)
        if sat is not None and spec is not None and now - sat.updated_at > STALE_READINGS * spec.stale_ms / 1000.0:
            return None
        return sat

    def load_reading(self, pool: str, now: float) -> PoolSaturation | None:
        """The pool's reading as the class caps take it: None (they go by latency alone, and a pool that serves
        nothing gives them none) while no replica is up to read (PoolSaturation.down). An outage is not load: the
        level learned before it is what the replicas take when they come back. (The pool-wide limit holds
        outright then: PoolGate.update.)"""
        sat = self.pool_reading(pool, now)
        return None if sat is not None and sat.down else sat

    def _ungated(self, pools) -> list[str]:
        gates = self.state.gates
        return [p for p in pools if not gates or p not in gates]

    def _struggling_pools(self, lim: ClassLimiter, now: float) -> set[str]:
        """The ungated pools where this class misses its latency SLO (it asks the lower classes to yield there, or
        its latency breaker is not closed): the per-class limits below it yield on those pools first, each at its
        next move. Yielding at every move for a whole window starved batch at 60% load (24 refusals)."""
        out = set()
        for pool in self._ungated(lim.pools):
            if self.yield_asked.get(pool, lim.rank + 1) <= lim.rank or any(
                    isinstance(b, LatencyBreaker) and b.poll(now) != CLOSED  # as time left it: idle, it closes
                    for b in self.state.breakers.get((lim.name, pool), ())):
                out.add(pool)
        return out

    def _class_saturation(self, lim: ClassLimiter, now: float) -> PoolSaturation | None:
        """The worst of the pools the class sends to: saturated if any of them is."""
        worst = None
        for pool in lim.pools:
            sat = self.load_reading(pool, now)
            if sat is not None and (worst is None or sat.saturated):
                worst = sat
        return worst
