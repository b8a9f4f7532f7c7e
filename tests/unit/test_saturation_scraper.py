"""Reading vLLM's /metrics (extproc/server/saturation.py): what a replica sends never stops the scraper, and a
replica that sends nothing trustworthy counts toward stale (saturated), never as idle headroom."""

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from extproc.policy.admission import AdmissionController
from extproc.policy.schema import PoolSpec
from extproc.server import saturation
from extproc.server.openai import models_body
from extproc.server.saturation import (MAX_METRICS_BYTES, PoolScraper, SaturationScrapers, UnreadableMetrics,
                                       parse_lora_info, parse_vllm_metrics)
from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.profile import load_profile
from extproc.tools.stack import free_port
from tests.conftest import FakeClock, make_policy, until
from tests.unit.test_model_names import listed_core

REAL_METRICS = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics.txt").read_bytes()


def real_metrics_with(waiting: str = "0.0", kv: str = "0.0", running: str = "0.0") -> bytes:
    """The captured vLLM 0.32 /metrics with these gauges set."""
    body = REAL_METRICS
    for name, value in (("num_requests_waiting", waiting), ("kv_cache_usage_perc", kv),
                        ("num_requests_running", running)):
        body = re.sub(rb"^(vllm:" + name.encode() + rb"\{[^}]*\}) \S+$", rb"\g<1> " + value.encode(), body,
                      flags=re.M)
    return body


class RecordingCore:
    """Stands in for the AdmissionController: keeps what the scraper published."""

    def __init__(self, listings: bool = False):
        self.published = []
        self.listings = [] if listings else None  # what set_listings got, when models.names_from_replicas is on

    def set_saturation(self, pool, saturation):
        self.published.append(saturation)

    def wants_listings(self, pool):
        return self.listings is not None

    def set_listings(self, pool, listings):
        self.listings.append(listings)
        return {}


