"""One class's waiters as flows (one per fairness key), served by GPU-seconds relative to weight, EDF inside a flow.

A drop-in for the class queue (`collections.deque[Waiter]`): `append`, `popleft`, `q[0]`, `remove`, `len`,
truthiness and iteration keep their meaning, with `q[0]` the waiter the next free slot goes to. Three ways to pick
between flows (`mode`):

- `fifo`: one line in arrival order, exactly the deque (deadlines and keys ignored);
- `round_robin`: flows take turns, one grant each (llm-d's flow control inside a priority band);
- `fair`: the backlogged flow with the least virtual time, where a flow's virtual time is the GPU-seconds it was
  admitted for divided by its weight (Virtual Token Counting, in our cost units). A flow that becomes backlogged
  starts no lower than the least virtual time of the flows already waiting (or, with none waiting, the start time
  of the last admission), so idle time is not banked. `settle()` corrects a flow with the cost a request really
  had once it is learned, and `teach()` the flow what its requests really cost against their estimates: usage is
  read for a sample of requests only, so the rest are charged their estimate times that (`scale`). A flow under
  its guaranteed share of the class's slots goes first. Work-conserving in every mode: while anyone waits, `q[0]`
  names someone.

Inside a flow (round_robin, fair) the earliest deadline goes first, arrivals breaking ties.

Flows nest in groups: a key `group + SEP + name` (`nested`) is flow `name` inside group `group` (the tenant whose
header key it is); any other key is a group of its own. The mode picks a group first (its weight and guarantee are
the group's name's), then a flow inside it (its name's): a group's keys share its share, however many it sends.

Admission tells the queue about every admission of the class (`admitted`, whether it waited or not: work admitted
straight away counts towards a flow's share too) and every release (`released`); popping a waiter charges nothing
by itself. An admission given back unused (revoked or withdrawn before it ran) gets its charge back (`settle` with
nothing used) and, granted from a round_robin queue, its flow's turn (`return_turn`). Per-label counters (`stats`) keep metrics' label sets bounded: keys that are not configured tenants
fold into "other".
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict
from typing import Any, Callable, Collection, Iterable, Iterator, Literal

Mode = Literal["fifo", "round_robin", "fair"]
MODES: tuple[str, ...] = ("fifo", "round_robin", "fair")
OTHER = "other"
# The least a grant charges, in GPU-seconds: a stream of zero-cost requests must still move its flow's virtual
# time, or it could keep another flow waiting for ever.
MIN_CHARGE_S = 1e-3
# The fairness index reads at most this many flows (the most recently served): header keys are unbounded.
INDEX_FLOWS = 1024
# A flow's scale (actual / estimated GPU-seconds of its settled requests) is the mean of its first samples, then
# moves this far towards each new one (one odd answer moves it by a fifth), within these bounds. The first sample
# replaces the prior of 1 outright: samples are a few percent of requests, and a tenant overcharged by its
# estimate is granted, and so sampled, least.
SCALE_RATE = 0.2
SCALE_BOUNDS = (0.02, 50.0)
SEP = "\x00"  # between a nested key's group and name (no HTTP header value holds a NUL)


def nested(group: str, name: str) -> str:
    """The key of flow `name` inside group `group`."""
    return f"{group}{SEP}{name}"


def split_key(key: str) -> tuple[str, str]:
    """(group, name) of a flow key: a key that is not nested is its own group."""
    group, sep, name = key.partition(SEP)
    return (group, name) if sep else (key, key)


def max_min_shares(demands: dict[str, float], weights: dict[str, float], total: float,
                   floors: dict[str, float] | None = None) -> dict[str, float]:
    """Weighted water-filling: each key gets min(its demand, level x its weight) of `total`, the level set so that
    they add up to it (all of it while demand lasts). Sorted once by demand per weight: O(n log n), where
    filling level by level was O(n^2) over the index's 1,024 flows. `floors`: a share of `total` some keys are
    guaranteed (as far as they ask): min(demand, max(floor x total, level x weight)), the level found by bisection."""
    if floors:
        return _max_min_with_floors(demands, weights, total, floors)
    shares: dict[str, float] = {}
    left, weight = total, sum(weights[k] for k in demands)
    order = sorted(demands, key=lambda k: demands[k] / weights[k])
    for i, k in enumerate(order):
        level = left / weight if weight > 0 else 0.0
        if demands[k] > level * weights[k]:  # this key and all after it ask more than the level: they get it
            shares.update((j, level * weights[j]) for j in order[i:])
            break
        shares[k] = demands[k]
        left -= demands[k]
        weight -= weights[k]
    return shares


def _max_min_with_floors(demands: dict[str, float], weights: dict[str, float], total: float,
                         floors: dict[str, float]) -> dict[str, float]:
    def given(level: float) -> dict[str, float]:
        return {k: min(d, max(floors.get(k, 0.0) * total, level * weights[k])) for k, d in demands.items()}

    if sum(demands.values()) <= total:
        return dict(demands)
    low, high = 0.0, max(d / weights[k] for k, d in demands.items())
    for _ in range(60):  # to ~1e-18 of the largest demand per weight
        mid = (low + high) / 2
        if sum(given(mid).values()) > total:
            high = mid
        else:
            low = mid
    return given(low)


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one has everything.
    1.0 for no values or all zeros (nothing to be unfair about)."""
    xs = [max(v, 0.0) for v in values]
    square = sum(x * x for x in xs)
    if not xs or square <= 0.0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square)


class TenantStats:
    """One label's counters and gauges, for metrics."""

    __slots__ = ("waiting", "inflight", "admitted", "charged_gpu_s", "refunded_gpu_s", "waited_s")

    def __init__(self) -> None:
        self.waiting = 0          # gauge: waiters queued now
        self.inflight = 0         # gauge: admitted and not yet released
        self.admitted = 0         # counter: admissions (queued or not)
        # Two counters, not one sum: learned usage below the estimate lowers what was served, and a series that
        # steps down cannot be rated (rate() reads it as a reset; deriv() of a gauge that restarts from 0 with the
        # process, or with its class after a reload removed it, read served traffic as negative for 5 minutes).
        self.charged_gpu_s = 0.0   # counter: estimates at admission, plus learned usage above them
        self.refunded_gpu_s = 0.0  # counter: learned usage below the estimates
        self.waited_s = 0.0       # counter: seconds waited by the waiters popped from the queue

    @property
    def served_gpu_s(self) -> float:
        return self.charged_gpu_s - self.refunded_gpu_s


