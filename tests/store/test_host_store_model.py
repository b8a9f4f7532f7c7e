"""A model-based test of `extproc serve --workers N`'s shared caps: the SharedSlots of three workers over HostStores
opened on one table in a temp dir (as the workers open theirs), driven by a seeded random walk of arrivals, ends,
clients leaving, time passing, workers dying (their cells cleared by forget(), as the supervisor does, the others
draining and then all restarted on a fresh table) and reloads (lower caps and budgets, a class removed, classes
added: many of them, and long names, stored as a hash).

It runs on the virtual clock of tests/store/slot_walk.py, whose selector here reads what is ready (a wake-up datagram)
before it moves the clock on: a datagram is read at the moment it is sent, as on a real clock. Invariants, checked after every step:
- the table counts exactly what runs: per class and worker, the slots and GPU-seconds of the worker's held
  requests; a dead worker's cells are zero once forgotten, and forget() left the others' cells as they were;
- every grant stays within the cap and budget of its claim, so the sum over the workers never exceeds them;
- no head waiter of a worker sleeps while its class has room for it: a release in another worker wakes it at once
  (its datagram); room forget() made, or room behind waiters that left, is found within a poll;
- no admission waits past its deadline;
- at the end every cell of the table is zero and every worker's bookkeeping is empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import selectors
from pathlib import Path

import pytest

from extproc.policy.admission import AdmissionController, RequestFacts
from extproc.store import host_store
from extproc.store.host_store import HostStore
from extproc.store.shared_slots import SHARED, SharedSlots
from tests.conftest import make_policy
from tests.store.slot_walk import Member, Request, VirtualTimeLoop, drain, end_one, leave_one, serve
from tests.store.slot_walk import run_virtual as run_virtual_on

WORKERS = 3
POLL_S = 0.1
EPS = 1e-6
LONG_A = "l" * 58 + "-alpha"   # 64 bytes, equal to LONG_B in their first 56: each stored as its own hash
LONG_B = "l" * 58 + "-bravo"
MANY = [f"m{i:02d}-" + "k" * 50 for i in range(12)]  # 54 bytes: stored as they are, many rows


def policy(variant: dict):
    """A policy of the walk: `variant` says which caps are low, which classes are in it."""
    low = variant["low"]
    classes = {"interactive": {"max_concurrency": 3 if low else 5, "max_queue": 4, "max_wait_ms": 1500,
                               "max_inflight_gpu_seconds": 7.0 if low else 12.0}}
    if variant["batch"]:
        classes["batch"] = {"max_concurrency": 3, "max_queue": 3, "max_wait_ms": 2500}
    for name in variant["long"]:
        classes[name] = {"max_concurrency": 1 if low else 2, "max_queue": 2, "max_wait_ms": 1000,
                         "max_inflight_gpu_seconds": 4.0}
    for name in MANY[slice(*variant["many"])]:
        classes[name] = {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 800}
    return make_policy(classes=classes, tenants=[], lease_ms=2000,
                       store={"kind": "memory", "poll_ms": int(POLL_S * 1000)})


class _Selector(selectors.DefaultSelector):
    """Never blocks: what is ready (a wake-up datagram) is read at once; a wait for `timeout` moves the loop's clock
    on by it instead."""

    loop: VirtualTimeLoop

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("the loop would wait for ever: nothing scheduled (a hang)")
        self.loop.now += timeout
        return super().select(0)


def run_virtual(coro):
    return run_virtual_on(coro, lambda: VirtualTimeLoop(_Selector()))


class CheckedStore(HostStore):
    """A HostStore whose every grant is checked against the table right after it: within the claim's cap and
    budget, summed over the workers."""

    dead = False

    async def acquire(self, claim):
        if self.dead:
            raise asyncio.CancelledError  # the process is gone: nothing it would still do happens
        fresh = (claim.cls, claim.holder) not in self._held
        granted = await super().acquire(claim)
        if granted and fresh:
            cells = self._cells(self._row(claim.cls))
            assert sum(c[0] for c in cells) <= claim.cap, (claim, cells)
            assert claim.budget is None or sum(c[1] for c in cells) <= claim.budget * (1 + 1e-9) + EPS, (claim, cells)
            self.on_grant(claim.cls)
        return granted

    async def release(self, slots):
        if self.dead:
            raise asyncio.CancelledError
        await super().release(slots)

    def on_grant(self, cls: str) -> None:
        pass

    def _claim(self, row: int, name: bytes) -> None:
        super()._claim(row, name)
        self.on_claim(name)

    def on_claim(self, name: bytes) -> None:
        pass


class Worker(Member):
    def __init__(self, walk: "Walk", index: int):
        self.walk = walk
        self.index = index
        self.store = CheckedStore(walk.dir, index, WORKERS)
        self.store.on_grant = walk.granted
        self.store.on_claim = walk.claimed
        core = AdmissionController(policy(walk.variant), clock=asyncio.get_running_loop().time)
        super().__init__(core, SharedSlots(core, self.store, workers=WORKERS))

    async def die(self) -> None:
        """SIGKILL: nothing more runs or is released; its inbox is gone (datagrams to it are refused)."""
        self.stop()
        await asyncio.sleep(0)
        await self.store.close()


class Walk:
    def __init__(self, seed: int, directory: Path):
        self.rng = random.Random(seed)
        self.loop = asyncio.get_running_loop()
        self.root = directory
        self.generation = 0
        self.dir = directory
        self.variant = {"low": False, "batch": True, "long": [LONG_A], "many": (0, 0)}
        self.workers: list[Worker] = []
        self.dead: list[Worker] = []
        self.log: list[str] = []
        self.room_since: dict[tuple[int, str], float] = {}
        self.poll_until = 0.0  # room made by forget() (no wake-up) is found by a poll until then
        self.class_poll_until: dict[bytes, float] = {}  # ... and room in a class's new row

    def now(self) -> float:
        return self.loop.time()

    async def fresh_table(self) -> None:
        """The supervisor's start: a new table, N workers on it."""
        self.generation += 1
        self.dir = self.root / f"table-{self.generation}"
        self.dir.mkdir()
        host_store.create(self.dir, WORKERS)
        self.workers, self.dead = [], []
        for i in range(WORKERS):
            w = Worker(self, i)
            await w.start()
            self.workers.append(w)
        self.room_since.clear()

    def granted(self, cls: str) -> None:
        """A grant takes room: whoever saw room in that class must see it anew."""
        for key in [k for k in self.room_since if k[1] == cls]:
            del self.room_since[key]

    def claimed(self, name: bytes) -> None:
        """A class got a row (its first, or a new one after an idle row of it went to another class): a worker that
        waited for it with its flag in the old row, or that found the table full, asks again at its next poll."""
        self.class_poll_until[name] = self.now() + POLL_S
        for key in [k for k in self.room_since if host_store._stored_name(k[1]) == name]:
            del self.room_since[key]

    def classes(self) -> list[str]:
        return list(policy(self.variant).classes)

    # --- rules ---

    def arrive(self) -> None:
        w = self.rng.choice(self.workers)
        cls = self.rng.choice(self.classes() + ["interactive"] * 3)
        deadline = self.rng.choice((None, None, None, 300.0, 800.0))
        facts = RequestFacts(header_class=cls, model="llama", max_tokens=self.rng.choice((1000, 2000, 4000)),
                             deadline_ms=deadline)
        wait_ms = min(policy(self.variant).classes[cls].max_wait_ms, deadline or float("inf"))
        req = Request(w, cls, self.now(), wait_s=wait_ms / 1000.0)
        req.task = self.loop.create_task(serve(w, req, facts))
        w.requests.append(req)

    def end(self) -> None:
        end_one(self.rng, self.workers)

    def leave(self) -> None:
        leave_one(self.rng, self.workers)

    async def kill(self) -> None:
        """A worker dies; the supervisor clears its cells: exactly its own, the others' stay as they were."""
        if self.dead:
            return  # the others are draining already; the restart comes next
        w = self.rng.choice(self.workers)
        await w.die()
        self.workers.remove(w)
        self.dead.append(w)
        before = self.table()
        host_store.forget(self.dir, w.index, WORKERS)
        after = self.table()
        for name, cells in before.items():
            for i, cell in enumerate(cells):
                expected = (0, 0.0, 0) if i == w.index else cell
                assert after[name][i] == expected, (name, i, before[name], after[name])
        self.room_since = {k: v for k, v in self.room_since.items() if k[0] != w.index}
        self.poll_until = self.now() + POLL_S

    async def restart(self) -> None:
        """The survivors drained and stopped: all start again on a fresh table."""
        if not self.dead:
            return
        await self.finish()
        await self.fresh_table()

    def reload(self) -> None:
        v = dict(self.variant)
        change = self.rng.choice(("low", "batch", "long", "many"))
        if change == "low":
            v["low"] = not v["low"]
        elif change == "batch":
            v["batch"] = not v["batch"]
        elif change == "long":
            v["long"] = self.rng.choice(([], [LONG_A], [LONG_B], [LONG_A, LONG_B]))
        else:
            v["many"] = self.rng.choice(((0, 0), (0, 4), (0, 6), (6, 12), (4, 10)))
        self.variant = v
        self.log.append(f"  reload {v}")
        self.room_since.clear()  # a lower cap takes room
        for w in self.workers:
            w.slots.apply(policy(v))

    async def step(self) -> None:
        rule = self.rng.choices(("arrive", "end", "leave", "time", "kill", "restart", "reload"),
                                weights=(30, 14, 4, 20, 0.5, 1.5, 2))[0]
        self.log.append(f"{self.now():.3f} {rule}")
        if rule == "time":
            await asyncio.sleep(self.rng.choice((0.0, 0.001, 0.01, 0.05, 0.2, 1.0)))
        elif rule in ("kill", "restart"):
            await getattr(self, rule)()
        else:
            getattr(self, rule)()
        await asyncio.sleep(0)
        self.check()

    # --- invariants ---

    def table(self) -> dict[bytes, list[tuple[int, float, int]]]:
        """Every named row of the table and its cells (read directly, outside any worker)."""
        with contextlib.closing(_Reader(self.dir)) as r:
            return {name: r._cells(row) for row, name in r.rows()}

    def check(self) -> None:
        table = self.table()
        # The table counts exactly what runs: per worker, its held requests' slots and GPU-seconds.
        expected: dict[bytes, list[list[float]]] = {}
        for w in self.workers:
            assert w.slots.state == SHARED
            assert not w.slots.unshared
            # What it holds, and what it released whose call has not run yet (the releaser runs next).
            for c in (*w.slots.held.values(), *w.slots._to_release):
                cell = expected.setdefault(host_store._stored_name(c.cls), [[0, 0.0] for _ in range(WORKERS)])
                cell[w.index][0] += 1
                cell[w.index][1] += c.cost
        for name in set(table) | set(expected):
            cells = table.get(name, [(0, 0.0, 0)] * WORKERS)
            want = expected.get(name, [[0, 0.0]] * WORKERS)
            for i in range(WORKERS):
                assert cells[i][0] == want[i][0], (name, i, cells, want)
                assert abs(cells[i][1] - want[i][1]) < 1e-6, (name, i, cells, want)
        # No head waiter sleeps while its class has room for it, beyond a poll.
        now = self.now()
        seen = set()
        for w in self.workers:
            for cls, q in w.slots._waiting.items():
                head = next((x for x in q if not x.future.done()), None)
                if head is None or cls not in w.core.limiters:
                    continue
                claim = w.slots.claim(head.ticket)
                cells = table.get(host_store._stored_name(cls))
                if cells is None:  # no row yet (the table full of others' slots): it takes one at a poll
                    continue
                room = sum(c[0] for c in cells) < claim.cap and (
                    claim.budget is None or sum(c[1] for c in cells) + claim.cost <= claim.budget * (1 + 1e-9))
                if not room:
                    continue
                key = (w.index, cls)
                seen.add(key)
                # Room a release made wakes the waiter at once (a datagram from another worker, an event from its
                # own); room forget() made or in a class's new row is found at the next poll, and so is room behind
                # waiters that left (their client gone, their deadline passed: only a release wakes the queue, and
                # the head that left may have needed more GPU-seconds than the one behind it).
                since = self.room_since.setdefault(key, max(now, self.poll_until,
                                                            self.class_poll_until.get(host_store._stored_name(cls), 0)))
                late = POLL_S if q[0] is not head else 0.0
                assert now - since <= late + 0.01, (
                    f"worker {w.index}'s head {cls} waiter sleeps since {since} while its class has room (now {now})")
        self.room_since = {k: v for k, v in self.room_since.items() if k in seen}
        # No admission waits past its deadline.
        for w in self.workers:
            for r in w.waiting():
                assert now <= r.arrived + r.wait_s + EPS, f"a {r.cls} admission waits since {r.arrived} (now {now})"
            for r in w.requests:
                if r.task.done() and not r.task.cancelled() and r.task.exception() is not None:
                    raise r.task.exception()

    async def finish(self) -> None:
        """Every client leaves or ends; then the table is all zeros and every worker's bookkeeping empty."""
        await drain(self.workers)
        await asyncio.sleep(0.5)
        self.check()
        for name, cells in self.table().items():
            assert all(c[:2] == (0, 0.0) for c in cells), (name, cells)  # a waiting flag may stay: a spare wake
        for w in self.workers:
            s = w.slots
            assert not s.held and not s.unshared and not s._to_release and not s._unreleased
            assert not any(x for q in s._waiting.values() for x in q if not x.future.done())
            assert not w.core.tickets
            assert all(lim.inflight == 0 for lim in w.core.limiters.values())
            assert not w.store._held
            w.housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w.housekeeping
            await s.close()


