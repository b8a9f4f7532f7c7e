"""Which replicas new requests go to while one of their pool's replicas is stalled or slow.

Envoy balances a pool's requests over its replicas by itself (least request), and goes on doing so for a replica
whose engine hangs while its HTTP server answers: /health says it is fine, and every request it takes waits until
the client gives up. The scraper sees such a replica as stalled (server.saturation, `stall_ms`). While one is, each
request forwarded to that pool names the replicas that work, in `x-extproc-replica` (read by the override_host
load-balancing policy of envoy/envoy.yaml's pool clusters, which takes the first of them it has): the least loaded
first, by the last scrape's running + waiting plus what was sent there since. With no replica stalled nothing is
named and Envoy's own least-request picks, as without the ext_proc.

A replica that is slow (policy.replica_speed: its inter-token latency well over the fastest replica's) still
works, only not fast enough for a tight SLO. A request of a class with an SLO names the other replicas first, the
least loaded of them first, and the slow ones last, however many it sends there: the pool-wide limit, whose
latency is then theirs, bounds it (spread past their share of the limit, it ran a replica 2x slower by design
at a p99 of 2.5-4 s and the limit, cutting for it, fell to a third: scenarios/mixed-pool.yaml). The other
classes are left to Envoy's balancing, which, with the SLO classes gone elsewhere, finds the slow replica the
least loaded. (Weighing the
slow replica by its measured pace instead, (load + 1) x pace, sent it too much: its pace measured at a lighter
load than the others' reads nearer theirs than it is. On the real stack p99 2.46-2.59 s against 2.06-2.26 s.)

Envoy takes the first named host it has, whatever its health: override_host does not skip a host its health
checks failed or its outlier detection ejected (a later name only matters where Envoy lacks the ones before it, or
to a retry, which envoy.yaml does not configure). At most NAMED are named. So what Envoy would not use
is left out here: a replica whose /health does not answer 200 (the scraper asks while a replica is stalled), and
one whose last FAILURES answers in a row were errors, for EJECT_S after the last (Envoy's own outlier rule in
envoy.yaml, seen through the access log's upstream address).

LoRA adapters (vLLM's --enable-lora): a replica runs at most `--max-loras` distinct adapters in a batch, and a
request for another one waits ("deferred") however empty its KV cache. Envoy's least request spreads every adapter
over every replica, so with more adapters in use than the slots each replica's slots churn over all of them, its
batch stays small and most requests wait for a slot (scenarios/audit-multi-lora.yaml: 4-9 sequences a replica at
1% KV with 15-20 deferred). Where a pool's replicas export `vllm:lora_requests_info` (its adapters running now and
`max_lora`) and the request's model is one of the pool's adapters (a `/v1/models` card with a `parent`, or an
adapter a replica reports running), the request names one replica (`_affine`): the least loaded one already running
the adapter (or sent it since the last scrape), while its load is within one adapter's share of the least loaded
candidate's; else the least loaded one with a free adapter slot (fewer adapters than max_lora, counting those sent
since); else, every slot taken, its home (the replica last named for it, where its earlier requests wait for a
slot) within the same bound; else none, and Envoy balances. A stalled or slow replica is left out of the
candidates first, as above, and nothing changes for any other model or pool.
"""

from __future__ import annotations

import math
from heapq import nsmallest
from itertools import islice

FAILURES = 5  # envoy.yaml's outlier_detection.consecutive_5xx
EJECT_S = 30.0  # and its base_ejection_time
# The most replicas one request names. Past the first, a name serves only when Envoy lacks the ones before it (they
# left its host set before the scraper saw them go: one discovery or reload behind); 15 such in a row fall back to
# Envoy's least-request. Every working replica named made the header grow with the pool: past Envoy's 60 KiB header
# limit at ~3,000 replicas (a cardinality review, 2026-12-06). A pool of up to NAMED has every one named.
NAMED = 16


