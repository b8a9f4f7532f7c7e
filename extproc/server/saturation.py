"""Scrape each pool's vLLM replicas for their own saturation signals and hand them to the core.

vLLM knows it is saturated before any latency shows it: requests waiting in its scheduler, the KV cache nearly
full, preemptions. Reading them every ~200 ms lets adaptive caps react to in-flight growth at once instead of
waiting for slow completions. A replica that cannot be read is counted as saturated, not as headroom: one that did
not answer, answered too much, or answered without the series admission needs (or with values that are not finite
and non-negative) keeps its last good reading, which counts as saturated once older than `stale_ms`. A replica
that holds requests while its token counters stand still for `stall_ms` (a wedged engine whose HTTP server still
answers) is reported as stalled and left out of the pool's reading (saturated only when every replica is stalled).
A replica that refuses the connection (nothing listens: the process died or is restarting), or whose /health does not
answer 200 either (frozen whole: SIGSTOP, a hung host), is not load either: it is left out of the reading too, as
Envoy's health checks leave it out of the pool, and the pool is saturated only when no replica is left to read (one
dead or frozen replica of two cut the pool limit to its floor for as long as it was down); it is then also `down`,
which the limits do not read as load (LimitMoves.load_reading).
A pool that names nothing to scrape (no replicas, no Envoy admin) is not scraped at all: it has no saturation
signal, and its limit and adaptive caps run on latency alone.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import re
import socket
import time

import aiohttp
import orjson

from ..policy.adaptive import PoolSaturation
from ..policy.admission import AdmissionController
from ..policy.limit_moves import STALE_READINGS
from ..policy.replica_speed import TokenPace, judge_slow
from ..policy.schema import PoolSpec

log = logging.getLogger("extproc.saturation")

_WANTED = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
           "vllm:kv_cache_usage_perc": "kv", "vllm:num_preemptions_total": "preemptions",
           "vllm:prompt_tokens_total": "tokens", "vllm:generation_tokens_total": "tokens",
           "process_start_time_seconds": "started",
           "vllm:inter_token_latency_seconds_sum": "itl_sum", "vllm:inter_token_latency_seconds_count": "itl_count",
           "vllm:num_requests_waiting_by_reason": "deferred", "vllm:request_success_total": "finished",
           "vllm:iteration_tokens_total_count": "steps"}
# vLLM 0.32 splits the waiting requests by reason (tests/fixtures/vllm/metrics.txt): `capacity`, and `deferred by
# transient constraints (LoRA budget, KV transfer, blocked status)`. Only the line of the deferred is read: they wait
# for an adapter slot (--max-loras, 1 by default), not for room, and must not read as saturation (eight requests for
# eight adapters kept seven waiting with the KV cache empty, and the pool read saturated).
_DEFERRED = re.compile(rb'[{,][ \t]*reason="deferred"')
_HIGHEST = ("kv", "started")  # the highest of their label sets (processes), not the sum
# The token counters are progress: a replica that holds requests while neither moves is stalled (`stall_ms`).
# Optional: without them (an older vLLM, another server) the stall rule is off for that replica.
_PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
# The inter-token latency histogram's sum and count give a replica's pace (policy.replica_speed). Optional too.
_PACE = ("vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count")
# Requests waiting in vLLM are saturation only when they wait for room. At a high rate of short requests some are
# always between their arrival and the next engine step: two replicas answering 1-5-token classification calls at
# 700 requests/s each read as saturated at half their capacity with the KV cache empty, and the pool limit was cut
# to a few requests and refused thousands (scenarios/classify-burst.yaml). By Little's law the ones waiting now wait
# about waiting / (requests finished per second); within this many engine steps (the mean inter-token latency
# since the last scrape; with no decode in it, as with 1-token answers, the interval over its engine steps,
# vllm:iteration_tokens_total's count) they are passing through, not held. Four, not one or two: a snapshot of a
# count that averages under one is often two or three (2 cut the limit every ~25 s on that scenario), while a queue
# held for room grows past it within a scrape, and a 70B replica's one waiting request at a few requests a second
# is still ten steps or more (bench/seeds.py unchanged). Without the counters (request_success_total, and the inter-token
# or iteration-tokens histogram) every waiting request counts, as before.
PASSING_STEPS = 4.0
# Where one waiting request already reads as more than PASSING_STEPS (requests finished a second under 1 / four
# steps), a snapshot cannot tell a request passing through from one held: the count is 0 or 1, and 1 reads as
# 1 / (requests finished a second), whatever it really waits. At ~80 short requests a second a replica (code
# completion: 16-64-token answers, ~2.9 ms steps) that is 12.5 ms, over four steps: one of four replicas holding
# one request between its arrival and the next step read as saturation at a quarter of the scrapes, and the pool
# limit was cut 8 times in a minute at 60% load with the latency at a quarter of its target
# (scenarios/code-completion.yaml). A queue held for room is still there at the next scrape; a request passing
# through is long gone. A reading saturated only by requests not waiting at the previous scrape too is
# `fleeting` (PoolSaturation): the pool limit does not count it while its latency is under half its target
# (policy.pool). Everything else reads it as before: the per-class adaptive caps need it at a spike's onset
# (spike seeds 7-11, ignoring it: p99 1.61 / 1.64 / 1.79 / 1.75 / 1.55 -> 1.65 / 1.98 / 2.12 / 1.83 / 1.60 s),
# and so does the pool limit near its target (scenarios/one-model-ramp.yaml: worst window 1.53 -> 1.62 s).
PACE_SCRAPES = 100  # a replica's pace is its mean inter-token latency over this many scrape intervals
# Without these a scrape says nothing about load. vLLM 0.32 (tests/fixtures/vllm/metrics.txt) emits all four; the
# older name vllm:gpu_cache_usage_perc is gone from it and is not read.
_REQUIRED = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")

# A real vLLM /metrics is ~60 KB (the fixture: 58 KB for one engine and two served names; more engines, LoRA
# adapters or buckets multiply that by a few). 4 MiB is ~70 times that, and reading and searching it costs
# ~15 ms of the event loop; a body past it is not a vLLM's and is not read on.
MAX_METRICS_BYTES = 4 * 1024 * 1024
COMPLAIN_EVERY_S = 60.0  # a replica that stays unreadable is logged once a minute, not once a scrape
RESOLVE_EVERY_S = 30.0  # replicas named by host name are looked up this often (every round while one is stalled)

# Only the lines of the series we read are looked at: name, optional {labels} (values may hold spaces, braces and
# escaped quotes), value, optional timestamp (milliseconds). A line is found by the newline before it (the body is
# read with one put in front): a pattern that starts with a literal is searched for fast, one that starts with `^`
# is tried at every byte (280 µs a 58 KB body, 6 times the search; 128 replicas every 200 ms took 20% of a core of
# the event loop that decides). The names share their "vllm:" for the same reason.
_VLLM = "vllm:"
_SAMPLE = re.compile(
    rb"\n(" + re.escape(_VLLM.encode()) + rb"(?:"
    + b"|".join(re.escape(n[len(_VLLM):].encode()) for n in _WANTED if n.startswith(_VLLM)) + rb")"
    + b"".join(b"|" + re.escape(n.encode()) for n in _WANTED if not n.startswith(_VLLM))
    + rb")([{ \t][^\n]*)")
_REST = re.compile(rb'(?:\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\}[ \t]*|[ \t]+)(\S+)(?:[ \t]+-?\d+(?:\.\d+)?)?[ \t]*\r?')


class UnreadableMetrics(ValueError):
    """A /metrics answer that says nothing trustworthy about the replica's load; the message says why."""


