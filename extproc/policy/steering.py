"""Which replicas new requests go to while one of their pool's replicas is stalled.

Envoy balances a pool's requests over its replicas by itself (least request), and goes on doing so for a replica
whose engine hangs while its HTTP server answers: /health says it is fine, and every request it takes waits until
the client gives up. The scraper sees such a replica as stalled (server.saturation, `stall_ms`). While one is, each
request forwarded to that pool names the replicas that work, in `x-extproc-replica` (read by the override_host
load-balancing policy of envoy/envoy.yaml's pool clusters: the first of them that Envoy can use, the next if it
cannot): the least loaded first, by the last scrape's running + waiting plus what was sent there since. With no
replica stalled nothing is named and Envoy's own least-request picks, as without the ext_proc.
"""

from __future__ import annotations


class ReplicaSteering:
    """Per pool, the working replicas as last scraped, each with its load and what was sent to it since."""

    __slots__ = ("_pools",)

    def __init__(self) -> None:
        self._pools: dict[str, list[list]] = {}  # pool -> [[address, load], ...]; only pools with a stalled replica

    def update(self, pool: str, working: tuple[tuple[str, float], ...]) -> None:
        """A new reading: `working` lists each working replica with its load, empty when none is stalled."""
        if working:
            self._pools[pool] = [[address, load] for address, load in working]
        else:
            self._pools.pop(pool, None)

    def pick(self, pool: str) -> str | None:
        """The override-host list for one request to `pool` (counted as sent), or None: no replica is stalled."""
        replicas = self._pools.get(pool)
        if replicas is None:
            return None
        first = min(replicas, key=_load)
        first[1] += 1.0
        if len(replicas) == 1:
            return first[0]
        return ",".join([first[0], *(r[0] for r in replicas if r is not first)])


def _load(replica: list) -> float:
    return replica[1]
