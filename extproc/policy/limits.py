"""Per-class slots, bounded deadline queues (fairness.py), and the tickets and waiters they hand out."""

from __future__ import annotations

import enum
import itertools
import math
from typing import Any, Callable, Protocol

from .fairness import FairQueue
from .schema import ClassSpec


class Limit(Protocol):
    """A class's concurrency-limit algorithm, kept apart from the gate that enforces it (ClassLimiter): told how
    completed requests fared and how loaded the replicas are, it says the limit. Static caps, AIMD and any future
    algorithm are interchangeable behind this (AdmissionController's `limit_factory` picks one per class)."""

    limit: float  # the current limit
    floor: float  # the lowest it goes (a lower class above it can still yield to a higher one)

    def observe(self, now: float, latency_s: float, admitted_at: float | None = None) -> None: ...
    def update(self, now: float, inflight: int, saturation: Any, yielding: bool = False,
               lower_excess: float = 0.0) -> int: ...


class StaticLimit:
    """The policy's `max_concurrency`, as written."""

    __slots__ = ("limit",)

    def __init__(self, limit: int):
        self.limit = limit

    @property
    def floor(self) -> float:
        return self.limit  # a static cap does not move

    def observe(self, now: float, latency_s: float, admitted_at: float | None = None) -> None:
        pass

    def update(self, now: float, inflight: int, saturation: Any, yielding: bool = False,
               lower_excess: float = 0.0) -> int:
        return self.limit


LimitFactory = Callable[[ClassSpec], Limit]


def default_limit(spec: ClassSpec) -> Limit:
    """AIMD anchored to the class's SLO when `adaptive.enabled`, else the static cap."""
    if spec.adaptive.enabled:
        from .adaptive import AdaptiveLimit  # adaptive imports the breakers' windows; only adaptive classes need it

        return AdaptiveLimit(spec.adaptive, spec.slo_p95_ms / 1000.0, spec.max_concurrency)
    return StaticLimit(spec.max_concurrency)


class Outcome(enum.Enum):
    """How an admitted request ended; every ticket is reported with exactly one."""

    OK = "ok"                          # the response completed with a status below 500
    UPSTREAM_ERROR = "upstream_error"  # 5xx, upstream reset, connect failure or timeout
    CLIENT_ABORT = "client_abort"      # the client went away before the response completed
    LEASE_EXPIRED = "lease_expired"    # never seen to end; freed by the safety net
    # The ext_proc failed it after admitting it: its stream handler raised (extproc_stream_errors_total) with no
    # report to say how the request ended, or Envoy's report says Envoy failed it for the ext_proc (its stream
    # failed or answered past message_timeout, with failure_mode_allow: false). Neither the replica's nor the
    # client's: no breaker counts it.
    EXTPROC_ERROR = "ext_proc_error"
    # Envoy answered it itself, from its own configuration, without asking a replica: no such cluster (a model
    # routed to a cluster Envoy lacks), no route, a route's direct_response, a cluster in maintenance mode.
    # Neither the replicas' failure nor their service: no breaker counts it and no limit learns from it.
    NOT_ROUTED = "not_routed"
    # Only when no completion report arrives (Envoy's access log not configured): the gRPC stream closed after
    # the request was admitted, which Envoy does the same way for a normal end and a client abort.
    ENDED = "ended"


class Completion:
    """What the data plane reports about how an admitted request ended (Envoy's access log)."""

    __slots__ = ("outcome", "status", "first_byte_s", "total_s")

    def __init__(self, outcome: Outcome, status: int, first_byte_s: float | None, total_s: float | None):
        self.outcome = outcome
        self.status = status
        self.first_byte_s = first_byte_s  # request start to the first response byte sent to the client
        self.total_s = total_s            # request start to the last response byte sent to the client


_ticket_ids = itertools.count(1)


