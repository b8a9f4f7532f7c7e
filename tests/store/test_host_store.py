"""HostStore: the caps the workers of one `extproc serve --workers N` share through this host's memory. Two
workers' stores on one table, in one process (the table and the wake-ups work the same across processes)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest

from extproc.policy.admission import AdmissionController, RequestFacts
from extproc.policy.slot_store import SlotClaim
from extproc.server.final_admission import FinalAdmission
from extproc.store import host_store
from extproc.store.host_store import HostStore
from extproc.store.shared_slots import SharedSlots
from tests.conftest import make_policy
from tests.store.test_host_store_model import run_virtual


def claim(holder: str, cls: str = "interactive", cap: int = 2, cost: float = 1.0,
          budget: float | None = None) -> SlotClaim:
    return SlotClaim(cls, holder, cost, cap, budget)


@pytest.fixture
async def pair(tmp_path):
    """Workers 0 and 1 of a table for two, started (their wake-up sockets bound)."""
    host_store.create(tmp_path, 2)
    stores = [HostStore(tmp_path, w, 2) for w in range(2)]
    for s in stores:
        await s.start()
    yield stores
    for s in stores:
        await s.close()


async def test_one_cap_across_the_workers(pair):
    a, b = pair
    assert await a.acquire(claim("a:1"))
    assert await b.acquire(claim("b:1"))
    assert not await a.acquire(claim("a:2"))  # 2 held on the host, one by each worker
    assert not await b.acquire(claim("b:2"))
    assert a.count("interactive") == b.count("interactive") == 2
    await b.release([("interactive", "b:1")])
    assert await a.acquire(claim("a:2"))
    assert b.count("interactive") == 2


async def test_classes_and_budgets_are_counted_apart(pair):
    a, b = pair
    assert await a.acquire(claim("a:1", cls="batch", cap=10, cost=3.0, budget=5.0))
    assert not await b.acquire(claim("b:1", cls="batch", cap=10, cost=3.0, budget=5.0))  # 6 GPU-s > 5
    assert await b.acquire(claim("b:2", cls="batch", cap=10, cost=2.0, budget=5.0))
    assert await b.acquire(claim("b:3", cls="interactive", cap=1))  # another class, its own count
    await a.release([("batch", "a:1")])
    assert await b.acquire(claim("b:1", cls="batch", cap=10, cost=3.0, budget=5.0))


async def test_release_and_acquire_are_idempotent_and_renew_reports_what_is_not_held(pair):
    a, b = pair
    assert await a.acquire(claim("a:1", cap=1))
    assert await a.acquire(claim("a:1", cap=1))  # the same holder again: still one slot
    assert a.count("interactive") == 1
    await a.release([("interactive", "a:1"), ("interactive", "a:1"), ("interactive", "nobody")])
    assert a.count("interactive") == 0
    assert await b.acquire(claim("b:1", cap=1))
    assert await b.renew([("interactive", "b:1"), ("interactive", "b:gone")]) == [("interactive", "b:gone")]


async def test_a_release_wakes_the_worker_that_waits_and_only_it(pair):
    a, b = pair
    heard: dict[str, list[str]] = {"a": [], "b": []}
    a.on_release(heard["a"].append)
    b.on_release(heard["b"].append)
    assert await a.acquire(claim("a:1", cap=1))
    await a.release([("interactive", "a:1")])
    await asyncio.sleep(0.05)
    assert heard == {"a": [], "b": []}  # nobody waited
    assert await a.acquire(claim("a:1", cap=1))
    assert not await b.acquire(claim("b:1", cap=1))  # b waits now
    await a.release([("interactive", "a:1")])
    for _ in range(100):
        if heard["b"]:
            break
        await asyncio.sleep(0.01)
    assert heard == {"a": [], "b": ["interactive"]}


async def test_adopted_slots_count_past_the_cap(pair):
    a, b = pair
    assert await b.acquire(claim("b:1", cap=1))
    await a.adopt([claim("a:1", cap=1)])
    assert a.count("interactive") == 2
    await b.release([("interactive", "b:1")])
    assert not await b.acquire(claim("b:2", cap=1))  # a's adopted slot still counts


async def test_a_long_class_name_has_its_own_row(pair):
    a, b = pair
    long_a, long_b = "x" * 80 + "a", "x" * 80 + "b"  # equal in their first 56 bytes
    assert await a.acquire(claim("a:1", cls=long_a, cap=1))
    assert await b.acquire(claim("b:1", cls=long_b, cap=1))
    assert not await b.acquire(claim("b:2", cls=long_a, cap=1))
    assert a.count(long_a) == b.count(long_b) == 1


async def test_classes_renamed_over_a_long_life_reuse_the_rows_of_classes_nobody_holds(pair):
    # A row was claimed per class name ever seen and never given back: reloads that rename classes over the life
    # of one `serve --workers N` filled the 256 rows, and every request of the 257th name failed ("more than 256
    # classes in the shared table", a stream error: failure_mode_allow sent it on unadmitted).
    a, b = pair
    assert await b.acquire(claim("b:1", cls="kept", cap=1))  # held throughout: its row is never taken
    assert await b.acquire(claim("b:2", cls="gen-0", cap=5))
    await b.release([("gen-0", "b:2")])  # b knows gen-0's row; it is idle now
    for gen in range(1, host_store.MAX_CLASSES + 50):
        assert await a.acquire(claim(f"a:{gen}", cls=f"gen-{gen}", cap=1))
        await a.release([(f"gen-{gen}", f"a:{gen}")])
    assert await a.acquire(claim("a:x", cls="gen-300", cap=1))
    assert b.count("gen-300") == 1
    assert not await a.acquire(claim("a:y", cls="kept", cap=1))  # b's slot still counts
    assert await b.acquire(claim("b:3", cls="gen-0", cap=1))  # its row went to another class: found again
    assert a.count("gen-0") == 1 and a.count("gen-300") == 1
    await b.release([("kept", "b:1")])
    assert a.count("kept") == 0


def test_a_class_a_reload_removed_leaves_no_row_cached_behind(tmp_path):
    # HostStore._rows cached (row, name) for every class name ever seen, for the worker's life: each class that
    # reloads removed kept its entry (SharedSlots.apply drops its own per-class entries since 2a61c78). A class
    # still held when removed keeps its row until this worker's last slot of it is given back.
    async def scenario() -> None:
        host_store.create(tmp_path, 1)
        store = HostStore(tmp_path, 0, 1)
        classes = {name: {"max_concurrency": 2, "max_queue": 10} for name in ("interactive", "batch", "bulk")}
        policy = make_policy(classes=classes, tenants=[], store={"kind": "memory"})
        slots = SharedSlots(AdmissionController(policy), store)
        await slots.start()
        assert await store.acquire(claim("w0:1", cls="batch"))  # still running when the reload removes it
        assert await store.acquire(claim("w0:2", cls="bulk"))
        await store.release([("bulk", "w0:2")])
        assert await store.acquire(claim("w0:3", cls="interactive"))
        slots.apply(make_policy(classes={"interactive": classes["interactive"]}, tenants=[], store={"kind": "memory"}))
        assert set(store._rows) == {"interactive", "batch"}
        await store.release([("batch", "w0:1")])
        assert set(store._rows) == {"interactive"}
        await store.release([("interactive", "w0:3")])
        assert set(store._rows) == {"interactive"}  # configured: kept
        await slots.close()

    run_virtual(scenario())


def test_a_worker_that_dies_gives_its_slots_back_before_the_others_drain(tmp_path, monkeypatch):
    """The supervisor stops the other workers when one dies, but they drain first (--drain-s, then --grace-s),
    still admitting: the dead worker's slots used to stay counted in the table all that while (a class it held
    full refused every request for up to 40 s), though nobody could ever release them."""
    import signal
    import sys
    from argparse import Namespace

    from extproc.server import main

    host_store.create(tmp_path, 2)
    prelude = (f"import asyncio, pathlib, signal, sys, time\nfrom extproc.store.host_store import HostStore\n"
               f"from extproc.policy.slot_store import SlotClaim\nd = pathlib.Path({str(tmp_path)!r})\n")
    dies_holding = prelude + (
        "s = HostStore(d, 0, 2)\nassert asyncio.run(s.acquire(SlotClaim('c', 'w0:1', 1.0, 1, None)))\n"
        "while not (d / 'ready').exists(): time.sleep(0.02)\nsys.exit(3)\n")
    asks_when_stopped = prelude + (
        "stop = []\nsignal.signal(signal.SIGTERM, lambda *_: stop.append(1))\n(d / 'ready').touch()\n"
        "while not stop: time.sleep(0.02)\ns = HostStore(d, 1, 2)\n"
        "(d / 'got').write_text(str(asyncio.run(s.acquire(SlotClaim('c', 'w1:1', 1.0, 1, None)))))\n")
    scripts = [dies_holding, asks_when_stopped]
    monkeypatch.setattr(main, "worker_argv", lambda args, i: [sys.executable, "-c", scripts[i]])
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        status = main._run_workers(Namespace(workers=2, host_store=str(tmp_path)))
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert status == 3
    assert (tmp_path / "got").read_text() == "True"  # the dead worker's slot was free for the draining one


async def test_a_class_that_finds_the_table_full_waits_instead_of_failing(pair):
    # A reload that renames the classes of a policy of MAX_CLASSES classes while the old ones still run: the new
    # classes found no row, and their acquire raised RuntimeError (a stream error: failure_mode_allow sent the
    # request on unadmitted). It is refused now, as a full class is, and its poll finds a row once one is idle.
    a, b = pair
    for i in range(host_store.MAX_CLASSES):
        assert await b.acquire(claim(f"b:{i}", cls=f"old-{i}", cap=1))
    assert not await a.acquire(claim("a:1", cls="new", cap=1))
    await b.release([("old-7", "b:7")])
    assert await a.acquire(claim("a:1", cls="new", cap=1))
    assert a.count("new") == 1 and not await b.acquire(claim("b:x", cls="new", cap=1))


async def test_the_table_goes_where_its_sockets_can_bind_under_a_long_tmpdir(tmp_path, monkeypatch):
    # The supervisor put the table and the workers' wake-up sockets in the temp dir; under a TMPDIR of ~70
    # characters or more (a CI runner's, a container's volume) a socket path passed the AF_UNIX limit (108 bytes on
    # Linux, 104 on macOS) and `serve --workers` could not start: OSError 'AF_UNIX path too long'.
    import tempfile
    long_tmp = tmp_path / ("t" * 60) / ("u" * 40)
    long_tmp.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    naive = Path(tempfile.mkdtemp(prefix="extproc-workers-"))
    host_store.create(naive, 16)
    with pytest.raises(OSError):
        await HostStore(naive, 15, 16).start()
    with tempfile.TemporaryDirectory(prefix="extproc-workers-", dir=host_store.table_parent(16)) as d:
        host_store.create(Path(d), 16)
        store = HostStore(Path(d), 15, 16)
        await store.start()
        await store.close()
    short = tempfile.mkdtemp(dir="/tmp", prefix="x")
    monkeypatch.setattr(tempfile, "tempdir", short)  # a short one is kept
    assert host_store.table_parent(16) == short
    os.rmdir(short)


def test_a_waiter_behind_a_head_whose_client_left_takes_the_room_it_has_at_once(tmp_path):
    # A head too large for the class's GPU-seconds left holds the smaller requests behind it (FIFO). When its
    # client left, nothing woke the queue: the one behind, which fit, waited for the next release or poll_ms (5 s
    # here), where the core's queue hands a leaving client's room on at once (AdmissionController.abandon).
    async def scenario() -> float:
        host_store.create(tmp_path, 2)
        other = HostStore(tmp_path, 1, 2)  # another worker holds 3 of the class's 5 GPU-seconds
        assert await other.acquire(claim("w1:1", cap=10, cost=3.0, budget=5.0))
        policy = make_policy(classes={"interactive": {"max_concurrency": 10, "max_queue": 10, "max_wait_ms": 20_000,
                                                      "max_inflight_gpu_seconds": 5.0}},
                             tenants=[], store={"kind": "memory", "poll_ms": 5000})
        loop = asyncio.get_running_loop()
        slots = SharedSlots(AdmissionController(policy, clock=loop.time), HostStore(tmp_path, 0, 2), workers=2)
        await slots.start()
        waits = []
        for max_tokens in (2000, 1000):  # 2.2 and 1.1 GPU-seconds: the head does not fit, the next one would
            d = slots.core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=max_tokens))
            fa = FinalAdmission(slots.core, slots, d)
            waits.append((fa, loop.create_task(fa.settle(lambda s: asyncio.sleep(0)))))
            await asyncio.sleep(0.01)
        (head, head_task), (behind, behind_task) = waits
        assert not head_task.done() and not behind_task.done()
        left = loop.time()
        head_task.cancel()  # its client left (what the stream does)
        with contextlib.suppress(asyncio.CancelledError):
            await head_task
        head.give_back()
        d = await behind_task
        assert d.ticket is not None and d.reason == "dequeued"
        await slots.close()
        await other.close()
        return loop.time() - left

    assert run_virtual(scenario()) < 0.1