class _Reader(HostStore):
    """The table as the test reads it: rows by name, cells; nothing written."""

    def __init__(self, directory: Path):
        super().__init__(directory, 0, WORKERS)

    def rows(self):
        for row in range(host_store.MAX_CLASSES):
            name = self._name_at(row)
            if not name:
                return
            yield row, name

    def close(self) -> None:
        self._close_files()


async def walk(seed: int, steps: int, directory: Path) -> Walk:
    w = Walk(seed, directory)
    await w.fresh_table()
    try:
        for _ in range(steps):
            await w.step()
        await w.finish()
    except BaseException:
        print("\n".join(w.log[-40:]))
        raise
    return w


@pytest.mark.parametrize("seed", range(8))
def test_host_store_model(seed, tmp_path):
    """1000 steps on a virtual clock (a few simulated minutes), three workers on one table, all restarted on a
    fresh one after a death."""
    w = run_virtual(walk(seed, 1000, tmp_path))
    assert w.generation > 1


@pytest.mark.parametrize("seed", range(4))
def test_host_store_model_on_a_small_table(seed, tmp_path, monkeypatch):
    """A table of 10 rows, as many as the largest policy of the walk has classes: reloads that rename classes while
    the old ones run fill it, and rows of classes nobody holds change hands."""
    monkeypatch.setattr(host_store, "MAX_CLASSES", 10)
    run_virtual(walk(seed, 1000, tmp_path))