def wait_ends(limiter: ClassLimiter, arrival: float, wait_ms: float | None = None) -> float:
    """When a request's wait for a slot ends: its arrival plus the class's max wait, or its own deadline (`wait_ms`)
    if shorter: a request's own deadline may shorten the wait, never lengthen it."""
    max_wait_ms = limiter.spec.max_wait_ms
    return arrival + (max_wait_ms if wait_ms is None else min(wait_ms, max_wait_ms)) / 1000.0


class Ticket:
    """An admitted request's hold on a class slot. Closed exactly once via AdmissionController.finish."""

    __slots__ = ("id", "limiter", "cls", "tenant", "pool", "admitted_at", "lease_until", "cost", "closed", "waited_s",
                 "released_at", "stream_outcome", "completion", "trickle", "degraded", "holds_slot", "charge",
                 "usage", "gate", "units", "rank", "pool_stall", "flow", "queued", "awaiting_store", "rest", "fair_charge",
                 "wait_until", "fair_flow", "fair_stats", "fair_turn", "cohort", "answer_failed",
                 "stream_status")

    def __init__(self, limiter: ClassLimiter, tenant: str, pool: str, now: float, lease_s: float, cost: float,
                 waited_s: float, holds_slot: bool = True):
        self.id = next(_ticket_ids)
        self.limiter = limiter          # the limiter it was admitted under, kept across policy reloads
        self.cls = limiter.name
        self.tenant = tenant
        self.pool = pool                # the Envoy cluster it was sent to
        self.admitted_at = now
        self.lease_until = now + lease_s
        self.cost = cost
        self.closed = False
        self.waited_s = waited_s
        self.released_at = 0.0
        self.stream_outcome = Outcome.ENDED      # what the ext_proc stream saw, used if no report comes
        self.stream_status = 0                   # ... and the response status it read (0: none), likewise
        self.completion: Completion | None = None  # the data plane's report, if it arrived
        self.trickle = False            # a half-open breaker's probe
        self.degraded = False           # holds a slot of the class's degraded limiter, on a fallback pool
        self.holds_slot = holds_slot    # False for shadow-mode passes that enforce mode would not have admitted
        self.charge: Any = None         # the admission's Charge (estimate, tenant, session) to settle at the end
        self.usage: tuple[int, int] | None = None  # (prompt, completion) tokens, when the response was read
        # The replica failed the answer inside a 2xx (vLLM's error event in a stream it had begun), when read.
        self.answer_failed = False
        self.gate: Any = None           # the PoolGate it holds `units` of (a pool with a pool-wide limit)
        self.units = 0.0
        self.rank = 0                   # its class's rank when it took them
        self.pool_stall = 0             # the stall of its pool it took them in (PoolGate.take; 0: none)
        self.rest = 0.0                 # taken over its class's share: the class rests this long per second it ran
        self.cohort: Any = None         # the post-cut cohort its pool's limit counted it in (PoolLimit.admitted)
        self.flow = tenant              # the fairness key it counts against in its class's queue
        self.fair_charge = cost         # GPU-seconds its flow was charged (the estimate times the flow's scale)
        self.fair_flow: Any = None      # the flow charged (FairQueue.flow_of), which settles it
        self.fair_stats: Any = None     # the metric label's counters it was served under (FairQueue.stats_of)
        self.fair_turn = False          # its grant took its flow's round_robin turn (FairQueue.return_turn)
        self.queued = False             # counted as a queue entry: it waited in its class queue or for the store
        # It waits for the shared store's global slot (AdmissionController.await_store): its class slot is only
        # reserved, and it counts as queued, not in flight, until the store confirms or it is revoked.
        self.awaiting_store = False
        # When its wait for a slot ends, the shared store's included (as a Waiter's; admission sets the request's
        # own deadline where it has one).
        self.wait_until = wait_ends(limiter, now - waited_s)

    def waited_by(self, now: float) -> float:
        """What a request not yet confirmed (waiting on the shared store) has waited by `now`: its class queue's
        wait and the time since its class admitted it."""
        return self.waited_s + (now - self.admitted_at)


