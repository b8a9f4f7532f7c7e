"""Scrape each pool's vLLM replicas for their own saturation signals and hand them to the core.

vLLM knows it is saturated before any latency shows it: requests waiting in its scheduler, the KV cache nearly
full, preemptions. Reading them every ~200 ms lets adaptive caps react to in-flight growth at once instead of
waiting for slow completions. A replica that cannot be read is counted as saturated, not as headroom. A pool that
names nothing to scrape (no replicas, no Envoy admin) is not scraped at all: it has no saturation signal, and its
limit and adaptive caps run on latency alone.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from ..policy.adaptive import PoolSaturation
from ..policy.admission import AdmissionController
from ..policy.schema import PoolSpec

log = logging.getLogger("extproc.saturation")

_WANTED = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv", "vllm:num_preemptions_total": "preemptions"}


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The few vLLM series admission reads, summed over label sets (one engine may serve several names)."""
    out = dict.fromkeys(_WANTED.values(), 0.0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = _WANTED.get(name)
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[key] = max(out[key], value) if key == "kv" else out[key] + value
    return out


class ScrapedReplica:
    """One replica as its scrapes saw it: the last metrics read, when, and the preemption counter to diff."""

    __slots__ = ("address", "metrics", "at", "preemptions")

    def __init__(self, address: str):
        self.address = address
        self.metrics: dict[str, float] | None = None
        self.at = -1.0
        self.preemptions: float | None = None


class PoolScraper:
    """One pool: scrape every replica each interval, aggregate, and publish a PoolSaturation to the core."""

    def __init__(self, core: AdmissionController, name: str, spec: PoolSpec, session: aiohttp.ClientSession,
                 clock=time.monotonic):
        self.core = core
        self.name = name
        self.spec = spec
        self.session = session
        self.clock = clock
        self.replicas: dict[str, ScrapedReplica] = {a: ScrapedReplica(a) for a in spec.replicas}
        self._last_discovery = -1e9

    async def run(self) -> None:
        interval = self.spec.scrape_interval_ms / 1000.0
        while True:
            started = self.clock()
            if not self.spec.replicas and self.spec.envoy_admin and started - self._last_discovery > 5.0:
                await self._discover()
            await asyncio.gather(*(self._scrape(r) for r in list(self.replicas.values())))
            self.core.set_saturation(self.name, self.aggregate(self.clock()))
            await asyncio.sleep(max(interval - (self.clock() - started), 0.0))

    async def _scrape(self, r: ScrapedReplica) -> None:
        timeout = aiohttp.ClientTimeout(total=max(self.spec.scrape_interval_ms / 1000.0 * 2, 0.5))
        try:
            async with self.session.get(f"http://{r.address}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return
                m = parse_vllm_metrics(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return  # stays stale: counted as saturated once older than stale_ms
        self.record(r, m)

    def record(self, r: ScrapedReplica, m: dict[str, float]) -> None:
        """Take one scrape's parsed metrics for replica r (what changed since its previous scrape included)."""
        prev = r.preemptions
        r.preemptions = m["preemptions"]
        m["preempting"] = float(prev is not None and m["preemptions"] > prev)
        r.metrics, r.at = m, self.clock()

    def aggregate(self, now: float) -> PoolSaturation:
        spec, sat = self.spec, PoolSaturation()
        sat.updated_at = now
        stale = now - spec.stale_ms / 1000.0
        if not self.replicas:
            sat.saturated = True
            return sat
        for r in self.replicas.values():
            m = r.metrics
            if m is None or r.at < stale:
                sat.saturated = True
                continue
            sat.kv_usage = max(sat.kv_usage, m["kv"])
            sat.waiting = max(sat.waiting, m["waiting"])
            sat.running += m["running"]
            sat.preempting = sat.preempting or bool(m["preempting"])
        if sat.kv_usage >= spec.kv_saturated or (spec.waiting_saturated and sat.waiting >= spec.waiting_saturated) \
                or sat.preempting:
            sat.saturated = True
        return sat

    async def _discover(self) -> None:
        """Take the pool's endpoints from Envoy's admin API (Envoy is the source of truth for membership)."""
        self._last_discovery = self.clock()
        try:
            async with self.session.get(f"{self.spec.envoy_admin}/clusters?format=json",
                                        timeout=aiohttp.ClientTimeout(total=2)) as resp:
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return
        for cluster in doc.get("cluster_statuses", []):
            if cluster.get("name") != self.name:
                continue
            found = set()
            for host in cluster.get("host_statuses", []):
                sa = host.get("address", {}).get("socket_address", {})
                if "address" in sa:
                    found.add(f"{sa['address']}:{sa.get('port_value', 80)}")
            for gone in set(self.replicas) - found:
                del self.replicas[gone]
            for new in found - set(self.replicas):
                self.replicas[new] = ScrapedReplica(new)


class SaturationScrapers:
    """All pools of the policy; restarted when a reload changes `pools`."""

    def __init__(self, core: AdmissionController):
        self.core = core
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None
        self._config: dict | None = None

    async def configure(self, pools: dict[str, PoolSpec]) -> None:
        if pools == self._config:
            return
        self._config = pools  # first: stop() forgets the readings of the pools no longer scraped
        await self.stop()
        scraped = self._scraped()
        for name in [n for n in pools if n not in scraped]:
            log.warning("pool %s names neither replicas nor envoy_admin: not scraped, its limit and adaptive caps "
                        "run on latency only", name)
        if not scraped:
            return
        self._session = aiohttp.ClientSession()
        for name in scraped:
            self._tasks.append(asyncio.create_task(PoolScraper(self.core, name, pools[name], self._session).run()))
        log.info("scraping vLLM saturation for pools: %s", ", ".join(scraped))

    def _scraped(self) -> list[str]:
        """The configured pools that name something to scrape (not those with no saturation signal at all)."""
        return [name for name, spec in (self._config or {}).items() if spec.scraped]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
        scraped = self._scraped()
        for name in list(self.core.saturation):
            if name not in scraped:  # no longer scraped: not scraped (None), not stuck at its last reading
                self.core.set_saturation(name, None)
