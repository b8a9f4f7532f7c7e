"""Whether Envoy has the clusters the policy routes to: `models.<name>.cluster` against Envoy's admin.

A policy that routes a model to a cluster Envoy does not have validates and loads (the ext_proc cannot know Envoy's
clusters offline; `extproc check --envoy ENVOY_YAML` can), and then every admitted request for that model is
answered by Envoy itself, 503 `cluster_not_found` (flag NC), with nothing in the ext_proc's log. Where the policy
names an Envoy admin (a pool's `envoy_admin`, as the saturation scraper reads for replicas), its
/clusters?format=json says which clusters Envoy has: one the models name that any of them does not list is logged
(at start, at every reload that still names it, and when the set changes) and exported as
extproc_policy_unknown_clusters{cluster} = 1 until Envoy lists it.

A warning, not a refused reload: Envoy's clusters may be added after the policy (CDS, a rolling Envoy update), an
admin that does not answer says nothing either way, and a refused reload keeps the whole old policy in force
(whatever else the new file fixed) for a problem Envoy already fails closed on, per request, with a clear 503
(envoy.yaml's local_reply_config).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

from ..policy.schema import Policy
from .saturation import envoy_clusters

log = logging.getLogger("extproc.clusters")

CHECK_EVERY_S = 30.0  # Envoy's clusters are read again this often: one added to Envoy clears the gauge by then
ADMIN_TIMEOUT_S = 2.0


def admins(policy: Policy) -> list[str]:
    """The distinct Envoy admin URLs the policy names (its pools' `envoy_admin`), in the policy's order."""
    return list(dict.fromkeys(p.envoy_admin.rstrip("/") for p in policy.pools.values() if p.envoy_admin))


def routed(policy: Policy) -> set[str]:
    return {m.cluster for m in policy.models.values()}


def listed_clusters(doc: dict) -> set[str]:
    """The cluster names in Envoy's /clusters?format=json. ValueError for an answer that is not Envoy's (a wrong
    URL answering JSON must not read as an Envoy without clusters)."""
    statuses = doc.get("cluster_statuses") if isinstance(doc, dict) else None
    if not isinstance(statuses, list):
        raise ValueError("not Envoy's /clusters?format=json: no cluster_statuses list")
    return {c["name"] for c in statuses if isinstance(c, dict) and isinstance(c.get("name"), str)}


class ClusterCheck:
    """Reads each admin's clusters at configure (start, reload) and every CHECK_EVERY_S; `set_unknown` gets the
    routed clusters an admin that answered does not list (an empty set when all are there), after each read that
    any admin answered; a round none answers leaves the last reading as it was."""

    def __init__(self, set_unknown: Callable[[set[str]], None], every_s: float = CHECK_EVERY_S):
        self.set_unknown = set_unknown
        self.every_s = every_s
        self.unknown: set[str] | None = None  # None: not known (no admin named, or none answered yet)
        self._task: asyncio.Task | None = None
        self._complained: frozenset[str] = frozenset()  # the clusters last said to be missing
        self._say_again = False  # a reload: say what is still missing again

    async def configure(self, policy: Policy) -> None:
        """Check `policy` at once, in the background (an Envoy not up yet must not hold the start), and every
        `every_s` after; a reload names what is still missing again."""
        old, self._task = self._task, None
        self._say_again = True
        if admins(policy):
            self._task = asyncio.create_task(self._run(policy))
        else:
            if self.unknown:
                self.set_unknown(set())
            self.unknown, self._complained = None, frozenset()
        if old is not None:
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)

    async def _run(self, policy: Policy) -> None:
        while True:
            try:
                await self.check(policy)
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("reading Envoy's clusters failed")
            await asyncio.sleep(self.every_s)

    async def check(self, policy: Policy) -> set[str] | None:
        listed: set[str] = set()
        read = 0
        async with aiohttp.ClientSession() as session:
            for url in admins(policy):
                try:
                    names = listed_clusters(await envoy_clusters(session, url, ADMIN_TIMEOUT_S))
                except Exception as e:  # noqa: BLE001 - an admin that does not answer says nothing either way
                    log.debug("Envoy admin %s: clusters not read (%r)", url, e)
                    continue
                # Every admin must have it: each Envoy routes some of the requests.
                listed = names if not read else listed & names
                read += 1
        if not read:
            return self.unknown  # unknown this round: the last reading stands
        unknown = routed(policy) - listed
        if unknown != self._complained or (unknown and self._say_again):
            if unknown:
                log.warning("the policy routes models to clusters Envoy (admin %s) does not have: %s; Envoy answers "
                            "their requests 503 cluster_not_found until the cluster is added or the policy fixed "
                            "(models: %s)", ", ".join(admins(policy)), ", ".join(sorted(unknown)),
                            ", ".join(sorted(n for n, m in policy.models.items() if m.cluster in unknown)))
            elif self._complained:
                log.info("Envoy now has every cluster the policy routes to (was missing: %s)",
                         ", ".join(sorted(self._complained)))
            self._complained = frozenset(unknown)
        self._say_again = False
        self.unknown = unknown
        self.set_unknown(unknown)
        return unknown

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