def parse_vllm_metrics(body: bytes | str) -> dict[str, float]:
    """The few vLLM series admission reads, summed over label sets (one engine may serve several names); the KV
    cache usage is the highest; `tokens` is prompt + generated tokens so far (NaN when neither counter is there;
    any other counter diffed between scrapes that is not there is NaN too).
    Raises UnreadableMetrics when a required series is missing, a sample line of a read series is malformed, a
    value is not finite and non-negative, or the KV cache usage is over 1."""
    if isinstance(body, str):
        body = body.encode()
    out = dict.fromkeys(_WANTED.values(), 0.0)
    seen = set()
    for match in _SAMPLE.finditer(b"\n" + body):
        name = match.group(1).decode()
        sample = _REST.fullmatch(match.group(2))
        try:
            value = float(sample.group(1)) if sample else math.nan
        except ValueError:
            value = math.nan
        if sample is None or not math.isfinite(value) or value < 0:
            raise UnreadableMetrics(f"{name} has no finite non-negative value: {match.group(0)[1:201]!r}")
        key = _WANTED[name]
        if key == "kv" and value > 1:  # a share of the cache, 1 when full: over it, it is not what we read it as
            raise UnreadableMetrics(f"{name} is over 1: {match.group(0)[1:201]!r}")
        if key == "deferred" and not _DEFERRED.search(match.group(2)):
            continue  # reason="capacity" (or another): counted in the total already
        out[key] = max(out[key], value) if key in _HIGHEST else out[key] + value
        seen.add(name)
    missing = [n for n in _REQUIRED if n not in seen]
    if missing:
        raise UnreadableMetrics(f"no {' or '.join(missing)} in /metrics")
    overflowed = [key for key, value in out.items() if not math.isfinite(value)]
    if overflowed:  # finite values whose sum over label sets is not (the pool's waiting read inf)
        raise UnreadableMetrics(f"the sum of {', '.join(overflowed)} over its label sets is not finite")
    if not any(n in seen for n in _PROGRESS):
        out["tokens"] = math.nan
    if "process_start_time_seconds" not in seen:
        out["started"] = math.nan
    if not all(n in seen for n in _PACE):
        out["itl_sum"] = out["itl_count"] = math.nan
    # Counters diffed between scrapes: missing is unknown (NaN), not 0 (the preemption counter back at its
    # value read as that many preemptions).
    for name in ("vllm:request_success_total", "vllm:iteration_tokens_total_count", "vllm:num_preemptions_total"):
        if name not in seen:
            out[_WANTED[name]] = math.nan
    return out


