"""A model-based test of the shared slot store: three ext_proc instances' SharedSlots on one store, driven by a
seeded random walk of arrivals, ends, clients leaving, time passing (renewals every second), store outages of every
kind (refused at once, frozen until the client's timeout, read-only, cut off from one instance, a call that went
through but whose answer was lost), instances dying without releasing and new ones starting, and reloads.

It runs on a virtual clock (an event loop whose time jumps to its next timer when nothing is ready), so leases,
timeouts and deadlines are exact and a walk of minutes takes a fraction of a second. The store is a fake SlotStore
written to the interface (the semantics of the Redis scripts: leases, idempotent acquires, adopt past the cap),
whose failures the walk controls; one walk also runs on a real redis-server, in real time.

Invariants, checked after every step (and some at the moment they matter):
- while the store answers, a slot is granted only within the class's cap and GPU-second budget as the instance's
  policy sets them: the slots held by holders that were never adopted never exceed the cap;
- failing open, an instance admits only within its local share (running requests counted, docs/reliability.md);
- no admission waits past its deadline plus the store's timeout, and none waits while failing closed;
- an admitted request holds exactly one slot (global or share), a refused one none;
- after the store is back and a lease has passed, it counts exactly what runs (adopted), nothing more;
- at the end, once everything has ended and a lease has passed, the store counts zero for every class and every
  instance's bookkeeping (held, unshared, unreleased, waiters, the core's tickets) is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest

from extproc.policy.admission import AdmissionController, RequestFacts
from extproc.policy.slot_store import SlotClaim, StoreUnavailable
from extproc.store.redis_store import RedisStore
from extproc.store.shared_slots import CLOSED, LOCAL, SHARED, SharedSlots
from tests.conftest import make_policy
from tests.store.slot_walk import Member, Request, drain, end_one, leave_one, run_virtual, serve, stacks

INSTANCES = 3
TIMEOUT_S = 0.05
LEASE_S = 3.0
CLASSES = ("interactive", "batch")
EPS = 1e-6


def policy(on_failure: str, low: bool | None = False, url: str = "redis://fake"):
    """The policies a reload switches between: `low` lowers the interactive cap and budget, None removes the batch
    class. The core's lease (2 s) is shorter than the longest wait: a ticket whose stream is never renewed is reaped,
    waiting or running."""
    interactive = {"max_concurrency": 4 if low else 6, "max_queue": 4, "max_wait_ms": 1500,
                   "max_inflight_gpu_seconds": 9.0 if low else 12.0}
    classes = {"interactive": interactive}
    if low is not None:
        classes["batch"] = {"max_concurrency": 3, "max_queue": 3, "max_wait_ms": 2500}
    return make_policy(classes=classes, tenants=[], lease_ms=2000,
                       store={"kind": "redis", "url": url, "instances": INSTANCES, "on_failure": on_failure,
                              "poll_ms": 100, "timeout_ms": int(TIMEOUT_S * 1000), "lease_ms": int(LEASE_S * 1000)})


# --- the fake store ---


class Backend:
    """What Redis holds: per class, holder -> [lease deadline, cost]; plus the outage the walk sets."""

    def __init__(self, clock, rng: random.Random):
        self.clock = clock
        self.rng = rng
        self.slots: dict[str, dict[str, list[float]]] = {}
        self.mode = "up"  # up, down (refused at once), readonly (answers errors), frozen (hangs to the timeout)
        self.adopted: set[str] = set()  # holders ever recorded by adopt(): they may stand past the cap
        self.clients: list[FakeStore] = []
        self.grants: list[tuple[SlotClaim, int, float]] = []  # what each grant left: (claim, count, cost)
        self.late: list = []  # calls sent to a frozen store, run in order when it resumes

    timeout_s = TIMEOUT_S  # an admission waits for one store call at most

    def client(self, inst_policy, rng: random.Random) -> "FakeStore":
        return FakeStore(self, rng)

    async def holders(self, cls: str) -> dict[str, float]:
        """Live holders of a class and their cost."""
        return {h: cost for h, (_, cost) in self.live(cls).items()}

    def set_mode(self, mode: str) -> None:
        if self.mode == "frozen" and mode != "frozen":
            late, self.late = self.late, []
            for effect in late:
                effect()
        self.mode = mode

    async def close(self) -> None:
        pass

    def live(self, cls: str) -> dict[str, list[float]]:
        now = self.clock()
        held = self.slots.setdefault(cls, {})
        for h in [h for h, (until, _) in held.items() if until <= now]:
            del held[h]
        return held

    # The scripts' effects (each atomic, as a Lua script is).

    def acquire(self, claim: SlotClaim) -> bool:
        held = self.live(claim.cls)
        if claim.holder in held:
            held[claim.holder][0] = self.clock() + LEASE_S
            return True
        cost = sum(c for _, c in held.values())
        if len(held) >= claim.cap or (claim.budget is not None and cost + claim.cost > claim.budget * (1 + 1e-9)):
            return False
        held[claim.holder] = [self.clock() + LEASE_S, claim.cost]
        self.grants.append((claim, len(held), cost + claim.cost))
        return True

    def release(self, slots: list[tuple[str, str]]) -> None:
        freed = set()
        for cls, holder in slots:
            if self.slots.get(cls, {}).pop(holder, None) is not None:
                freed.add(cls)
        for cls in sorted(freed):
            for client in self.clients:
                client.announce(cls)

    def renew(self, held: list[tuple[str, str]]) -> list[tuple[str, str]]:
        lost = []
        for cls, holder in held:
            slots = self.live(cls)
            if holder in slots:
                slots[holder][0] = self.clock() + LEASE_S
            else:
                lost.append((cls, holder))
        return lost

    def adopt(self, claims: list[SlotClaim]) -> None:
        for c in claims:
            self.live(c.cls)[c.holder] = [self.clock() + LEASE_S, c.cost]
            self.adopted.add(c.holder)


class FakeStore:
    """One instance's client of the Backend. A call takes a random latency within the timeout and applies its
    effect at its start or its end; in an outage it fails as the RedisStore client does (StoreUnavailable), at
    once or after the timeout, and a frozen call may have gone through with only its answer lost."""

    shared = True

    def __init__(self, backend: Backend, rng: random.Random):
        self.backend = backend
        self.rng = rng
        self.cut = False   # this instance alone cannot reach the store (a partition)
        self.dead = False  # its process is gone: nothing it sends arrives
        self._listeners = []
        backend.clients.append(self)

    def _mode(self) -> str:
        return "down" if self.cut else self.backend.mode

    async def _call(self, effect):
        if self.dead:
            raise StoreUnavailable("dead")
        mode = self._mode()
        if mode in ("down", "readonly"):
            raise StoreUnavailable(f"fake store {mode}")
        if mode == "frozen":
            luck = self.rng.random()
            if luck < 0.3:
                effect()  # it went through just before the store froze; the answer never came
            elif luck < 0.6 and not self.cut:
                self.backend.late.append(effect)  # it runs when the store resumes, as SIGCONT does
            await asyncio.sleep(TIMEOUT_S)
            raise StoreUnavailable("fake store timeout")
        early = self.rng.random() < 0.5
        if early:
            result = effect()
        await asyncio.sleep(self.rng.choice((0.0, 0.001, 0.005, 0.02)))
        if self.dead:
            raise StoreUnavailable("dead")
        if self._mode() != "up":  # it failed on its way back
            if not early and self.rng.random() < 0.5:
                effect()
            raise StoreUnavailable("fake store failed mid-call")
        if not early:
            result = effect()
        return result

    async def acquire(self, claim: SlotClaim) -> bool:
        return await self._call(lambda: self.backend.acquire(claim))

    async def release(self, slots):
        await self._call(lambda: self.backend.release(list(slots)))

    async def renew(self, held):
        held = list(held)
        return await self._call(lambda: self.backend.renew(held))

    async def adopt(self, claims):
        claims = list(claims)
        await self._call(lambda: self.backend.adopt(claims))

    async def ping(self) -> None:
        await self._call(lambda: None)

    def announce(self, cls: str) -> None:
        """The pub/sub message of a release, heard only by a live instance that reaches the store."""
        if not self.dead and not self.cut:
            for callback in self._listeners:
                asyncio.get_running_loop().call_soon(callback, cls)

    def on_release(self, callback) -> None:
        self._listeners.append(callback)

    def forget(self, cls: str) -> None:
        pass

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


# --- the model ---


class ShareChecked(dict):
    """SharedSlots.unshared, checked as it fills: failing open, an instance admits only within its share of each
    class, every request running on it counted (docs/reliability.md, 'Redis lost while requests wait')."""

    def __init__(self, inst: "Instance"):
        super().__init__()
        self.inst = inst

    def __setitem__(self, tid, claim):
        s = self.inst.slots
        spec = s.policy.classes.get(claim.cls)
        if s.state == LOCAL and spec is not None:
            share = max(1, spec.max_concurrency // INSTANCES)
            running = [c for c in (*s.held.values(), *self.values()) if c.cls == claim.cls]
            assert len(running) + 1 <= share, f"{claim.cls}: {len(running) + 1} running past the share {share}"
            if spec.max_inflight_gpu_seconds is not None:
                budget = spec.max_inflight_gpu_seconds / INSTANCES
                assert sum(c.cost for c in running) + claim.cost <= budget + EPS
        super().__setitem__(tid, claim)


class Instance(Member):
    def __init__(self, n: int, backend, rng: random.Random, on_failure: str, low: bool):
        self.n = n
        p = policy(on_failure, low, getattr(backend, "url", "redis://fake"))
        self.store = backend.client(p, rng)
        core = AdmissionController(p, clock=asyncio.get_running_loop().time)
        super().__init__(core, SharedSlots(core, self.store, workers=1))
        self.slots.unshared = ShareChecked(self)

    def die(self) -> None:
        """SIGKILL: nothing more runs, nothing is released; its store leases must run out."""
        self.stop(getattr(self.store, "_subscriber", None), getattr(self.store, "_acquirer", None))


class Walk:
    def __init__(self, seed: int, on_failure: str, backend=None):
        self.rng = random.Random(seed)
        self.loop = asyncio.get_running_loop()
        self.backend = backend or Backend(self.loop.time, random.Random(seed + 1))
        self.on_failure = on_failure
        self.low = False
        self.instances: list[Instance] = []
        self.dead: list[Instance] = []
        self.count = 0
        self.log: list[str] = []
        self.pace = 1.0  # how much of the drawn time passes (less on a real clock)

    def now(self) -> float:
        return self.loop.time()

    async def add_instance(self) -> None:
        inst = Instance(self.count, self.backend, random.Random(self.rng.random()), self.on_failure, self.low)
        self.count += 1
        await inst.start()
        self.instances.append(inst)

    # --- rules ---

    def arrive(self) -> None:
        inst = self.rng.choice(self.instances)
        cls = self.rng.choice(CLASSES)
        deadline = self.rng.choice((None, None, None, 300.0, 800.0))
        facts = RequestFacts(header_class=cls, model="llama", max_tokens=self.rng.choice((1000, 2000, 4000)),
                             deadline_ms=deadline)
        req = Request(inst, cls, self.now(), deadline_ms=deadline, stale=self.rng.random() < 0.1)
        req.task = self.loop.create_task(serve(inst, req, facts))
        inst.requests.append(req)

    def end(self) -> None:
        end_one(self.rng, self.instances)

    def leave(self) -> None:
        leave_one(self.rng, self.instances)

    def outage(self) -> None:
        if self.rng.random() < 0.25:
            self.rng.choice(self.instances).store.cut = True
        else:
            self.backend.set_mode(self.rng.choice(("down", "readonly", "frozen")))

    def store_back(self) -> None:
        self.backend.set_mode("up")
        for inst in self.instances:
            inst.store.cut = False

    async def kill(self) -> None:
        inst = self.rng.choice(self.instances)
        inst.die()
        self.instances.remove(inst)
        self.dead.append(inst)
        await asyncio.sleep(0)
        await self.add_instance()

    def reload(self) -> None:
        self.low = self.rng.choice([x for x in (False, True, None) if x is not self.low])
        for inst in self.instances:
            inst.slots.apply(policy(self.on_failure, self.low))

    async def step(self) -> None:
        rule = self.rng.choices(("arrive", "end", "leave", "time", "outage", "back", "kill", "reload"),
                                weights=(30, 14, 4, 20, 2, 3, 0.7, 1.5))[0]
        self.log.append(f"{self.now():.3f} {rule}")
        if rule == "time":
            await asyncio.sleep(self.rng.choice((0.0, 0.001, 0.01, 0.05, 0.2, 1.0)) * self.pace)
        elif rule == "kill":
            await self.kill()
        elif rule == "outage":
            self.outage()
        elif rule == "back":
            self.store_back()
        else:
            getattr(self, rule)()
        await asyncio.sleep(0)
        await self.check()

    # --- invariants ---

    def caps(self) -> dict[str, tuple[int, float | None]]:
        p = policy(self.on_failure, self.low)
        return {cls: (spec.max_concurrency, spec.max_inflight_gpu_seconds) for cls, spec in p.classes.items()}

    async def check(self) -> None:
        # Grants within the cap and budget the claim carried (the fake sees each grant).
        for claim, count, cost in getattr(self.backend, "grants", ()):
            assert count <= claim.cap, f"granted {count} of a cap of {claim.cap}"
            assert claim.budget is None or cost <= claim.budget * (1 + 1e-9) + EPS
        if hasattr(self.backend, "grants"):
            self.backend.grants.clear()
        # Never adopted, the slots in the store stand within the cap and the budget (right after a reload lowered
        # them the running ones may stand above: never above the higher policy's).
        high = policy(self.on_failure).classes
        for cls in CLASSES:
            held = await self.backend.holders(cls)
            if held is None:  # the store is away: nothing to read
                continue
            fresh = {h: c for h, c in held.items() if h not in self.backend.adopted}
            assert len(fresh) <= high[cls].max_concurrency, (cls, held)
            budget = high[cls].max_inflight_gpu_seconds
            assert budget is None or sum(fresh.values()) <= budget + EPS, (cls, held)
        # No admission waits past its deadline plus one store call; failing closed, none waits at all.
        for inst in self.instances:
            if inst.slots.state == CLOSED:
                assert not [w for q in inst.slots._waiting.values() for w in q if not w.future.done()]
            for r in inst.waiting():
                wait_ms = min(high[r.cls].max_wait_ms, r.deadline_ms or float("inf"))
                limit = r.arrived + wait_ms / 1000.0 + self.backend.timeout_s
                if hasattr(self.backend, "stalled"):  # real time: the harness's own blocking delays every timer
                    limit += self.backend.stalled(r.arrived, self.now())
                assert self.now() <= limit + EPS, f"a {r.cls} admission waits since {r.arrived} (now {self.now()})"
            for r in inst.requests:
                if r.task.done() and not r.task.cancelled() and r.task.exception() is not None:
                    raise r.task.exception()

    def holders(self, insts, pick) -> set[str]:
        return {f"{inst.slots.replica}:{r.decision.ticket.id}" if r.decision is not None else None
                for inst in insts for r in pick(inst)} - {None}

    async def counts_what_runs(self, dead_may_hold: bool) -> None:
        """The store holds every request that runs, and beside them only, within a lease of their death, dead
        instances' ones."""
        for _ in range(100):  # a release on its way (a ticket reaped just now) lands first
            if all(inst.slots._releaser is None for inst in self.instances):
                break
            await asyncio.sleep(0.01)
        live = {h for cls in CLASSES for h in await self.backend.holders(cls)}
        running = self.holders(self.instances, Instance.running)
        assert running <= live, f"running without a global slot: {sorted(running - live)}"
        assert not any(inst.waiting() for inst in self.instances)
        dead = {h for h in live if any(h.startswith(inst.slots.replica) for inst in self.dead)}
        extra = live - running - (dead if dead_may_hold else set())
        assert not extra, f"the store counts slots nothing holds: {sorted(extra)}"
        for inst in self.instances:
            s = inst.slots
            assert s.state == SHARED and not s.unshared and not s._unreleased and not s._to_release
            assert set(s.held) >= {r.decision.ticket.id for r in inst.running()}

    async def settle(self) -> None:
        """The store answers for good: after two renewals it counts what runs (what ran during the outage adopted),
        and once a lease has passed, what dead instances held is gone too."""
        self.store_back()
        await asyncio.sleep(2.6)  # past every deadline (2.5 s at most): no acquire on its way
        await self.check()
        await self.counts_what_runs(dead_may_hold=True)
        await asyncio.sleep(LEASE_S)
        await self.check()
        await self.counts_what_runs(dead_may_hold=False)
        for inst in self.instances:
            assert not inst.waiting()
            assert set(inst.slots.held) == {r.decision.ticket.id for r in inst.running()}

    async def finish(self) -> None:
        await drain(self.instances)
        await self.settle()
        for cls in CLASSES:
            assert not await self.backend.holders(cls), cls
        for inst in self.instances:
            s = inst.slots
            assert not s.held and not s.unshared and not s._unreleased and not s._to_release and not s._maybe_adopted
            assert not any(s._waiting.values()) and not s._pumps
            assert not inst.core.tickets
            assert all(lim.inflight == 0 for lim in inst.core.limiters.values())
            inst.housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await inst.housekeeping
            await s.close()
        for inst in self.dead:
            with contextlib.suppress(Exception):
                await inst.store.client.aclose()


