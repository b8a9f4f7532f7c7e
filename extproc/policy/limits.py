"""Per-class slots, bounded FIFO deadline queues, and the tickets and waiters they hand out."""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from typing import Any, Callable

from .schema import ClassSpec


class Outcome(enum.Enum):
    """How an admitted request ended; every ticket is closed with exactly one."""

    OK = "ok"                          # response completed with a status below 500
    UPSTREAM_ERROR = "upstream_error"  # 5xx from upstream or Envoy (reset, timeout, no healthy host)
    CLIENT_ABORT = "client_abort"      # the client went away before the response ended
    LEASE_EXPIRED = "lease_expired"    # never seen to end; freed by the safety net


_ticket_ids = itertools.count(1)


class Ticket:
    """An admitted request's hold on a class slot. Closed exactly once via AdmissionController.finish."""

    __slots__ = ("id", "limiter", "tenant", "admitted_at", "lease_until", "cost", "closed", "waited_s", "status")

    def __init__(self, limiter: ClassLimiter, tenant: str, now: float, lease_s: float, cost: float,
                 waited_s: float):
        self.id = next(_ticket_ids)
        self.limiter = limiter          # the limiter it was admitted under, kept across policy reloads
        self.tenant = tenant
        self.admitted_at = now
        self.lease_until = now + lease_s
        self.cost = cost
        self.closed = False
        self.waited_s = waited_s
        self.status = 0                 # upstream HTTP status once response headers are seen

    @property
    def cls(self) -> str:
        return self.limiter.name


class Waiter:
    """A request waiting in a class queue. Its result (a Decision) is set exactly once."""

    __slots__ = ("limiter", "tenant", "enqueued_at", "deadline", "cost", "result", "on_result", "context")

    def __init__(self, limiter: ClassLimiter, tenant: str, now: float, cost: float, context: Any):
        self.limiter = limiter
        self.tenant = tenant
        self.enqueued_at = now
        self.deadline = now + limiter.spec.max_wait_ms / 1000.0
        self.cost = cost
        self.result: Any = None
        self.on_result: Callable[[Any], None] | None = None  # set by the adapter (e.g. a future's set_result)
        self.context = context          # whatever the caller needs back with the result (the request facts)

    @property
    def pending(self) -> bool:
        return self.result is None


class DrainRate:
    """Completions per second, as an exponentially weighted rate (for Retry-After estimates)."""

    __slots__ = ("half_life_s", "_rate", "_last")

    def __init__(self, half_life_s: float = 10.0):
        self.half_life_s = half_life_s
        self._rate = 0.0
        self._last: float | None = None

    def record(self, now: float, n: float = 1.0) -> None:
        if self._last is None:
            self._last = now
            return
        dt = max(now - self._last, 1e-6)
        alpha = 1.0 - math.exp(-dt * math.log(2) / self.half_life_s)
        self._rate += alpha * (n / dt - self._rate)
        self._last = now

    def rate(self, now: float) -> float:
        """The rate, decayed for the time since the last completion (a stalled class drains slowly)."""
        if self._last is None:
            return 0.0
        idle = max(now - self._last, 0.0)
        return self._rate * math.exp(-idle * math.log(2) / self.half_life_s)


class ClassLimiter:
    """One class's slots and its bounded FIFO queue. Counts only; the decisions live in admission."""

    __slots__ = ("name", "spec", "limit", "inflight", "inflight_cost", "queue", "drain")

    def __init__(self, name: str, spec: ClassSpec):
        self.name = name
        self.spec = spec
        self.limit = spec.max_concurrency
        self.inflight = 0
        self.inflight_cost = 0.0
        self.queue: deque[Waiter] = deque()
        self.drain = DrainRate()

    def reconfigure(self, spec: ClassSpec) -> None:
        """New caps apply to new decisions; slots already held stay held until released."""
        self.spec = spec
        self.limit = spec.max_concurrency

    @property
    def saturated(self) -> bool:
        return self.inflight >= self.limit

    def has_room(self) -> bool:
        return self.inflight < self.limit

    def queue_has_room(self) -> bool:
        return self.spec.max_wait_ms > 0 and len(self.queue) < self.spec.max_queue

    def take(self, cost: float) -> None:
        self.inflight += 1
        self.inflight_cost += cost

    def give_back(self, cost: float, now: float) -> None:
        self.inflight -= 1
        self.inflight_cost -= cost
        self.drain.record(now)

    def retry_after_s(self, now: float, ceiling: int) -> int:
        """Whole seconds until this class has likely drained the queue ahead of a new arrival (>= 1)."""
        rate = self.drain.rate(now)
        if rate <= 0.0:
            return 1
        return max(1, min(ceiling, math.ceil((len(self.queue) + 1) / rate)))