class _Flow:
    """One fairness key's waiters, ordered (deadline, arrival) - or by arrival alone in fifo mode."""

    __slots__ = ("key", "entries", "vtime", "inflight", "inflight_cost", "weight", "guaranteed", "group",
                 "members", "backlogged", "waiting", "floor", "flows", "heap", "longest", "since", "bound")

    def __init__(self, key: str, weight: float, guaranteed: float, group: "_Flow | None" = None):
        self.key = key
        self.entries: list[tuple[float, int, Any]] = []
        self.group = group    # a flow's group (None: this is a group)
        self.members = 0      # a group's: its flows kept
        self.backlogged = 0   # a group's: its flows with waiters
        self.waiting = 0      # a group's: its waiters
        self.floor = 0.0      # a group's: start virtual time of its latest admission (never decreases)
        # A group's: its flows with waiters, in turn order (round_robin) as the queue's own list; and a lazy heap of
        # their items (_flow_item: virtual time, in-flight cost per weight, next entry's arrival, key), for the least
        # of them without a pass over the flows a header keys (an item is current while it equals its flow's now).
        self.flows: OrderedDict[str, _Flow] | None = OrderedDict() if group is None else None
        self.heap: list[tuple[float, float, int, str]] | None = [] if group is None else None
        # ...and of their items by length (_long_item: the most waiters, then the highest virtual time, then the
        # first in turn order): the flow a crowded-out place is taken from.
        self.longest: list[tuple[int, float, int, str]] | None = [] if group is None else None
        self.since = 0        # a waiting flow's place in the turn order (the queue's count when it took it)
        self.bound: dict[Any, int] = {}  # pool -> its waiters bound for it (a share on one pool counts these)
        self.vtime = 0.0
        self.inflight = 0
        self.inflight_cost = 0.0
        self.weight = weight
        self.guaranteed = guaranteed

    def first_for(self, pool: str) -> tuple[float, int, Any] | None:
        if pool not in self.bound:
            return None  # no pass over its waiters for another pool
        for entry in self.entries:
            if entry[2].pool == pool:
                return entry
        return None

    def first_outside(self, pools: Collection[str]) -> tuple[float, int, Any] | None:
        for entry in self.entries:
            if entry[2].pool not in pools:
                return entry
        return None


def _guaranteed_share(key: str, weight: float, total: float, guaranteed: list[tuple[str, float, float]]) -> float:
    """A group's share of its class when the active groups with a guarantee (`guaranteed`: key, weight, guarantee)
    get it where it is more than their weighted share, and the rest share what is left by weight (`total`: every
    active group's weight). The owner's return holds a flow to this on a full pool: by weight alone, a tenant
    guaranteed 60% of a class beside two others was held to a third there."""
    bound: dict[str, float] = {}
    left, rest = 1.0, total
    changed = True
    while changed:  # a group bound lowers the others' shares, which may bind another: one pass per group at most
        changed = False
        for k, w, g in guaranteed:
            if k not in bound and rest > 0.0 and g > w / rest * left:
                bound[k], left, rest, changed = g, left - g, rest - w, True
    if key in bound:
        return bound[key]
    return weight / rest * max(left, 0.0) if rest > 0.0 else 0.0


def tenant_key(waiter: Any) -> str:
    """The default fairness key: the waiter's tenant."""
    return waiter.tenant


