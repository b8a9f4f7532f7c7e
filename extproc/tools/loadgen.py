"""Load generator for OpenAI-compatible endpoints: closed loop or open-loop Poisson, streaming-aware.

Library: `run_closed_loop`, `run_open_loop`, `summarize`. CLI: `extproc loadgen`. Arrivals, request kinds,
prompt lengths and abort points come from a seeded RNG, so the same run can be replayed against other targets.
A kind may be an agent session (`session:`): one arrival starts a loop of calls, each sent when the previous one
ends plus a think time, its prompt the previous prompt + the previous answer + new tokens (`SessionShape`).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import yaml

from extproc.tools.sim.tokens import FILLER_WORDS, chat_content_tokens, filler_text
from extproc.tools.stats import percentile

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
CLIENT_ERROR = 0  # status recorded when no HTTP status arrived (timeout, refused, aborted by us)
SESSION_HEADER = "x-session-id"
RETRYABLE = frozenset({408, 409, 429})  # and every 5xx: what the OpenAI and Anthropic SDKs retry
RETRY_AFTER_MAX_S = 60.0  # a longer Retry-After is ignored for the backoff, as those SDKs do


def sample_count(spec: int | dict, rng: random.Random) -> int:
    """int: fixed; {"min", "max"}: uniform; {"median", "sigma"[, "max"]}: log-normal (at least 8)."""
    if isinstance(spec, int):
        return spec
    if "median" in spec:
        value = spec["median"] * math.exp(rng.gauss(0.0, spec.get("sigma", 0.0)))
        return max(8, min(int(spec.get("max", 1e9)), round(value)))
    return rng.randint(int(spec["min"]), int(spec["max"]))


def mean_count(spec: int | dict) -> float:
    """The mean of `sample_count` for a fixed or uniform spec."""
    if isinstance(spec, int):
        return float(spec)
    if "median" in spec:
        raise ValueError(f"a session's `calls` must be an int or {{min, max}}, got {spec}")
    return (int(spec["min"]) + int(spec["max"])) / 2


@dataclass(frozen=True)
class SessionShape:
    """An agent session: `calls` sequential calls, `think_s` simulated seconds between one's end and the next.

    Each call's prompt is the previous prompt + the previous call's output + `growth_tokens` new tokens (tool
    results, the next instruction), trimmed to `max_context_tokens` - max_tokens (frameworks drop the oldest turns
    when the context is full). A refused call (408, 409, 429, 5xx) is retried up to `retries` times after its
    Retry-After (at most 60 s; without one, 0.5 s doubling), like the OpenAI and Anthropic SDKs' default
    max_retries=2; a call that still fails, times out or is aborted ends the session, as the SDK's exception ends
    an agent run."""

    calls: int | dict = 5
    think_s: float = 1.0
    growth_tokens: int | dict = 200
    retries: int = 2
    max_context_tokens: int | None = None

    @property
    def mean_calls(self) -> float:
        return mean_count(self.calls)

    def next_prompt(self, prompt: int, output_tokens: int, growth: int, max_tokens: int | None) -> int:
        grown = prompt + output_tokens + growth
        if self.max_context_tokens is None:
            return grown
        return min(grown, self.max_context_tokens - (max_tokens or 0))

    def retry_delay(self, record: RequestRecord, retry: int) -> float | None:
        """Seconds before retrying this failed call (`retry` retries made so far), or None: the session ends."""
        if retry >= self.retries or not (record.status in RETRYABLE or record.status >= 500):
            return None
        if record.retry_after is not None and 0 < record.retry_after <= RETRY_AFTER_MAX_S:
            return record.retry_after
        return min(0.5 * 2 ** retry, 8.0)


@dataclass
class RequestKind:
    """One kind of request in a workload mix."""

    name: str = "default"
    weight: float = 1.0
    endpoint: str = "chat"  # chat | completions
    # int: fixed; {"min", "max"}: uniform; {"median", "sigma"[, "max"]}: log-normal
    prompt_tokens: int | dict = 512
    max_tokens: int | None = 256
    stream: bool = False
    include_usage: bool = True
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: dict = field(default_factory=dict)  # extra JSON fields, e.g. {"priority": 1, "ignore_eos": true}
    abort_prob: float = 0.0  # chance the client gives up early (mid-stream, or before the reply)
    session: SessionShape | dict | None = None  # an agent session: one arrival, several calls (SessionShape)

    def __post_init__(self) -> None:
        if isinstance(self.session, dict):
            self.session = SessionShape(**self.session)

    def sample_prompt_tokens(self, rng: random.Random) -> int:
        return sample_count(self.prompt_tokens, rng)

    @property
    def mean_calls(self) -> float:
        """Requests per arrival: 1, or a session's mean number of calls."""
        return self.session.mean_calls if self.session else 1.0

    def sample_call_prompt(self, rng: random.Random, output_tokens) -> int:
        """The prompt of a random call of this kind (a session's calls weighted alike); `output_tokens()` draws
        an earlier call's output length. For the capacity measurement, which has no sessions."""
        prompt = self.sample_prompt_tokens(rng)
        shape = self.session
        if shape is None:
            return prompt
        if isinstance(shape.calls, int):
            calls = shape.calls
        else:  # a random call falls in a session of n calls with a probability proportional to n
            sizes = range(int(shape.calls["min"]), int(shape.calls["max"]) + 1)
            calls = rng.choices(sizes, weights=sizes)[0]
        for _ in range(rng.randrange(calls)):
            prompt = shape.next_prompt(prompt, output_tokens(), sample_count(shape.growth_tokens, rng),
                                       self.max_tokens)
        return prompt