@contextlib.asynccontextmanager
async def replica(handler, health: int = 200, models=None):
    """A stand-in vLLM on 127.0.0.1 answering GET /metrics with `handler` (and /health with `health`, GET /v1/models
    with `models`); yields its HOST:PORT."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    if models is not None:
        app.router.add_get("/v1/models", models)
    async def health_check(request):
        return web.Response(status=health)

    app.router.add_get("/health", health_check)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def answering(body: bytes, status: int = 200, content_type: str = "text/plain"):
    async def handler(request):
        return web.Response(body=body, status=status, content_type=content_type)
    return handler


async def scrape_once(handler, clock=None) -> PoolScraper:
    """One scrape of one replica; the scraper, to look at what it kept."""
    async with replica(handler) as address, aiohttp.ClientSession() as session:
        scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=[address]), session,
                              clock=clock or FakeClock())
        await scraper._scrape(scraper.replicas[address])
        return scraper


def only_replica(scraper: PoolScraper):
    (r,) = scraper.replicas.values()
    return r


# --- the happy path: the real vLLM 0.32 /metrics ---

def test_the_real_vllm_metrics_are_read():
    m = parse_vllm_metrics(real_metrics_with(waiting="3.0", kv="0.42", running="2.0"))
    assert m == {"running": 2.0, "waiting": 3.0, "kv": 0.42, "preemptions": 0.0, "tokens": 2341.0 + 8193.0,
                 "started": 1.79621509968e+09, "itl_sum": 52.43323827200152, "itl_count": 8085.0, "deferred": 0.0,
                 "finished": 107.0, "steps": 1579.0}


def test_a_replica_serving_the_real_vllm_metrics_is_read_and_not_saturated():
    scraper = asyncio.run(scrape_once(answering(real_metrics_with(kv="0.5"))))
    sat = scraper.aggregate(scraper.clock())
    assert only_replica(scraper).metrics["kv"] == 0.5
    assert not sat.saturated and sat.kv_usage == 0.5


# --- bug 1: nothing a replica sends stops the scraper ---

def test_a_non_utf8_metrics_body_does_not_stop_the_pool_scraper():
    async def scrape_a_while():
        core = RecordingCore()
        async with replica(answering(b"vllm:num_requests_waiting 3\n\xff\xfe")) as address, \
                aiohttp.ClientSession() as session:
            spec = PoolSpec(replicas=[address], scrape_interval_ms=20, stale_ms=100)
            task = asyncio.create_task(PoolScraper(core, "pool_a", spec, session).run())
            await asyncio.sleep(0.4)
            alive = not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return alive, core.published

    alive, published = asyncio.run(scrape_a_while())
    assert alive
    assert len(published) >= 5 and all(s.saturated for s in published)  # never read: saturated, every round


def test_any_error_reading_one_replica_makes_it_unreadable_for_that_round(monkeypatch):
    def broken_parser(body):
        raise RuntimeError("a bug in parsing")
    monkeypatch.setattr(saturation, "parse_vllm_metrics", broken_parser)
    scraper = asyncio.run(scrape_once(answering(REAL_METRICS)))
    assert only_replica(scraper).metrics is None
    assert scraper.aggregate(scraper.clock()).saturated


def test_a_failing_round_is_logged_and_scraping_goes_on_saturated_once_stale(monkeypatch, caplog):
    rounds = []

    def broken_aggregate(now):
        rounds.append(now)
        raise RuntimeError("a bug in aggregating")

    async def scrape_a_while():
        core = RecordingCore()
        async with replica(answering(REAL_METRICS)) as address, aiohttp.ClientSession() as session:
            scraper = PoolScraper(core, "pool_a", PoolSpec(replicas=[address], scrape_interval_ms=20, stale_ms=100),
                                  session)
            monkeypatch.setattr(scraper, "aggregate", broken_aggregate)
            task = asyncio.create_task(scraper.run())
            await asyncio.sleep(0.4)
            alive = not task.done()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return alive, core.published

    with caplog.at_level(logging.ERROR, "extproc.saturation"):
        alive, published = asyncio.run(scrape_a_while())
    assert alive and len(rounds) >= 5
    assert published and all(s.saturated for s in published)  # no reading for stale_ms: saturated
    assert len([r for r in caplog.records if "round failed" in r.getMessage()]) == 1  # once a minute


def test_an_unreadable_replica_is_logged_once_a_minute_and_again_when_it_recovers(caplog):
    clock = FakeClock()
    healthy = [False]

    async def flaky(request):
        return web.Response(body=REAL_METRICS if healthy[0] else b"\xff\xfe", content_type="text/plain")

    async def scrape_for(seconds):
        async with replica(flaky) as address, aiohttp.ClientSession() as session:
            scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=[address]), session, clock=clock)
            for _ in range(int(seconds / 0.2)):
                await scraper._scrape(scraper.replicas[address])
                clock.advance(0.2)
            healthy[0] = True
            await scraper._scrape(scraper.replicas[address])

    with caplog.at_level(logging.INFO, "extproc.saturation"):
        asyncio.run(scrape_for(90))  # 450 failed scrapes over 90 s, then a good one
    messages = [r.getMessage() for r in caplog.records]
    unreadable = [m for m in messages if "unreadable" in m]
    assert len(unreadable) == 2 and "vllm:kv_cache_usage_perc" in unreadable[0]
    assert sum("readable again" in m for m in messages) == 1


def test_a_frozen_reading_counts_as_saturated_once_older_than_stale_ms():
    clock = FakeClock()
    body = [real_metrics_with()]

    async def changing(request):
        return web.Response(body=body[0], content_type="text/plain")

    async def read_then_fail():
        async with replica(changing) as address, aiohttp.ClientSession() as session:
            scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=[address], stale_ms=1500), session,
                                  clock=clock)
            r = scraper.replicas[address]
            await scraper._scrape(r)
            body[0] = b"<html>login</html>"
            states = []
            for _ in range(10):
                clock.advance(0.2)
                await scraper._scrape(r)
                states.append(scraper.aggregate(clock()).saturated)
            return states

    assert asyncio.run(read_then_fail()) == [False] * 7 + [True] * 3  # the good read is 1.6 s old at the 8th


def test_a_scraper_that_ended_reads_as_saturated_and_is_restarted_by_the_next_configure(monkeypatch):
    core = RecordingCore()
    core.saturation = {}
    runs = []

    async def dies(self):
        runs.append(self.name)
        raise RuntimeError("a scraper bug")

    async def lives(self):
        runs.append(self.name)
        await asyncio.Event().wait()

    async def reload_twice():
        scrapers = SaturationScrapers(core)
        pools = {"pool_a": PoolSpec(replicas=["127.0.0.1:9"])}
        monkeypatch.setattr(PoolScraper, "run", dies)
        await scrapers.configure(pools)
        await asyncio.sleep(0.01)
        saturated_after_death = core.published[-1].saturated
        monkeypatch.setattr(PoolScraper, "run", lives)
        await scrapers.configure(dict(pools))  # SIGHUP with the same pools
        await asyncio.sleep(0.01)
        alive = not scrapers._tasks["pool_a"].done()
        await scrapers.stop()
        return saturated_after_death, alive

    saturated_after_death, alive = asyncio.run(reload_twice())
    assert saturated_after_death
    assert runs == ["pool_a", "pool_a"] and alive


# --- bug 2: a huge body is not read whole ---

def test_a_replica_that_refuses_connections_is_left_out_not_read_as_the_pools_saturation():
    """One replica of two dead (SIGKILL): Envoy's health checks take it out of the pool, and the other serves on.
    Read as saturated, it cut the pool limit to its floor for as long as it was down, the other one idle."""
    clock = FakeClock()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: connection refused

    async def run():
        async with replica(answering(real_metrics_with())) as alive, aiohttp.ClientSession() as session:
            scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=[alive, dead], stale_ms=1500),
                                  session, clock=clock)
            await scraper._scrape(scraper.replicas[dead])
            clock.advance(2.0)  # past stale_ms: the dead one has never been read
            await asyncio.gather(*(scraper._scrape(r) for r in scraper.replicas.values()))
            one_left = scraper.aggregate(clock())
            del scraper.replicas[alive]
            none_left = scraper.aggregate(clock())
            scraper.replicas.clear()
            none_listed = scraper.aggregate(clock())
            return [(sat.saturated, sat.down) for sat in (one_left, none_left, none_listed)]

    # Saturated only when no replica is left to serve, and then down: no word on load for the limits
    # (LimitMoves.load_reading), which keep their level for the replicas' return.
    assert asyncio.run(run()) == [(False, False), (True, True), (True, True)]


async def _slow(request):
    await asyncio.sleep(1.0)  # past the scraper's timeout (0.5 s at least)
    return web.Response(body=b"")


def rounds_with_a_second_replica(metrics, health: int = 200) -> bool:
    """Two scrape rounds (the second past stale_ms) of a pool of a replica answering well and one answering
    /metrics with `metrics` and /health with `health`: whether the pool read saturated."""
    clock = FakeClock()

    async def run():
        async with replica(answering(real_metrics_with())) as alive, replica(metrics, health) as other, \
                aiohttp.ClientSession() as session:
            scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=[alive, other], stale_ms=1500),
                                  session, clock=clock)
            await scraper._round(clock())
            clock.advance(2.0)
            await scraper._round(clock())
            return scraper.core.published[-1].saturated

    return asyncio.run(run())


def test_a_replica_whose_metrics_do_not_answer_in_time_but_whose_health_does_counts_as_saturated():
    """Too loaded to answer its /metrics is no headroom."""
    assert rounds_with_a_second_replica(_slow, health=200) is True


def test_a_replica_whose_metrics_and_health_both_fail_is_left_out():
    """Frozen whole (SIGSTOP): Envoy's health checks take it out of the pool; read as saturated, it cut the pool
    limit to its floor (through Envoy: 16 to 2.4 in a second, nothing new admitted while it was stopped)."""
    assert rounds_with_a_second_replica(_slow, health=503) is False


def test_a_metrics_body_over_the_cap_is_unreadable():
    scraper = asyncio.run(scrape_once(answering(REAL_METRICS + b"# " + b"x" * MAX_METRICS_BYTES + b"\n")))
    assert only_replica(scraper).metrics is None


def test_a_streamed_metrics_body_is_read_no_further_than_the_cap():
    sent = [0]

    async def endless(request):
        resp = web.StreamResponse()
        resp.content_type = "text/plain"
        await resp.prepare(request)
        await resp.write(REAL_METRICS)
        chunk = b"# " + b"x" * 65533 + b"\n"
        with contextlib.suppress(ConnectionError):
            for _ in range(8 * MAX_METRICS_BYTES // len(chunk)):
                await resp.write(chunk)
                sent[0] += len(chunk)
            await resp.write_eof()
        return resp

    scraper = asyncio.run(scrape_once(endless))
    assert only_replica(scraper).metrics is None
    assert sent[0] < 4 * MAX_METRICS_BYTES  # the scraper hung up instead of reading on (socket buffers aside)


# --- bug 3: an answer without the series we need, or with values that are not load, is unreadable ---

@pytest.mark.parametrize("body, why", [
    (b"", "vllm:num_requests_waiting or vllm:kv_cache_usage_perc"),
    (b"<html><body>login</body></html>", "vllm:num_requests_waiting"),
    (REAL_METRICS.replace(b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc"), "vllm:kv_cache_usage_perc"),
    (re.sub(rb"^vllm:num_requests_waiting\{.*\n", b"", REAL_METRICS, flags=re.M), "vllm:num_requests_waiting"),
    (real_metrics_with(waiting="NaN"), "vllm:num_requests_waiting"),
    (real_metrics_with(kv="+Inf"), "vllm:kv_cache_usage_perc"),
    (real_metrics_with(waiting="-50"), "vllm:num_requests_waiting"),
    (real_metrics_with(running="-3"), "vllm:num_requests_running"),
    (real_metrics_with(kv="zero"), "vllm:kv_cache_usage_perc"),
], ids=["empty", "html", "pre_v1_kv_name", "no_waiting", "nan", "inf", "negative_waiting", "negative_running",
        "not_a_number"])
def test_metrics_without_trustworthy_series_are_unreadable_and_say_which(body, why):
    with pytest.raises(UnreadableMetrics, match=re.escape(why)):
        parse_vllm_metrics(body)


def test_a_replica_answering_200_without_the_series_is_not_idle_headroom():
    clock = FakeClock()
    scraper = asyncio.run(scrape_once(answering(b"<html>login</html>", content_type="text/html"), clock=clock))
    assert only_replica(scraper).metrics is None
    assert scraper.aggregate(clock()).saturated


def test_a_preemption_counter_missing_from_one_scrape_is_not_read_as_preemptions():
    # A /metrics without vllm:num_preemptions_total read it as 0: the scrape after, with the counter back at the
    # same 7, read as 7 preemptions since, and the pool as saturated. A missing counter is unknown, as the others.
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["r:1"]), None, clock=clock)
    without = b"vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n"
    with_counter = without + b"vllm:num_preemptions_total 7\n"
    states = []
    for body in (with_counter, without, with_counter, with_counter + b"vllm:num_preemptions_total 1\n"):
        scraper.record(scraper.replicas["r:1"], parse_vllm_metrics(body))
        sat = scraper.aggregate(clock())
        states.append((sat.preempting, sat.saturated))
        clock.advance(0.2)
    assert states == [(False, False)] * 3 + [(True, True)]  # a counter that moved is still read


# --- bug 4: the exposition format: name{labels} value [timestamp] ---

def test_a_sample_timestamp_is_not_read_as_its_value():
    m = parse_vllm_metrics(b'vllm:num_requests_waiting{engine="0",model_name="m"} 0 1700000000000\n'
                           b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25 1700000000000\n')
    assert m["waiting"] == 0.0 and m["kv"] == 0.25


def test_label_values_may_hold_spaces_braces_and_escaped_quotes():
    m = parse_vllm_metrics(b'vllm:num_requests_waiting{model_name="a \\"quoted\\" } name",engine="0"} 2 17\n'
                           b'vllm:num_requests_waiting{model_name="b\\\\",engine="0"} 3\n'
                           b'vllm:num_requests_waiting_by_reason{reason="capacity"} 99\n'
                           b'vllm:kv_cache_usage_perc 0.5\n')
    assert m["waiting"] == 5.0 and m["kv"] == 0.5


# --- a replica that holds requests and makes no progress (a wedged engine whose HTTP server still answers) ---

def reading(running=0.0, waiting=0.0, tokens=0.0) -> dict:
    return {"running": running, "waiting": waiting, "kv": 0.1, "preemptions": 0.0, "tokens": tokens}


def stall_run(readings, stall_ms=3000, every_s=1.0, alone=False):
    """Feed replica r:1 these readings (and r:2, unless `alone`, an idle one), one scrape each `every_s`; what the
    pool read after each: (saturated, stalled replicas)."""
    clock = FakeClock()
    replicas = ["r:1"] if alone else ["r:1", "r:2"]
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=replicas, stall_ms=stall_ms), None,
                          clock=clock)
    out = []
    for m in readings:
        scraper.record(scraper.replicas["r:1"], m)
        if not alone:
            scraper.record(scraper.replicas["r:2"], reading())
        sat = scraper.aggregate(clock())
        out.append((sat.saturated, sat.stalled))
        clock.advance(every_s)
    return out


def test_a_replica_holding_requests_with_its_token_counters_still_is_stalled_after_stall_ms(caplog):
    caplog.set_level(logging.INFO, logger="extproc.saturation")
    busy = [reading(running=2, tokens=100 + 10 * i) for i in range(3)]  # moving: 3 s
    hung = [reading(running=3, tokens=120.0)] * 6  # still from the 3rd reading on
    moving_again = [reading(running=2, tokens=130.0)]
    states = stall_run(busy + hung + moving_again)
    assert states == [(False, 0)] * 6 + [(False, 1)] * 3 + [(False, 0)]  # still since t=2: stalled past t=5
    messages = [r.getMessage() for r in caplog.records]
    assert sum("stalled" in m for m in messages) == 1 and "holds 3 requests" in messages[0]
    assert sum("progress again" in m for m in messages) == 1


def test_a_stalled_replicas_queue_is_not_read_as_the_pools_saturation_unless_every_replica_is_stalled():
    hung = [reading(running=4, waiting=6, tokens=50.0)] * 6  # its queue grows whatever the load
    assert stall_run(hung) == [(True, 0)] * 4 + [(False, 1)] * 2  # saturated by its queue until seen stalled
    assert stall_run(hung, alone=True) == [(True, 0)] * 4 + [(True, 1)] * 2  # nothing else left to serve


def test_an_idle_replica_is_never_stalled_however_long_its_counters_stand_still():
    assert stall_run([reading(tokens=500.0)] * 10) == [(False, 0)] * 10


def test_a_restarted_replica_whose_counters_fell_is_progress_not_a_stall():
    states = stall_run([reading(running=1, tokens=9000.0)] * 3 + [reading(running=1, tokens=5.0)] * 3)
    assert states == [(False, 0)] * 6


def test_without_token_counters_or_with_stall_ms_0_the_stall_rule_is_off():
    no_counters = [reading(running=3, tokens=float("nan"))] * 10
    assert stall_run(no_counters) == [(False, 0)] * 10
    assert stall_run([reading(running=3, tokens=7.0)] * 10, stall_ms=0) == [(False, 0)] * 10


def test_metrics_without_token_counters_are_still_read_with_the_stall_rule_off():
    body = re.sub(rb"^vllm:(prompt|generation)_tokens_total\{.*\n", b"", real_metrics_with(running="2.0"), flags=re.M)
    m = parse_vllm_metrics(body)
    assert m["running"] == 2.0 and m["tokens"] != m["tokens"]  # NaN


def test_a_stalled_replica_that_goes_idle_stays_stalled_until_its_counters_move():
    # Its requests' clients gave up (or a wedged vLLM's gauges read 0): idle is no news from a hung engine, and
    # looking well again it would be sent requests that hang too. A restart or a resumed engine moves its counters.
    hung = [reading(running=3, tokens=120.0)] * 5  # stalled past 3 s
    idle = [reading(tokens=120.0)] * 4
    states = stall_run(hung + idle + [reading(running=1, tokens=125.0)])
    assert states == [(False, 0)] * 4 + [(False, 1)] * 5 + [(False, 0)]
    # An idle replica that was never stalled is not judged by its still counters (above), nor is this one after.
    assert stall_run([reading(tokens=120.0)] * 6) == [(False, 0)] * 6


def steer_run(hung_readings, other=None, stall_ms=2000):
    """r:1 given `hung_readings` one a second, r:2 `other` (a working reading): the last aggregate."""
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000",
                                                                        "10.0.0.3:8000"], stall_ms=stall_ms),
                          None, clock=clock)
    r1, r2, r3 = scraper.replicas.values()
    for m in hung_readings:
        scraper.record(r1, m)
        scraper.record(r2, other or reading(running=2, tokens=clock()))
        if clock() < 1003:  # r3 stops answering after a while: its last reading goes stale
            scraper.record(r3, reading(running=1, tokens=clock()))
        sat = scraper.aggregate(clock())
        clock.advance(1.0)
    return sat


def test_while_a_replica_is_stalled_the_reading_names_the_others_with_their_load():
    sat = steer_run([reading(running=3, tokens=50.0)] * 5)
    assert sat.stalled == 1
    # The working one with its running + waiting, the unread one last (named only for Envoy to fall back to).
    assert sat.working == (("10.0.0.2:8000", 2.0, 1.0), ("10.0.0.3:8000", float("inf"), 1.0))
    assert steer_run([reading(running=3, tokens=50.0 + i) for i in range(5)]).working == ()  # nothing stalled


def test_a_replica_named_by_host_name_is_named_by_its_ip_once_resolved():
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["localhost:8000", "[::1]:8001",
                                                                        "127.0.0.1:8002"]), None)
    r1, r2, r3 = scraper.replicas.values()
    assert (r1.endpoint, r2.endpoint, r3.endpoint) == (None, "[::1]:8001", "127.0.0.1:8002")
    asyncio.run(scraper._resolve())
    assert set(r1.endpoint.split(",")) <= {"127.0.0.1:8000", "[::1]:8000"} and r1.endpoint  # every address


def test_a_replica_listed_by_an_ip_written_otherwise_is_named_as_envoy_lists_its_hosts():
    # Envoy lists (and logs) an IPv6 host as inet_ntop writes it; the override-host list must name it so, or Envoy
    # does not find it and balances by itself, onto the stalled replica too.
    spec = PoolSpec(replicas=["[FD00:0:0:0:0:0:0:2]:8000", "[fd00:0000::0003]:8000", "10.0.0.4:8000"])
    scraper = PoolScraper(RecordingCore(), "pool_a", spec, None)
    assert [r.endpoint for r in scraper.replicas.values()] == ["[fd00::2]:8000", "[fd00::3]:8000", "10.0.0.4:8000"]
    assert saturation._as_envoy_lists("vllm-0.vllm:8000") is None  # a name: resolved, as before


def test_envoys_cluster_membership_gives_each_host_as_ip_port_ipv6_in_brackets():
    doc = {"cluster_statuses": [
        {"name": "other", "host_statuses": [{"address": {"socket_address": {"address": "10.9.9.9", "port_value": 1}}}]},
        {"name": "pool_a", "host_statuses": [
            {"address": {"socket_address": {"address": "10.0.0.1", "port_value": 8000}}},
            {"address": {"socket_address": {"address": "fd00::2", "port_value": 8000}}},
            {"address": {"pipe": {"path": "/tmp/x"}}}]}]}
    assert saturation._cluster_hosts(doc, "pool_a") == {"10.0.0.1:8000", "[fd00::2]:8000"}
    assert saturation._cluster_hosts(doc, "missing") is None
    assert saturation.ScrapedReplica("[fd00::2]:8000").endpoint == "[fd00::2]:8000"


def test_a_reload_that_restarts_the_scrapers_keeps_what_they_knew_of_each_replica(monkeypatch):
    # A replica seen stalled must not be trusted afresh (and sent requests that hang) because a reload changed the
    # pool's settings; one no longer listed is forgotten.
    started = []

    async def idle(self):
        started.append(self)
        await asyncio.Event().wait()

    async def reload():
        core = RecordingCore()
        core.saturation = {}
        scrapers = SaturationScrapers(core)
        monkeypatch.setattr(PoolScraper, "run", idle)
        await scrapers.configure({"pool_a": PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000"])})
        await asyncio.sleep(0)
        hung = started[-1].replicas["10.0.0.1:8000"]
        hung.stalled = True
        await scrapers.configure({"pool_a": PoolSpec(replicas=["10.0.0.1:8000"], stall_ms=5000)})
        await asyncio.sleep(0)
        kept = started[-1].replicas
        await scrapers.configure({"pool_b": PoolSpec(replicas=["10.0.0.1:8000"])})
        await asyncio.sleep(0)
        other_pool = started[-1].replicas
        await scrapers.stop()
        return hung, kept, other_pool

    hung, kept, other_pool = asyncio.run(reload())
    assert kept == {"10.0.0.1:8000": hung} and kept["10.0.0.1:8000"].stalled
    assert not other_pool["10.0.0.1:8000"].stalled  # another pool's replica of that address is its own


def test_a_reload_of_a_pool_found_through_envoy_starts_from_its_replicas_as_last_listed():
    # Any reload that changes `pools` (a limit knob) restarts the scrapers. One of a pool found through Envoy's
    # admin started with no replica until its first discovery: an admin that did not answer then left the pool with
    # none, read as saturated for 5 s (the next try), where a failed discovery otherwise keeps the last membership.
    clock = FakeClock()
    spec = PoolSpec(envoy_admin="http://127.0.0.1:9901")
    before = PoolScraper(RecordingCore(), "pool_a", spec, None, clock=clock)
    before.replicas.update((a, saturation.ScrapedReplica(a)) for a in ("10.0.0.1:8000", "10.0.0.2:8000"))
    for r in before.replicas.values():
        before.record(r, reading(running=1, tokens=5.0))
    after = PoolScraper(RecordingCore(), "pool_a", PoolSpec(envoy_admin="http://127.0.0.1:9901", stale_ms=2000),
                        None, clock=clock, known=before.replicas)
    asyncio.run(after._discover())  # no session: the admin is not read
    assert after.replicas == before.replicas
    assert not after.aggregate(clock()).saturated


class EnvoyAdmin:
    """Stands in for the session the scraper reads Envoy's /clusters through: lists `hosts` for pool_a."""

    def __init__(self, hosts):
        self.hosts = hosts

    @contextlib.asynccontextmanager
    async def get(self, url, timeout=None):
        statuses = [{"address": {"socket_address": {"address": h.rpartition(":")[0], "port_value": 8000}}}
                    for h in self.hosts]
        doc = {"cluster_statuses": [{"name": "pool_a", "host_statuses": statuses}]}

        class Answer:
            async def json(self, content_type=None):
                return doc
        yield Answer()


