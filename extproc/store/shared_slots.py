"""The adapter's side of a shared store: global slots for admitted requests, local FIFO waits, fallback."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from typing import Protocol

from ..policy.admission import AdmissionController, Decision
from ..policy.reasons import R_CLASS_REMOVED, R_CLIENT_GONE, R_QUEUE_FULL, R_QUEUE_TIMEOUT, R_STORE_UNAVAILABLE, say
from ..policy.limits import Ticket
from ..policy.schema import Policy
from ..policy.slot_store import SlotClaim, SlotStore, StoreUnavailable, local_share, share_has_room

log = logging.getLogger("extproc.store")

SHARED, LOCAL, CLOSED = "shared", "local", "closed"  # store states (extproc_store_state{state})
STORE_STATES = (SHARED, LOCAL, CLOSED)
_CLOSED = object()  # a waiter's result when the store failed while it waited and the policy fails closed
_REMOVED = object()  # ... when a reload removed its class
_REVOKED = object()  # ... when the policy takes keys only (anonymous.allow false): it is anonymous, or a reload
# removed its tenant


class _Waiting:
    __slots__ = ("ticket", "claim", "future")

    def __init__(self, ticket: Ticket, claim: SlotClaim, future: asyncio.Future):
        self.ticket = ticket
        self.claim = claim
        self.future = future


class StoreEvents(Protocol):
    """What the store adapter tells the outside world (telemetry implements it). Must be cheap and never raise."""

    def store_state(self, state: str, switched: bool) -> None: ...  # once at start, then after every switch
    def store_leases_lost(self, count: int) -> None: ...


class NoStoreEvents:
    def store_state(self, state: str, switched: bool) -> None:
        pass

    def store_leases_lost(self, count: int) -> None:
        pass


class SharedSlots:
    """Confirms the core's admissions with a global slot from `store`, or refuses them after the class's wait.

    Waiters queue per class in FIFO order on this replica; the head retries when any replica announces a release,
    and at least every `poll_ms`. While the store is unreachable the policy's `on_failure` applies: `local` runs
    the replica on its share of each cap from the first moment (requests already running count against it, and
    waiters keep their place in the FIFO for a share slot until their deadline), `closed` refuses with 503. Each
    second tick() renews every held lease in one round trip, or probes the store and switches back when it answers.
    """

    def __init__(self, core: AdmissionController, store: SlotStore, events: StoreEvents | None = None,
                 workers: int = 1):
        self.core = core
        self.events: StoreEvents = events or NoStoreEvents()
        self.store = store
        spec = core.policy.store
        self.on_failure = spec.on_failure
        # The share is per process: each worker of a `serve --workers N` replica admits on its own while the
        # store is away (the host table is not used with Redis), so `instances` replicas run instances x N shares.
        self.instances = spec.instances * workers
        self.poll_s = spec.poll_ms / 1000.0
        self.replica = uuid.uuid4().hex[:12]   # holder ids are "<replica>:<ticket id>", unique across replicas
        self.policy = core.policy              # as written; the core runs local_share() of it while failing open
        self.state = SHARED
        self.held: dict[int, SlotClaim] = {}       # ticket id -> its global slot
        self.unshared: dict[int, SlotClaim] = {}   # admitted while the store was away; adopted when it is back
        self._waiting: dict[str, deque[_Waiting]] = {}
        self._released: dict[str, asyncio.Event] = {}
        self._pumps: dict[str, asyncio.Task] = {}
        self._to_release: list[SlotClaim] = []
        # Releases the store did not take (it stalled or went away as they were sent):
        # sent again before anything else once it answers, or a class would stay full of finished requests on an
        # idle fleet until their leases ran out.
        self._unreleased: list[SlotClaim] = []
        # Ticket ids of unshared requests whose adoption is on its way or failed: it may have gone through with only
        # its answer lost, so the store may count them, and their end is released like a global slot's.
        self._maybe_adopted: set[int] = set()
        self._releaser: asyncio.Task | None = None
        core.gate_on_store(store.shared)
        store.on_release(self._wake)
        self.events.store_state(self.state, switched=False)

    # --- policy ---

    def apply(self, policy: Policy) -> None:
        """Install a policy: as written while the store is shared, the replica's share while failing open."""
        self.policy = policy
        before = set(self.core.limiters)
        self.core.apply(local_share(policy, self.instances) if self.state == LOCAL else policy)
        for cls in before.difference(self.core.limiters):
            self.store.forget(cls)
        # Waiters of a class the reload removed are refused, as its local queue is (they would run later under
        # no class), and so are those it revoked under keys only (anonymous, or a removed tenant's); the others
        # ask with the new cap at their next attempt (_serve_queue refreshes the claim).
        for cls, q in list(self._waiting.items()):
            removed = cls not in self.core.limiters
            for w in q:
                revoked = self.core.revoked(w.ticket.tenant)
                if (removed or revoked) and not w.future.done():
                    w.future.set_result(_REMOVED if removed else _REVOKED)
            if removed:
                self._forget(cls)
            else:
                self._wake(cls)

    def _forget(self, cls: str) -> None:
        """A removed class's queue and wake-up go once no pump serves them (else its pump does this as it ends,
        having handed out the refusals): kept, each class a reload ever removed held its entries for the process's
        life. Its requests still running release by (class, holder) and look them up without making them again."""
        if cls not in self._pumps and cls not in self.core.limiters:
            self._waiting.pop(cls, None)
            self._released.pop(cls, None)

    # --- admission ---

    def claim(self, ticket: Ticket) -> SlotClaim:
        lim = ticket.limiter
        return SlotClaim(lim.name, f"{self.replica}:{ticket.id}", ticket.cost, lim.limit,
                         lim.spec.max_inflight_gpu_seconds)

    @staticmethod
    def deadline(ticket: Ticket) -> float:
        """When the request's wait ends: its arrival plus the class's max_wait_ms or its own shorter deadline,
        queueing included."""
        return ticket.wait_until

    async def try_now(self, d: Decision) -> Decision | None:
        """One attempt (a single round trip): the final decision, or None when the request has to wait()."""
        if self.state == CLOSED:
            return self._closed(d)
        t = d.ticket
        claim = self.claim(t)
        if not self._waiting.get(claim.cls):  # nobody here waits ahead of it
            try:
                granted = await self._take(t, claim)
            except asyncio.CancelledError:
                self._release_soon(claim)
                raise
            if granted:
                return self._confirm(d)
            if self.state == CLOSED:  # the store failed during the attempt
                return self._closed(d)
        if self.deadline(t) <= self.core.clock():
            return self.core.revoke(d, R_QUEUE_FULL, say(R_QUEUE_FULL, cls=claim.cls, detail=f"{claim.cap} slots "
                                                         "across the replicas sharing it, no queue"))
        return None

    async def wait(self, d: Decision) -> Decision:
        """Wait in this replica's FIFO for a global slot until the class's deadline; then 429 like a queue. While
        it waits the request counts as queued, not in flight (core.await_store)."""
        if self.state == CLOSED:  # failed closed since try_now(): nothing would ask the store for its slot
            return self._closed(d)
        t = d.ticket
        claim = self.claim(t)
        if claim.cls not in self.core.limiters:  # a reload removed its class since try_now(), refusing its waiters
            return self.core.revoke(d, R_CLASS_REMOVED, say(R_CLASS_REMOVED, cls=claim.cls))
        started = self.core.clock()
        self.core.await_store(d)
        w = _Waiting(t, claim, asyncio.get_running_loop().create_future())
        self._waiting.setdefault(claim.cls, deque()).append(w)
        self._pump(claim.cls)
        try:
            # Not wait_for, which on Python 3.11 loses a cancel that lands in the turn the slot is handed over
            # (FinalAdmission._queue_verdict): the client's leaving goes on, and give_back() frees the slot.
            async with asyncio.timeout(max(self.deadline(t) - self.core.clock(), 0.0)):
                await w.future
        except asyncio.CancelledError:
            self._left_head(claim.cls, w)
            raise
        except TimeoutError:
            if w.future.cancelled():  # else the slot came in the turn the deadline passed: it is granted
                # Told the wait it had (its class queue's and this one), not the class's max_wait_ms: a request's
                # own shorter deadline ends it sooner.
                waited_ms = round(t.waited_by(self.core.clock()) * 1000.0)
                return self.core.revoke(d, R_QUEUE_TIMEOUT, say(R_QUEUE_TIMEOUT, cls=claim.cls,
                                                                where=" across the replicas sharing it",
                                                                max_wait_ms=waited_ms))
        result = w.future.result()
        if result is _CLOSED:
            return self._closed(d)
        if result is _REMOVED:
            return self.core.revoke(d, R_CLASS_REMOVED, say(R_CLASS_REMOVED, cls=claim.cls))
        if result is _REVOKED:  # the 401 it now gets at arrival (AdmissionController._refuse_revoked)
            reason = self.core.revoked_reason(d.classification)
            return self.core.revoke(d, reason, say(reason))
        return self._confirm(d, self.core.clock() - started)

    def _confirm(self, d: Decision, waited_s: float = 0.0) -> Decision:
        """The core's confirmation of a granted slot; a refusal instead (its lease ran out while it waited) gives
        the global slot back: no stream would release it, and tick() renewed it forever."""
        out = self.core.confirm(d, waited_s)
        if out.ticket is not d.ticket:
            self.release(d.ticket)
        return out

    def abandon(self, d: Decision) -> None:
        """The client left while its admission waited on the store: give back whatever it got."""
        self.release(d.ticket)
        self.core.revoke(d, R_CLIENT_GONE, say(R_CLIENT_GONE, waiting="waiting for a slot"))

    def _closed(self, d: Decision) -> Decision:
        return self.core.revoke(d, R_STORE_UNAVAILABLE, say(R_STORE_UNAVAILABLE))

    async def _take(self, ticket: Ticket, claim: SlotClaim) -> bool:
        """One attempt at a slot for an admitted request: a global one while the store answers, else (failing
        open) a place within this replica's share. True: it holds one and may run."""
        if self.state == SHARED:
            try:
                granted = await self.store.acquire(claim)
            except StoreUnavailable as e:
                self._release_soon(claim)  # the call may have gone through before it timed out
                self._fail(e)
            else:
                if granted:
                    self.held[ticket.id] = claim
                return granted
        if self.state == LOCAL and self._share_has_room(ticket, claim):
            self.unshared[ticket.id] = claim
            return True
        return False

    def _share_has_room(self, ticket: Ticket, claim: SlotClaim) -> bool:
        """While failing open: the class's local cap is this replica's share (local_share), and every request
        running here counts against it, those that got a global slot before the outage included. Requests that
        only hold a local place while they wait for a slot do not run, so they do not count."""
        running = [c for c in itertools.chain(self.held.values(), self.unshared.values()) if c.cls == claim.cls]
        lim = ticket.limiter
        return share_has_room(running, claim, lim.limit, lim.spec.max_inflight_gpu_seconds)

    # --- release ---

    def release(self, ticket: Ticket) -> None:
        """The ticket ended: free its global slot (one round trip, in the background). Idempotent."""
        held = self.held.pop(ticket.id, None)
        claim = held or self.unshared.pop(ticket.id, None)
        if claim is None:
            return
        maybe_adopted = ticket.id in self._maybe_adopted
        self._maybe_adopted.discard(ticket.id)
        if held is not None or self.state == SHARED or maybe_adopted:
            self._release_soon(claim)
        if self.state != SHARED:
            self._wake(claim.cls)  # a share slot is free: the next waiter here may take it

    def _release_soon(self, claim: SlotClaim) -> None:
        """Queue a release; one call at a time carries every release queued meanwhile (one round trip for a
        batch), so releases never pile up ahead of acquires under load."""
        self._to_release.append(claim)
        if self._releaser is None:
            self._releaser = asyncio.get_running_loop().create_task(self._release_queued())

    async def _release_queued(self) -> None:
        try:
            while self._to_release:
                batch, self._to_release = self._to_release, []
                try:
                    await self._send_releases(batch)
                except StoreUnavailable as e:
                    self._unreleased.extend(batch)
                    self._fail(e)
        finally:
            self._releaser = None

    async def _release_again(self) -> None:
        """Send the releases the store did not take, old ones too: a call that timed out may still reach the store
        later (held by TCP through a partition, queued in a stalled Redis) and take its slot with a fresh lease.
        The list is sent whole at the first answer, so it never holds more than one outage's releases."""
        if not self._unreleased:
            return
        pending, self._unreleased = self._unreleased, []
        try:
            await self._send_releases(pending)
        except StoreUnavailable:
            self._unreleased = pending + self._unreleased
            raise

    async def _send_releases(self, claims: list[SlotClaim]) -> None:
        """One call for their global slots, then the waiters of their classes here look again."""
        await self.store.release([(c.cls, c.holder) for c in claims])
        for cls in {c.cls for c in claims}:
            self._wake(cls)

    # --- waiting ---

    def _wake(self, cls: str) -> None:
        ev = self._released.get(cls)
        if ev is not None:
            ev.set()

    def _left_head(self, cls: str, w: _Waiting) -> None:
        """A waiter whose client left: at the head, the next one looks at once (one that fits the room the head
        was too large for waited up to poll_ms), as the core's queue hands a leaving client's room on. A head
        that timed out does not, as in the core: the next release does (docs/overload.md)."""
        q = self._waiting.get(cls)
        if q and q[0] is w:
            self._wake(cls)

    def _pump(self, cls: str) -> None:
        if cls not in self._pumps:
            self._pumps[cls] = asyncio.get_running_loop().create_task(self._serve_queue(cls))

    async def _serve_queue(self, cls: str) -> None:
        """Hand slots to this class's waiters in arrival order (global ones, or share slots while failing open),
        retrying on releases and every poll_ms."""
        q = self._waiting[cls]
        ev = self._released.setdefault(cls, asyncio.Event())
        try:
            while q:
                w = q[0]
                if w.future.done():  # timed out, its client left, or the store failed closed
                    q.popleft()
                    continue
                ev.clear()
                w.claim = self.claim(w.ticket)  # the cap now: a reload may have changed it while it waited
                if await self._take(w.ticket, w.claim):
                    if q and q[0] is w:
                        q.popleft()
                    if w.future.done():
                        self.release(w.ticket)  # it gave up while the attempt was on its way
                    else:
                        w.future.set_result(True)
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ev.wait(), self.poll_s)
        finally:
            del self._pumps[cls]
            self._forget(cls)

    # --- health ---

    def _fail(self, error: Exception) -> None:
        if self.state != SHARED:
            return
        self._switch(self.on_failure, f"slot store unreachable ({error}); "
                     + ("admitting on this replica's share of each cap (1/%d)" % self.instances
                        if self.on_failure == LOCAL else "refusing requests that need a slot (503)"))
        if self.on_failure == LOCAL:
            # Waiters keep their place and now wait for a share slot: admitting them all at once would put up to
            # the whole cap in flight from this replica alone.
            for cls in self._waiting:
                self._wake(cls)
            return
        for q in self._waiting.values():
            for w in q:
                if not w.future.done():
                    w.future.set_result(_CLOSED)
            q.clear()

    def _switch(self, state: str, why: str) -> None:
        self.state = state
        self.events.store_state(state, switched=True)
        log.warning("store state -> %s: %s", state, why)
        self.apply(self.policy)

    async def tick(self) -> None:
        """Every second: renew held leases and adopt unshared ones, or probe a store that was away."""
        if self.state != SHARED:
            try:
                await self.store.ping()
                await self._release_again()
            except StoreUnavailable:
                return
            self._switch(SHARED, "slot store answers again; caps are shared")
        try:
            await self._release_again()
            if not self.held and not self.unshared:
                await self.store.ping()  # nothing to renew: still notice an outage before a request does
            lost = await self.store.renew([(c.cls, c.holder) for c in self.held.values()])
            # A request that ended during the round trip gave its slot back (release() dropped it from `held`):
            # its lease is not lost, and there is nothing to adopt for it.
            by_holder = {c.holder: tid for tid, c in self.held.items()}
            lost = [holder for _, holder in lost if holder in by_holder]
            if lost:
                self.events.store_leases_lost(len(lost))
                log.warning("%d global slots expired before their renewal; adopting them again", len(lost))
                for holder in lost:
                    tid = by_holder[holder]
                    self.unshared[tid] = self.held.pop(tid)
            if self.unshared:
                adopted = dict(self.unshared)
                self._maybe_adopted.update(adopted)  # until the store answers, it may count them
                await self.store.adopt(list(adopted.values()))
                self._maybe_adopted.difference_update(adopted)
                for tid, c in adopted.items():
                    if self.unshared.pop(tid, None) is not None:
                        self.held[tid] = c
                    else:
                        self._release_soon(c)  # ended while it was being adopted
        except StoreUnavailable as e:
            self._fail(e)

    async def start(self) -> None:
        """Subscribe to releases; start on the fallback if the store does not answer yet."""
        await self.store.start()
        try:
            await self.store.ping()
        except StoreUnavailable as e:
            self._fail(e)

    async def close(self) -> None:
        if self._releaser is not None:
            await asyncio.wait([self._releaser], timeout=1.0)
        for task in self._pumps.values():
            task.cancel()
        await self.store.close()