# vllm:lora_requests_info (with --enable-lora): a gauge per label set ever current, its value the unix time it last
# was; the newest is now. Its running_lora_adapters and waiting_lora_adapters (vLLM 0.32 writes the same list into
# both: adapters with a request scheduled or queued, not one deferred for the budget) are the adapters it runs.
_LORA_INFO = re.compile(rb"^vllm:lora_requests_info\{([^}\n]*)\}[ \t]+(\S+)", re.MULTILINE)
_LORA_LABEL = re.compile(rb'(max_lora|running_lora_adapters|waiting_lora_adapters)="((?:[^"\\\n]|\\.)*)"')


def parse_lora_info(body: bytes | str) -> tuple[int, frozenset[str]] | None:
    """A replica's LoRA state from its /metrics: (max_lora, the adapters it runs), from the newest
    vllm:lora_requests_info series; None without one (LoRA off, another server) or where it is malformed."""
    if isinstance(body, str):
        body = body.encode()
    # Found by a plain search first: most bodies have no such series, and the regex over all 57 KiB of a vLLM body
    # took a fifth of the rest of its parse.
    start = body.find(b"vllm:lora_requests_info{")
    if start < 0:
        return None
    newest, at = None, -math.inf
    for match in _LORA_INFO.finditer(body, start):
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if value > at:  # NaN never is
            newest, at = match.group(1), value
    if newest is None:
        return None
    labels = dict(_LORA_LABEL.findall(newest))
    try:
        max_lora = int(labels[b"max_lora"])
    except (KeyError, ValueError):
        return None
    if max_lora < 1:
        return None
    adapters = frozenset(name for key in (b"running_lora_adapters", b"waiting_lora_adapters")
                         for name in labels.get(key, b"").decode(errors="replace").split(",") if name)
    return max_lora, adapters


def queued(m: dict[str, float]) -> float:
    """The requests waiting in a replica's scheduler, less those deferred for the LoRA budget."""
    return m["waiting"] - min(m.get("deferred", 0.0), m["waiting"])


def held_waiting(m: dict[str, float], across_scrapes: bool = False) -> float:
    """The requests waiting in a replica for room: queued(), none when they are only passing through (m["passing"],
    PoolScraper.record; `across_scrapes`: m["passing_across"], see PASSING_STEPS)."""
    return 0.0 if m.get("passing_across" if across_scrapes else "passing") else queued(m)


def passing_through(prev: dict[str, float], m: dict[str, float], elapsed_s: float) -> tuple[bool, bool]:
    """Whether the replica's waiting requests (less deferred) will be taken in within PASSING_STEPS engine steps at
    the rate it finished requests since its previous reading `prev`, `elapsed_s` ago (PASSING_STEPS): (as read now,
    across scrapes). Across scrapes, where one waiting request already reads as more than that, only those waiting
    at both readings count (the smaller count)."""
    def moved(key: str) -> float:  # NaN where either reading lacks the counter
        return m.get(key, math.nan) - prev.get(key, math.nan)

    finished, tokens, steps = moved("finished"), moved("itl_count"), moved("steps")
    if tokens > 0:
        step_s = moved("itl_sum") / tokens
    else:  # no decode in the interval (1-token answers): the time per engine step, idle time included
        step_s = elapsed_s / steps if steps > 0 else math.nan
    if not (elapsed_s > 0 and finished > 0 and step_s > 0):  # NaN: a counter missing; fewer: a restart
        return False, False
    bound, one = PASSING_STEPS * step_s, elapsed_s / finished
    now = queued(m) * one <= bound
    return now, now or (one > bound and min(queued(prev), queued(m)) * one <= bound)


async def read_capped(resp: aiohttp.ClientResponse, limit: int = MAX_METRICS_BYTES) -> bytes:
    """The response body, or UnreadableMetrics as soon as it is known to be over `limit` bytes (after any
    decompression: the cap is on what we would parse)."""
    if resp.content_length is not None and resp.content_length > limit:
        raise UnreadableMetrics(f"/metrics is {resp.content_length} bytes, over the {limit}-byte cap")
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            resp.close()  # not drained: the connection goes
            raise UnreadableMetrics(f"/metrics is over the {limit}-byte cap")
    return bytes(body)