class Waiter:
    """A request waiting in a class queue. Its result (a Decision) is set exactly once."""

    __slots__ = ("limiter", "tenant", "pool", "trickle", "enqueued_at", "deadline", "cost", "result", "on_result",
                 "charge", "gate", "units", "flow", "classification")

    def __init__(self, limiter: ClassLimiter, tenant: str, pool: str, now: float, cost: float,
                 flow: str | None = None, wait_ms: float | None = None):
        self.limiter = limiter
        self.tenant = tenant
        self.flow = flow or tenant      # its fairness key (the tenant unless the class keys flows by header)
        self.pool = pool
        self.trickle = False
        self.enqueued_at = now
        self.deadline = wait_ends(limiter, now, wait_ms)
        self.cost = cost
        self.result: Any = None
        self.on_result: Callable[[Any], None] | None = None  # notify(): whoever waits for the verdict
        self.charge: Any = None
        self.gate: Any = None           # the PoolGate it waits for as well as its class (None: class only)
        self.units = 0.0
        self.classification: Any = None  # how decide() classified it: its final decision carries it (metrics)

    @property
    def pending(self) -> bool:
        return self.result is None

    def notify(self, callback: Callable[[Any], None]) -> None:
        """Call `callback` with the final decision when it comes (at once if it already has)."""
        if self.result is not None:
            callback(self.result)
        else:
            self.on_result = callback


def flow_key(waiter: Waiter) -> str:
    return waiter.flow


class DrainRate:
    """Completions per second of the time the class was busy (had requests in flight), over roughly the last
    `tau_s` busy seconds (exponentially decayed count). Idle time is left out: a class's pace is how fast it frees
    slots while it has some to free, and a rate diluted by a quiet minute predicted waits of seconds for a queue
    that drains in half of one, so early rejection refused requests it would have served (found by an audit)."""

    __slots__ = ("tau_s", "_count", "_first", "_last", "_idle_s", "_idle_since")

    def __init__(self, tau_s: float = 10.0):
        self.tau_s = tau_s
        self._count = 0.0
        self._first: float | None = None
        self._last = 0.0
        self._idle_s = 0.0                   # idle seconds so far (the busy clock is now less these)
        self._idle_since: float | None = None

    def idle(self, now: float) -> None:
        """Nothing in flight any more: the busy clock stops."""
        if self._idle_since is None:
            self._idle_since = now

    def busy(self, now: float) -> None:
        """A request in flight again: the busy clock goes on from where it stopped."""
        if self._idle_since is not None:
            self._idle_s += max(now - self._idle_since, 0.0)
            self._idle_since = None

    def _clock(self, now: float) -> float:
        return (now if self._idle_since is None else self._idle_since) - self._idle_s

    def record(self, now: float) -> None:
        t = self._clock(now)
        if self._first is None:
            self._first = t
        else:
            self._count *= math.exp(-(t - self._last) / self.tau_s)
        self._count += 1.0
        self._last = t

    def rate(self, now: float) -> float:
        """The decayed count over the decayed busy span it covers; a stalled class's rate falls towards 0."""
        if self._first is None:
            return 0.0
        t = self._clock(now)
        count = self._count * math.exp(-max(t - self._last, 0.0) / self.tau_s)
        # A steady rate r observed for `span` seconds leaves count = r * tau * (1 - exp(-span / tau)).
        span = max(t - self._first, 0.05)
        return count / (self.tau_s * (1.0 - math.exp(-span / self.tau_s)))