def test_a_replica_envoy_drops_after_a_reload_comes_back_as_a_new_one():
    # A reload hands the new scraper what the old one knew. It kept all of it for good: a replica Envoy dropped
    # later (its pod deleted) and listed again (a new pod at that IP) came back with the old one's reading, here
    # stalled, its old requests counted as the pool's stalled share until the new one was read.
    clock = FakeClock()
    spec = PoolSpec(envoy_admin="http://127.0.0.1:9901", stall_ms=1000)
    before = PoolScraper(RecordingCore(), "pool_a", spec, None, clock=clock)
    before.replicas.update((a, saturation.ScrapedReplica(a)) for a in ("10.0.0.1:8000", "10.0.0.2:8000"))
    hung, other = before.replicas.values()
    for _ in range(3):
        before.record(hung, reading(running=2, tokens=5.0))
        before.record(other, reading())
        before.aggregate(clock())
        clock.advance(1.0)
    assert hung.stalled
    admin = EnvoyAdmin(["10.0.0.1:8000", "10.0.0.2:8000"])
    after = PoolScraper(RecordingCore(), "pool_a", spec, admin, clock=clock, known=before.replicas)
    assert after.replicas["10.0.0.1:8000"] is hung  # kept across the reload
    admin.hosts = ["10.0.0.2:8000"]
    asyncio.run(after._discover())
    admin.hosts = ["10.0.0.1:8000", "10.0.0.2:8000"]
    asyncio.run(after._discover())
    back = after.replicas["10.0.0.1:8000"]
    assert back is not hung and not back.stalled and back.metrics is None
    assert after.aggregate(clock()).stalled == 0