class ScrapedReplica:
    """One replica as its scrapes saw it: the last good metrics and when they were read, the preemption counter to
    diff, and when its being unreadable was last logged."""

    __slots__ = ("address", "endpoint", "metrics", "at", "preemptions", "complained_at", "failing", "tokens",
                 "started", "progressed_at", "stalled", "stalled_since", "healthy", "refused", "pace", "listing",
                 "loras")

    def __init__(self, address: str):
        self.address = address
        # IP:PORT, as Envoy knows the replica (its override-host list names it so): the address itself when it is
        # one (written as Envoy writes it), else what its name resolves to (PoolScraper._resolve; several,
        # comma-separated).
        self.endpoint = _as_envoy_lists(address)
        self.metrics: dict[str, float] | None = None
        self.at = -1.0
        self.preemptions: float | None = None
        self.complained_at = -math.inf
        self.failing = False  # its being unreadable was logged, and it has not been read since
        self.tokens = math.nan  # its token counters' sum at the last scrape
        self.started = math.nan  # its process_start_time_seconds at the last scrape (a change is a restart)
        self.progressed_at = -math.inf  # when it was last seen idle or with its token counters moving
        self.stalled = False  # as last judged (logged when it changes)
        self.stalled_since = -math.inf  # its progressed_at when it was judged stalled
        # Its /health answered 200 when last asked: asked while one of the pool is stalled, or its /metrics is stale.
        self.healthy = True
        self.refused = False  # its last scrape found nothing listening (a dead or restarting process)
        self.pace = TokenPace(0.0)  # its inter-token latency lately; the window is set by its scraper (record)
        self.listing: list | None = None  # its last GET /v1/models `data` (models.<name>.names_from_replicas)
        # (max_lora, adapters running) from its last scrape's vllm:lora_requests_info; None: not exported (no LoRA)
        self.loras: tuple[int, frozenset[str]] | None = None