class ReplicaSteering:
    """Per pool, the working replicas as last scraped, each with its load and what was sent to it since."""

    __slots__ = ("_pools", "_stalled", "_failing", "_loras", "_adapters", "_homes")

    def __init__(self) -> None:
        # pool -> [[address, load, pace], ...]; only pools with a stalled or a slow replica
        self._pools: dict[str, list[list]] = {}
        self._stalled: set[str] = set()  # those of them with a stalled replica (not only a slow one)
        self._failing: dict[str, list[float]] = {}  # address -> [errors in a row, when the last was]
        # pool -> {address: [load, max_lora, adapters running or sent since]}; only pools whose replicas export
        # their LoRA adapters (vllm:lora_requests_info)
        self._loras: dict[str, dict[str, list]] = {}
        self._adapters: dict[str, frozenset[str]] = {}  # pool -> its LoRA adapters' names (/v1/models listings)
        self._homes: dict[str, dict[str, str]] = {}  # pool -> adapter -> the replica last named for it (_affine)

    @property
    def active(self) -> bool:
        """Whether any pool is steered now (only then are answers per replica worth counting)."""
        return bool(self._pools or self._loras)

    def set_adapters(self, pool: str, names: frozenset[str]) -> None:
        """The pool's LoRA adapters, as its replicas' /v1/models list them (cards with a `parent`)."""
        if names:
            self._adapters[pool] = frozenset(names)
        else:
            self._adapters.pop(pool, None)

    def update_loras(self, pool: str, loras: tuple[tuple[str, float, int, frozenset[str]], ...]) -> None:
        """A new reading of the pool's working replicas' LoRA state: (address, running + waiting, max_lora,
        adapters running), empty when none exports it."""
        if loras:
            self._loras[pool] = {address: [load, max_lora, set(adapters)] for address, load, max_lora, adapters
                                 in loras}
        else:
            self._loras.pop(pool, None)
            self._homes.pop(pool, None)

    def answered(self, address: str, failed: bool, now: float) -> None:
        """One answer of the replica at `address` (IP:PORT, as Envoy names its hosts): an error or not."""
        if not failed:
            self._failing.pop(address, None)
            return
        errors = self._failing.get(address)
        if errors is None or now - errors[1] > EJECT_S:
            # An ejection over is over (as _ejected finds it): its errors no longer count toward the next, whether or
            # not a lookup or a scrape dropped them in between.
            errors = self._failing[address] = [0.0, now]
        errors[0] += 1.0
        errors[1] = now

    def update(self, pool: str, working: tuple[tuple[str, float, float], ...], stalled: bool = True,
               now: float | None = None) -> None:
        """A new reading at `now`: `working` lists each working replica with its load and pace (over 1: slow),
        empty when none is stalled or slow; `stalled`: some replica of the pool is (not only slow)."""
        if now is not None and self._failing:
            # Errors past EJECT_S are over (as _ejected finds them), and a replica that left the pool, often after
            # failing, is never looked up again: kept until then, they grew with every replica that ever failed.
            self._failing = {a: e for a, e in self._failing.items() if now - e[1] <= EJECT_S}
        if working:
            self._pools[pool] = [[address, load, pace] for address, load, pace in working]
        else:
            self._pools.pop(pool, None)
        if working and stalled:
            self._stalled.add(pool)
        else:
            self._stalled.discard(pool)

    def pick(self, pool: str, now: float, tight_slo: bool = False, model: str | None = None) -> str | None:
        """The override-host list for one request to `pool` for `model` (counted as sent), or None: no replica is
        stalled or slow, or only a slow one and the request is not to be kept off it (`tight_slo`), and the model
        is not one of the pool's LoRA adapters with a replica to prefer for it; or every working one is failing
        (Envoy's own balancing then knows best)."""
        loras = self._loras.get(pool)
        adapter = loras is not None and model is not None and (
            model in self._adapters.get(pool, ()) or any(model in r[2] for r in loras.values()))
        replicas = self._pools.get(pool)
        if replicas is None or not (tight_slo or pool in self._stalled):
            if not adapter:
                return None
            candidates = [(a, r) for a, r in loras.items() if not (self._failing and self._ejected(a, now))]
            chosen = self._affine(pool, candidates, model)
            if chosen is None:
                return None
            chosen[1][0] += 1.0
            return chosen[0]
        if self._failing:
            replicas = [r for r in replicas if not self._ejected(r[0], now)]
            if not replicas:
                return None
        first = min(replicas, key=_fast_first if tight_slo else _load)
        if adapter:
            # Among the replicas steering would send it to first: not stalled (left out of `replicas`), and for a
            # class with an SLO not slow, where a fast one works.
            keep = {r[0] for r in replicas if not (tight_slo and r[2] > 1.0 and first[2] <= 1.0)}
            chosen = self._affine(pool, [(a, r) for a, r in loras.items() if a in keep], model)
            if chosen is not None:
                first = next(r for r in replicas if r[0] == chosen[0])
        if loras is not None and first[0] in loras:
            loras[first[0]][0] += 1.0
        first[1] += 1.0
        if len(replicas) == 1:
            return first[0]
        rest = (r for r in replicas if r is not first)
        # The slow ones last there too; nsmallest is sorted()[:n], stable among equal paces
        rest = nsmallest(NAMED - 1, rest, key=_pace) if tight_slo else islice(rest, NAMED - 1)
        return ",".join([first[0], *(r[0] for r in rest)])

    def _affine(self, pool: str, candidates: list[tuple[str, list]], adapter: str) -> tuple[str, list] | None:
        """_affine's pick, counted as running the adapter there from now, and its home."""
        homes = self._homes.setdefault(pool, {})
        chosen = _affine(candidates, adapter, homes.get(adapter))
        if chosen is not None:
            chosen[1][2].add(adapter)
            homes[adapter] = chosen[0]
        return chosen

    def _ejected(self, address: str, now: float) -> bool:
        errors = self._failing.get(address)
        if errors is None:
            return False
        if now - errors[1] > EJECT_S:
            del self._failing[address]
            return False
        return errors[0] >= FAILURES