def test_a_stalled_replica_whose_metrics_stop_answering_stays_stalled_and_is_not_named():
    # A wedged server whose /metrics hangs too: unread, it would count as saturation (any unread replica does)
    # and stop being stalled, so requests would be steered to it again.
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000"],
                                                              stall_ms=2000, stale_ms=1500), None, clock=clock)
    hung, ok = scraper.replicas.values()
    for i in range(8):
        if i < 4:
            scraper.record(hung, reading(running=3, tokens=50.0))  # then its /metrics stops answering too
        scraper.record(ok, reading(running=1, tokens=float(i)))
        sat = scraper.aggregate(clock())
        clock.advance(1.0)
    assert hung.stalled and sat.stalled == 1 and sat.stalled_requests == 3 and not sat.saturated
    assert sat.working == (("10.0.0.2:8000", 1.0, 1.0),)


def test_a_stalled_replica_that_then_refuses_connections_is_down_not_stalled():
    # The alert says "restart it"; while it restarts (a 70B model loads for minutes) nothing listens. Counted as
    # stalled, the critical ExtprocReplicaStalled ("its HTTP server still answers: restart it") kept firing beside
    # ExtprocReplicaDown (an on-call audit: hang, then SIGKILL, through real Envoy and Prometheus). It is down, as
    # a replica that refuses connections is; the verdict is kept for when it answers again.
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000"],
                                                              stall_ms=2000, stale_ms=1500), None, clock=clock)
    hung, ok = scraper.replicas.values()
    for i in range(8):
        if i < 4:
            scraper.record(hung, reading(running=3, tokens=50.0))
        else:
            hung.refused = True  # killed: its scrapes find nothing listening
        scraper.record(ok, reading(running=1, tokens=float(i)))
        sat = scraper.aggregate(clock())
        clock.advance(1.0)
    assert hung.stalled and sat.stalled == 0 and sat.stalled_requests == 0 and not sat.saturated
    scraper.record(hung, reading(running=0, tokens=50.0))  # back, idle, its counters where they were
    assert scraper.aggregate(clock()).stalled == 1  # not trusted until they move