class ClassLimiter:
    """One class's slots and its bounded queue (FIFO unless the class has a fairness mode). Counts only; the
    decisions live in admission."""

    __slots__ = ("name", "spec", "limit", "inflight", "inflight_cost", "queue", "drain", "controller", "pools",
                 "rank", "reserved", "reserved_cost")

    def __init__(self, name: str, spec: ClassSpec):
        self.name = name
        self.spec = spec
        self.limit = spec.max_concurrency
        self.inflight = 0               # slots held, `reserved` ones included (the cap counts them all)
        self.inflight_cost = 0.0
        self.reserved = 0               # held for admissions waiting for the shared store's global slot: not running
        self.reserved_cost = 0.0
        self.queue = FairQueue("fifo", key=flow_key)  # policy state configures its mode, weights and clock
        self.drain = DrainRate()
        self.controller: Limit = StaticLimit(spec.max_concurrency)  # the algorithm that sets `limit`
        self.pools: set[str] = set()    # pools this class has sent requests to (whose saturation it heeds)
        self.rank = 0                   # its place in the policy's classes (0: highest priority)

    def reconfigure(self, spec: ClassSpec) -> bool:
        """New caps apply to new decisions; slots already held stay held until released. True when the limit
        algorithm must be rebuilt (an adaptive one whose knobs and SLO are unchanged keeps what it learned)."""
        # The SLO too: the adaptive cap is anchored to it (kept, a tightened SLO was judged against the old one).
        keep = spec.adaptive.enabled and spec.adaptive == self.spec.adaptive and spec.slo_p95_ms == self.spec.slo_p95_ms
        self.spec = spec
        return not keep

    def queue_wait_s(self, now: float, flow: str | None = None) -> float | None:
        """Predicted wait of a new arrival (of `flow`, in a fair queue): the queue ahead at the observed drain rate
        (None without data)."""
        rate = self.drain.rate(now)
        if rate <= 0.0:
            return None
        return ((len(self.queue) if flow is None else self.queue.ahead(flow)) + 1) / rate

    @property
    def saturated(self) -> bool:
        budget = self.spec.max_inflight_gpu_seconds
        return self.inflight >= self.limit or (budget is not None and self.inflight_cost >= budget)

    def has_room(self, cost: float = 0.0) -> bool:
        """A free slot, and room in the GPU-seconds budget for `cost` (when the class has one)."""
        if self.inflight >= self.limit:
            return False
        budget = self.spec.max_inflight_gpu_seconds
        return budget is None or self.inflight_cost + cost <= budget * (1 + 1e-9)

    def queue_has_room(self) -> bool:
        return self.spec.max_wait_ms > 0 and len(self.queue) < self.spec.max_queue

    def take(self, cost: float, now: float) -> None:
        if self.inflight == 0:
            self.drain.busy(now)
        self.inflight += 1
        self.inflight_cost += cost

    def untake(self, cost: float, now: float) -> None:
        """A slot given back by a request that never ran (its admission was revoked): no completion."""
        self.inflight -= 1
        self.inflight_cost -= cost
        if self.inflight == 0:
            self.inflight_cost = 0.0  # a float sum drifts: nothing held is exactly 0, not -8e-17
            self.drain.idle(now)

    def reserve(self, cost: float) -> None:
        """A held slot's admission waits for the shared store's global slot: it is queued, not running."""
        self.reserved += 1
        self.reserved_cost += cost

    def unreserve(self, cost: float) -> None:
        """The store answered (or the request left): the slot runs its request, or is about to be given back."""
        self.reserved -= 1
        self.reserved_cost = self.reserved_cost - cost if self.reserved else 0.0

    @property
    def running(self) -> int:
        """Requests admitted and running (holding a slot, not waiting for the shared store)."""
        return self.inflight - self.reserved

    @property
    def running_cost(self) -> float:
        """Estimated GPU-seconds of the running requests."""
        return self.inflight_cost - self.reserved_cost if self.running else 0.0

    @property
    def waiting(self) -> int:
        """Requests waiting: in the class queue, or holding a slot while they wait for the shared store."""
        return len(self.queue) + self.reserved

    def give_back(self, cost: float, now: float) -> None:
        self.inflight -= 1
        self.inflight_cost -= cost
        self.drain.record(now)
        if self.inflight == 0:
            self.drain.idle(now)

    def retry_after_s(self, now: float, ceiling: int) -> int:
        """Whole seconds until this class has likely drained the queue ahead of a new arrival (>= 1)."""
        rate = self.drain.rate(now)
        if rate <= 0.0:
            return 1
        return max(1, min(ceiling, math.ceil((len(self.queue) + 1) / rate)))
