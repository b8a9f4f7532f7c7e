"""Which pools are scraped for saturation (extproc/server/saturation.py): a pool that names nothing to scrape has
no saturation signal, and must not read as permanently saturated."""

import asyncio

import pytest

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import AdmissionController
from extproc.policy.schema import PoolSpec
from extproc.server.saturation import PoolScraper, SaturationScrapers
from tests.conftest import FakeClock, make_policy

ADAPTIVE = {"max_concurrency": 16, "slo_p95_ms": 2000, "adaptive": {"enabled": True, "min_limit": 2}}


def unscraped_pool_policy():
    return make_policy(classes={"interactive": ADAPTIVE, "batch": {"max_concurrency": 8}},
                       pools={"pool_a": {"limit": {"enabled": True, "unit": "requests", "min": 1, "max": 64}}})


def test_a_pool_that_names_nothing_to_scrape_leaves_its_limit_and_adaptive_caps_to_latency():
    clock = FakeClock()
    policy = unscraped_pool_policy()
    core = AdmissionController(policy, clock=clock)

    async def serve_a_while() -> None:
        scrapers = SaturationScrapers(core)
        await scrapers.configure(policy.pools)
        await asyncio.sleep(0.05)  # a scraper, had one started, has published by now
        assert "pool_a" not in core.saturation  # not scraped (None), not saturated
        for _ in range(10):
            clock.advance(1.0)
            core.tick()
        await scrapers.stop()

    asyncio.run(serve_a_while())
    assert core.gates["pool_a"].limit == 64  # not pinned at its minimum
    assert core.limiters["interactive"].limit == 16  # not cut to min_limit


def test_a_pool_no_longer_scraped_after_a_reload_forgets_its_last_reading():
    core = AdmissionController(unscraped_pool_policy(), clock=FakeClock())
    scrapers = SaturationScrapers(core)
    scrapers._config = {"pool_a": PoolSpec(replicas=["10.0.0.1:8000"])}  # as scraped before the reload
    stale = PoolSaturation()
    stale.saturated = True
    core.set_saturation("pool_a", stale)
    asyncio.run(scrapers.configure({"pool_a": PoolSpec()}))
    assert "pool_a" not in core.saturation


def test_listed_replicas_that_were_never_read_still_count_as_saturated():
    core = AdmissionController(unscraped_pool_policy(), clock=FakeClock())
    scraper = PoolScraper(core, "pool_a", PoolSpec(replicas=["10.0.0.1:8000"]), session=None, clock=lambda: 100.0)
    assert scraper.aggregate(100.0).saturated


def test_a_reading_nobody_refreshes_stops_counting():
    """The scraper's loop stuck or gone: its last reading (saturated) holds the limits down only while it is
    recent; after STALE_READINGS x stale_ms the limits go by latency alone, as for a pool not scraped."""
    clock = FakeClock()
    core = AdmissionController(unscraped_pool_policy(), clock=clock)
    core.gates["pool_a"].take(0, 40.0)  # 40 requests in flight
    reading = PoolSaturation()
    reading.saturated, reading.updated_at = True, clock()
    core.set_saturation("pool_a", reading)
    for _ in range(2):  # two saturated moves in a row: cut below what is in flight
        clock.advance(1.0)
        core.tick()
    cut = core.gates["pool_a"].limit
    assert cut < 40
    clock.advance(3 * 1.5)  # past 3 x the default stale_ms (1500) since the reading
    for _ in range(10):
        clock.advance(1.0)
        core.tick()
    assert core.gates["pool_a"].limit == cut  # held (no latency samples either), not cut further
    assert core.pool_reading("pool_a", clock()) is None
    reading.updated_at = clock()  # the scraper is back
    assert core.pool_reading("pool_a", clock()) is reading


def test_the_pools_rounds_are_spread_over_the_scrape_interval_not_run_at_once(monkeypatch):
    # Found by bench/scale.py --scrape-live: 8 pools of 16 replicas scraped in step read 128 answers back to back
    # on the event loop every round, and decisions waited behind them (loop lag p99 11 ms, max 36 ms).
    core = AdmissionController(unscraped_pool_policy(), clock=FakeClock())
    started = {}

    async def run(self):
        started[self.name] = self.phase_s
        await asyncio.Event().wait()

    monkeypatch.setattr(PoolScraper, "run", run)

    async def configure():
        scrapers = SaturationScrapers(core)
        await scrapers.configure({f"pool_{i}": PoolSpec(replicas=["127.0.0.1:9"], scrape_interval_ms=200)
                                  for i in range(4)})
        await asyncio.sleep(0.01)
        await scrapers.stop()

    asyncio.run(configure())
    assert sorted(started.values()) == pytest.approx([0.0, 0.05, 0.1, 0.15])


def test_a_scraper_waits_its_phase_before_its_first_round(monkeypatch):
    core = AdmissionController(unscraped_pool_policy(), clock=FakeClock())
    rounds = []

    async def round_(self, started):
        rounds.append(asyncio.get_running_loop().time())

    monkeypatch.setattr(PoolScraper, "_round", round_)
    scraper = PoolScraper(core, "pool_a", PoolSpec(replicas=["127.0.0.1:9"], scrape_interval_ms=1000), session=None,
                          phase_s=0.1)

    async def a_while():
        t0 = asyncio.get_running_loop().time()
        task = asyncio.create_task(scraper.run())
        await asyncio.sleep(0.05)
        assert not rounds
        await asyncio.sleep(0.1)
        task.cancel()
        return t0

    t0 = asyncio.run(a_while())
    assert len(rounds) == 1 and rounds[0] - t0 >= 0.1