@dataclass
class Workload:
    """A weighted mix of request kinds."""

    kinds: list[RequestKind]

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        return cls([RequestKind(**k) for k in data["kinds"]])

    @classmethod
    def load(cls, path: str) -> Workload:
        return cls.from_dict(yaml.safe_load(Path(path).read_text()))

    def pick(self, rng: random.Random, weights: list[float] | None = None) -> RequestKind:
        return rng.choices(self.kinds, weights=weights or [k.weight for k in self.kinds])[0]


@dataclass
class PlannedRequest:
    """Everything random about one request, drawn up front so a run can be replayed exactly."""

    index: int
    kind: RequestKind
    prompt_tokens: int
    abort_fraction: float | None  # give up after this fraction of max_tokens deltas (or of the timeout)
    at: float = 0.0  # open loop: seconds after the start
    session: SessionPlan | None = None  # the kind is a session: this is its first call
    call: int = 0  # the call's index in its session
    retry: int = 0  # retries of this call so far


@dataclass
class SessionPlan:
    """What is random about one agent session, drawn up front: its id, number of calls, each call's new tokens."""

    id: str
    calls: int
    growth: list[int]  # new tokens before call 1, 2, ...

    def next_call(self, planned: PlannedRequest, record: RequestRecord, at: float) -> PlannedRequest | None:
        """The call to send after `record` ended (the same call retried, or the next one), or None: the session
        is over. `at` is when `record` ended; the returned plan's `at` is when to send it."""
        shape = planned.kind.session
        if not record.ok:
            delay = shape.retry_delay(record, planned.retry)
            if delay is None:
                return None
            return PlannedRequest(planned.index, planned.kind, planned.prompt_tokens, planned.abort_fraction,
                                  at + delay, self, planned.call, planned.retry + 1)
        if planned.call + 1 >= self.calls:
            return None
        prompt = shape.next_prompt(planned.prompt_tokens, record.output_tokens, self.growth[planned.call],
                                   planned.kind.max_tokens)
        return PlannedRequest(planned.index, planned.kind, prompt, planned.abort_fraction, at + shape.think_s, self,
                              planned.call + 1)


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds (scaled by time_scale), start relative to the run."""

    start: float
    kind: str
    url: str
    status: int
    latency: float | None = None
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    asked_model: str | None = None  # the `model` the request named
    model: str | None = None  # the model that answered, as the response names it (vLLM echoes its served name)
    queued: bool = False  # the admission layer held it in a queue first (x-extproc-queue-wait-ms > 0)
    queue_wait: float = 0.0  # how long it was held there (scaled): a degrade after a wait is decided at its end
    # The admission layer degraded it (x-extproc-decision: degrade): another model, or the same one with fewer
    # tokens or no streaming, which the answer's model name alone does not show.
    degraded_by_policy: bool = False
    retry_after: float | None = None  # the refusal's Retry-After (scaled by time_scale)
    session: str | None = None  # an agent session's id (the x-session-id header)
    call: int | None = None  # the call's index in its session, from 0
    calls: int | None = None  # the calls the session would make if none failed: it completed if call + 1 == calls
    retry: int = 0  # 0: the call's first attempt

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def degraded(self) -> bool:
        """Not the answer asked for: another model's (a degrade to a smaller model's pool), or one the admission
        layer degraded on the same model (clamped max_tokens, no streaming)."""
        return self.degraded_by_policy or (self.model is not None and self.asked_model is not None
                                           and self.model != self.asked_model)


def plan_request(index: int, workload: Workload, rng: random.Random, at: float = 0.0,
                 weights: list[float] | None = None) -> PlannedRequest:
    """Draw a request's kind (by `weights` if given, else the kinds' own), prompt length, abort point, and for a
    session kind its length and growth."""
    kind = workload.pick(rng, weights)
    prompt_tokens = kind.sample_prompt_tokens(rng)
    abort = rng.random() if kind.abort_prob > 0 and rng.random() < kind.abort_prob else None
    session = None
    if kind.session is not None:
        calls = max(1, sample_count(kind.session.calls, rng))
        growth = [sample_count(kind.session.growth_tokens, rng) for _ in range(calls - 1)]
        session = SessionPlan(f"{kind.name}-{index}", calls, growth)
    return PlannedRequest(index, kind, prompt_tokens, abort, at, session)


def plan_arrivals(workload: Workload, schedule: list[tuple[float, float]], seed: int,
                  phase_weights: list[dict[str, float]] | None = None) -> list[PlannedRequest]:
    """Poisson arrivals for phases of (duration_s, requests/s), each drawn up front (replayable by seed).

    Rates count requests: a session kind's arrivals (session starts) are divided by its mean calls, so its
    calls make up its weight's share of the requests. `phase_weights[i]` (kind name -> factor) multiplies those
    kinds' rates in phase i, the others' unchanged (a tenant flooding at 5x while the rest keep their rates)."""
    total = sum(k.weight for k in workload.kinds)
    per_phase, scaled = [], []
    for i, (duration, rate) in enumerate(schedule):
        factors = phase_weights[i] if phase_weights else {}
        w = [k.weight * factors.get(k.name, 1.0) / k.mean_calls for k in workload.kinds]
        per_phase.append(w)
        scaled.append((duration, rate * (sum(w) / total)))  # exactly `rate` for plain kinds and no factors
    ends = list(itertools.accumulate(d for d, _ in schedule))
    rng = random.Random(seed + 1)
    plans = []
    for n, at in enumerate(poisson_arrivals(scaled, seed)):
        phase = min(bisect.bisect_right(ends, at), len(ends) - 1)
        plans.append(plan_request(n, workload, rng, at, per_phase[phase]))
    return plans


def poisson_arrivals(schedule: list[tuple[float, float]], seed: int) -> list[float]:
    """Arrival times for phases of (duration_s, rate_per_s) with exponential gaps."""
    rng = random.Random(seed)
    times: list[float] = []
    phase_start = 0.0
    for duration, rate in schedule:
        t = phase_start
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= phase_start + duration:
                break
            times.append(t)
        phase_start += duration
    return times


class _PromptCache:
    """Prompt text of any length: a slice of one filler text (growing session prompts have many lengths)."""

    def __init__(self) -> None:
        self._filler = ""

    def text(self, endpoint: str, prompt_tokens: int) -> str:
        n = chat_content_tokens(prompt_tokens) if endpoint == "chat" else prompt_tokens
        chars = n * len(FILLER_WORDS[0])  # every filler word is one token of the same length
        if len(self._filler) < chars:
            self._filler = filler_text(max(n, 2 * len(self._filler) // len(FILLER_WORDS[0])))
        return self._filler[:chars]


class LoadClient:
    """Sends planned requests over one pooled aiohttp session and records each outcome."""

    def __init__(self, urls: list[str], timeout_s: float = 60.0, time_scale: float = 1.0, pool: int = 256,
                 default_model: str | None = None):
        self.urls = urls
        self.timeout_s = timeout_s
        self.time_scale = time_scale
        self.default_model = default_model
        self.records: list[RequestRecord] = []
        self._prompts = _PromptCache()
        self._pool = pool
        self._session: aiohttp.ClientSession | None = None
        self.t0 = 0.0

    async def __aenter__(self) -> LoadClient:
        connector = aiohttp.TCPConnector(limit=self._pool, limit_per_host=self._pool, force_close=False)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        self.t0 = time.monotonic()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    def body(self, planned: PlannedRequest) -> dict:
        kind = planned.kind
        text = self._prompts.text(kind.endpoint, planned.prompt_tokens)
        body: dict = {"messages": [{"role": "user", "content": text}]} if kind.endpoint == "chat" else {"prompt": text}
        model = kind.model or self.default_model
        if model:
            body["model"] = model
        if kind.max_tokens is not None:
            body["max_tokens"] = kind.max_tokens
        if kind.stream:
            body["stream"] = True
            if kind.include_usage:
                body["stream_options"] = {"include_usage": True}
        body.update(kind.body)
        return body

    async def send(self, planned: PlannedRequest) -> RequestRecord:
        """Send one request, wait for it (streaming or not) and record the outcome."""
        kind = planned.kind
        url = self.urls[planned.index % len(self.urls)]
        scale = self.time_scale
        start = time.monotonic()
        record = RequestRecord((start - self.t0) * scale, kind.name, url, CLIENT_ERROR,
                               prompt_tokens=planned.prompt_tokens, asked_model=kind.model or self.default_model)
        headers = kind.headers
        if planned.session is not None:
            headers = {**headers, SESSION_HEADER: planned.session.id}
            record.session, record.call, record.calls = planned.session.id, planned.call, planned.session.calls
            record.retry = planned.retry
        abort_after_s = None
        if planned.abort_fraction is not None and not kind.stream:
            abort_after_s = planned.abort_fraction * self.timeout_s / 4  # give up some time before the timeout
        try:
            async with asyncio.timeout(abort_after_s if abort_after_s is not None else self.timeout_s):
                async with self._session.post(url + ENDPOINTS[kind.endpoint], json=self.body(planned),
                                              headers=headers) as resp:
                    record.status = resp.status
                    wait_ms = float(resp.headers.get("x-extproc-queue-wait-ms") or 0)
                    record.queued, record.queue_wait = wait_ms > 0, wait_ms / 1000.0 * scale
                    record.degraded_by_policy = resp.headers.get("x-extproc-decision") == "degrade"
                    if resp.status != 200:
                        record.error = _error_type(await resp.read())
                        record.retry_after = _retry_after(resp.headers.get("retry-after"), scale)
                    elif kind.stream:
                        await self._read_stream(resp, planned, record, start)
                    else:
                        data = await resp.json()
                        record.model = data.get("model")
                        record.output_tokens = data.get("usage", {}).get("completion_tokens", 0)
                        record.ttft = (time.monotonic() - start) * scale
        except TimeoutError:
            record.error = "abort" if abort_after_s is not None else "timeout"
        except aiohttp.ClientError as exc:
            record.error = type(exc).__name__
        record.latency = (time.monotonic() - start) * scale
        self.records.append(record)
        return record

    async def _read_stream(self, resp: aiohttp.ClientResponse, planned: PlannedRequest, record: RequestRecord,
                           start: float) -> None:
        """Count SSE content events without parsing each one; parse only errors and the usage chunk."""
        kind = planned.kind
        abort_at = None
        if planned.abort_fraction is not None:
            abort_at = max(1, math.ceil(planned.abort_fraction * (kind.max_tokens or 256)))
        pending = b""
        deltas = 0
        usage_tokens = None
        async for chunk in resp.content.iter_any():
            events = (pending + chunk).split(b"\n\n")
            pending = events.pop()
            for event in events:
                if not event.startswith(b"data: "):
                    continue
                if event == b"data: [DONE]":
                    record.output_tokens = usage_tokens if usage_tokens is not None else deltas
                    return
                if record.model is None and b'"model"' in event:  # every chunk names it: read the first
                    record.model = json.loads(event[6:]).get("model")
                if b'"choices":[]' in event or b'"error"' in event:
                    data = json.loads(event[6:])
                    if "error" in data:
                        record.error = data["error"].get("type", "stream_error")
                        return
                    if not data.get("choices"):  # the usage chunk
                        usage_tokens = (data.get("usage") or {}).get("completion_tokens", usage_tokens)
                        continue
                    # else a token whose text (or logprobs) holds "error": a token like any other
                if b'"role":' in event and deltas == 0:
                    continue  # chat's opening role chunk carries no token (a token's text "role" is no key)
                deltas += 1
                record.output_tokens = deltas  # so far: kept when a timeout or a dropped connection cuts the stream
                if deltas == 1:
                    record.ttft = (time.monotonic() - start) * self.time_scale
                if abort_at is not None and deltas >= abort_at:
                    record.output_tokens = deltas
                    record.error = "abort"
                    resp.close()  # drop the connection: the server must free the sequence
                    return
        record.output_tokens = deltas
        record.error = "incomplete_stream"


def _retry_after(value: str | None, scale: float) -> float | None:
    """Retry-After in seconds (the delta form; an HTTP date is ignored), scaled like every recorded time."""
    try:
        return float(value) * scale if value is not None else None
    except ValueError:
        return None


def _error_type(body: bytes) -> str:
    """The OpenAI error's type, and its code when it has one ("rate_limit_error: queue_timeout"): the type alone
    made every refusal of the admission layer read as rate limiting, whatever its reason."""
    try:
        err = json.loads(body)["error"]
        code = err.get("code")
        return f"{err['type']}: {code}" if isinstance(code, str) and code else err["type"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return "http_error"


async def run_closed_loop(client: LoadClient, workload: Workload, concurrency: int, duration_s: float | None = None,
                          requests: int | None = None, seed: int = 0, drain: bool = True) -> list[RequestRecord]:
    """`concurrency` workers each send a request as soon as their previous one ends, until time or count runs out."""
    if duration_s is None and requests is None:
        raise ValueError("give duration_s or requests")
    deadline = None if duration_s is None else time.monotonic() + duration_s
    counter = iter(range(requests if requests is not None else 1 << 62))

    async def worker(w: int) -> None:
        rng = random.Random(seed * 1_000_003 + w)  # one stream per worker: replayable whatever the timing
        while deadline is None or time.monotonic() < deadline:
            index = next(counter, None)
            if index is None:
                return
            await client.send(plan_request(index * concurrency + w, workload, rng))

    tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
    if drain or deadline is None:
        await asyncio.gather(*tasks)
    else:
        if tasks:  # to the deadline, or sooner once every worker is done
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return client.records


async def run_session(client: LoadClient, planned: PlannedRequest) -> None:
    """An agent session from its first call: each next call (or retry) once the previous one ended and its think
    time (or Retry-After) passed, until the session plan says it is over."""
    while planned is not None:
        record = await client.send(planned)
        ended = (time.monotonic() - client.t0) * client.time_scale
        following = planned.session.next_call(planned, record, ended)
        if following is not None:
            await asyncio.sleep((following.at - ended) / client.time_scale)
        planned = following


async def run_open_loop(client: LoadClient, workload: Workload, schedule: list[tuple[float, float]], seed: int = 0,
                        max_in_flight: int = 5000,
                        phase_weights: list[dict[str, float]] | None = None) -> list[RequestRecord]:
    """Poisson arrivals following the rate schedule, whatever the server's speed (arrivals never wait on it; a
    session's later calls do wait on its earlier ones). `phase_weights`: see `plan_arrivals`."""
    plans = plan_arrivals(workload, schedule, seed, phase_weights)
    # The run starts once its arrivals are drawn (117K of them take 0.8 s): records, progress lines and fleet events
    # read client.t0, and a t0 taken before the drawing put every record that much (x time_scale) late.
    client.t0 = loop_start = time.monotonic()
    tasks: set[asyncio.Task] = set()
    for planned in plans:
        delay = loop_start + planned.at / client.time_scale - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_in_flight:  # a safety bound for a dead target, recorded as a client-side refusal
            client.records.append(RequestRecord((time.monotonic() - client.t0) * client.time_scale,
                                                planned.kind.name, "", CLIENT_ERROR, error="client_overload"))
            continue
        task = asyncio.create_task(client.send(planned) if planned.session is None else run_session(client, planned))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return client.records


