"""The load generator: replayable arrivals, prompts of the requested size, aborts and summaries."""

import random
import time

from extproc.tools.loadgen import (LoadClient, RequestKind, RequestRecord, Workload, plan_request, poisson_arrivals,
                             run_open_loop, summarize)
from extproc.tools.sim.fleet import SimFleet


def test_poisson_arrivals_are_replayable_and_follow_the_schedule():
    schedule = [(100.0, 5.0), (100.0, 20.0)]
    first, second = poisson_arrivals(schedule, seed=7), poisson_arrivals(schedule, seed=7)
    assert first == second
    low = sum(1 for t in first if t < 100)
    high = len(first) - low
    assert 400 < low < 600 and 1700 < high < 2300


def test_plans_are_replayable_with_the_same_seed():
    workload = Workload([RequestKind(name="a", weight=3, prompt_tokens={"min": 10, "max": 900}),
                         RequestKind(name="b", weight=1, abort_prob=0.5)])
    plans = [[plan_request(i, workload, rng) for i in range(50)] for rng in (random.Random(1), random.Random(1))]
    assert [(p.kind.name, p.prompt_tokens, p.abort_fraction) for p in plans[0]] == \
        [(p.kind.name, p.prompt_tokens, p.abort_fraction) for p in plans[1]]


async def test_open_loop_counts_prompt_tokens_aborts_and_tokens():
    workload = Workload([RequestKind(name="chat", endpoint="chat", prompt_tokens=300, max_tokens=40, stream=True),
                         RequestKind(name="cmpl", endpoint="completions", prompt_tokens=200, max_tokens=40,
                                     stream=True, abort_prob=1.0)])
    async with SimFleet("h100-llama8b", replicas=2, speed=20) as fleet:
        async with LoadClient(fleet.urls, time_scale=20) as client:
            await run_open_loop(client, workload, [(10.0, 4.0)], seed=2)
    records = client.records
    assert records and {r.kind for r in records} == {"chat", "cmpl"}
    for r in records:
        if r.kind == "chat":
            assert r.ok and 1 <= r.output_tokens <= 40 and r.ttft <= r.latency
        else:
            assert r.error == "abort" or r.output_tokens < 40  # the stream may end naturally before its abort point
    summary = summarize(records)
    assert summary["requests"] == len(records) and summary["by_status"] == {"200": len(records)}
    assert summary["latency_p50"] > 0 and summary["ttft_p50"] > 0


def test_a_refusal_is_recorded_with_its_reason_not_only_its_type():
    from extproc.tools.loadgen import _error_type
    body = b'{"error": {"message": "m", "type": "rate_limit_error", "param": null, "code": "queue_timeout"}}'
    assert _error_type(body) == "rate_limit_error: queue_timeout"
    assert _error_type(b'{"error": {"message": "m", "type": "server_error", "code": null}}') == "server_error"
    assert _error_type(b"upstream connect error") == "http_error"
    assert _error_type(b'{"error": "text"}') == "http_error"


async def test_a_stream_cut_by_the_timeout_keeps_the_tokens_it_received():
    # The tokens that came before the timeout were generated and delivered: counted for an abort, they were lost
    # (0) for a timeout or a dropped connection, so tokens/s under overload read low.
    kind = RequestKind(endpoint="completions", prompt_tokens=50, max_tokens=4000, stream=True,
                       body={"ignore_eos": True})
    async with SimFleet("h100-llama8b", replicas=1, speed=1) as fleet:
        async with LoadClient(fleet.urls, timeout_s=0.5) as client:
            record = await client.send(plan_request(0, Workload([kind]), random.Random(0)))
    assert record.error == "timeout" and record.ttft is not None
    assert record.output_tokens > 0


class _FakeContent:
    def __init__(self, chunks):
        self.chunks = chunks

    async def iter_any(self):
        for chunk in self.chunks:
            yield chunk


class _FakeStream:
    def __init__(self, events):
        self.content = _FakeContent([b"".join(b"data: " + e + b"\n\n" for e in events)])

    def close(self):
        pass