def test_a_killed_replica_whose_last_reading_is_still_fresh_is_down_at_once_never_stalled():
    # Killed while it held requests, its last reading younger than stale_ms: aggregate() judged that reading's
    # standing counters by stall_ms first, so a dead replica read "stalled" (ExtprocReplicaStalled, "its HTTP
    # server still answers: restart it") until the reading aged out; the slow drill `replica_down` saw it pending.
    # Nothing listens: it is down, left out of the reading at once (not named to Envoy, its requests not counted).
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000"],
                                                              stall_ms=1000, stale_ms=5000), None, clock=clock)
    killed, ok = scraper.replicas.values()
    scraper.record(killed, reading(running=3, tokens=50.0))
    scraper.record(ok, reading(running=1, tokens=1.0))
    assert scraper.aggregate(clock()).stalled == 0
    for i in range(3):
        clock.advance(1.0)
        killed.refused = True  # its scrapes find nothing listening; its last reading stays, fresher than stale_ms
        scraper.record(ok, reading(running=1, tokens=2.0 + i))
        sat = scraper.aggregate(clock())
        assert sat.stalled == 0 and sat.stalled_requests == 0, i
        assert not killed.stalled and not sat.saturated and sat.running == 1
    assert clock() - killed.at < 5.0  # still fresh: left out for refusing, not for its age


def test_a_stalled_replica_that_restarts_idle_is_progress_even_with_its_counters_at_0_again():
    # It hung before its first token (counters 0), and comes back from a restart idle with counters 0: only its
    # process start time says it is a new process.
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["10.0.0.1:8000"], stall_ms=2000), None,
                          clock=clock)
    (r,) = scraper.replicas.values()
    states = []
    for m in [reading(running=2)] * 4 + [reading()] * 2 + [{**reading(), "started": 2.0e9}] * 2:
        m.setdefault("started", 1.0e9)
        scraper.record(r, m)
        states.append(scraper.aggregate(clock()).stalled)
        clock.advance(1.0)
    assert states == [0, 0, 0, 1, 1, 1, 0, 0]


def test_a_reload_that_raises_stall_ms_keeps_a_stalled_replica_stalled_until_it_moves():
    clock = FakeClock()
    core = RecordingCore()
    scraper = PoolScraper(core, "pool_a", PoolSpec(replicas=["10.0.0.1:8000"], stall_ms=1000), None, clock=clock)
    (r,) = scraper.replicas.values()
    for _ in range(3):
        scraper.record(r, reading(running=2, tokens=5.0))
        scraper.aggregate(clock())
        clock.advance(1.0)
    assert r.stalled
    longer = PoolScraper(core, "pool_a", PoolSpec(replicas=["10.0.0.1:8000"], stall_ms=60000), None, clock=clock,
                         known=scraper.replicas)
    longer.record(r, reading(tokens=5.0))  # idle now, still no progress
    assert longer.aggregate(clock()).stalled == 1
    off = PoolScraper(core, "pool_a", PoolSpec(replicas=["10.0.0.1:8000"], stall_ms=0), None, clock=clock,
                      known=longer.replicas)
    off.record(r, reading(tokens=5.0))
    assert off.aggregate(clock()).stalled == 0  # stall_ms 0: the rule is off


