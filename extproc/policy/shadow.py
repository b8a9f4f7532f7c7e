"""Shadow mode, around enforcement: every decision is made and counted as enforce mode would, nothing is refused.

Enforce-mode state stays exact for what enforce would admit: a refused request runs without a slot; a request
enforce would queue runs at once while a virtual place in the queue plays out, and takes the slot the queue
gives it (or is counted as refused there) without the client noticing.
"""

from __future__ import annotations

from .classify import Classification
from .decision import ACCEPT, DEGRADE, QUEUE, Admit, Charge, Decision, Queued
from .limits import ClassLimiter, Ticket, Waiter
from .reasons import R_DEQUEUED, R_ENDED_WHILE_QUEUED, R_SHADOW


class ShadowMode:
    """Hooks the controller calls at the four points where shadow mode differs from enforce mode."""

    def __init__(self, core):
        self.core = core
        self.everything = False                 # policy `mode: shadow`; else per class (`classes.<name>.shadow`)
        self.running: dict[int, Ticket] = {}    # id(waiter) -> the request already running in its place
        self.places: dict[int, Waiter] = {}     # ticket id -> its virtual place in a queue

    def configure(self, policy) -> None:
        self.everything = policy.mode == "shadow"

    def covers(self, lim: ClassLimiter) -> bool:
        return self.everything or lim.spec.shadow

    def pass_through(self, d: Decision, lim: ClassLimiter, c: Classification, cluster: str, now: float,
                     charge: Charge) -> Decision:
        """Count what enforce decided, then let the request through to its own pool."""
        core = self.core
        if d.kind == ACCEPT:
            return core._emit(d)
        ticket = d.ticket if d.kind == DEGRADE and d.ticket is not None else None
        if ticket is None:
            ticket = Ticket(lim, c.tenant, cluster, now, core._lease_s, 0.0, 0.0, holds_slot=False)
            ticket.charge = charge  # learns from usage like any request; charges nobody's budget
            core.tickets[ticket.id] = ticket
        ticket.pool = cluster
        ticket.degraded = False  # it runs on its own pool, so its outcome speaks for that pool's breakers
        if d.kind == QUEUE:
            self.running[id(d.waiter)] = ticket
            self.places[ticket.id] = d.waiter
        else:
            core.events.shadow(c.cls, d.kind, d.reason)
        passed = Admit(R_SHADOW, c.cls, c.tenant, ticket, cluster=cluster, classification=c)
        passed.shadow_would = d
        passed.headers = d.headers
        passed.charge = charge
        return core._emit(passed)

    def grant(self, w: Waiter, lim: ClassLimiter, waited_s: float, now: float) -> bool:
        """The queue reached a virtual place: the running request now holds the slot enforce gives it."""
        t = self.running.pop(id(w), None)
        if t is None:
            return False
        self.places.pop(t.id, None)
        t.cost, t.holds_slot, t.flow = w.cost, True, w.flow
        self.core.hold(t, lim, w.cost, now, w.gate, w.units)
        self.core.shed_below(lim, now)  # as enforce's grant does (_admit): the lower queues it sheds go
        w.result = Admit(R_DEQUEUED, lim.name, w.tenant, t, waited_s=waited_s)
        self.core.events.shadow(lim.name, ACCEPT, R_DEQUEUED)
        return True

    def resolved(self, w: Waiter, d: Decision) -> bool:
        """A virtual place got its verdict (shed, timed out...): count it; the request runs on regardless."""
        t = self.running.pop(id(w), None)
        if t is None:
            return False
        self.places.pop(t.id, None)
        if d.ticket is not None:
            self._hand_over(d.ticket, t)
        self.core.events.shadow(d.cls, d.kind, d.reason)
        return True

    def _hand_over(self, held: Ticket, t: Ticket) -> None:
        """The place's overflow took a degraded slot (on_overflow: fallback): the request already running in its
        place holds it, as a degrade at arrival does (pass_through), and gives it back when it ends. Nobody
        would ever finish `held` itself: its slot stayed taken until the lease ran out."""
        self.core.tickets.pop(held.id, None)
        held.closed = True
        t.limiter, t.cost, t.holds_slot, t.flow = held.limiter, held.cost, True, held.flow
        t.gate, t.units, t.rank, t.rest = held.gate, held.units, held.rank, held.rest

    def ended(self, ticket: Ticket) -> None:
        """The request ended while enforce mode would still have had it queued: its place goes too."""
        w = self.places.pop(ticket.id, None)
        if w is None or not w.pending:
            return
        self.running.pop(id(w), None)
        w.limiter.queue.remove(w)
        self.core._dequeue(w)
        self.core.charging.refund(w.charge)  # never admitted, as a waiter whose client left: it held no slot
        w.result = Queued(R_ENDED_WHILE_QUEUED, w.limiter.name, ticket.tenant, w)
        self.core.events.shadow(w.limiter.name, QUEUE, R_ENDED_WHILE_QUEUED)