def summarize(records: list[RequestRecord], window: tuple[float, float] | None = None) -> dict:
    """Latency/TTFT percentiles of successful requests started in the window; tokens/s of those ending in it."""
    if window is None:
        starts = [r.start for r in records] or [0.0]
        window = (min(starts), max(r.start + (r.latency or 0.0) for r in records) if records else 0.0)
    t0, t1 = window
    started = [r for r in records if t0 <= r.start < t1]
    ok = [r for r in started if r.ok]
    latencies = sorted(r.latency for r in ok)
    ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
    ended_tokens = sum(r.output_tokens for r in records if r.latency is not None and t0 <= r.start + r.latency <= t1)
    span = max(t1 - t0, 1e-9)
    return {
        "requests": len(started),
        "ok": len(ok),
        "by_status": dict(Counter(str(r.status) for r in started)),
        "errors": dict(Counter(r.error for r in started if r.error)),
        "latency_p50": percentile(latencies, 50), "latency_p95": percentile(latencies, 95),
        "latency_p99": percentile(latencies, 99),
        "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95), "ttft_p99": percentile(ttfts, 99),
        "output_tokens_per_s": ended_tokens / span,
        "mean_output_tokens": sum(r.output_tokens for r in ok) / len(ok) if ok else 0.0,
        "ok_per_s": len(ok) / span,
        "window_s": span,
    }