class PoolScraper:
    """One pool: scrape every replica each interval, aggregate, and publish a PoolSaturation to the core."""

    def __init__(self, core: AdmissionController, name: str, spec: PoolSpec, session: aiohttp.ClientSession,
                 clock=time.monotonic, known: dict[str, ScrapedReplica] | None = None, phase_s: float = 0.0):
        self.core = core
        self.name = name
        self.spec = spec
        self.phase_s = phase_s  # the first round waits this long (SaturationScrapers spreads the pools' rounds)
        self.session = session
        self.clock = clock
        # `known`: the replicas a previous scraper of this pool saw (a reload), taken over by address, now only: one
        # Envoy's list drops later is forgotten, and comes back as a new one (kept, a replica stalled at the reload
        # came back stalled, its old requests counted again as the pool's stalled share).
        known = known or {}
        # A pool found through Envoy starts from the replicas last listed (a reload), as a failed discovery keeps
        # them: started with none, an admin that did not answer its first try read the pool as saturated.
        listed = spec.replicas or (list(known) if spec.envoy_admin else [])
        self.replicas: dict[str, ScrapedReplica] = {a: known.get(a) or ScrapedReplica(a) for a in listed}
        self._last_discovery = -1e9
        self._resolved_at = -math.inf
        self._published_at = clock()  # as if just published: the first round has stale_ms to fail before it counts
        self._round_complained_at = -math.inf
        self._discovery_complained_at = -math.inf
        self._listed_at = -math.inf
        self._listing: asyncio.Task | None = None  # the /v1/models read in flight
        self._served: dict[str, str] = {}  # the names last taken from the replicas' /v1/models

    async def run(self) -> None:
        """Scrape, aggregate and publish every interval until cancelled. Nothing a replica sends ends it, and
        neither does a bug in one round: that is logged, and the pool counts as saturated once its last published
        reading is older than stale_ms."""
        interval = self.spec.scrape_interval_ms / 1000.0
        try:
            if self.phase_s > 0:
                await asyncio.sleep(self.phase_s)
            while True:
                started = self.clock()
                try:
                    await self._round(started)
                except Exception:  # noqa: BLE001 - the loop must outlive any one round
                    self._round_failed()
                await asyncio.sleep(max(interval - (self.clock() - started), 0.0))
        finally:
            if self._listing is not None:
                self._listing.cancel()

    async def _round(self, started: float) -> None:
        if not self.spec.replicas and self.spec.envoy_admin and started - self._last_discovery > 5.0:
            await self._discover()
        await asyncio.gather(*(self._scrape(r) for r in list(self.replicas.values())))
        if any(r.stalled or r.pace.slow for r in self.replicas.values()):
            # Envoy takes a named replica whatever its health: name only those its health check would pass.
            await asyncio.gather(self._resolve(), *(self._check_health(r) for r in self.replicas.values()
                                                    if not r.stalled))
        else:
            for r in self.replicas.values():
                r.healthy = True
            if started - self._resolved_at > RESOLVE_EVERY_S:  # names known before a stall needs them
                await self._resolve()
            # One whose /metrics does not answer may be too loaded to (saturated) or frozen whole (SIGSTOP, a
            # hung host): its /health tells them apart, as Envoy's health check does.
            stale = self.clock() - self.spec.stale_ms / 1000.0
            await asyncio.gather(*(self._check_health(r) for r in self.replicas.values()
                                   if r.at < stale and not r.refused))
        now = self.clock()
        self.core.set_saturation(self.name, self.aggregate(now))
        self._published_at = now
        if started - self._listed_at >= self.spec.models_interval_ms / 1000.0 and self.core.wants_listings(self.name):
            # Beside the rounds, not in them: a replica slow to list its models must not delay the saturation
            # reading (stale_ms counts from it). One read at a time.
            self._listed_at = started
            if self._listing is None or self._listing.done():
                self._listing = asyncio.create_task(self._read_listings())

    async def _read_listings(self) -> None:
        """Every replica's /v1/models, for the names it serves (policy.served). One that does not answer keeps its
        last listing (a replica too loaded to answer still serves its adapters); one that refuses the connection
        (dead, restarting) and one that left the pool list nothing."""
        await asyncio.gather(*(self._list(r) for r in list(self.replicas.values())))
        listings = [r.listing for r in self.replicas.values() if r.listing is not None and not r.refused]
        try:
            served = self.core.set_listings(self.name, listings)
        except Exception:  # noqa: BLE001 - the names stay as they were; the next read tries again
            log.exception("pool %s: the replicas' /v1/models listings were not taken", self.name)
            return
        if served != self._served:
            added, gone = sorted(set(served) - set(self._served)), sorted(set(self._served) - set(served))
            log.info("pool %s: names from its replicas' /v1/models: %d (added: %s; gone: %s)", self.name,
                     len(served), ", ".join(added[:20]) or "-", ", ".join(gone[:20]) or "-")
            self._served = served

    async def _list(self, r: ScrapedReplica) -> None:
        try:
            async with self.session.get(f"http://{r.address}/v1/models", timeout=self._timeout()) as resp:
                if resp.status != 200:
                    return
                # orjson, as GET /v1/models is written: Python's json also reads integers past 64 bits and lone
                # surrogate escapes, which orjson cannot write back (one replica's card broke the edge's list).
                doc = orjson.loads(await read_capped(resp))
        except Exception:  # noqa: BLE001 - not read this time: its last listing stands (a refusal shows in r.refused)
            return
        r.listing = doc.get("data") if isinstance(doc, dict) and isinstance(doc.get("data"), list) else []

    def _round_failed(self) -> None:
        now = self.clock()
        if now - self._round_complained_at >= COMPLAIN_EVERY_S:
            self._round_complained_at = now
            log.exception("pool %s: saturation scrape round failed; scraping goes on", self.name)
        if now - self._published_at > self.spec.stale_ms / 1000.0:
            try:
                self.core.set_saturation(self.name, saturated_reading(now))
            except Exception:  # noqa: BLE001
                pass  # the same bug as above, already logged

    async def _scrape(self, r: ScrapedReplica) -> None:
        try:
            async with self.session.get(f"http://{r.address}/metrics", timeout=self._timeout()) as resp:
                if resp.status != 200:
                    raise UnreadableMetrics(f"/metrics answered HTTP {resp.status}")
                body = await read_capped(resp)
                m = parse_vllm_metrics(body)
        except Exception as e:  # noqa: BLE001 - whatever it was, this replica was not read this round
            r.refused = _refused(e)
            self._unreadable(r, e)
            return  # stays stale: counted as saturated once older than stale_ms (left out if it refused)
        self.record(r, m, parse_lora_info(body))

    def _unreadable(self, r: ScrapedReplica, error: Exception) -> None:
        now = self.clock()
        if now - r.complained_at < COMPLAIN_EVERY_S:
            return
        r.complained_at, r.failing = now, True
        why = str(error) if isinstance(error, UnreadableMetrics) else repr(error)
        if r.refused:
            log.warning("pool %s: replica %s refuses connections (%s); left out of the pool's reading until it "
                        "answers (logged once a minute)", self.name, r.address, why)
            return
        log.warning("pool %s: replica %s unreadable (%s); counted as saturated once its last reading is over %d ms "
                    "old (logged once a minute)", self.name, r.address, why, self.spec.stale_ms)

    def record(self, r: ScrapedReplica, m: dict[str, float],
               loras: tuple[int, frozenset[str]] | None = None) -> None:
        """Take one good scrape's parsed metrics for replica r (what changed since its previous scrape included),
        and its LoRA state (parse_lora_info); the stale rule goes by the time of the last one."""
        r.loras = loras
        prev = r.preemptions
        r.preemptions = m["preemptions"]
        m["preempting"] = float(prev is not None and m["preemptions"] > prev)
        now = self.clock()
        passing, across = (False, False) if r.metrics is None else passing_through(r.metrics, m, now - r.at)
        m["passing"], m["passing_across"] = float(passing), float(across)
        r.metrics, r.at, r.refused = m, now, False
        was_started, r.started = r.started, m.get("started", math.nan)
        restarted = was_started != r.started and not math.isnan(was_started) and not math.isnan(r.started)
        r.pace.window_s = PACE_SCRAPES * self.spec.scrape_interval_ms / 1000.0
        if restarted:  # its counters began again at 0: a difference with the old process's is no pace (a first reading)
            r.pace.add(r.at, math.nan, math.nan)
        r.pace.add(r.at, m.get("itl_sum", math.nan), m.get("itl_count", math.nan), m["running"], m["kv"])
        # Progress: a token counter moved (a smaller sum is a restarted replica), a restart (its process start
        # time changed: one that hung before its first token restarts with its counters at 0 again), no counters
        # to judge, or idle. Idle is no news from a replica already stalled: its requests were given up on, none
        # are sent to it now (policy.steering), and one sent because it looked idle again would hang too.
        before, r.tokens = r.tokens, m.get("tokens", math.nan)
        idle = m["running"] + m["waiting"] == 0
        if (idle and not r.stalled) or restarted or math.isnan(r.tokens) or r.tokens != before:
            r.progressed_at = r.at
        if r.failing:
            r.failing = False
            log.info("pool %s: replica %s readable again", self.name, r.address)

    def aggregate(self, now: float) -> PoolSaturation:
        spec, sat = self.spec, PoolSaturation()
        sat.updated_at = now
        stale = now - spec.stale_ms / 1000.0
        if not self.replicas:
            sat.saturated = sat.down = True
            return sat
        working, gone, paced, held, held_across, unread = [], 0, [], 0.0, 0.0, False
        for r in self.replicas.values():
            m = r.metrics
            if m is None or r.at < stale or r.refused:
                # Seen hung, and now its /metrics does not answer either: hung still. One that refuses connections
                # is down (killed, or being restarted as the alert asks), not hung: gone below at once, however
                # fresh its last reading (its standing counters read by _stalled made a dead replica "stalled"),
                # and its verdict kept for its return.
                if r.stalled and not r.refused:
                    sat.stalled += 1
                    sat.stalled_requests += m["running"] + m["waiting"]
                    continue
                if r.refused or not r.healthy:  # dead, or frozen whole: out of Envoy's pool too (health checks)
                    gone += 1
                    continue
                sat.saturated = unread = True
                if r.healthy:  # unread: named last, for Envoy to fall back to
                    working.append((r, math.inf))
                continue
            if self._stalled(r, now):
                sat.stalled += 1
                sat.stalled_requests += m["running"] + m["waiting"]
                continue
            if r.healthy:
                working.append((r, m["running"] + m["waiting"]))
            paced.append(r)
            sat.kv_usage = max(sat.kv_usage, m["kv"])
            sat.waiting = max(sat.waiting, queued(m))
            held = max(held, held_waiting(m))
            held_across = max(held_across, held_waiting(m, across_scrapes=True))
            sat.running += m["running"]
            sat.preempting = sat.preempting or bool(m["preempting"])
        other = sat.kv_usage >= spec.kv_saturated or sat.preempting or sat.stalled + gone == len(self.replicas)
        sat.down = gone == len(self.replicas)
        if other or (spec.waiting_saturated and held >= spec.waiting_saturated):
            sat.saturated = True
            # Saturated only by requests a snapshot cannot tell from passing through (PASSING_STEPS).
            sat.fleeting = not (other or unread or held_across >= spec.waiting_saturated)
        self._judge_pace(paced, now)
        sat.slow = sum(r.pace.slow for r in paced)
        if sat.stalled or sat.slow:  # new requests go to the others, or those of classes with an SLO do
            sat.working = tuple((r.endpoint or r.address, load, r.pace.factor) for r, load in working)
        # A request for a LoRA adapter prefers a replica running it (policy.steering): each working one that says.
        sat.loras = tuple((r.endpoint or r.address, load, r.loras[0], r.loras[1]) for r, load in working
                          if r.loras is not None)
        return sat

    def _judge_pace(self, paced: list[ScrapedReplica], now: float) -> None:
        """Which of the replicas read this round run markedly slower than the fastest (policy.replica_speed);
        the others' verdicts are cleared (a stalled or unread replica is not judged on its pace)."""
        for r in self.replicas.values():
            if r.pace.slow and r not in paced:
                r.pace.slow = False
        changed = {id(pace) for pace in judge_slow([r.pace for r in paced], now, self.spec.slow_ratio)}
        for r in (r for r in paced if id(r.pace) in changed):
            pace = r.pace
            if pace.slow:
                log.warning("pool %s: replica %s is slow: its inter-token latency is %.1fx the fastest "
                            "replica's (slow_ratio %g); requests of classes with an SLO go to the others first",
                            self.name, r.address, pace.relative, self.spec.slow_ratio)
            else:
                log.info("pool %s: replica %s is no longer slow", self.name, r.address)

    def _stalled(self, r: ScrapedReplica, now: float) -> bool:
        """Whether r holds requests (or held them when last judged stalled) and its token counters stood still for
        `stall_ms`. Reported (a gauge, a log line) for an operator to restart it, and left out of the pool's
        reading: the queue a hung engine builds grows whatever the load, and read as saturation it held the
        limits at their floors while the other replicas idled. New requests go to the others (aggregate's
        `working`, policy.steering); the ones it holds keep their slots until their clients give up."""
        if self.spec.stall_ms <= 0:
            stalled = False
        elif r.stalled and r.progressed_at == r.stalled_since:
            stalled = True  # no progress since: stays stalled, whatever stall_ms a reload set meanwhile
        else:
            stalled = (math.isfinite(r.progressed_at)  # not judged before its first record
                       and now - r.progressed_at > self.spec.stall_ms / 1000.0)
        if stalled != r.stalled:
            r.stalled, r.stalled_since = stalled, r.progressed_at
            if stalled:
                log.warning("pool %s: replica %s holds %d requests and generated nothing for %d ms: stalled, left "
                            "out of the pool's saturation and sent no new requests until it moves (restart it: "
                            "its /health still answers)", self.name, r.address,
                            r.metrics["running"] + r.metrics["waiting"], 1000 * (now - r.progressed_at))
            else:
                log.info("pool %s: replica %s is making progress again", self.name, r.address)
        return stalled

    def _timeout(self) -> aiohttp.ClientTimeout:
        """For a call to a replica: two scrape intervals, at least half a second."""
        return aiohttp.ClientTimeout(total=max(self.spec.scrape_interval_ms / 1000.0 * 2, 0.5))

    async def _check_health(self, r: ScrapedReplica) -> None:
        try:
            async with self.session.get(f"http://{r.address}/health", timeout=self._timeout()) as resp:
                r.healthy = resp.status == 200
        except Exception:  # noqa: BLE001 - no answer is not healthy
            r.healthy = False

    async def _resolve(self) -> None:
        """The IPs of each replica named by host name, for the override-host list: looked up every
        RESOLVE_EVERY_S, and every round while a replica of the pool is stalled (a restarted pod may have a new
        one); a failed lookup keeps the last."""
        self._resolved_at = self.clock()
        named = [r for r in self.replicas.values() if not _ip_address(r.address)]
        if named:
            await asyncio.gather(*(self._resolve_one(r) for r in named))

    @staticmethod
    async def _resolve_one(r: ScrapedReplica) -> None:
        host, _, port = r.address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM), 1.0)
        except Exception:  # noqa: BLE001 - not resolved this round: Envoy ignores a name it does not know
            return
        # Every address: which one Envoy holds depends on its DNS settings, and it skips the names it has not.
        ips = dict.fromkeys(info[4][0] for info in found)
        r.endpoint = ",".join(host_port(ip, port) for ip in ips)

    async def _discover(self) -> None:
        """Take the pool's endpoints from Envoy's admin API (Envoy is the source of truth for membership)."""
        self._last_discovery = self.clock()
        try:
            found = _cluster_hosts(await envoy_clusters(self.session, self.spec.envoy_admin, 2.0), self.name)
        except Exception as e:  # noqa: BLE001 - membership stays as it was until the next try
            self._discovery_failed(repr(e))
            return
        if found is None:
            self._discovery_failed(f"it lists no cluster {self.name!r}")
            return
        for gone in set(self.replicas) - found:
            del self.replicas[gone]
        for new in sorted(found - set(self.replicas)):  # one order, whatever the hash seed: runs repeat
            self.replicas[new] = ScrapedReplica(new)

    def _discovery_failed(self, why: str) -> None:
        """Said at warning level, once a minute: with no replica known the pool reads as saturated, so a wrong
        `envoy_admin` held its limit and adaptive caps at their floor while only a debug line said why."""
        now = self.clock()
        if now - self._discovery_complained_at < COMPLAIN_EVERY_S:
            return
        self._discovery_complained_at = now
        log.warning("pool %s: Envoy admin %s not read (%s); its replicas stay %s (logged once a minute)", self.name,
                    self.spec.envoy_admin, why, "unknown, so the pool counts as saturated" if not self.replicas
                    else "as last listed")