class FairQueue:
    """A class's waiters: flows per fairness key, the next grant picked by `mode` (see the module docstring).

    `weights` and `guaranteed` map keys to a weight (default 1) and a guaranteed share of the class's slots
    (0..1, default 0, needs `capacity`); `tenants` are the keys that get their own metric label (others fold
    into "other"); `clock` times waits and decays the recent work the fairness index reads (optional)."""

    def __init__(self, mode: Mode = "fair", weights: dict[str, float] | None = None,
                 guaranteed: dict[str, float] | None = None, tenants: Iterable[str] = (),
                 key: Callable[[Any], str] = tenant_key, clock: Callable[[], float] | None = None,
                 capacity: float = 0.0, index_tau_s: float = 60.0):
        if mode not in MODES:
            raise ValueError(f"unknown fairness mode {mode!r} (modes: {', '.join(MODES)})")
        self.mode = mode
        self.weights = dict(weights or {})
        self.guaranteed = dict(guaranteed or {})
        for name, w in self.weights.items():
            if not w > 0:
                raise ValueError(f"weight of {name!r} must be positive, got {w}")
        self.key = key
        self.clock = clock
        self._capacity = capacity
        self.index_tau_s = index_tau_s
        self._labels = set(tenants)
        self.stats: dict[str, TenantStats] = {}
        # flow key -> [served GPU-seconds, unmet GPU-seconds, when], decayed over index_tau_s: the fairness index's
        # input, per flow (not per metric label: header keys all fold into "other" there), the INDEX_FLOWS most
        # recently served or refused
        self._recent: OrderedDict[str, list[float]] = OrderedDict()
        # flow key -> [its scale, samples taught], the most recently settled INDEX_FLOWS (kept apart from the flows:
        # a tenant idle between its bursts keeps what it taught, and header keys' state stays bounded)
        self._scales: OrderedDict[str, list[float]] = OrderedDict()
        # flow key -> [estimates, charges, flow charged, stats served] of its answers settled unread while it had no
        # scale of its own (settle_unread): charged again at the scale its first read answer teaches
        self._unscaled: OrderedDict[str, list[Any]] = OrderedDict()
        self._flows: dict[str, _Flow] = {}          # every flow with waiters, in flight, or configured
        self._groups: dict[str, _Flow] = {}         # every group with a flow kept, or configured
        self._turns: OrderedDict[str, _Flow] = OrderedDict()  # groups with waiters; round_robin: turn order
        # The group whose flows' names are believed to name tenants (their weight, guarantee and label): the
        # anonymous tenant's, keyed by a gateway that knows who is behind it. In any other group a name is just a
        # name: a tenant's key splits its own share, never takes another tenant's.
        self.open_group: str | None = None
        self._backlogged: OrderedDict[str, _Flow] = OrderedDict()  # flows with waiters; round_robin: turn order
        # id(waiter) -> its flow, its entry, and its own key (fifo keeps every waiter in one flow)
        self._where: dict[int, tuple[_Flow, tuple[float, int, Any], str]] = {}
        self._seq = itertools.count()
        self._turn = itertools.count()  # places in the turn order of the waiting flows (_Flow.since)
        self._front = itertools.count(-1, -1)  # ...and before all of them, for a turn given back (return_turn)
        self._lengths: dict[int, int] = {}  # waiting flows by their waiters' count (round_robin's ahead())
        # (deadline, seq, entry) of every waiter, a heap: overdue() runs on every release, and a scan of every
        # waiter for the rare late one cost each grant O(waiters). Left waiters are dropped lazily (_live).
        self._deadlines: list[tuple[float, int, tuple[float, int, Any]]] = []
        # Lazy heaps (an item is current while it equals what it was pushed for; others are dropped when met):
        # (virtual time, group key) of every waiting group, for the least of them; and, in fair mode, each waiting
        # group's grant rank (virtual time, in-flight cost per weight, its next entry's arrival, key) for the groups
        # without a guarantee whose one waiting flow is their own (_pick). Both spare a pass over the waiting flows.
        self._vtimes: list[tuple[float, str]] = []
        self._ranks: list[tuple[float, float, int, str]] = []
        self._nested = 0  # waiting flows nested in a group (a header key)
        self._nesting: dict[str, _Flow] = {}  # the groups with such a flow waiting: _pick looks inside each
        self._vfloor = 0.0  # start virtual time of the latest admission, at most the least waiting (never decreases)
        self._head: Any = None  # cache of q[0]; None when it must be recomputed

    @property
    def capacity(self) -> float:
        """The class's slots now (set by the limiter as its limit moves): a guarantee is a share of them."""
        return self._capacity

    @capacity.setter
    def capacity(self, slots: float) -> None:
        if slots != self._capacity:
            self._capacity = slots
            self._head = None  # who is under their guarantee may have changed: q[0] is picked anew

    # --- the deque interface ---

    def append(self, waiter: Any) -> None:
        if id(waiter) in self._where:
            raise ValueError("waiter is already queued")
        key = self.key(waiter)
        fkey = "" if self.mode == "fifo" else key
        new, new_group = fkey not in self._flows, split_key(fkey)[0] not in self._groups
        flow = self._flow(fkey)
        if not flow.entries:
            # never served: it starts where the waiting flows are, not behind them (_become_backlogged)
            if new:
                flow.vtime = -math.inf
            if new_group:
                flow.group.vtime = -math.inf
            self._become_backlogged(flow)
        flow.group.waiting += 1
        order = 0.0 if self.mode == "fifo" else waiter.deadline
        entry = (order, next(self._seq), waiter)
        bisect.insort(flow.entries, entry, key=_order)
        pool = getattr(waiter, "pool", None)
        flow.bound[pool] = flow.bound.get(pool, 0) + 1
        self._count_length(len(flow.entries) - 1, len(flow.entries))
        self._where[id(waiter)] = (flow, entry, key)
        heapq.heappush(self._deadlines, (waiter.deadline, entry[1], entry))
        self._stats(key).waiting += 1
        self._moved(flow.group, flow)
        self._head = None

    def popleft(self) -> Any:
        """Remove and return q[0], the next grant (see take())."""
        return self.take(self[0])

    def remove(self, waiter: Any) -> None:
        """Take a waiter out wherever it is (deadline passed, client gone); ValueError if it is not queued."""
        if id(waiter) not in self._where:
            raise ValueError("waiter is not queued")
        self._take(waiter)

    def __getitem__(self, index: int) -> Any:
        if index != 0:
            raise IndexError("only q[0] (the next grant) is defined")
        if self._head is None:
            self._head = self._pick(None)
            if self._head is None:
                raise IndexError("the queue is empty")
        return self._head

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __iter__(self) -> Iterator[Any]:
        """The waiters in arrival order (not grant order)."""
        if self.mode == "fifo":  # one flow, already in arrival order: no sort of every waiter (a fifo grant's pass)
            line = self._flows.get("")
            return iter([e[2] for e in line.entries] if line is not None else [])
        entries = sorted((e for _, e, _ in self._where.values()), key=lambda e: e[1])
        return iter([e[2] for e in entries])

    def __contains__(self, waiter: Any) -> bool:
        return id(waiter) in self._where

    def unordered(self) -> Iterator[Any]:
        """The waiters in no particular order, read as asked for (a test of every waiter stops at the first that
        fails, without the sort or the copy of iteration in arrival order). Nothing may be queued or taken meanwhile."""
        return (entry[2] for _, entry, _ in self._where.values())

    def in_line(self) -> Iterator[Any]:
        """fifo: the waiters queued now, in arrival order, each looked up when the one before it has been handled
        (taken, left, or passed over): O(log waiters) a step, where a copy of the line cost every grant on a full
        class a pass over all of its waiters. Those that arrive meanwhile are not given, as a copy would not."""
        line = self._flows.get("")
        if line is None or not line.entries:
            return
        last, end = (0.0, -1), line.entries[-1][1]
        while True:
            line = self._flows.get("")  # forgotten once empty, and made anew by an arrival
            if line is None:
                return
            i = bisect.bisect_right(line.entries, last, key=_order)
            if i == len(line.entries) or line.entries[i][1] > end:
                return
            entry = line.entries[i]
            last = _order(entry)
            yield entry[2]

    # --- beyond the deque ---

    def configure(self, mode: Mode, weights: dict[str, float], guaranteed: dict[str, float],
                  tenants: Iterable[str]) -> None:
        """A reloaded policy: new mode, weights, guarantees and labels. Waiters keep their arrival order and
        flows what they were served; a changed mode re-sorts the waiters into its flows. New labels move what
        waits and what runs to its key's new label: a request is released from the label it is counted under."""
        if mode not in MODES:
            raise ValueError(f"unknown fairness mode {mode!r} (modes: {', '.join(MODES)})")
        labels = set(tenants)
        relabel = labels != self._labels
        waiters = list(self) if mode != self.mode or relabel else []
        for w in waiters:
            self._take(w, forget=False)  # a flow that only waits keeps what it was served (forgotten below if idle)
        running = [(f, self.label(f.key)) for f in self._flows.values() if relabel and f.inflight]
        self.mode = mode
        self.weights, self.guaranteed, self._labels = dict(weights), dict(guaranteed), labels
        for flow, was in running:
            self._counts(was).inflight -= flow.inflight
            self._stats(flow.key).inflight += flow.inflight
        for group in self._groups.values():
            group.weight, group.guaranteed = self.weights.get(group.key, 1.0), self.guaranteed.get(group.key, 0.0)
        for flow in self._flows.values():
            flow.weight, flow.guaranteed = self._own(flow.key)
        for w in waiters:
            self.append(w)
        for flow in list(self._flows.values()):
            self._forget_if_idle(flow)  # configured no more: an idle one is kept no longer than any header key's
        for group in list(self._groups.values()):
            self._forget_group_if_idle(group)
        for label in [label for label in self.stats if label not in labels and label != OTHER]:
            del self.stats[label]  # a tenant the policy removed (what it had waiting and running moved above)
        for group in self._turns.values():  # the flows' weights may have changed: each group's items anew
            self._reheap(group)
        self._reindex()
        self._head = None

    def first_for(self, pool: str) -> Any | None:
        """The next waiter bound for `pool` (the one a slot freed on that pool goes to), or None."""
        return self._pick(pool)

    def first_outside(self, pools: Collection[str]) -> Any | None:
        """The next grant among the waiters bound for a pool not in `pools` (pools found with no room), or None."""
        if not pools:
            return self[0] if self else None
        return self._pick(None, pools)

    def take(self, waiter: Any) -> Any:
        """Remove a waiter because it is granted (q[0], or first_for(pool)): its flow's turn ends (round_robin;
        return_turn() gives it back if the grant is never used) and its wait is counted. Charges nothing: admission
        reports the admission (`admitted`)."""
        if id(waiter) not in self._where:
            raise ValueError("waiter is not queued")
        flow, _, key = self._where[id(waiter)]
        self._take(waiter)
        if self.mode == "round_robin":  # its turn is over, and its group's
            if flow.key in self._backlogged:
                self._backlogged.move_to_end(flow.key)
                flow.group.flows.move_to_end(flow.key)
                flow.since = next(self._turn)
                self._moved(flow.group, flow)
            if flow.group.key in self._turns:
                self._turns.move_to_end(flow.group.key)
        if self.clock is not None:
            self._stats(key).waited_s += max(self.clock() - waiter.enqueued_at, 0.0)
        return waiter

    def ahead(self, key: str) -> int:
        """Waiters likely granted before a new arrival of flow `key` (fifo: all of them; otherwise its own flow's,
        of every other flow of its group it would not be served before as many as its own flow will have, and of
        every other group it would not be served before as many as its own group will have put before it): the
        deadline-aware early rejection's queue ahead."""
        if self.mode == "fifo":
            return len(self._where)
        own = self._flows.get(key)
        mine = len(own.entries) if own is not None else 0
        if self.mode == "round_robin" and not self._nested and SEP not in key:  # every group one flow, its own too
            # Every other flow goes before it, each with as many as its own will have (its own flow, when it waits,
            # is the `mine` of that sum): from the count of flows by length, not a pass over every waiting flow.
            return sum(min(length, mine + 1) * flows for length, flows in self._lengths.items())
        gkey = split_key(key)[0]
        group = self._groups.get(gkey)
        if self.mode == "round_robin":
            # Groups take turns, then their flows: a group of many header keys gets a turn, not one per key.
            inner = mine + sum(min(len(f.entries), mine + 1) for f in self._backlogged.values()
                               if f.group is group and f is not own)
            return inner + sum(min(g.waiting, inner + 1) for g in self._turns.values() if g is not group)
        least = self._least_vtime()
        gtime = max(group.vtime if group is not None else self._vfloor, self._vfloor if least is None else least)
        if group is None or group.backlogged == (1 if mine else 0):
            ftime = math.inf  # no other flow of its group waits (the usual case): the pass for it is not needed
        else:
            ftime = max(own.vtime if own is not None else group.floor, self._least_in(group, math.inf))
        # The others go first by their groups' rank (_grant_rank: under its guarantee first, then virtual time),
        # those of its own group by their own virtual time.
        first = self._under_guarantee(group) if group is not None else \
            self.guaranteed.get(gkey, 0.0) * self.capacity > 0.0
        rank = (not first, gtime)
        inner = mine if ftime == math.inf else \
            mine + sum(min(len(f.entries), mine + 1) for f in self._backlogged.values()
                       if f is not own and f.group is group and f.vtime <= ftime)
        return inner + sum(min(g.waiting, inner + 1) for g in self._turns.values()
                           if g is not group and (not self._under_guarantee(g), g.vtime) <= rank)

    def crowded_out_by(self, key: str) -> Any | None:
        """With every place taken, the waiter a new arrival of flow `key` takes the place of: the last of the
        longest flow of the group with the most waiters per weight, if that group would still hold as many per
        weight as `key`'s after the swap (equal weights: two places more; a group's keys share its places as they
        share its share). In `fair` places go by weight as grants do: counted by heads, a weight-2 tenant, drained
        twice as fast as its neighbours, ran out of waiters and was refused for a full queue its neighbours held,
        and was served 43% where 50% was due. `round_robin` grants by turns, and counts heads. None in fifo mode
        (the arrival overflows): a flood holds the queue's places no more than its slots."""
        if self.mode == "fifo" or not self._backlogged:
            return None
        gkey = split_key(key)[0]
        own = self._groups.get(gkey)
        fair = self.mode == "fair"
        mine = own.waiting if own is not None else 0
        own_weight = (own.weight if own is not None else self.weights.get(gkey, 1.0)) if fair else 1.0
        longest = max(self._turns.values(), key=lambda g: (g.waiting / (g.weight if fair else 1.0), g.vtime))
        if longest is own:
            return None
        # after the swap, the arrival's group must not hold more places per weight than the one giving one up
        if (longest.waiting - 1) / (longest.weight if fair else 1.0) < (mine + 1) / own_weight:
            return None
        return self._longest_flow(longest).entries[-1][2]

    def waiting_in(self, key: str) -> bool:
        """Whether flow `key` has waiters (fifo: whether anyone waits)."""
        flow = self._flows.get("" if self.mode == "fifo" else key)
        return flow is not None and bool(flow.entries)

    def heads_for(self, pool: str, holders: Collection[str] = (),
                  weights: Callable[[], tuple] | None = None) -> Iterator[tuple[str, float, Any]]:
        """Each waiting flow's next waiter bound for `pool`: (flow key, its share of the pool (share(key, pool,
        holders)), waiter). O(flows): the active weights the shares divide by are summed once per call (once per
        flow, a grant on a full pool was quadratic: 50-60 ms of the event loop with 1,000 tenants waiting,
        bench/scale.py). `weights`: pool_weights(pool, holders), where the caller needs them too."""
        active = None
        for flow in self._backlogged.values():
            entry = flow.first_for(pool)
            if entry is not None:
                if active is None:
                    active = weights() if weights is not None else self._active_weights(pool, holders)
                yield flow.key, self._share(flow.key, *active), entry[2]

    def share(self, key: str, pool: str | None = None, holders: Collection[str] = ()) -> float:
        """Flow `key`'s weighted share of the class: its group's share among the groups active in it (waiting or
        in flight) and its own, times the flow's share among its group's active flows and itself. In fair mode a
        group's share is at least its guaranteed share, the others sharing the rest by weight. With `pool`, its
        share of what the class holds there: only the flows waiting for that pool or holding some of it (their
        keys in `holders`) count as active. The owner's return compares a flow with what its class holds on one
        pool (PoolGate.owed): the class's tenants of other pools counted, a weight-3 tenant beside a weight-1 one
        was owed 3/5 of the 70B pool, not 3/4, and served 65% of it."""
        return self._share(key, *self._active_weights(pool, holders))

    def pool_weights(self, pool: str, holders: Collection[str]) -> tuple:
        """The active weights on `pool` that heads_for and borrowed read (summed once for both: O(flows))."""
        return self._active_weights(pool, holders)

    def borrowed(self, pool: str, holders: dict[str, list[float]], asking: str | None = None,
                 weights: tuple | None = None) -> float:
        """What the flows holding on `pool` (`holders`: key -> [units, requests]) hold there over their shares of
        all they hold (and over one request), summed: the room the owner's return may take back (PoolGate.owed). `asking`: a flow to count
        as active, as share() counts the flow it is asked for (one arriving with nothing waiting). O(flows), or
        O(holders) given `weights` (pool_weights)."""
        groups, flows, guaranteed, is_active = weights if weights is not None else \
            self._active_weights(pool, holders)
        own = self._flows.get(asking) if asking is not None else None
        if asking is not None and (own is None or not is_active(own)):
            gkey = split_key(asking)[0]
            group = self._groups.get(gkey)
            if group is None or group not in flows:
                gweight = group.weight if group is not None else self.weights.get(gkey, 1.0)
                groups += gweight
                mine = group.guaranteed if group is not None else self.guaranteed.get(gkey, 0.0)
                if mine > 0.0 and self.mode == "fair":
                    guaranteed = [*guaranteed, (gkey, gweight, mine)]
            if group is not None:
                fweight = own.weight if own is not None else self._own(asking)[0]
                flows = {**flows, group: flows.get(group, 0.0) + fweight}
        total = sum(held[0] for held in holders.values())
        # A flow's one request is never over its share (a flow holding one is owed it, as the asking one is):
        # else, with more flows than requests on the pool, every holder reads as a borrower.
        return sum(max(0.0, units - max(self._share(key, groups, flows, guaranteed, is_active) * total,
                                        units / requests))
                   for key, (units, requests) in holders.items() if requests > 1)

    def _active_weights(self, pool: str | None = None, holders: Collection[str] = ()) -> \
            tuple[float, dict[_Flow, float], list[tuple[str, float, float]], Callable[[_Flow], bool]]:
        """The weights of the groups active in the class (waiting or in flight; with `pool`, on that pool: see
        share()), summed; of each group's active flows (summed in the order share() always added them: the same
        floats); (key, weight, guarantee) of the active groups with a guarantee (fair mode); and the test of a
        flow's being active."""
        if pool is None:
            def is_active(f: _Flow) -> bool:
                return bool(f.entries) or f.inflight > 0
        else:
            def is_active(f: _Flow) -> bool:
                return pool in f.bound or f.key in holders
        flows: dict[_Flow, float] = {}
        for f in self._flows.values():
            if is_active(f):
                flows[f.group] = flows.get(f.group, 0) + f.weight
        active = [g for g in self._groups.values() if g in flows]
        groups = sum(g.weight for g in active)
        guaranteed = [(g.key, g.weight, g.guaranteed) for g in active if g.guaranteed > 0.0] \
            if self.mode == "fair" and self.guaranteed else []
        return groups, flows, guaranteed, is_active

    def _share(self, key: str, groups: float, active: dict[_Flow, float],
               guaranteed: list[tuple[str, float, float]], is_active: Callable[[_Flow], bool]) -> float:
        gkey = split_key(key)[0]
        group, own = self._groups.get(gkey), self._flows.get(key)
        gweight = group.weight if group is not None else self.weights.get(gkey, 1.0)
        fweight = own.weight if own is not None else self._own(key)[0]
        flows = active.get(group, 0) if group is not None else 0
        if group is None or group not in active:
            groups += gweight
            mine = group.guaranteed if group is not None else self.guaranteed.get(gkey, 0.0)
            if mine > 0.0 and self.mode == "fair":
                guaranteed = [*guaranteed, (gkey, gweight, mine)]
        if own is None or not is_active(own):
            flows += fweight
        if not guaranteed:
            return gweight / groups * fweight / flows
        return _guaranteed_share(gkey, gweight, groups, guaranteed) * fweight / flows

    def overdue(self, now: float) -> list[Any]:
        """Waiters whose deadline has passed, earliest first (q[0] need not be the earliest in fair modes). O(1)
        when none has (the deadline heap's top), else O(late + left waiters above them) and their sort."""
        heap = self._deadlines
        while heap and not self._live(heap[0]):
            heapq.heappop(heap)
        if not heap or heap[0][0] > now:
            return []
        late, below = [], [0]
        while below:  # every heap node at or before `now`: its parents are too
            i = below.pop()
            if i < len(heap) and heap[i][0] <= now:
                if self._live(heap[i]):
                    late.append(heap[i][2])
                below += (2 * i + 1, 2 * i + 2)
        late.sort(key=lambda e: (e[2].deadline, e[1]))
        return [e[2] for e in late]

    def _live(self, item: tuple[float, int, tuple[float, int, Any]]) -> bool:
        """Whether a deadline heap item's waiter still waits in this place (not taken, nor queued anew since)."""
        where = self._where.get(id(item[2][2]))
        return where is not None and where[1] is item[2]

    def admitted(self, key: str, cost: float) -> float:
        """A request of flow `key` was admitted (from the queue or straight away), estimated at `cost` GPU-s.
        Returns what it was charged (the estimate times the flow's scale): settle() against that."""
        flow = self._flow(key)
        group = flow.group
        charge = cost * self.scale(key)
        # The floor follows admissions in virtual-time order, never past a group still waiting: a guaranteed
        # tenant is granted ahead of that order, and its far virtual time as the floor put whoever started at
        # the floor (a flow forgotten when its last waiter was granted, then admitted anew) behind every waiter.
        least = self._least_vtime()
        self._vfloor = max(self._vfloor, group.vtime if least is None else min(group.vtime, least))
        # Likewise a group's floor, never past a flow of the group still waiting (a guaranteed key of the open
        # group is granted ahead of its virtual time order).
        group.floor = max(group.floor, self._least_in(group, flow.vtime))
        step = max(charge, MIN_CHARGE_S)
        for f in (group, flow):
            f.vtime += step / f.weight
            f.inflight += 1
            f.inflight_cost += cost
        st = self._stats(key)
        st.admitted += 1
        st.inflight += 1
        self._serve(st, key, charge)
        self._moved(group, flow)
        self._head = None
        return charge

    def released(self, key: str, cost: float) -> None:
        """An admitted request of flow `key` gave its slot back."""
        flow = self._flows.get(key)
        if flow is not None:
            for f in (flow.group, flow):
                f.inflight -= 1
                f.inflight_cost -= cost
            self._moved(flow.group, flow)
            self._forget_if_idle(flow)
        self._stats(key).inflight -= 1
        self._head = None

    def return_turn(self, key: str, taken_from: Any = None) -> None:
        """round_robin: a grant of flow `key` that took its turn (take()) was given back unused (its admission
        revoked or withdrawn before it ran): the turn goes back, as settle() with nothing used refunds a fair charge.
        The flow, if it still waits, goes first in the turn order again, and its group first among the groups (where
        a grant of q[0] found them). Turns given back do not add up: two give it the next grant, not the next two.
        `taken_from`: flow_of(key) at its admission; a flow forgotten since (nothing waited or ran) has none to get."""
        flow = self._flows.get(key)
        if self.mode != "round_robin" or flow is None or not flow.entries or \
                (taken_from is not None and flow is not taken_from):
            return
        group = flow.group
        self._backlogged.move_to_end(flow.key, last=False)
        group.flows.move_to_end(flow.key, last=False)
        self._turns.move_to_end(group.key, last=False)
        flow.since = next(self._front)
        self._moved(group, flow)
        self._head = None

    def flow_of(self, key: str) -> Any:
        """The flow kept for `key` now (None: none), as settle() takes it: a request's charge went to the flow kept
        when it was admitted."""
        return self._flows.get(key)

    def stats_of(self, key: str) -> TenantStats:
        """The counters of the metric label a request of flow `key` is charged under now (settle's `served_by`)."""
        return self._stats(key)

    def settle(self, key: str, charged: float, actual: float, charged_to: Any = None,
               served_by: TenantStats | None = None) -> None:
        """Learned usage: a request of flow `key` charged `charged` GPU-seconds (what admitted() returned) really
        cost `actual` (0: it never ran). `charged_to`: flow_of(key) at its admission; the flow's virtual time is
        corrected only if it is still the one kept (a flow forgotten since took the charge with it: a refund to the
        flow that came back put it below the waiting flows by what the estimate was over). `served_by`:
        stats_of(key) at its admission, the label it was counted as served under (a reload may have relabelled
        the key since: the whole charge refunded to its new label read as negative service there)."""
        flow = self._flows.get(key)
        if flow is not None and (charged_to is None or flow is charged_to):
            flow.vtime += (actual - charged) / flow.weight
            flow.group.vtime += (actual - charged) / flow.group.weight
            self._moved(flow.group, flow)
        self._serve(self._stats(key) if served_by is None else served_by, key, actual - charged)
        self._head = None

    def settle_unread(self, key: str, charged: float, estimated: float, charged_to: Any = None,
                      served_by: TenantStats | None = None) -> None:
        """An answer of flow `key` whose usage was not read (all but `learn_sample` of them), charged `charged`
        at its admission, `estimated` GPU-seconds at the cost model's coefficients now. While the flow has no
        scale of its own, it is kept and charged again once the flow's first read answer teaches one (teach): a
        client asking max_tokens 1,000 for 50-token answers, charged ~10x its use until then, carried that debt
        for good, and beside a neighbour whose answers were read more often (it was granted more) was served 1
        grant in 15 for 300 grants. Once the flow has a scale, its answers stay as charged: re-pricing each at the
        scale of the moment (a sum over its last few read answers) moved tenants-backlogged's weight-2 tenant from
        46% of the GPU-seconds to 43%."""
        if self.has_scale(key):
            return
        now = estimated * self.scale(key)
        self.settle(key, charged, now, charged_to, served_by)
        kept = self._unscaled.get(key)
        if kept is None:
            kept = self._unscaled[key] = [0.0, 0.0, charged_to, served_by]
        kept[0] += estimated
        kept[1] += now
        kept[2], kept[3] = charged_to, served_by
        self._unscaled.move_to_end(key)
        while len(self._unscaled) > INDEX_FLOWS:
            self._unscaled.popitem(last=False)

    def has_scale(self, key: str) -> bool:
        """Whether a read answer of flow `key` has taught it a scale of its own (kept for the INDEX_FLOWS settled
        last)."""
        return key in self._scales

    def scale(self, key: str) -> float:
        """What flow `key`'s requests really cost against their estimates, as its settled ones said (1 until one
        has): a client that asks a large max_tokens and gets short answers, or whose text has more tokens per
        character than the estimate assumes, is charged what it uses, not what the estimate says. A nested key
        that has settled nothing yet takes its group's (its tenant's clients are alike more often than not)."""
        learned = self._scales.get(key)
        if learned is None and SEP in key:
            learned = self._scales.get(split_key(key)[0])
        return min(max(learned[0] / learned[1], SCALE_BOUNDS[0]), SCALE_BOUNDS[1]) if learned else 1.0

    def teach(self, key: str, estimated: float, actual: float) -> None:
        """A request of flow `key` whose estimate, at the cost model's coefficients now, is `estimated` really cost
        `actual` at the same: its scale. (Against the estimate made at admission the scale would follow the
        coefficients as they are learned too, each flow as fast as it is sampled: a weight-1 tenant lagged its
        weight-2 neighbour's and was served 29% where 25% was due.)"""
        if estimated <= 0.0:
            return
        group = split_key(key)[0]
        for k in (key,) if group == key else (key, group):
            learned = self._scales.get(k)
            if learned is None:
                self._scales[k] = [actual, estimated]
            else:  # sums, the older samples fading: large requests weigh more than a mean of ratios gave them
                learned[0] = learned[0] * (1.0 - SCALE_RATE) + actual
                learned[1] = learned[1] * (1.0 - SCALE_RATE) + estimated
                self._scales.move_to_end(k)
        while len(self._scales) > INDEX_FLOWS:
            self._scales.popitem(last=False)  # the flow settled least recently
        kept = self._unscaled.pop(key, None)
        if kept is not None:  # its answers settled unread before it had a scale: at the one it has now
            self.settle(key, kept[1], kept[0] * self.scale(key), kept[2], kept[3])
            flow = self._flows.get(key)
            if flow is not None and (kept[2] is None or flow is kept[2]):
                self._back_in_line(flow)

    def _back_in_line(self, flow: _Flow) -> None:
        """A flow refunded a long overcharge goes no further back than the least of the others waiting: below them
        it took every grant for the next hundred, its neighbour starved meanwhile. (Not the floor: that is where
        the latest admission started, often its own overcharged virtual time.)"""
        group = flow.group
        others = [g.vtime for g in self._turns.values() if g is not group]
        if others:
            group.vtime = max(group.vtime, min(others))
        if flow is not group:
            inside = [f.vtime for f in group.flows.values() if f is not flow]
            if inside:
                flow.vtime = max(flow.vtime, min(inside))
        self._moved(group, flow)

    def virtual_time(self, key: str) -> float:
        """A flow's virtual time among its group's flows; a key that is its own group's, among the groups."""
        flow = self._flows.get(key)
        if flow is None:
            return self._vfloor
        return flow.group.vtime if flow.key == flow.group.key else flow.vtime

    def unmet(self, key: str, cost: float) -> None:
        """A request of flow `key`, estimated at `cost` GPU-seconds, that the class could not take (its queue full,
        its wait out, shed, a breaker: refused, or sent to a fallback): demand the fairness index weighs what each
        flow was served against. Priced as an admission would have charged it (times the flow's scale). A
        fairness-header key the index does not hold yet is left out: refusals cost a client nothing, and a flood of
        them under new keys would push the tenants out of the index's INDEX_FLOWS (every tenant is counted, and a
        header key once served)."""
        index_key = self._index_key(key)
        if SEP in index_key and index_key not in self._recent:
            return
        self._remember(key, 0.0, max(cost, 0.0) * self.scale(key))

    def fairness_index(self) -> float:
        """Jain's index of what each flow was served against its due: its weighted max-min share of all that was
        served, given what it asked (served, refused or sent elsewhere for want of room, and waiting now). GPU-seconds,
        decayed over `index_tau_s` (without a clock, over all time). A flow that got all it asked reads as fairly
        served however little that was; one refused while another got more than its weight's share reads low. Per
        tenant, and per flow where a header names it without an API key (the open group), so that gateway's flows
        count one by one - each against its part of the group's weight, as the queue shares it."""
        now = self.clock() if self.clock is not None else None
        served: dict[str, float] = {}
        asked: dict[str, float] = {}
        for key, (gpu_s, unmet, at) in self._recent.items():
            decay = 1.0 if now is None else math.exp(-max(now - at, 0.0) / self.index_tau_s)
            served[key] = max(gpu_s, 0.0) * decay
            asked[key] = served[key] + unmet * decay
        for _, entry, key in self._where.values():  # demand not met yet
            k = self._index_key(key)
            asked[k] = asked.get(k, 0.0) + getattr(entry[2], "cost", 0.0) * self.scale(key)
            served.setdefault(k, 0.0)
        asked = {k: a for k, a in asked.items() if a > 1e-9}
        if len(asked) < 2:
            return 1.0
        # A tenant's guaranteed share is of the class's slots: taken here as that share of its service.
        floors = {k: self.guaranteed[k] for k in asked if k in self.guaranteed}
        due = max_min_shares(asked, self._index_weights(asked), sum(served[k] for k in asked), floors)
        return jain_index(served[k] / due[k] if due[k] > 1e-12 else 1.0 for k in asked)

    def _index_weights(self, keys: Iterable[str]) -> dict[str, float]:
        """Each flow's weight as the queue shares: its group's, split among the group's flows here by their own."""
        own = {k: self._own(k)[0] for k in keys}
        inside: dict[str, float] = {}
        for k, w in own.items():
            group = split_key(k)[0]
            inside[group] = inside.get(group, 0.0) + w
        return {k: self.weights.get(split_key(k)[0], 1.0) * w / inside[split_key(k)[0]] for k, w in own.items()}

    def label(self, key: str) -> str:
        """The metric label of a fairness key: the tenant it names if that is a configured tenant, else "other".
        A key nested in a group other than the open one is labelled by its group (the tenant whose key it is)."""
        group, name, believed = self._split(key)
        name = name if believed else group
        return name if name in self._labels else OTHER

    # --- inside ---

    def _own(self, key: str) -> tuple[float, float]:
        """A flow's weight and guaranteed share inside its group, by its name (in the open group, or a group of
        its own) - a name in any other group is only a name."""
        _, name, believed = self._split(key)
        return self._named(name, believed)

    def _named(self, name: str, believed: bool) -> tuple[float, float]:
        """_own() of a key split already: its name's weight and guarantee if the name is believed."""
        if not believed:
            return 1.0, 0.0
        return self.weights.get(name, 1.0), self.guaranteed.get(name, 0.0)

    def _split(self, key: str) -> tuple[str, str, bool]:
        """split_key()'s (group, name) of a flow key, and whether its name is believed: taken to name a tenant (its
        weight, guarantee, label and index entry). It is for a key that is its own group, or one in the open group (a
        gateway's, for requests without an API key). A name in any other group is the tenant's own key, which splits
        that tenant's share and never takes another's. (One split for all three: label() and _own() on every
        admission and release split each key twice.)"""
        # Not group == name: a tenant's own header key that spells the tenant's name is nested too, and took the
        # tenant's weight and guarantee against its sibling keys.
        group, sep, name = key.partition(SEP)
        if not sep:
            return key, key, True
        return group, name, group == self.open_group

    def _flow(self, key: str) -> _Flow:
        flow = self._flows.get(key)
        if flow is None:
            gkey, name, believed = self._split(key)
            group = self._groups.get(gkey)
            if group is None:
                group = self._groups[gkey] = _Flow(gkey, self.weights.get(gkey, 1.0), self.guaranteed.get(gkey, 0.0))
                group.vtime = self._vfloor
            flow = _Flow(key, *self._named(name, believed), group)
            flow.vtime = group.floor
            group.members += 1
            self._flows[key] = flow
        return flow

    def _become_backlogged(self, flow: _Flow) -> None:
        group = flow.group
        if not group.backlogged:
            least = self._least_vtime()
            group.vtime = max(group.vtime, self._vfloor if least is None else least)
            self._turns[group.key] = group
            floor = group.floor  # none of its flows waits
        else:
            least = self._least_flow(group)
            floor = group.floor if least is None else least.vtime
        flow.vtime = max(flow.vtime, floor)
        group.backlogged += 1
        self._backlogged[flow.key] = flow
        group.flows[flow.key] = flow
        flow.since = next(self._turn)
        if flow.key != group.key:
            self._nested += 1
            self._nesting[group.key] = group

    def _take(self, waiter: Any, forget: bool = True) -> None:
        flow, entry, key = self._where.pop(id(waiter))
        i = bisect.bisect_left(flow.entries, _order(entry), key=_order)
        while flow.entries[i] is not entry:
            i += 1
        del flow.entries[i]
        pool = getattr(waiter, "pool", None)
        flow.bound[pool] -= 1
        if not flow.bound[pool]:
            del flow.bound[pool]
        self._count_length(len(flow.entries) + 1, len(flow.entries))
        flow.group.waiting -= 1
        self._stats(key).waiting -= 1
        if len(self._deadlines) > 2 * len(self._where) + 64:  # left waiters' items: dropped, amortized O(1)
            self._deadlines = [item for item in self._deadlines if self._live(item)]
            heapq.heapify(self._deadlines)
        group = flow.group
        if not flow.entries:
            del self._backlogged[flow.key]
            del group.flows[flow.key]
            if flow.key != group.key:
                self._nested -= 1
                if len(group.flows) == (1 if group.key in group.flows else 0):
                    del self._nesting[group.key]
            group.backlogged -= 1
            if not group.backlogged:
                del self._turns[group.key]
            if forget:
                self._forget_if_idle(flow)
        self._moved(group, flow)
        self._head = None

    def _moved(self, group: _Flow, flow: _Flow | None = None) -> None:
        """A group's virtual time, in-flight cost or next entry may have changed, or those of its flow `flow`: their
        heap items anew."""
        if flow is not None and flow.entries and group.flows.get(flow.key) is flow:
            heapq.heappush(group.heap, _flow_item(flow))
            heapq.heappush(group.longest, _long_item(flow))
            if len(group.heap) > 2 * len(group.flows) + 8:  # items out of date dropped, amortized O(1) a change
                self._reheap(group)
        if not group.backlogged or self._turns.get(group.key) is not group:
            return
        heapq.heappush(self._vtimes, (group.vtime, group.key))
        rank = self._rank(group)
        if rank is not None:
            heapq.heappush(self._ranks, rank)
        if len(self._vtimes) + len(self._ranks) > 8 * len(self._turns) + 128:
            self._reindex()  # items gone out of date: dropped, amortized O(1) a change

    def _reindex(self) -> None:
        """The heaps from the waiting groups (a reload, or too many items out of date)."""
        self._vtimes = [(g.vtime, g.key) for g in self._turns.values()]
        heapq.heapify(self._vtimes)
        self._ranks = [r for r in map(self._rank, self._turns.values()) if r is not None]
        heapq.heapify(self._ranks)

    def _rank(self, group: _Flow) -> tuple[float, float, int, str] | None:
        """A waiting group's item of the rank heap (fair mode, no guarantee, its own key's flow the one waiting), or
        None."""
        if self.mode != "fair" or group.guaranteed > 0.0 or group.backlogged != 1:
            return None
        flow = self._flows.get(group.key)
        if flow is None or not flow.entries:
            return None
        return group.vtime, group.inflight_cost / group.weight, flow.entries[0][1], group.key

    def _least_vtime(self) -> float | None:
        """The least virtual time of the waiting groups (None: none waits)."""
        heap, turns = self._vtimes, self._turns
        while heap:
            vtime, key = heap[0]
            group = turns.get(key)
            if group is not None and group.vtime == vtime:
                return vtime
            heapq.heappop(heap)
        return None

    def _least_in(self, group: _Flow, vtime: float) -> float:
        """`vtime`, or the least virtual time of the group's waiting flows if lower (its heap's least)."""
        if not group.backlogged or vtime <= group.floor:
            return vtime  # nothing waits, or the floor does not move anyway
        least = self._least_flow(group)
        return vtime if least is None else min(vtime, least.vtime)

    @staticmethod
    def _least_flow(group: _Flow) -> _Flow | None:
        """The group's waiting flow first by its item (_flow_item: virtual time first), None if none waits."""
        return _least_current(group.heap, group.flows, _flow_item)

    @staticmethod
    def _longest_flow(group: _Flow) -> _Flow:
        """The waiting group's flow with the most waiters, of those the one with the highest virtual time, of those
        the first in turn order (its heap's least current item by _long_item)."""
        return _least_current(group.longest, group.flows, _long_item)

    @staticmethod
    def _reheap(group: _Flow) -> None:
        """A group's heaps from its waiting flows: their items out of date dropped, or all of them changed."""
        flows = list(group.flows.values())
        group.heap, group.longest = [_flow_item(f) for f in flows], [_long_item(f) for f in flows]
        heapq.heapify(group.heap)
        heapq.heapify(group.longest)

    def _first_in(self, group: _Flow) -> _Flow:
        """Fair mode: the waiting flow of a waiting group that _grant_rank puts first. Its one waiting flow; else a
        flow of the open group under its guarantee (its name's, a configured tenant's), or the least of its heap."""
        flows = group.flows
        if len(flows) == 1:
            return next(iter(flows.values()))
        candidates = [self._least_flow(group)]
        if group.key == self.open_group:
            candidates += (f for name, share in self.guaranteed.items() if share > 0.0
                           if (f := flows.get(nested(group.key, name))) is not None)
        return min(candidates, key=lambda f: self._grant_rank(f, f.entries[0]))

    def _least_rank(self) -> tuple[float, float, int, str] | None:
        """The rank heap's least current item (fair mode)."""
        heap, turns = self._ranks, self._turns
        while heap:
            item = heap[0]
            group = turns.get(item[3])
            if group is not None and self._rank(group) == item:
                return item
            heapq.heappop(heap)
        return None

    def _count_length(self, was: int, now: int) -> None:
        """A waiting flow's waiters went from `was` to `now` (0: it does not wait)."""
        lengths = self._lengths
        if was:
            left = lengths[was] - 1
            if left:
                lengths[was] = left
            else:
                del lengths[was]
        if now:
            lengths[now] = lengths.get(now, 0) + 1

    def _forget_if_idle(self, flow: _Flow) -> None:
        """Keys from a header are unbounded: a flow with nothing queued or in flight keeps no state unless it is
        configured (a returning flow restarts at the floor, which it could not have been below by much), nor a
        group with no flow kept."""
        if (not flow.entries and flow.inflight <= 0 and flow.key not in self.weights
                and flow.key not in self.guaranteed and self._flows.pop(flow.key, None) is not None):
            flow.group.members -= 1
            self._forget_group_if_idle(flow.group)

    def _forget_group_if_idle(self, group: _Flow) -> None:
        if group.members <= 0 and group.key not in self.weights and group.key not in self.guaranteed:
            self._groups.pop(group.key, None)

    def _pick(self, pool: str | None, outside: Collection[str] = ()) -> Any | None:
        """The next grant: of every waiter (`pool` None), of those bound for `pool`, or of those bound for a pool
        not in `outside`."""
        if self.mode != "fair" and pool is None and not outside and self._turns:
            # The group in turn, then its flow in turn (fifo: its one flow): the first of each, no pass needed.
            group = next(iter(self._turns.values()))
            return next(iter(group.flows.values())).entries[0][2]
        if self.mode != "fair":  # fifo has one flow; round_robin: groups take turns, then their flows
            firsts: dict[str, tuple] = {}  # group -> the next entry of its first flow in turn order that has one
            for flow in self._backlogged.values():
                if flow.group.key not in firsts:
                    entry = self._next_entry(flow, pool, outside)
                    if entry is not None:
                        firsts[flow.group.key] = entry
            return next((firsts[g][2] for g in self._turns if g in firsts), None)
        if pool is None and not outside:
            # The least rank of the groups without a guarantee whose one waiting flow is their own from their heap,
            # then the few with a guarantee (their rank moves with the class's capacity), and the groups with a
            # header's key waiting (their first flow from the group's own heap): no pass over the waiting flows.
            least = self._least_rank()
            groups = [] if least is None else [self._turns[least[3]]]
            groups += (self._turns[key] for key, share in self.guaranteed.items()
                       if share > 0.0 and key in self._turns and self._turns[key].guaranteed > 0.0)
            candidates = [self._first_in(group) for group in (*groups, *self._nesting.values())]
        else:
            candidates = self._backlogged.values()
        best_entry = best_rank = None
        for flow in candidates:
            entry = self._next_entry(flow, pool, outside)
            if entry is None:
                continue
            rank = self._grant_rank(flow, entry)
            if best_rank is None or rank < best_rank:
                best_rank, best_entry = rank, entry
        return best_entry[2] if best_entry is not None else None

    @staticmethod
    def _next_entry(flow: _Flow, pool: str | None, outside: Collection[str]) -> tuple[float, int, Any] | None:
        if pool is not None:
            return flow.first_for(pool)
        return flow.first_outside(outside) if outside else flow.entries[0]

    def _grant_rank(self, flow: _Flow, entry: tuple[float, int, Any]) -> tuple:
        """Fair mode's order of the next grant (least first): the flow's group first (its guarantee, then its
        virtual time and in-flight cost per weight), then the flow inside it, then its next entry's arrival."""
        group = flow.group
        if flow.key == group.key and group.backlogged == 1:
            inner: tuple = (False, 0.0, 0.0)  # its group's one waiting flow: the group's rank is its own
        else:
            # The group's own key's flow (its requests without a header key) beside header keys goes by its virtual
            # time too: ranked first, it took every grant of its group while it waited. Its guarantee is its
            # group's, counted above.
            under = flow.key != group.key and self._under_guarantee(flow)
            inner = (not under, flow.vtime, flow.inflight_cost / flow.weight)
        return (not self._under_guarantee(group), group.vtime, group.inflight_cost / group.weight, *inner, entry[1])

    def _under_guarantee(self, flow: _Flow) -> bool:
        return flow.guaranteed > 0.0 and flow.inflight < flow.guaranteed * self.capacity

    def _stats(self, key: str) -> TenantStats:
        return self._counts(self.label(key))

    def _counts(self, label: str) -> TenantStats:
        st = self.stats.get(label)
        if st is None:
            st = self.stats[label] = TenantStats()
        return st

    def _serve(self, st: TenantStats, key: str, gpu_s: float) -> None:
        if gpu_s >= 0.0:
            st.charged_gpu_s += gpu_s
        else:
            st.refunded_gpu_s -= gpu_s
        self._remember(key, gpu_s, 0.0)

    def _index_key(self, key: str) -> str:
        """The flow the index reads a key as: what the queue shares between, a tenant, not each of its own keys."""
        group, _, believed = self._split(key)
        return key if believed else group

    def _remember(self, key: str, served: float, unmet: float) -> None:
        """Add to a flow's recent served and unmet GPU-seconds (the fairness index's input), decayed to now."""
        key = self._index_key(key)
        mine = self._recent.get(key)
        if mine is None:
            mine = self._recent[key] = [0.0, 0.0, 0.0]
            if len(self._recent) > INDEX_FLOWS:
                self._recent.popitem(last=False)  # the flow served or refused least recently
        else:
            self._recent.move_to_end(key)
        if self.clock is None:
            mine[0] += served
            mine[1] += unmet
            return
        now = self.clock()
        decay = math.exp(-max(now - mine[2], 0.0) / self.index_tau_s)
        mine[0] = mine[0] * decay + served
        mine[1] = mine[1] * decay + unmet
        mine[2] = now


def _order(entry: tuple[float, int, Any]) -> tuple[float, int]:
    return entry[0], entry[1]


def _flow_item(flow: _Flow) -> tuple[float, float, int, str]:
    """A waiting flow's item of its group's heap: its order inside the group (_grant_rank's, but for a guarantee)."""
    return flow.vtime, flow.inflight_cost / flow.weight, flow.entries[0][1], flow.key


def _least_current(heap: list, flows: dict[str, _Flow], item_of: Callable[[_Flow], tuple]) -> _Flow | None:
    """The waiting flow of a group's lazy heap's least current item (one that equals item_of(its flow) now; those
    out of date are dropped as they are met), None if none waits."""
    while heap:
        item = heap[0]
        flow = flows.get(item[3])
        if flow is not None and flow.entries and item_of(flow) == item:
            return flow
        heapq.heappop(heap)
    return None


def _long_item(flow: _Flow) -> tuple[int, float, int, str]:
    """A waiting flow's item of its group's heap by length (the least first: the most waiters, then the highest
    virtual time, then the first in turn order)."""
    return -len(flow.entries), -flow.vtime, flow.since, flow.key
