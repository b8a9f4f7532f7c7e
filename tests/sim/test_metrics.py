"""/metrics parses with the Prometheus parser and carries vLLM's names, types and labels."""

import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.sim.fleet import SimFleet

JSON = {"content-type": "application/json"}  # vLLM refuses a JSON POST without it (the simulator too)

EXPECTED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


async def test_metrics_parse_with_vllm_names_types_and_counts():
    async with SimFleet("h100-llama8b", replicas=1, speed=50) as fleet, aiohttp.ClientSession() as http:
        url = fleet.urls[0]
        model = fleet.profile.model_names[0]
        for _ in range(3):
            body = {"prompt": "x" * 400, "max_tokens": 5, "ignore_eos": True}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in EXPECTED} == EXPECTED
    samples = {(s.name, s.labels.get("finished_reason"), s.labels.get("le")): s
               for f in families.values() for s in f.samples if f.name.startswith("vllm:")}
    # prometheus_client's process start time, unlabelled, as in real vLLM's /metrics: a restart changes it.
    assert 0 < time.time() - families["process_start_time_seconds"].samples[0].value < 600
    for sample in samples.values():
        assert sample.labels["model_name"] == model and sample.labels["engine"] == "0"
    assert samples[("vllm:prompt_tokens_total", None, None)].value == 300
    assert samples[("vllm:generation_tokens_total", None, None)].value == 15
    assert samples[("vllm:request_success_total", "length", None)].value == 3
    assert samples[("vllm:num_preemptions_total", None, None)].value == 0
    assert samples[("vllm:e2e_request_latency_seconds_count", None, None)].value == 3
    assert samples[("vllm:time_to_first_token_seconds_bucket", None, "+Inf")].value == 3
    assert samples[("vllm:inter_token_latency_seconds_count", None, None)].value == 12
    # One observation per engine step (the scraper's step time when nothing decodes): a prefill and four decodes each.
    assert samples[("vllm:iteration_tokens_total_count", None, None)].value == 15
    assert samples[("vllm:iteration_tokens_total_sum", None, None)].value == 300 + 12
    assert 0.0 <= samples[("vllm:kv_cache_usage_perc", None, None)].value <= 1.0


def test_counter_families_keep_vllm_names_without_the_total_suffix():
    from extproc.tools.sim.engine import Engine
    from extproc.tools.sim.metrics import ReplicaMetrics
    from extproc.tools.sim.profile import load_profile

    engine = Engine(load_profile("h100-llama8b"))
    text = ReplicaMetrics("m").render(engine)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:num_preemptions"].samples[0].name == "vllm:num_preemptions_total"
    # vLLM 0.32 exposes all five finished_reason values from start-up (tests/fixtures/vllm/metrics.json).
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} == {
        "stop", "length", "abort", "error", "repetition"}


class _Conn:
    """A connection that keeps what is written to it."""

    def __init__(self):
        self.transport, self.out = object(), b""

    def write(self, data: bytes) -> None:
        self.out += data

    def response_finished(self, keep_alive: bool) -> None:
        pass


async def test_a_request_an_idle_engine_takes_at_once_is_never_scraped_as_waiting():
    """vLLM publishes its gauges after each step, and a step takes in what arrived before it; the simulator's step
    waits for the event loop, so a scrape right behind an arrival is answered after that step, not before."""
    import asyncio

    from extproc.tools.sim.http11 import HttpRequest, ResponseWriter
    from extproc.tools.sim.profile import load_profile
    from extproc.tools.sim.replica import Replica

    replica = Replica(load_profile("h100-llama8b"), speed=1)
    replica.start()
    await asyncio.sleep(0)  # the engine loop parks, idle
    model = replica.profile.model_names[0]
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 50}' % model.encode()
    replica.handle(HttpRequest("POST", "/v1/completions", "", JSON, body), ResponseWriter(_Conn(), True))
    scrape = _Conn()
    replica.handle(HttpRequest("GET", "/metrics", "", {}, b""), ResponseWriter(scrape, True))
    assert scrape.out == b""  # held for the step the woken loop is about to take
    await asyncio.sleep(0.01)
    text = scrape.out.decode()
    assert f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0' in text
    assert f'vllm:num_requests_running{{engine="0",model_name="{model}"}} 1.0' in text
    busy = _Conn()
    replica.handle(HttpRequest("GET", "/metrics", "", {}, b""), ResponseWriter(busy, True))
    assert busy.out.startswith(b"HTTP/1.1 200")  # a busy engine's scrape is answered at once
    await replica.stop()


class _FixedClock:
    def __init__(self, now: float):
        self.t = now

    def now(self) -> float:
        return self.t


async def test_a_request_that_arrives_while_the_engine_lags_behind_the_clock_has_no_negative_latency():
    """A starved loop (or a high --speed) runs the engine behind the simulated clock, up to MAX_LAG_REAL_S: a request
    arriving then was stamped with the clock and served by the lagging engine before it arrived, its TTFT observed
    as negative (-48 s at --speed 1000 with 64 streams) and the histogram's sum falling."""
    import asyncio

    from extproc.tools.sim.http11 import HttpRequest, ResponseWriter
    from extproc.tools.sim.profile import load_profile
    from extproc.tools.sim.replica import Replica

    replica = Replica(load_profile("h100-llama8b"), speed=1000)
    replica._clock, replica._wake = _FixedClock(100.0), asyncio.Event()
    replica._sim_t = 60.0  # the engine (busy, not parked) is 40 simulated seconds behind the clock
    model = replica.profile.model_names[0]
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 3, "ignore_eos": true}' % model.encode()
    conn = _Conn()
    replica.handle(HttpRequest("POST", "/v1/completions", "", JSON, body), ResponseWriter(conn, True))
    engine = replica.engine
    while engine.has_work:
        replica._sim_t += engine.begin_iteration(replica._sim_t)
        replica._deliver(engine.end_iteration(replica._sim_t))
    assert conn.out.startswith(b"HTTP/1.1 200")
    metrics = replica.metrics
    assert metrics.ttft.count == 1 and 0 < metrics.ttft.total < 1
    assert 0 < metrics.e2e.total < 1 and metrics.queue.total == 0.0


async def test_samples_of_a_prompt_count_as_vllm_counts_them():
    """n=4 with a 300-token prompt (16-token blocks here; vLLM 0.32 on the CPU, 128-token blocks, gave the same shape:
    usage 300, prompt_tokens_total 1200, hits 3 x 256): usage counts the prompt once, prompt_tokens_total once a
    sample, and three samples read the first one's 18 full blocks."""
    async with SimFleet("h100-llama8b", replicas=1, speed=50) as fleet, aiohttp.ClientSession() as http:
        url = fleet.urls[0]
        body = {"prompt": [7] * 300, "max_tokens": 4, "n": 4, "temperature": 1.0, "ignore_eos": True}
        async with http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (300, 16)
    assert samples["vllm:prompt_tokens_total"] == 1200
    assert (samples["vllm:prefix_cache_queries_total"], samples["vllm:prefix_cache_hits_total"]) == (1200, 3 * 288)
