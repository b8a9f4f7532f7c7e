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
"""

from __future__ import annotations

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

    __slots__ = ("_pools", "_stalled", "_failing")

    def __init__(self) -> None:
        # pool -> [[address, load, pace], ...]; only pools with a stalled or a slow replica
        self._pools: dict[str, list[list]] = {}
        self._stalled: set[str] = set()  # those of them with a stalled replica (not only a slow one)
        self._failing: dict[str, list[float]] = {}  # address -> [errors in a row, when the last was]

    @property
    def active(self) -> bool:
        """Whether any pool is steered now (only then are answers per replica worth counting)."""
        return bool(self._pools)

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

    def pick(self, pool: str, now: float, tight_slo: bool = False) -> str | None:
        """The override-host list for one request to `pool` (counted as sent), or None: no replica is stalled or
        slow, or only a slow one and the request is not to be kept off it (`tight_slo`), or every working one is
        failing (Envoy's own balancing then knows best)."""
        replicas = self._pools.get(pool)
        if replicas is None or not (tight_slo or pool in self._stalled):
            return None
        if self._failing:
            replicas = [r for r in replicas if not self._ejected(r[0], now)]
            if not replicas:
                return None
        first = min(replicas, key=_fast_first if tight_slo else _load)
        first[1] += 1.0
        if len(replicas) == 1:
            return first[0]
        rest = (r for r in replicas if r is not first)
        # The slow ones last there too; nsmallest is sorted()[:n], stable among equal paces
        rest = nsmallest(NAMED - 1, rest, key=_pace) if tight_slo else islice(rest, NAMED - 1)
        return ",".join([first[0], *(r[0] for r in rest)])

    def _ejected(self, address: str, now: float) -> bool:
        errors = self._failing.get(address)
        if errors is None:
            return False
        if now - errors[1] > EJECT_S:
            del self._failing[address]
            return False
        return errors[0] >= FAILURES


def _load(replica: list) -> float:
    return replica[1]


def _pace(replica: list) -> float:
    return replica[2]


def _fast_first(replica: list) -> tuple[bool, float]:
    return replica[2] > 1.0, replica[1]