async def test_a_token_whose_text_is_error_is_a_token_not_an_error_event():
    # A model's token "error" makes a chunk holding `"content":"error"`: it was parsed as an error event, had no
    # "usage", and the KeyError ended the whole load run.
    def chunk(content, reason=b"null"):
        return (b'{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"content":"'
                + content + b'"},"logprobs":null,"finish_reason":' + reason + b'}]}')
    events = [b'{"id":"c","object":"chat.completion.chunk","model":"m","choices":[{"index":0,"delta":{"role":'
              b'"assistant","content":""},"logprobs":null,"finish_reason":null}]}',
              chunk(b"error"), chunk(b": bad", b'"stop"'),
              b'{"id":"c","object":"chat.completion.chunk","model":"m","choices":[],"usage":{"prompt_tokens":5,'
              b'"total_tokens":7,"completion_tokens":2}}', b"[DONE]"]
    kind = RequestKind(stream=True)
    planned = plan_request(0, Workload([kind]), random.Random(0))
    record = RequestRecord(0.0, "default", "u", 200)
    await LoadClient(["u"])._read_stream(_FakeStream(events), planned, record, 0.0)
    assert record.ok and record.output_tokens == 2 and record.model == "m" and record.ttft is not None
    error = b'{"error":{"message":"m","type":"InternalServerError","param":null,"code":500}}'
    record = RequestRecord(0.0, "default", "u", 200)
    await LoadClient(["u"])._read_stream(_FakeStream([chunk(b" a"), error, b"[DONE]"]), planned, record, 0.0)
    assert record.error == "InternalServerError"


async def test_a_first_token_whose_text_is_role_is_counted():
    # Chat's opening chunk was told apart by the bytes "role" anywhere in it: a first token "role" was skipped with
    # it: one token short without a usage chunk, and the TTFT taken at the second token.
    def chunk(content, reason=b"null"):
        return (b'{"id":"c","object":"text_completion","model":"m","choices":[{"index":0,"text":"' + content
                + b'","logprobs":null,"finish_reason":' + reason + b'}]}')
    kind = RequestKind(endpoint="completions", stream=True, include_usage=False)
    planned = plan_request(0, Workload([kind]), random.Random(0))
    record = RequestRecord(0.0, "default", "u", 200)
    stream = _FakeStream([chunk(b"role"), chunk(b" of", b'"length"'), b"[DONE]"])
    await LoadClient(["u"])._read_stream(stream, planned, record, 0.0)
    assert record.ok and record.output_tokens == 2


async def test_a_closed_loop_without_drain_ends_when_its_requests_are_done_not_at_its_deadline():
    # drain=False slept to the deadline whatever: 2 requests with duration_s=60 took a minute.
    import asyncio

    from extproc.tools.loadgen import run_closed_loop

    kind = RequestKind(endpoint="completions", prompt_tokens=20, max_tokens=2)
    async with SimFleet("h100-llama8b", replicas=1, speed=50) as fleet:
        async with LoadClient(fleet.urls) as client:
            records = await asyncio.wait_for(
                run_closed_loop(client, Workload([kind]), concurrency=2, duration_s=60, requests=2, drain=False), 5)
    assert len(records) == 2 and all(r.ok for r in records)


async def test_open_loop_records_start_on_the_clock_its_arrivals_are_scheduled_on(monkeypatch):
    # The arrivals were drawn after the client's clock started and then scheduled from the end of the drawing, so
    # every record's start (on the client's clock) was late by the drawing's time x speed: code-completion's 117K
    # arrivals take 0.8 s, 4 simulated s at speed 5, moving requests into the next phase's window.
    from extproc.tools import loadgen

    drawn = loadgen.plan_arrivals

    def slow_draw(*args, **kwargs):
        time.sleep(0.5)
        return drawn(*args, **kwargs)

    monkeypatch.setattr(loadgen, "plan_arrivals", slow_draw)
    sent = []

    class Recorder(loadgen.LoadClient):
        async def send(self, planned):
            sent.append(((time.monotonic() - self.t0) * self.time_scale, planned.at))

    async with Recorder(["http://127.0.0.1:9"]) as client:
        await loadgen.run_open_loop(client, loadgen.Workload([loadgen.RequestKind()]), [(1.0, 100.0)], seed=1)
    assert len(sent) > 50
    assert max(abs(start - at) for start, at in sent) < 0.25  # before: 0.5 (the drawing's time)