async def envoy_clusters(session: aiohttp.ClientSession, admin: str, timeout_s: float):
    """Envoy's cluster listing (/clusters?format=json: each cluster's name and endpoints) from the admin URL."""
    async with session.get(f"{admin.rstrip('/')}/clusters?format=json",
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        return await resp.json(content_type=None)


def _cluster_hosts(doc: dict, cluster_name: str) -> set[str] | None:
    """The host:port of each endpoint of the named cluster in Envoy's /clusters?format=json, None if not listed."""
    for cluster in doc.get("cluster_statuses", []):
        if cluster.get("name") != cluster_name:
            continue
        found = set()
        for host in cluster.get("host_statuses", []):
            sa = host.get("address", {}).get("socket_address", {})
            if "address" in sa:
                found.add(host_port(sa["address"], sa.get("port_value", 80)))
        return found
    return None


def host_port(host: str, port: int | str) -> str:
    """HOST:PORT as a URL and Envoy's override host write it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host_port(text: str) -> tuple[str, int]:
    """host_port()'s inverse, as a listener or socket_address takes the host: an IPv6 one without its brackets
    (aiohttp cannot resolve "[::]", Envoy refuses "[::1]" as a malformed IP); an empty host is 127.0.0.1."""
    host, _, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


def _ip_address(address: str) -> bool:
    """Whether HOST:PORT names its host by an IP address (IPv6 in brackets), as Envoy's override host needs it."""
    host = address.rpartition(":")[0]
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
    except ValueError:
        return False
    return True


def _as_envoy_lists(address: str) -> str | None:
    """HOST:PORT with an IP host as Envoy lists its hosts (and the access log names them): the form inet_ntop
    writes, lower case, the longest run of zeros as `::`; None when the host is a name. Written otherwise in the
    policy ("[fd00:0:0:0:0:0:0:3]:8000"), the override-host list named a host Envoy did not know, and Envoy's own
    balancing sent the requests, to the stalled replica too."""
    if not _ip_address(address):
        return None
    host, _, port = address.rpartition(":")
    return host_port(str(ipaddress.ip_address(host.strip("[]"))), port)


def _refused(error: BaseException) -> bool:
    """Whether a failed scrape found nothing listening at the replica's address (connection refused), as opposed to
    one that did not answer in time or answered badly, which may be a replica too loaded to answer."""
    for _ in range(8):  # aiohttp wraps the OSError once or twice; a chain is never this long (nor a cycle followed)
        if error is None:
            return False
        if isinstance(error, ConnectionRefusedError):
            return True
        error = getattr(error, "os_error", None) or error.__cause__
    return False


def saturated_reading(now: float) -> PoolSaturation:
    """What a pool without a fresh reading reports: saturated."""
    sat = PoolSaturation()
    sat.saturated, sat.updated_at = True, now
    return sat


class SaturationScrapers:
    """All pools of the policy; restarted when a reload changes `pools`, and a scraper that ended is restarted by
    the next configure (a reload) even when `pools` did not change."""

    def __init__(self, core: AdmissionController):
        self.core = core
        self._tasks: dict[str, asyncio.Task] = {}
        # Each pool's replicas as last seen, kept across a reload that restarts the scrapers: a replica found
        # stalled stays stalled (and sent nothing) instead of being trusted afresh.
        self._seen: dict[str, dict[str, ScrapedReplica]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._config: dict | None = None
        # Each reload starts a configure of its own: two at once interleaved at stop()'s await, both started
        # scrapers (the first from the second's pools: a KeyError) and the replaced ones ran on, unstopped.
        self._configuring = asyncio.Lock()

    async def configure(self, pools: dict[str, PoolSpec]) -> None:
        async with self._configuring:
            await self._configure(pools)

    async def _configure(self, pools: dict[str, PoolSpec]) -> None:
        if pools == self._config:
            for name in [n for n, t in self._tasks.items() if t.done()]:
                log.warning("pool %s: restarting its saturation scraper, which had stopped", name)
                self._start(name, pools[name])
            return
        self._config = pools  # first: stop() forgets the readings of the pools no longer scraped
        await self.stop()
        scraped = self._scraped()
        self._seen = {name: seen for name, seen in self._seen.items() if name in scraped}
        for name in [n for n in pools if n not in scraped]:
            log.warning("pool %s names neither replicas nor envoy_admin: not scraped, its limit and adaptive caps "
                        "run on latency only", name)
        if not scraped:
            return
        self._session = aiohttp.ClientSession()
        for name in scraped:
            self._start(name, pools[name])
        log.info("scraping vLLM saturation for pools: %s", ", ".join(scraped))

    def _start(self, name: str, spec: PoolSpec) -> None:
        # The pools' rounds spread over the interval, not all at once: each round's answers arrive together and
        # are read back to back on the event loop that decides (8 pools of 16 replicas in step: a burst of 128
        # parses, decisions waiting up to ~35 ms behind it; bench/scale.py --scrape-live).
        scraped = self._scraped()
        phase = scraped.index(name) / len(scraped) if name in scraped else 0.0
        scraper = PoolScraper(self.core, name, spec, self._session, known=self._seen.get(name),
                              phase_s=phase * spec.scrape_interval_ms / 1000.0)
        self._seen[name] = scraper.replicas  # the same dict: what discovery adds and removes included
        task = asyncio.create_task(scraper.run())
        task.add_done_callback(lambda t: self._ended(name, t))
        self._tasks[name] = task

    def _ended(self, name: str, task: asyncio.Task) -> None:
        """A scraper ended without being stopped (PoolScraper.run does not return): its last reading must not be
        trusted on, so the pool reads as saturated; once that reading is STALE_READINGS x `stale_ms` old nobody has
        refreshed it, and the pool's limits go by latency alone (LimitMoves.pool_reading) until a reload
        restarts the scraper."""
        if task.cancelled():
            return
        log.error("pool %s: saturation scraper stopped; the pool reads as saturated for %d x stale_ms, then its "
                  "limits go by latency alone until a reload (SIGHUP) restarts it", name, STALE_READINGS,
                  exc_info=task.exception())
        if self._tasks.get(name) is task:
            self.core.set_saturation(name, saturated_reading(time.monotonic()))

    def _scraped(self) -> list[str]:
        """The configured pools that name something to scrape (not those with no saturation signal at all)."""
        return [name for name, spec in (self._config or {}).items() if spec.scraped]

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # an error that ended one was logged by _ended
        if self._session is not None:
            await self._session.close()
            self._session = None
        scraped = self._scraped()
        for name in list(self.core.saturation):
            if name not in scraped:  # no longer scraped: not scraped (None), not stuck at its last reading
                self.core.set_saturation(name, None)