def test_while_a_replica_is_stalled_one_whose_health_check_fails_is_not_named():
    # Envoy takes a named replica whatever its health checks say: one draining (/health 503) must not be named.
    sat = steer_run([reading(running=3, tokens=50.0)] * 5)
    assert sat.working[0][0] == "10.0.0.2:8000"
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000",
                                                                        "10.0.0.3:8000"], stall_ms=2000),
                          None, clock=clock)
    r1, r2, r3 = scraper.replicas.values()
    r2.healthy = False
    for i in range(4):
        scraper.record(r1, reading(running=3, tokens=50.0))
        scraper.record(r2, reading(tokens=float(i)))
        scraper.record(r3, reading(running=1, tokens=float(i)))
        sat = scraper.aggregate(clock())
        clock.advance(1.0)
    assert sat.stalled == 1 and sat.working == (("10.0.0.3:8000", 1.0, 1.0),)


def test_while_a_replica_is_stalled_each_round_asks_the_others_health():
    async def rounds():
        hung = real_metrics_with(running="3.0")  # its token counters never move
        async with replica(answering(hung)) as a, replica(answering(real_metrics_with()), health=503) as b, \
                aiohttp.ClientSession() as session:
            clock = FakeClock()
            core = RecordingCore()
            scraper = PoolScraper(core, "pool_a", PoolSpec(replicas=[a, b], stall_ms=1000), session, clock=clock)
            for _ in range(4):
                await scraper._round(clock())
                clock.advance(1.0)
            return core.published[-1], scraper.replicas[b].healthy

    sat, b_healthy = asyncio.run(rounds())
    assert sat.stalled == 1 and not b_healthy and sat.working == ()  # b draining: nothing to name


# --- models.<name>.names_from_replicas: each replica's /v1/models is handed to the core ---

def test_each_replicas_models_listing_is_handed_over_and_a_silent_one_keeps_its_last():
    cards = [{"id": "llama", "parent": None}, {"id": "sql-lora", "parent": "llama"}]
    answers = [web.json_response({"object": "list", "data": cards}), web.Response(status=500)]

    async def models(request):
        return answers.pop(0)

    async def list_twice():
        core = RecordingCore(listings=True)
        async with replica(answering(real_metrics_with()), models=models) as address, \
                aiohttp.ClientSession() as session:
            scraper = PoolScraper(core, "pool_a", PoolSpec(replicas=[address]), session, clock=FakeClock())
            await scraper._read_listings()
            await scraper._read_listings()  # it answers 500 now: its last listing stands
            return core.listings

    assert asyncio.run(list_twice()) == [[cards], [cards]]


@pytest.mark.parametrize("body", [
    b'{"data": [{"id": "llama", "parent": null, "max_model_len": 100000000000000000000000}]}',
    b'{"data": [{"id": "llama", "parent": null}, {"id": "lora-\\ud800", "parent": "llama"}]}',
], ids=["int_past_64_bits", "lone_surrogate"])
def test_a_models_listing_that_json_cannot_carry_back_does_not_break_get_v1_models(body):
    # Python's json reads an integer of any size and a lone UTF-16 surrogate escape; orjson, which writes GET
    # /v1/models, refuses both (TypeError): one replica's card broke the edge's model list for every client.
    async def read():
        core = listed_core(FakeClock())
        async with replica(answering(real_metrics_with()), models=answering(body, content_type="application/json")) \
                as address, aiohttp.ClientSession() as session:
            scraper = PoolScraper(core, "pool_a", PoolSpec(replicas=[address]), session, clock=FakeClock())
            await scraper._read_listings()
        return core.model_catalog()

    catalog = asyncio.run(read())
    assert models_body(catalog, 0) and catalog["llama"]["max_model_len"] is None


def test_a_replica_slow_to_list_its_models_does_not_delay_the_saturation_readings():
    async def slow_models(request):
        await asyncio.sleep(1.5)  # past the scraper's 0.5 s timeout
        return web.json_response({"data": []})

    async def run_a_while():
        core = RecordingCore(listings=True)
        async with replica(answering(real_metrics_with()), models=slow_models) as address, \
                aiohttp.ClientSession() as session:
            spec = PoolSpec(replicas=[address], scrape_interval_ms=50, models_interval_ms=200)
            task = asyncio.create_task(PoolScraper(core, "pool_a", spec, session).run())
            await asyncio.sleep(0.6)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return len(core.published)

    assert asyncio.run(run_a_while()) >= 6  # a round every 50 ms, none waiting for /v1/models


def test_a_models_context_is_learned_from_the_simulated_replicas_listings_without_names_from_replicas():
    """cost.max_context_tokens unset: the scraper reads the pool's /v1/models for it, and the model's context is
    the largest max_model_len its replicas list (a request may run that far on the replica that lists it)."""
    profile = load_profile("h100-llama70b-awq").with_model_names(["llama-70b"])

    async def learn():
        async with SimFleet(profile, port=0, speed=50) as long, \
                SimFleet(dataclasses.replace(profile, max_model_len=4096), port=0, speed=50) as short, \
                aiohttp.ClientSession() as session:
            replicas = [url.removeprefix("http://") for url in (*long.urls, *short.urls)]
            core = AdmissionController(make_policy(models={"llama-70b": {"cluster": "pool_a"}},
                                                   pools={"pool_a": {"replicas": replicas}}, tenants=[]))
            spec = PoolSpec(replicas=replicas, scrape_interval_ms=50, models_interval_ms=200)
            task = asyncio.create_task(PoolScraper(core, "pool_a", spec, session).run())
            try:
                return await until(lambda: core.cost_models["llama-70b"].context_tokens, timeout=5.0,
                                   holds=lambda tokens: tokens == 8192)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(learn()) == 8192


def test_requests_vllm_defers_for_its_lora_budget_are_not_saturation():
    """vLLM 0.32 (--max-loras, 1 by default) keeps requests for a second adapter waiting while the first one's run:
    num_requests_waiting counts them, num_requests_waiting_by_reason{reason="deferred"} says they wait for an
    adapter slot, not for room."""
    body = real_metrics_with(waiting="7.0", running="1.0")
    body = body.replace(b'reason="deferred"} 0.0', b'reason="deferred"} 7.0')
    m = parse_vllm_metrics(body)
    assert (m["waiting"], m["deferred"]) == (7.0, 7.0)
    scraper = asyncio.run(scrape_once(answering(body)))
    sat = scraper.aggregate(scraper.clock())
    assert not sat.saturated and sat.waiting == 0
    # One waiting for room besides them is saturation again, as before.
    scraper = asyncio.run(scrape_once(answering(body.replace(b'reason="capacity"} 0.0', b'reason="capacity"} 1.0')
                                                .replace(b'reason="deferred"} 7.0', b'reason="deferred"} 6.0'))))
    assert scraper.aggregate(scraper.clock()).saturated


