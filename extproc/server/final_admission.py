"""The final admission a request waits for: its class queue's verdict, then the shared store's global slot."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, Callable

from ..policy.admission import AdmissionController, Decision, Queued
from ..policy.reasons import R_CLIENT_GONE, say
from ..store.shared_slots import SharedSlots


class FinalAdmission:
    """A decision that is not final yet, awaited once with settle(), or given back with give_back().

    Two waits, in this order, either or both: a place in the class's local queue (the core's Waiter; its verdict
    may be an admission that the store must still confirm), and an admission gated on a global slot from the
    shared store (`core.gated(d)`). At any moment it holds exactly one of them, or nothing once settled.
    """

    __slots__ = ("core", "shared", "waiter", "gated", "queued", "_verdict")

    def __init__(self, core: AdmissionController, shared: SharedSlots | None, d: Decision):
        self.core = core
        self.shared = shared
        self.queued = type(d) is Queued    # it waited in a class queue (the answer then says how long)
        self.waiter = d.waiter if self.queued else None
        self.gated = None if self.queued else d
        self._verdict: asyncio.Future | None = None
        if self.waiter is not None:
            # The core's hook for the queue's verdict, set before anything can await: a verdict that came
            # while the override was being written would otherwise wait out the deadline unheard.
            self.waiter.notify(self._deliver)

    def _deliver(self, d: Decision) -> None:
        if self._verdict is not None and not self._verdict.done():
            self._verdict.set_result(d)

    async def settle(self, extend: Callable[[float], Awaitable[None]]) -> Decision:
        """The final decision. `extend(seconds)` is awaited once, before the first real wait, with the time
        left until the class's deadline (Envoy's message timeout must cover the wait)."""
        extended = False
        if self.waiter is not None:
            w = self.waiter
            # A gated verdict then waits for a global slot until this same deadline (SharedSlots.deadline): Envoy
            # takes one extension per message, and this one covers both waits.
            await extend(max(w.deadline - self.core.clock(), 0.0))
            extended = True
            d = await self._queue_verdict()
            if not self.core.gated(d):
                return d
            self.gated = d
        d = await self.shared.try_now(self.gated)
        if d is None:
            if not extended:
                await extend(max(self.shared.deadline(self.gated.ticket) - self.core.clock(), 0.0))
            d = await self.shared.wait(self.gated)
        self.gated = None
        return d

    async def _queue_verdict(self) -> Decision:
        w = self.waiter
        if w.pending:
            self._verdict = asyncio.get_running_loop().create_future()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result of a future that completed
            # in the loop turn its task was cancelled in, losing the cancel (python/cpython#86296; 3.12 rebuilt
            # wait_for on asyncio.timeout, python/cpython#98518). A grant in the turn the client left would be
            # forwarded for a client that is gone; here the cancel goes on, and the stream's end gives the grant
            # back (give_back) as it does any grant that came in the instant the client left.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(w.deadline - self.core.clock(), 0.0)):
                    await self._verdict
        return self._leave_queue(timed_out=True)  # no effect when the queue has already answered

    def _leave_queue(self, timed_out: bool) -> Decision:
        """The queue's verdict: the one it gave, or (still pending) a timeout or client-gone verdict now."""
        w, self.waiter = self.waiter, None
        return self.core.abandon(w, timed_out=timed_out) or w.result

    def give_back(self) -> None:
        """The client left while waiting (or the stream failed): leave the queue or the store's wait. A verdict the
        queue gave in that same instant, before the stream took it, never went upstream: a slot it granted (or a
        fallback's degraded one) is revoked, and the request counted as a client that left while queued (499,
        client_disconnected), as a moment earlier. The core counts admissions when forwarded (count_on_forward,
        which Processor sets), so that grant was never counted: closed as a client abort, it was an admission of a
        request that never ran (a drain-rate completion, its tenant charged, a report awaited that never comes)."""
        if self.waiter is not None:
            d = self._leave_queue(timed_out=False)
            if d.ticket is None:
                return
            if not self.core.gated(d):
                self.core.revoke(d, R_CLIENT_GONE, say(R_CLIENT_GONE, waiting="queued"))
                return
            self.gated = d  # granted in the same instant, before its global slot
        if self.gated is not None:
            self.shared.abandon(self.gated)
            self.gated = None
