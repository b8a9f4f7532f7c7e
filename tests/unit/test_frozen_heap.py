"""gc.freeze in the server (extproc/server/main.py FrozenHeap): a reload freezes what it applied, garbage is collected
before a freeze, and cycles that died frozen are freed once the frozen objects regrew, so that reloads do not leak.

Each gen-2 collection walked the whole heap on the event loop, the modules and the policy included (2,000 tenants:
10-50 ms a collection, bench/gc_pauses.py); frozen, they are walked no more."""

import asyncio
import gc
import weakref

import pytest

from extproc.server.main import FrozenHeap

from .test_server_background import GOOD, serve


class Node:
    """One link of a reference cycle (weakref-able, so that a test can see whether it was freed)."""

    __slots__ = ("next", "__weakref__")

    def __init__(self) -> None:
        self.next: object = None


def cycle(links: int) -> Node:
    head = node = Node()
    for _ in range(links - 1):
        node.next = Node()
        node = node.next
    node.next = head
    return head


@pytest.fixture(autouse=True)
def thawed():
    """What a test froze is unfrozen after it: the rest of the suite runs with the collector as it found it."""
    yield
    gc.enable()
    gc.unfreeze()


def reload_edited(server, i: int) -> None:
    """The file edited (new bytes: the reload applies) and reloaded, as SIGHUP does."""
    with open(server.policy_path, "a") as f:
        f.write(f"# edit {i}\n")

    async def go() -> bool:
        return await server.reload()

    assert asyncio.run(go())


def test_a_reload_freezes_the_policy_it_applied(tmp_path):
    server = serve(tmp_path)
    reload_edited(server, 0)
    policy = server.core.policy
    assert gc.is_tracked(policy)
    assert not any(o is policy for o in gc.get_objects())  # in the permanent generation: no collection walks it


def test_a_cycle_that_died_before_a_reload_is_collected_not_frozen(tmp_path):
    """Frozen without a collection first, garbage in a cycle of that moment would be kept for good."""
    server = serve(tmp_path)
    reload_edited(server, 0)  # the first settle, a full collection
    gc.disable()  # no collection of the collector's own between its death and the reload
    dead = weakref.ref(cycle(10))
    assert dead() is not None
    reload_edited(server, 1)
    assert dead() is None


def test_cycles_frozen_alive_and_dropped_after_are_freed_and_reloads_do_not_grow_the_heap(tmp_path):
    """A cycle alive at one reload's freeze (a request in flight, a replaced policy's) and dropped after is out of
    every collection's reach while frozen. Without the unfreeze and full collection once the frozen objects regrew
    by FrozenHeap.REGROWTH, each reload kept its cycles for good: here all 20, as many objects as the heap.
    The cycles are sized to the heap the first settle left (this process's: a test worker's heap is whatever the
    tests before it made), so that the bound holds, and fails without the unfreeze, whatever that heap is."""
    server = serve(tmp_path)
    reload_edited(server, 0)
    heap = server.heap
    links = max(1000, heap._full_at // 20)  # 20 cycles: as many objects as the heap holds
    left = [heap._full_at]  # what each full collection left (REGROWTH is of that)
    frozen_at_start = gc.get_freeze_count()
    alive = []
    tracked = []
    for i in range(1, 21):
        held = cycle(links)
        alive.append(weakref.ref(held))
        reload_edited(server, i)  # frozen alive
        del held  # and garbage from now on
        gc.collect()
        left.append(heap._full_at)
        tracked.append(len(gc.get_objects()) + gc.get_freeze_count())
    still = sum(r() is not None for r in alive)
    assert alive[0]() is None
    # Dead and frozen: at most REGROWTH of what the last full collection left, the cycle of the round that crossed
    # it, and the last round's (frozen alive, dropped after): about 7 of the 20 here; all 20 without the unfreeze.
    assert still * links <= max(left) * FrozenHeap.REGROWTH + 2 * links, f"{still} of 20 cycles still kept"
    assert max(tracked) - tracked[0] <= max(frozen_at_start, max(left)) * FrozenHeap.REGROWTH + 2 * links


def test_a_reload_without_new_bytes_freezes_nothing_new(tmp_path):
    """The same bytes again (a SIGHUP sent to be sure) apply nothing: no collection on the loop for them."""
    server = serve(tmp_path)
    reload_edited(server, 0)
    settled = []
    server.heap.settle = lambda: settled.append(1)

    async def go() -> bool:
        return await server.reload()

    assert asyncio.run(go())
    assert settled == []
    assert GOOD in open(server.policy_path).read()