async def walk(seed: int, on_failure: str, steps: int, backend=None, pace: float = 1.0,
               settle_every: int = 150) -> Walk:
    w = Walk(seed, on_failure, backend)
    w.pace = pace
    for _ in range(INSTANCES):
        await w.add_instance()
    try:
        for i in range(steps):
            await w.step()
            if i % settle_every == settle_every - 1:
                await w.settle()
        await w.finish()
    except BaseException:
        print("\n".join(w.log[-40:]))
        raise
    return w


# --- the same walk on a real redis-server ---


class ModelRedisStore(RedisStore):
    """The RedisStore, which the walk can also cut off from the server (a partition) or kill (nothing it sends
    arrives), and whose adoptions it records (those slots may stand past the cap)."""

    def __init__(self, spec, backend: "RedisBackend"):
        super().__init__(spec)
        self.backend = backend
        self.cut = False
        self.dead = False

    async def _call(self, coro):
        if self.cut or self.dead:
            coro.close()
            raise StoreUnavailable("cut off")
        return await super()._call(coro)

    async def adopt(self, claims):
        self.backend.adopted.update(c.holder for c in claims)  # before the call: it may go through unanswered
        await super().adopt(claims)


class RedisBackend:
    """A real redis-server the walk stops (a restart comes back empty), freezes (SIGSTOP: the commands sent
    meanwhile run when it resumes) or turns read-only (a replica of nothing, as after a failover)."""

    timeout_s = 2 * TIMEOUT_S + 0.5  # the call on its way, then the batch it queued for; slack for a real clock

    def __init__(self, server):
        import redis
        self.server = server
        self.url = server.url
        self.admin = redis.Redis.from_url(server.url, socket_timeout=2)
        self.adopted: set[str] = set()
        self.mode = "up"
        self.stalls: list[tuple[float, float]] = []

    def client(self, p, rng) -> ModelRedisStore:
        return ModelRedisStore(p.store, self)

    def set_mode(self, mode: str) -> None:
        # Starting and stopping the server blocks the event loop (spawn, then PING until it answers): no timer
        # fires meanwhile, so the time is recorded and the deadline check does not count it against admissions.
        start = time.monotonic()
        try:
            self._set_mode(mode)
        finally:
            self.stalls.append((start, time.monotonic()))

    def stalled(self, since: float, until: float) -> float:
        """Seconds of [since, until] the walk's own blocking calls held the loop (its clock is time.monotonic)."""
        return sum(max(0.0, min(b, until) - max(a, since)) for a, b in self.stalls)

    def _set_mode(self, mode: str) -> None:
        import os
        import signal
        if self.mode == "frozen":
            os.kill(self.server.proc.pid, signal.SIGCONT)
        elif self.mode == "down":
            self.server.start()
        elif self.mode == "readonly":
            self.admin.execute_command("REPLICAOF", "NO", "ONE")
        self.mode = mode
        if mode == "frozen":
            os.kill(self.server.proc.pid, signal.SIGSTOP)
        elif mode == "down":
            self.server.stop()
        elif mode == "readonly":
            self.admin.execute_command("REPLICAOF", "127.0.0.1", "1")

    async def holders(self, cls: str) -> dict[str, float] | None:
        if self.mode != "up":
            return None
        sec, us = self.admin.time()
        now = sec * 1000 + us // 1000
        held = [h.decode() for h in self.admin.zrangebyscore(f"extproc:slots:{cls}", f"({now}", "+inf")]
        costs = self.admin.hmget(f"extproc:cost:{cls}", held) if held else []
        return {h: float(c or 0) for h, c in zip(held, costs)}

    async def close(self) -> None:
        self.set_mode("up")
        self.admin.close()


async def test_shared_slots_model_on_redis(redis_server):
    """One walk on a real redis-server, in real time (renewals each second, leases of 3 s)."""
    backend = RedisBackend(redis_server)
    try:
        task = asyncio.create_task(walk(7, "local", 300, backend, pace=0.2, settle_every=200))
        done, _ = await asyncio.wait([task], timeout=80)  # about 17 s on a 2-core machine
        if not done:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            task.cancel()
            pytest.fail(f"the walk hung; its tasks:\n{stacks(others)}")
        task.result()
    finally:
        await backend.close()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("on_failure", ["local", "closed"])
def test_shared_slots_model(seed, on_failure):
    """600 steps on the fake store and a virtual clock (a few simulated minutes, a fraction of a second each),
    settling every 150 steps and at the end."""
    w = run_virtual(walk(seed, on_failure, 600))
    assert w.count >= INSTANCES