def passing_run(finished_per_s: float, waiting: float = 2.0, step_s: float = 0.01, **extra) -> list[bool]:
    """Replica r:1 with `waiting` requests queued at every scrape (every 200 ms), finishing `finished_per_s`
    requests a second and decoding one step every `step_s`: whether the pool read saturated after each scrape."""
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["r:1"]), None, clock=clock)
    out = []
    for i in range(5):
        t = 0.2 * i
        m = {**reading(running=4, waiting=waiting, tokens=1000 * t), "finished": finished_per_s * t,
             "itl_sum": t * 4, "itl_count": t * 4 / step_s, **extra}
        scraper.record(scraper.replicas["r:1"], m)
        out.append(scraper.aggregate(clock()).saturated)
        clock.advance(0.2)
    return out


def test_requests_only_passing_through_vllms_queue_are_not_saturation():
    """Found with scenarios/classify-burst.yaml (1-5-token classification calls, 700 requests/s a replica, KV cache
    empty): one or two requests were always between their arrival and the next engine step, so at half the pool's
    capacity it read saturated, the pool limit was cut to a few requests and 3,864 were refused in the first 15 s
    at 0.5x load. Two waiting where 700 finish a second wait ~3 ms, a third of one 10 ms engine step."""
    assert passing_run(finished_per_s=700) == [True] + [False] * 4  # the first reading has nothing to compare
    # Two waiting where five finish a second wait ~400 ms, forty steps: held for room, as before.
    assert passing_run(finished_per_s=5) == [True] * 5
    # Without vLLM's request_success_total (another server, an older vLLM) every waiting request counts.
    assert passing_run(finished_per_s=700, finished=float("nan")) == [True] * 5


def test_for_the_pool_limit_a_request_waiting_at_one_scrape_only_is_passing_through():
    """Found with scenarios/code-completion.yaml (completions of 16-64 tokens, ~80 requests/s a replica at 60% load,
    ~2.9 ms engine steps, KV cache 1% full): at a scrape one replica of four often held one request between its
    arrival and the next engine step. One waiting where 80 finish a second reads as 12.5 ms by Little's law: over
    the four steps of PASSING_STEPS, so the pool read saturated at a quarter of its scrapes, and twice in a row
    every ~7 s: the pool limit was cut by saturation 8 times in the calm minute (45K -> 22K tokens; twice two cuts
    half a second apart), with the latency at a quarter of its target, and batch waited out its 5 s. Where one
    waiting request is already over the bound, a snapshot of a count that averages under one (0 or 1) cannot
    tell; a queue held for room is still there at the next scrape. Such a reading is `fleeting`: the pool limit
    does not count it while its latency is under half its target (tests/unit/test_pool_limit.py); the per-class
    adaptive caps read `saturated` as before (for them the rule cost the spike's onset)."""
    def run(waiting: list[float]) -> list[tuple[bool, bool]]:
        clock = FakeClock()
        scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["r:1"]), None, clock=clock)
        out = []
        for i, w in enumerate(waiting):
            t = 0.2 * i
            scraper.record(scraper.replicas["r:1"], {**reading(running=6, waiting=w, tokens=1000 * t),
                                                     "finished": 80 * t, "itl_sum": t * 6,
                                                     "itl_count": t * 6 / 0.0029})
            sat = scraper.aggregate(clock())
            out.append((sat.saturated, sat.saturated and not sat.fleeting))
            clock.advance(0.2)
        return out

    y, n = (True, False), (False, False)  # (saturated, and not fleeting)
    assert run([0, 1, 0, 0, 1, 0]) == [n, y, n, n, y, n]
    # Still waiting at the next scrape: held, for both (and two or more, as the tests above).
    assert run([0, 1, 1, 0, 2, 2]) == [n, y, (True, True), n, y, (True, True)]
    # The first reading has no previous one: every waiting request counts, as before.
    assert run([1, 0]) == [(True, True), n]
    # Where one waiting request is within the bound (700 finished a second), the snapshot decides, as before.
    assert passing_run(finished_per_s=700, waiting=1.0) == [True] + [False] * 4


def test_with_1_token_answers_the_engine_steps_count_give_the_step_time():
    """1-token answers (a classifier) decode nothing, so the inter-token histogram stands still: the same calls as
    above then read as saturated every scrape (1,193 refused in the first 15 s at 0.5x). vLLM counts its engine
    steps in vllm:iteration_tokens_total; 200 ms over 20 steps is a 10 ms step."""
    no_decode = {"itl_sum": 0.0, "itl_count": 0.0}
    clock_steps = [{"steps": 20.0 * i} for i in range(5)]
    out = []
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["r:1"]), None, clock=clock)
    for i, extra in enumerate(clock_steps):
        scraper.record(scraper.replicas["r:1"], {**reading(running=4, waiting=2.0, tokens=100.0 * i),
                                                 "finished": 140.0 * i, **no_decode, **extra})
        out.append(scraper.aggregate(clock()).saturated)
        clock.advance(0.2)
    assert out == [True] + [False] * 4
    # Without that count either, every waiting request counts.
    assert passing_run(finished_per_s=700, **no_decode) == [True] * 5