def _affine(candidates: list[tuple[str, list]], adapter: str, home: str | None) -> tuple[str, list] | None:
    """Of (address, [load, max_lora, adapters]) candidates, the one to send a request for `adapter` to, or None:
    Envoy's least request picks. `home`: the replica last named for the adapter.

    The bound: the least loaded candidate's load plus one adapter's share of the load, the candidates' load over
    the adapters they run (requests per adapter slot in use, at least 1). Within it a replica takes what one more
    adapter would bring it anyway; past it the adapter spreads to another. No fixed number: the bound follows the
    pool's load and how many adapters share it. In order:
    - the least loaded replica running the adapter (or sent it since the scrape) within the bound;
    - else the least loaded one with a free adapter slot, where it runs at once instead of waiting for one;
    - else (every slot taken: it waits for one wherever it goes) its home within the bound, where the adapter's
      earlier requests wait, so that it takes one slot when one frees instead of one on every replica;
    - else none.
    (scenarios/audit-multi-lora.yaml, what-if, seeds 1-3 and 811: without the home goodput 125 req/s; with it
    143-146 at a worst-window p99 of 1.71-1.79 s. Naming the least loaded instead of none, which then becomes the
    home, served 150-151 but at 1.83-2.11 s, over the 2 s SLO on seed 2; an unbounded preference for a replica
    running the adapter, 155-158 at 2.5-2.8 s.)"""
    if not candidates:
        return None
    loads = [r[0] for _, r in candidates]
    least = min(loads)
    if not math.isfinite(least):
        return None
    finite = [load for load in loads if math.isfinite(load)]
    share = max(1.0, sum(finite) / max(1, sum(len(r[2]) for _, r in candidates if math.isfinite(r[0]))))
    bound = least + share
    best = None
    for c in candidates:
        r = c[1]
        if adapter in r[2] and r[0] <= bound and (best is None or r[0] < best[1][0]):
            best = c
    if best is not None:
        return best
    for c in candidates:
        r = c[1]
        if len(r[2]) < r[1] and math.isfinite(r[0]) and (best is None or r[0] < best[1][0]):
            best = c
    if best is not None:
        return best
    for c in candidates:
        if c[0] == home and c[1][0] <= bound:
            return c
    return None


def _load(replica: list) -> float:
    return replica[1]


def _pace(replica: list) -> float:
    return replica[2]


def _fast_first(replica: list) -> tuple[bool, float]:
    return replica[2] > 1.0, replica[1]
