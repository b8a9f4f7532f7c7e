"""Which pools are scraped for saturation (extproc/server/saturation.py): a pool that names nothing to scrape has
no saturation signal, and must not read as permanently saturated."""

import asyncio

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