async def test_an_envoy_admin_that_cannot_be_read_is_a_warning(caplog):
    """Found by writing `pools.<name>.envoy_admin` from the docs through the real stack: with the admin written
    without its scheme (127.0.0.1:9901) or naming no such cluster, no replica was ever found, so the pool read as
    saturated and its limit sat at its floor (extproc_pool_limit 1) - and only a debug line said why."""
    closed = free_port()
    async def clusters(request):
        return web.json_response({"cluster_statuses": [{"name": "other"}]})

    app = web.Application()
    app.router.add_get("/clusters", clusters)
    runner = web.AppRunner(app)
    await runner.setup()
    admin = free_port()
    await web.TCPSite(runner, "127.0.0.1", admin).start()
    clock = FakeClock()
    try:
        async with aiohttp.ClientSession() as session:
            for url, why in ((f"http://127.0.0.1:{closed}", "ClientConnectorError"),
                             (f"http://127.0.0.1:{admin}/", "it lists no cluster 'pool_a'")):
                caplog.clear()
                scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(envoy_admin=url), session, clock=clock)
                await scraper._discover()
                await scraper._discover()  # said once a minute, not every try
                (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
                assert record.getMessage().startswith(f"pool pool_a: Envoy admin {url} not read (")
                assert why in record.getMessage() and "counts as saturated" in record.getMessage()
    finally:
        await runner.cleanup()


def test_two_reloads_at_once_leave_one_scraper_per_pool(monkeypatch):
    """Found while editing `pools` live (the file watch and a SIGHUP close together): each reload starts
    configure() as its own task, and the second one's stop() ran while the first was still in its own - both then
    started scrapers, the later ones replacing the earlier in the task table without cancelling them. The orphans
    ran on after stop(), publishing readings for pools the policy no longer had."""
    core = RecordingCore()
    core.saturation = {}
    running: list[str] = []

    async def lives(self):
        running.append(self.name)
        try:
            await asyncio.Event().wait()
        finally:
            running.remove(self.name)

    monkeypatch.setattr(PoolScraper, "run", lives)

    async def reload_twice() -> tuple[list[str], list[str]]:
        scrapers = SaturationScrapers(core)
        await scrapers.configure({"pool_a": PoolSpec(replicas=["127.0.0.1:9"])})
        await asyncio.sleep(0.01)
        await asyncio.gather(scrapers.configure({"pool_b": PoolSpec(replicas=["127.0.0.1:9"])}),
                             scrapers.configure({"pool_c": PoolSpec(replicas=["127.0.0.1:9"])}))
        await asyncio.sleep(0.01)
        after_reloads = sorted(running)
        await scrapers.stop()
        await asyncio.sleep(0.01)
        return after_reloads, list(running)

    after_reloads, after_stop = asyncio.run(reload_twice())
    assert after_reloads == ["pool_c"]  # the last configuration asked for, alone
    assert after_stop == []


# --- the parse's cost: the same sample lines, found by a search for their names instead of a try at every byte ---

_LINE_START = re.compile(rb"^(" + b"|".join(re.escape(n.encode()) for n in saturation._WANTED) + rb")([{ \t][^\n]*)",
                         re.M)  # the pattern before: `^` in multi-line mode, every series name in full


def _samples(pattern, body):
    return [(m.group(1), m.group(2)) for m in pattern.finditer(body)]


@pytest.mark.parametrize("body", [
    REAL_METRICS,
    REAL_METRICS.replace(b"\n", b"\r\n"),
    REAL_METRICS[REAL_METRICS.index(b"vllm:num_requests_running{"):],  # a series on the body's first line
    b'process_start_time_seconds 1.7e9\nvllm:num_requests_waiting_by_reason{reason="deferred"} 2\n'
    b'vllm:num_requests_waitingX 5\n# HELP vllm:num_requests_waiting x\n vllm:kv_cache_usage_perc 0.3\n'
    b'vllm:kv_cache_usage_perc\t0.4\nvllm:kv_cache_usage_perc',  # prefixes, comments, indents, a last line cut off
], ids=["real", "crlf", "first_line", "edges"])
def test_the_parse_reads_the_lines_a_line_start_pattern_reads(body):
    assert _samples(saturation._SAMPLE, b"\n" + body) == _samples(_LINE_START, body)
    assert saturation._SAMPLE.pattern.startswith(b"\\n")  # a literal first: searched for, not tried at every byte


def test_a_restarted_replicas_pace_is_not_read_across_its_restart():
    # r:1 made 200 tokens at 8 ms a token, went down (a crash, a model load: unreadable for 30 s, past the pace
    # window) and came back at r:2's 10 ms. Its counters started again from 0 and by its first reading were past the
    # old ones: the difference across the restart (0.9 s over 50 tokens, 18 ms) is no pace of either process.
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["r:1", "r:2"]), None, clock=clock)
    r1, r2 = scraper.replicas.values()

    def read(r, started, itl_sum, itl_count):
        r_m = {"running": 4.0, "waiting": 0.0, "kv": 0.3, "preemptions": 0.0, "tokens": itl_count,
               "started": started, "itl_sum": itl_sum, "itl_count": itl_count}
        scraper.record(r, r_m)

    for i in range(1, 21):
        read(r1, 1000.0, 0.08 * i, 10.0 * i)
        read(r2, 1000.0, 1.0 * i, 100.0 * i)
        clock.advance(1.0)
        assert scraper.aggregate(clock()).slow == 0
    clock.advance(30.0)
    for i in range(1, 6):  # r:1 restarted: 250 tokens at 10 ms by its first reading, then as r:2
        read(r1, 2000.0, 2.5 + 1.0 * (i - 1), 250.0 + 100.0 * (i - 1))
        read(r2, 1000.0, 20.0 + 5.0 + 1.0 * (i - 1), 2000.0 + 500.0 + 100.0 * (i - 1))
        clock.advance(1.0)
        sat = scraper.aggregate(clock())
        assert sat.slow == 0 and not r1.pace.slow


def test_a_kv_cache_usage_over_1_is_unreadable_not_a_reading_out_of_range():
    # A share of the cache (1: full). Over it (a percent, another server's gauge) it read as kv_usage 85 and was
    # exported as extproc_pool_kv_cache_usage 85.
    for kv in ("85.0", "1.5", "1.7e308"):
        with pytest.raises(UnreadableMetrics, match="over 1"):
            parse_vllm_metrics(real_metrics_with(kv=kv))
    assert parse_vllm_metrics(real_metrics_with(kv="1.0"))["kv"] == 1.0


def test_finite_values_whose_sum_over_label_sets_is_not_finite_are_unreadable():
    # Each line's value is finite; two served names' sum is not, and the pool's waiting read inf.
    body = real_metrics_with(waiting="1.7e308") + b'vllm:num_requests_waiting{engine="1",model_name="b"} 1.7e308\n'
    with pytest.raises(UnreadableMetrics, match="not finite"):
        parse_vllm_metrics(body)


LORA_METRICS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "lora_metrics.json")
                          .read_text(encoding="utf-8"))


def test_the_adapters_a_replica_runs_are_read_from_the_newest_lora_requests_info():
    """vLLM 0.32 keeps a vllm:lora_requests_info series for every adapter list ever current, its value the time it
    last was (tests/fixtures/vllm/lora_metrics.json): the newest is what runs now."""
    held = "\n".join(LORA_METRICS["deferred"]["while_both_held"]["lines"]).encode()
    assert parse_lora_info(held) == (1, frozenset({"a1"}))  # a2 deferred for the slot: not among them
    assert parse_lora_info("\n".join(LORA_METRICS["after_all"]["lines"])) == (1, frozenset())  # all done
    assert parse_lora_info(REAL_METRICS) is None  # no --enable-lora
    body = REAL_METRICS + b'vllm:lora_requests_info{max_lora="4",running_lora_adapters="c01,c02",' \
                          b'waiting_lora_adapters="c01,c02,c03"} 1.79e+09\n'
    assert parse_lora_info(body) == (4, frozenset({"c01", "c02", "c03"}))
    # What the steering is given: each working replica's address, load, max_lora and adapters.
    scraper = asyncio.run(scrape_once(answering(real_metrics_with(running="2.0", waiting="1.0") + held[held.index(
        b"# HELP vllm:lora"):] + b"\n")))
    sat = scraper.aggregate(scraper.clock())
    (r,) = scraper.replicas
    assert sat.loras == ((r, 3.0, 1, frozenset({"a1"})),) and sat.working == ()
    # Without it the reading has none (nothing changes).
    scraper = asyncio.run(scrape_once(answering(real_metrics_with())))
    assert scraper.aggregate(scraper.clock()).loras == ()