def parse_schedule(text: str) -> list[tuple[float, float]]:
    """'30:5,10:20' -> [(30 s at 5/s), (10 s at 20/s)]."""
    phases = []
    for part in text.split(","):
        duration, _, rate = part.partition(":")
        phases.append((float(duration), float(rate)))
    return phases


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", action="append", required=True, help="target base URL (repeat: round robin)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop with this many workers")
    mode.add_argument("--rate-schedule", help="open loop: 'DURATION:RATE,...' (seconds, requests/s)")
    parser.add_argument("--duration", type=float, help="closed loop: seconds to keep sending")
    parser.add_argument("--requests", type=int, help="closed loop: total requests")
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds excluded from the summary")
    parser.add_argument("--workload", help="YAML/JSON file: {kinds: [{name, weight, endpoint, ...}]}")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--header", action="append", default=[], metavar="NAME:VALUE")
    parser.add_argument("--abort-prob", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (real seconds)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply measured times by this (the simulator's --speed) to report simulated time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records-out", help="write one JSON record per request to this file")


def _workload_from_args(args: argparse.Namespace) -> Workload:
    if args.workload:
        return Workload.load(args.workload)
    headers = dict(h.split(":", 1) for h in args.header)
    return Workload([RequestKind(endpoint=args.endpoint, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                 stream=args.stream, model=args.model, abort_prob=args.abort_prob,
                                 headers={k.strip(): v.strip() for k, v in headers.items()})])


async def _main(args: argparse.Namespace) -> dict:
    workload = _workload_from_args(args)
    pool = max(args.concurrency or 0, 256)
    async with LoadClient(args.url, timeout_s=args.timeout, time_scale=args.time_scale, pool=pool) as client:
        if args.concurrency:
            await run_closed_loop(client, workload, args.concurrency, args.duration, args.requests, seed=args.seed)
        else:
            await run_open_loop(client, workload, parse_schedule(args.rate_schedule), seed=args.seed)
    records = client.records
    if args.records_out:
        Path(args.records_out).write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    end = max((r.start + (r.latency or 0.0) for r in records), default=0.0)
    return summarize(records, (args.warmup * args.time_scale, end))


def run(args: argparse.Namespace) -> int:
    summary = asyncio.run(_main(args))
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1
