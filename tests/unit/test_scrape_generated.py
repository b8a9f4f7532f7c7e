"""Generated /metrics expositions through the scraper's own parse and aggregate path.

Starts from the recorded vLLM 0.32 exposition (tests/fixtures/vllm/metrics.txt) and one written the way the
simulator writes its own (extproc/tools/sim/metrics.py), and mutates one thing at a time: another version's names,
a series missing, labels reordered or escaped, several models or adapters on one replica, NaN/+Inf/-Inf/negative
values, counters going back (a restart), histogram buckets missing, duplicate series, comments and blank lines,
CRLF, a huge or truncated body, non-UTF-8 bytes, an HTML page, OpenMetrics `# EOF`. Whatever comes out, the parse
either reads it or raises UnreadableMetrics, and the pool's reading stays finite and in range. Seeded: the same
cases every run.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
from pathlib import Path

import aiohttp
from aiohttp import web

from extproc.policy.schema import PoolSpec
from extproc.server.saturation import MAX_METRICS_BYTES, PoolScraper, UnreadableMetrics, parse_vllm_metrics
from tests.conftest import FakeClock
from tests.unit.test_saturation_scraper import RecordingCore

RECORDED = (Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "metrics.txt").read_bytes()
READ = (b"vllm:num_requests_running", b"vllm:num_requests_waiting", b"vllm:kv_cache_usage_perc",
        b"vllm:num_preemptions_total", b"vllm:prompt_tokens_total", b"vllm:generation_tokens_total",
        b"process_start_time_seconds", b"vllm:inter_token_latency_seconds_sum",
        b"vllm:inter_token_latency_seconds_count", b"vllm:num_requests_waiting_by_reason",
        b"vllm:request_success_total", b"vllm:iteration_tokens_total_count")


def simulated(rng: random.Random) -> bytes:
    """An exposition as the simulator writes one (text format 0.0.4, its label order and families)."""
    labels = 'model_name="sim-8b",engine="0"'
    running, waiting = rng.randint(0, 64), rng.randint(0, 40)
    tokens = rng.randint(0, 10**7)
    lines = ["# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
             "# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {1.7e9 + rng.random()!r}"]
    for name, kind, value in (("vllm:num_requests_running", "gauge", running),
                              ("vllm:num_requests_waiting", "gauge", waiting),
                              ("vllm:kv_cache_usage_perc", "gauge", rng.random()),
                              ("vllm:num_preemptions_total", "counter", rng.randint(0, 100)),
                              ("vllm:prompt_tokens_total", "counter", tokens),
                              ("vllm:generation_tokens_total", "counter", tokens // 3),
                              ("vllm:request_success_total", "counter", rng.randint(0, 10**5))):
        lines += [f"# HELP {name} x", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {float(value)!r}"]
    count = rng.randint(0, 10**6)
    lines += ["# TYPE vllm:inter_token_latency_seconds histogram"]
    for le in ("0.01", "0.025", "0.05", "+Inf"):
        lines.append(f'vllm:inter_token_latency_seconds_bucket{{{labels},le="{le}"}} {float(count)!r}')
    lines += [f"vllm:inter_token_latency_seconds_count{{{labels}}} {float(count)!r}",
              f"vllm:inter_token_latency_seconds_sum{{{labels}}} {count * 0.012!r}"]
    return ("\n".join(lines) + "\n").encode()


def sample_lines(body: bytes) -> list[int]:
    """The indices of the lines of the series the scraper reads."""
    return [i for i, line in enumerate(body.split(b"\n"))
            if any(line.startswith(n) and line[len(n):len(n) + 1] in (b"{", b" ") for n in READ)]


def on_lines(body: bytes, rng: random.Random, change) -> bytes:
    lines = body.split(b"\n")
    picks = sample_lines(body)
    if picks:
        i = rng.choice(picks)
        lines[i] = change(lines[i])
    return b"\n".join(lines)


def set_value(value: bytes):
    return lambda line: line.rsplit(b" ", 1)[0] + b" " + value


def reorder_labels(line: bytes) -> bytes:
    m = re.match(rb"([^{]+)\{(.*)\}( .*)", line)
    if not m:
        return line
    parts = re.findall(rb'[^,=]+="(?:[^"\\]|\\.)*"', m.group(2))
    return m.group(1) + b"{" + b",".join(reversed(parts)) + b"}" + m.group(3)


def escaped_label(line: bytes) -> bytes:
    return line.replace(b"{", b'{note="a \\"quoted\\" } brace, \\\\ and \\n newline",', 1) if b"{" in line else line


def another_model(body: bytes, name: bytes) -> bytes:
    """Every read sample line again for model `name` (several served names, or a LoRA adapter, on one replica)."""
    lines = body.split(b"\n")
    extra = [lines[i].replace(b'model_name="', b'model_name="' + name + b"-", 1) for i in sample_lines(body)]
    return b"\n".join(lines + extra) + b"\n"


MUTATIONS = {
    "as is": lambda b, rng: b,
    "older names": lambda b, rng: b.replace(b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc"),
    "older token names": lambda b, rng: b.replace(b"vllm:inter_token_latency", b"vllm:time_per_output_token"),
    "series missing": lambda b, rng: b"\n".join(
        line for line in b.split(b"\n") if not line.startswith(rng.choice(READ))),
    "labels reordered": lambda b, rng: on_lines(b, rng, reorder_labels),
    "label escapes": lambda b, rng: on_lines(b, rng, escaped_label),
    "several models": lambda b, rng: another_model(b, b"lora-" + str(rng.randint(0, 9)).encode()),
    "NaN": lambda b, rng: on_lines(b, rng, set_value(b"NaN")),
    "+Inf": lambda b, rng: on_lines(b, rng, set_value(b"+Inf")),
    "-Inf": lambda b, rng: on_lines(b, rng, set_value(b"-Inf")),
    "negative": lambda b, rng: on_lines(b, rng, set_value(b"-%d" % rng.randint(1, 100))),
    "huge value": lambda b, rng: on_lines(b, rng, set_value(b"1.7e308")),
    "KV usage over 1": lambda b, rng: re.sub(rb"^(vllm:kv_cache_usage_perc\{[^}]*\}) \S+", rb"\g<1> 85.0", b,
                                             flags=re.M),
    "several engines": lambda b, rng: b + re.sub(rb'engine="0"', b'engine="1"', b"\n".join(
        b.split(b"\n")[i] for i in sample_lines(b))) + b"\n",
    "timestamp": lambda b, rng: on_lines(b, rng, lambda line: line + b" 1796215125905"),
    "buckets missing": lambda b, rng: b"\n".join(
        line for line in b.split(b"\n") if not (b"_bucket{" in line and rng.random() < 0.5)),
    "duplicate series": lambda b, rng: b + b"\n".join(
        b.split(b"\n")[i] for i in rng.sample(sample_lines(b), min(3, len(sample_lines(b))))) + b"\n",
    "comments and blank lines": lambda b, rng: b"\n".join(
        line + (b"\n\n# a comment vllm:num_requests_waiting 99\n" if rng.random() < 0.1 else b"")
        for line in b.split(b"\n")),
    "CRLF": lambda b, rng: b.replace(b"\n", b"\r\n"),
    "huge": lambda b, rng: b + b"# padding " + b"x" * (MAX_METRICS_BYTES // 2) + b"\n",
    "truncated": lambda b, rng: b[:rng.randint(0, len(b))],
    "non-UTF-8": lambda b, rng: on_lines(b, rng, lambda line: line.replace(b'"', b'"\xff\xfe', 1)),
    "bytes anywhere": lambda b, rng: b[:(i := rng.randint(0, len(b)))] + bytes([rng.randint(128, 255)]) + b[i:],
    "HTML page": lambda b, rng: b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1>"
                                b"vllm:num_requests_waiting 1</body></html>",
    "OpenMetrics EOF": lambda b, rng: b + b"# EOF\n",
    "empty": lambda b, rng: b"",
}


def bodies(seed: int):
    """(what was done, the body) for one seed: each mutation of each base, then a few pairs of them."""
    rng = random.Random(seed)
    for base_name, base in (("recorded", RECORDED), ("simulated", simulated(rng))):
        for name, mutate in MUTATIONS.items():
            yield f"{base_name}: {name} (seed {seed})", mutate(base, rng)
        for _ in range(8):
            first, then = rng.sample(sorted(MUTATIONS), 2)
            yield f"{base_name}: {first}, then {then} (seed {seed})", MUTATIONS[then](MUTATIONS[first](base, rng), rng)


def parsed(body: bytes) -> dict | None:
    try:
        m = parse_vllm_metrics(body)
    except UnreadableMetrics:
        return None
    for key in ("running", "waiting", "kv"):
        assert math.isfinite(m[key]) and m[key] >= 0, (key, m[key])
    return m


def assert_in_range(sat, what: str) -> None:
    assert 0.0 <= sat.kv_usage <= 1.0, (what, sat.kv_usage)
    for value in (sat.waiting, sat.running, sat.stalled, sat.stalled_requests, sat.slow):
        assert math.isfinite(value) and value >= 0, (what, value)
    for _, load, factor in sat.working or ():
        assert load >= 0 and factor >= 1.0, (what, load, factor)


def test_every_generated_exposition_is_read_or_refused_and_the_reading_stays_in_range():
    for seed in range(12):
        for what, body in bodies(seed):
            m = parsed(body)
            clock = FakeClock()
            scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["r:1", "r:2"]), None, clock=clock)
            r1, r2 = scraper.replicas.values()
            good = parsed(RECORDED)
            for _ in range(3):
                scraper.record(r1, dict(good))
                if m is not None:
                    scraper.record(r2, dict(m))
                clock.advance(0.2)
                assert_in_range(scraper.aggregate(clock()), what)
            if m is None:  # never read: counted as saturated once stale_ms passes without a reading
                clock.advance(2.0)
                scraper.record(r1, dict(good))
                assert scraper.aggregate(clock()).saturated, what


def with_counters(body: bytes, started: float, scale: float) -> bytes:
    """`body` with its process start time and every counter of a read series scaled by `scale`."""
    body = re.sub(rb"^process_start_time_seconds \S+", b"process_start_time_seconds %r" % started, body, flags=re.M)

    def scaled(m):
        return m.group(1) + b" %r" % (float(m.group(2)) * scale)
    return re.sub(rb"^(vllm:(?:prompt_tokens_total|generation_tokens_total|request_success_total|"
                  rb"num_preemptions_total|inter_token_latency_seconds_(?:sum|count)|"
                  rb"iteration_tokens_total_count)(?:\{[^}\n]*\})?) (\S+)", scaled, body, flags=re.M)


def test_a_replica_whose_counters_go_back_is_neither_stalled_nor_a_burst():
    rng = random.Random(7)
    clock = FakeClock()
    scraper = PoolScraper(RecordingCore(), "pool_a", PoolSpec(replicas=["r:1", "r:2"], stall_ms=1000), None,
                          clock=clock)
    r1, r2 = scraper.replicas.values()
    base = re.sub(rb"^(vllm:num_requests_running\{[^}]*\}) \S+", rb"\g<1> 3.0", RECORDED, flags=re.M)
    started, scale = 1.0e9, 1.0
    for i in range(200):
        if rng.random() < 0.1:  # restarted: its counters start again lower, with or without a new start time
            started += rng.choice((0.0, 50.0))
            scale = rng.uniform(0.0, scale)
        else:
            scale *= 1.0 + rng.uniform(0.001, 0.05)
        scraper.record(r1, parse_vllm_metrics(with_counters(base, started, scale)))
        scraper.record(r2, parse_vllm_metrics(with_counters(base, 1.0e9, 1.0 + i * 0.01)))
        clock.advance(0.2)
        sat = scraper.aggregate(clock())
        assert_in_range(sat, f"reading {i}")
        assert sat.stalled == 0, f"reading {i}"
        assert not r1.metrics["preempting"] or r1.metrics["preemptions"] > 0


async def healthy(request):
    return web.Response(status=200)


def test_the_scrape_loop_outlives_every_generated_exposition_over_http():
    """The real loop over loopback: one replica answers the generated bodies in turn (status 200 throughout), now and
    then one over the size cap or cut off before its Content-Length."""
    sent = [body for seed in range(2) for _, body in bodies(seed)]

    async def scrape_them_all():
        served = 0

        async def handler(request):
            nonlocal served
            body = sent[served % len(sent)]
            served += 1
            if served % 17 == 0:  # over the cap
                return web.Response(body=b"# " + b"x" * MAX_METRICS_BYTES, content_type="text/plain")
            if served % 13 == 0:  # cut off: fewer bytes than its Content-Length says
                resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
                resp.content_length = len(body) + 100
                await resp.prepare(request)
                await resp.write(body)
                request.transport.close()
                return resp
            return web.Response(body=body, content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", handler)
        app.router.add_get("/health", healthy)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        address = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        core = RecordingCore()
        try:
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(PoolScraper(core, "pool_a", PoolSpec(replicas=[address],
                                                                                  scrape_interval_ms=5), session).run())
                while served < len(sent) + 2 and not task.done():
                    await asyncio.sleep(0.01)
                assert not task.done()
                task.cancel()
        finally:
            await runner.cleanup()
        return core.published

    published = asyncio.run(scrape_them_all())
    assert published
    for sat in published:
        assert_in_range(sat, "over HTTP")
