"""What the two model-based walks of the shared slots have in common (test_shared_slots_model: instances over one
store; test_host_store_model: `serve --workers` over one host table): a virtual clock, the requests a walk sends,
a member (an instance or a worker) that serves them as the ext_proc's stream does, and the rules that end one and
make one's client leave."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import random
import selectors

from extproc.policy.admission import ACCEPT, AdmissionController, Queued, RequestFacts
from extproc.policy.limits import Outcome
from extproc.server.final_admission import FinalAdmission
from extproc.store.shared_slots import SharedSlots


class _Selector(selectors.DefaultSelector):
    """Never blocks: a wait for `timeout` moves the loop's clock on by it instead."""

    loop: VirtualTimeLoop

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("the loop would wait for ever: nothing scheduled (a hang)")
        self.loop.now += timeout
        return super().select(0)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, selector: selectors.BaseSelector | None = None):
        selector = selector or _Selector()
        super().__init__(selector)
        selector.loop = self
        self.now = 1000.0

    def time(self) -> float:
        return self.now


def run_virtual(coro, loop_factory=VirtualTimeLoop):
    loop = loop_factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def stacks(tasks) -> str:
    out = io.StringIO()
    for task in tasks:
        task.print_stack(limit=15, file=out)
    return out.getvalue()


@dataclasses.dataclass
class Request:
    member: Member
    cls: str
    arrived: float
    task: asyncio.Task | None = None
    decision: object = None
    answered_at: float | None = None
    ended: bool = False
    deadline_ms: float | None = None  # its own deadline (the policy's deadline header)
    stale: bool = False  # its stream is never renewed: the core's lease safety net reaps it
    wait_s: float = 0.0  # its class's max_wait_ms or its own shorter deadline (no reload changes max_wait_ms)


class Member:
    """One ext_proc (an instance, or a worker of one): its core and SharedSlots over its store, the requests sent to
    it, and main.py's housekeeping."""

    def __init__(self, core: AdmissionController, slots: SharedSlots):
        self.core = core
        self.slots = slots
        self.requests: list[Request] = []
        self.housekeeping: asyncio.Task | None = None
        self.alive = True

    async def start(self) -> None:
        await self.slots.start()
        self.housekeeping = asyncio.get_running_loop().create_task(self._housekeep())

    async def _housekeep(self) -> None:
        """What main.py's housekeeping does each second: renew the live tickets, reap, tick the store."""
        while True:
            await asyncio.sleep(1.0)
            for r in self.running():
                if not r.stale:
                    self.core.renew(r.decision.ticket)
            for t in self.core.reap():
                self.slots.release(t)
            await self.slots.tick()

    def running(self) -> list[Request]:
        return [r for r in self.requests if r.decision is not None and r.decision.kind == ACCEPT and not r.ended
                and not r.decision.ticket.closed]

    def waiting(self) -> list[Request]:
        return [r for r in self.requests if r.task is not None and not r.task.done()]

    def stop(self, *tasks: asyncio.Task | None) -> None:
        """SIGKILL: nothing more runs or is released (its store's calls fail from now); its waiting requests, its
        housekeeping, the SharedSlots' pumps and releaser, and `tasks` (the store's own) are cancelled."""
        self.alive = False
        self.store.dead = True
        self.housekeeping.cancel()
        for r in self.waiting():
            r.task.cancel()
        for task in (*self.slots._pumps.values(), self.slots._releaser, *tasks):
            if task is not None:
                task.cancel()


async def serve(member: Member, req: Request, facts: RequestFacts) -> None:
    """What the stream does: decide, then the final admission (class queue, then the store), given back if the
    client leaves."""
    core = member.core
    d = core.decide(facts)
    if type(d) is Queued or core.gated(d):
        held = FinalAdmission(core, member.slots, d)

        async def extend(_s: float) -> None:
            await asyncio.sleep(0.001)  # the timeout extension's write to Envoy
        try:
            d = await held.settle(extend)
        except asyncio.CancelledError:
            if member.alive:
                held.give_back()  # a slot granted in that same instant is revoked: it never ran
            raise
    req.decision, req.answered_at = d, core.clock()
    t = d.ticket
    slots = member.slots
    if d.kind == ACCEPT and core.gated(d):
        # An admitted request holds one slot of the store's: a global one or (failing open) a share one.
        assert (t.id in slots.held) != (t.id in slots.unshared), "an admission without exactly one slot"
    elif t is not None:
        assert t.id not in slots.held and t.id not in slots.unshared, "a refusal kept a slot"


def end_one(rng: random.Random, members: list[Member]) -> None:
    """A running request ends (answered, or its client aborted mid-answer)."""
    running = [r for m in members for r in m.running()]
    if running:
        r = rng.choice(running)
        r.ended = True
        t = r.decision.ticket
        r.member.core.finish(t, rng.choice((Outcome.OK, Outcome.CLIENT_ABORT)))
        r.member.slots.release(t)


def leave_one(rng: random.Random, members: list[Member]) -> None:
    """A waiting request's client leaves."""
    waiting = [r for m in members for r in m.waiting()]
    if waiting:
        rng.choice(waiting).task.cancel()


async def drain(members: list[Member]) -> None:
    """Every waiting request's client leaves (within 5 s, or the walk hangs), then every running one ends."""
    tasks = [r.task for m in members for r in m.waiting()]
    for task in tasks:
        task.cancel()
    # A wait_for whose future was answered as it was cancelled returns the answer (Python 3.11): admitted.
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=5)
        assert not pending, f"requests still waiting 5 s after their clients left: {stacks(pending)}"
    for m in members:
        for r in m.running():
            r.ended = True
            m.core.finish(r.decision.ticket, Outcome.OK)
            m.slots.release(r.decision.ticket)
