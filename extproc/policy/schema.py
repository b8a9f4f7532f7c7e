"""The policy YAML: types, defaults, docs and validation with key paths (the one source of truth)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import reprlib
import sys
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal

# Shares that add up to exactly 1 may not in floating point (twenty of 0.05: 1.0000000000000002): not "more than 1".
SHARES_SLACK = 1e-9


class PolicyError(ValueError):
    """A policy that does not validate; `errors` holds one "key.path: message" line per problem."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid policy:\n  " + "\n  ".join(errors))


MAX_CLASSES = 256      # the workers' shared table has this many rows (extproc/store/host_store.py)
MAX_CLASS_NAME = 64    # bytes


# The latency histograms' buckets (extproc.telemetry: LLM requests last from tens of milliseconds to minutes).
# histogram_quantile() reads a quantile past the highest finite bucket as that bucket's bound, so a class SLO at or
# above it can never read as missed (policies/reasoning-full.yaml's is 120 s): the buckets reach well past it, and
# policy_warnings() names an SLO past them.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
                   90.0, 120.0, 180.0, 300.0, 600.0)
# RFC 9110 token: what a header name may be (a name with a space or a colon can never match a request's header).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
# Request headers the ext_proc reads whatever the policy (extproc.server.protocol.read_request_headers).
READ_HEADERS = (":path", ":method", "authorization", "api-key", "content-encoding", "x-request-id")

def doc(text: str, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
        minimum: float | None = None, maximum: float | None = None, header_name: bool = False,
        secret: bool | str = False) -> Any:
    """A schema field: its documentation, default and numeric bounds travel together. `header_name`: an HTTP
    header name, lower-cased on load (Envoy hands the ext_proc lower-case keys; header names ignore case).
    `secret`: never quoted in an error (a string: the hint its type error gives instead)."""
    meta = {"doc": text, "min": minimum, "max": maximum, "header_name": header_name, "secret": secret}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --- the policy ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LatencyBreakerSpec:
    """Trips when the class's rolling p95 end-to-end latency on a pool exceeds its `slo_p95_ms`."""

    enabled: bool = doc("Set false to keep the SLO (for metrics and limits) without a latency breaker.", True)
    window_s: float = doc("Rolling window the p95 is computed over.", 30.0, minimum=1)
    min_samples: int = doc("Completed requests the window needs before it may trip (a hair trigger on a few "
                           "slow requests is what takes a class offline for nothing).", 50, minimum=1)
    cooldown_s: float = doc("Open for this long, then half-open.", 10.0, minimum=0)
    trickle: float = doc("Half-open: this fraction of the class's traffic goes to the pool as probes.", 0.05,
                         minimum=0.001, maximum=1)
    trickle_s: float = doc("Half-open for this long; one probe over the SLO re-opens, a clean period closes.",
                           60.0, minimum=0)


@dataclass(frozen=True)
class ErrorBreakerSpec:
    """Trips on the share of upstream failures (5xx, resets, connect failures, timeouts)."""

    enabled: bool = doc("Set false to disable the error breaker for this class.", True)
    max_error_ratio: float = doc("Trip when failures reach this share of the window's requests.", 0.5,
                                 minimum=0.01, maximum=1)
    min_requests: int = doc("Requests the window needs before it may trip.", 20, minimum=1)
    window_s: float = doc("Rolling window.", 30.0, minimum=1)
    cooldown_s: float = doc("Open for this long, then half-open. While open, the class's requests for the pool "
                            "get its fallback, those already queued for it too.", 10.0, minimum=0)
    trickle: float = doc("Half-open: fraction of traffic sent as probes.", 0.05, minimum=0.001, maximum=1)
    trickle_s: float = doc("Half-open period; one failed probe re-opens, a clean period closes.", 60.0,
                           minimum=0)


@dataclass(frozen=True)
class FallbackSpec:
    """What a request gets instead of its pool while a breaker is open (or on queue overflow, if chosen)."""

    action: Literal["reject", "degrade", "canned"] = doc(
        "`reject`: 503 (breaker) or 429 (overflow) with Retry-After. `degrade`: serve it anyway, changed as "
        "below. `canned`: answer at once with a fixed OpenAI-shaped response.", "reject")
    model: str | None = doc("degrade: route to this model (a key of `models`) and rewrite the body's `model`; a "
                            "`max_tokens` beyond its context (`cost.max_context_tokens`, else as its replicas list it) "
                            "is capped at it (vLLM refuses more), "
                            "and a request whose estimated prompt that context cannot hold is refused (429/503, "
                            "to retry) rather than degraded into vLLM's 400.",
                            None)
    max_tokens: int | None = doc("degrade: clamp `max_tokens` to this ceiling (and a `min_tokens` above it down "
                                 "to it, which vLLM would refuse). A clamped answer ends as any "
                                 "answer cut by its cap does (`finish_reason: length`, usage counting what was "
                                 "generated): the openai SDK's `parse()` and `stream()` helpers raise "
                                 "LengthFinishReasonError on it, and structured output comes cut off. On the "
                                 "request's own model, a request that asked for no more than this is not "
                                 "degraded (nothing would change): it gets the refusal instead.", None,
                                 minimum=1)
    stream: bool | None = doc("degrade: `false` (the only value: `true` is refused, since the gateway never turns "
                              "streaming on) asks the replica for one answer instead of a stream (chat and "
                              "completions; a Responses API stream keeps streaming). A client that asked to stream "
                              "still reads a stream: the whole answer as one chunk per choice (and the usage chunk "
                              "if it asked), once the answer is complete; an answer over `--max-body-bytes` (4 "
                              "MiB: about 3,500 tokens with `top_logprobs: 20`) ends that stream with an error "
                              "event instead (`degraded_answer_too_large`, which the openai SDK raises). On the "
                              "request's own model, a request "
                              "it would not change (one that does not stream, or a Responses API stream) is not "
                              "degraded: it gets the refusal instead (unless the fallback's `max_tokens` clamps "
                              "it). A policy that sets it has the ext_proc read every response's headers (one "
                              "more message per request).", None)
    max_concurrency: int | None = doc("degrade: degraded requests of this class in flight at once (their own "
                                      "slots; beyond it they are rejected). Default: the class's cap.", None,
                                      minimum=1)
    status: int = doc("canned: HTTP status of the canned response.", 200, minimum=200, maximum=599)
    message: str = doc("canned: the assistant text (status 2xx) or error message (otherwise).",
                       "The service is busy right now; please try again in a moment.")


@dataclass(frozen=True)
class AdaptiveSpec:
    """Let the class's cap move by itself (AIMD anchored to its SLO and the replicas' saturation)."""

    enabled: bool = doc("Adapt the cap; `max_concurrency` is the starting point. Needs `slo_p95_ms`.", False)
    min_limit: int = doc("The cap never goes below this.", 2, minimum=1)
    max_limit: int = doc("The cap never goes above this.", 256, minimum=1)
    interval_s: float = doc("How often the cap may move.", 1.0, minimum=0.05)
    window_s: float = doc("Short window of completed requests the p95 of service time is taken over (our own "
                          "queue wait left out).", 10.0, minimum=0.1)
    min_samples: int = doc("Completions the window needs before latency moves the cap.", 10, minimum=1)
    cut_at: float = doc("Cut when the window's p95 exceeds this fraction of the SLO (lower classes on the same "
                        "pools yield first while they hold more than their `min_limit`).", 0.9, minimum=0.1,
                        maximum=2)
    raise_below: float = doc("Raise while the p95 is under this fraction of the SLO; between this and `cut_at` "
                             "the cap holds, unless it binds and the p95 is no more than 15% over the class's "
                             "calm p95 (taken while the cap did not bind): then it rises a step per `window_s` "
                             "(a mix slow at any load gets back what a spike cut).", 0.7, minimum=0.05, maximum=1)
    binding: float = doc("...and in-flight is at least this fraction of the cap (an idle class does not drift "
                         "up).", 0.8, minimum=0, maximum=1)
    decrease: float = doc("Multiplicative cut.", 0.8, minimum=0.1, maximum=0.99)
    increase: float = doc("Additive raise per interval.", 1.0, minimum=0.01)


@dataclass(frozen=True)
class PoolLimitSpec:
    """One limit for the whole pool, found from its own saturation and shared by the classes in strict priority
    (docs/overload.md). Per-class `max_concurrency` stays a bound on each class."""

    enabled: bool = doc("Limit what the pool holds at once, whatever the class; the limit moves by itself.", False)
    unit: Literal["tokens", "requests"] = doc(
        "What the limit counts. `tokens`: each request weighs its prompt plus the output it asks for (`max_tokens`, "
        "all its sequences, clamped to the model's context: the KV-cache footprint it may reach; not the learned "
        "expected output, which moves as the ext_proc runs), so a mix of long prompts holds fewer requests than a "
        "short chat mix at the same limit. A chat request that sets no `max_tokens` weighs its prompt plus the "
        "model's `cost.default_max_tokens` (1024), though vLLM may run it to the end of the context: where clients "
        "omit it on long contexts, set `default_max_tokens` to the longest answer they get. "
        "`requests`: each request weighs the sequences a replica runs for it, as vLLM's running and waiting "
        "gauges count them: 1, or `n` (times the prompts of a completions list).", "tokens")
    initial: float | None = doc("Starting limit, in `unit`. Default: `max` (the controller cuts to what the pool "
                                "holds at the first sign of saturation or latency).", None, minimum=1)
    min: float = doc("The limit never goes below this (in `unit`; a pool always takes at least one request).",
                     1.0, minimum=1)
    max: float = doc("The limit never goes above this (in `unit`).", 1_000_000.0, minimum=1)
    interval_s: float = doc("How often the limit may move.", 0.5, minimum=0.05)
    window_s: float = doc("Completed requests the latency p95 is taken over (service time on the pool: our own "
                          "queueing is left out).", 5.0, minimum=0.5)
    min_samples: int = doc("Completions the window needs before latency moves the limit.", 10, minimum=1)
    quantile: float = doc("The served-latency quantile held to the target.", 0.95, minimum=0.5, maximum=0.999)
    target: float = doc("Aim that quantile of the service time of each class with an SLO at this fraction of "
                        "its `slo_p95_ms` (the rest is left for the queue wait and the tail).", 0.85, minimum=0.1,
                        maximum=1)
    decrease: float = doc("Deepest cut in one interval (a factor): saturation cuts by it at once, latency over "
                          "the target cuts in proportion, down to it.", 0.8, minimum=0.1, maximum=0.99)
    max_raise: float = doc("Largest raise in one interval, as a fraction of the limit. The default suits long "
                           "tails too: the latency the limit reads counts the requests still running, so it does "
                           "not rise on the quick answers before the slow ones end (docs/overload.md, rule 5).",
                           0.05, minimum=0.01,
                           maximum=2)
    borrow_lower: bool = doc(
        "The first class may go over the limit by what the classes below it hold above their `min_share`: their "
        "running requests are counted as lent to it (no new ones of theirs are admitted while it waits, so the pool "
        "comes back under the limit as they end). Fewer first-class degrades, fewer refusals at calm load and more "
        "full-model goodput, for a higher p99 in the worst windows (docs/overload.md, \"Over many seeds\").", False)
    onset_guard: bool = doc(
        "A surge in the first class's arrivals (a CUSUM test for twice their recent rate, about one false alarm in "
        "10^4 s of steady arrivals at any rate) caps the limit at the load where that class's served `quantile` met "
        "`target` x its SLO (learned from its last 1,024 completions and the pool's load over each one's life) until "
        "the latency loop cuts or the surge is over: the onset of a spike no longer meets a limit the calm phase "
        "raised. Off by default: over 29 scenario seeds it misses fewer onsets (17 of 78 spike targets against 23) "
        "and refuses less at calm load, but it moves single windows both ways, two of the public scenarios' own "
        "among them (docs/overload.md, \"Onset guard\").", False)


@dataclass(frozen=True)
class PoolSpec:
    """A model pool's replicas, scraped for vLLM's own saturation signals. A pool that names neither `replicas`
    nor `envoy_admin` is not scraped: its limit and the adaptive caps on it run on latency alone."""

    replicas: list[str] = doc("HOST:PORT of each replica (its vLLM /metrics; no scheme, no path). Empty with "
                              "`envoy_admin`: taken from Envoy's cluster membership.", factory=list)
    envoy_admin: str | None = doc("Envoy admin URL (e.g. http://127.0.0.1:9901) to read the cluster's "
                                  "endpoints from, when `replicas` is empty. The ext_proc also reads Envoy's "
                                  "clusters there (every 30 s) and names any `models.<name>.cluster` Envoy lacks "
                                  "(log, `extproc_policy_unknown_clusters`).", None)
    scrape_interval_ms: int = doc("How often each replica's /metrics is read.", 200, minimum=20)
    stale_ms: int = doc("Metrics older than this count as saturated (a replica that cannot answer is not "
                        "healthy headroom). A replica whose /health does not answer 200 either is left out "
                        "instead, and one that refuses the connection (nothing listens: dead or restarting) at "
                        "once, however fresh its last reading; the pool is saturated if none is left (and down: "
                        "the limits hold their level for the replicas' return).", 1500,
                        minimum=100)
    kv_saturated: float = doc("vllm:kv_cache_usage_perc at or above this is saturation.", 0.9, minimum=0.1,
                              maximum=1)
    waiting_saturated: float = doc("vllm:num_requests_waiting per replica at or above this is saturation, not "
                                   "counting requests vLLM defers for its LoRA budget (`--max-loras`: "
                                   "num_requests_waiting_by_reason{reason=\"deferred\"}), which wait for an adapter "
                                   "slot, not for room, nor those only passing through: by Little's law, the "
                                   "replica's waiting requests over the requests it finished a second since its "
                                   "last scrape (vllm:request_success_total) is within 4 engine steps (its mean "
                                   "inter-token latency, or with nothing decoded the interval over its "
                                   "vllm:iteration_tokens_total count), as with short requests at a high rate (0: "
                                   "waiting requests are not a signal).", 1.0,
                                   minimum=0)
    stall_ms: int = doc("A replica that holds requests (running or waiting) while its token counters "
                        "(vllm:prompt_tokens_total + vllm:generation_tokens_total) stand still this long is "
                        "stalled: a wedged engine whose HTTP server still answers. It is reported "
                        "(extproc_pool_stalled_replicas, a warning log), its readings are left out of the "
                        "pool's (its queue grows whatever the load; the pool is saturated only if every replica "
                        "is stalled), and new requests are sent to the other replicas (x-extproc-replica, for "
                        "the pool cluster's override_host load balancing) until its counters move. A prefill "
                        "longer than this on an otherwise idle replica reads as a short stall (0: off).", 10000,
                        minimum=0)
    slow_ratio: float = doc("A replica whose mean inter-token latency (vllm:inter_token_latency_seconds) over "
                            "the last 100 scrapes (20 s at the default interval) is over this many times the "
                            "pool's fastest replica's (of those that ran at least as heavy a load, in running requests "
                            "and in KV cache used; against a lighter one, beyond what the heavier load can explain: "
                            "a busier replica, or one holding longer contexts, decodes slower) is slow (a throttled "
                            "GPU, a noisy neighbour; a replica is judged once it has been read for half that window "
                            "since it started): it is reported "
                            "(extproc_pool_slow_replicas, a warning log) and requests of classes with an "
                            "`slo_p95_ms` are sent to the other replicas (x-extproc-replica, as for a stalled one), "
                            "however much of the pool-wide limit they hold; the classes without one still go to "
                            "it. It is slow until back within half "
                            "that margin, or until it has generated too little to judge for that long. Needs two "
                            "or more replicas with 50 tokens each in the window (0: off).", 1.5,
                            minimum=0)
    models_interval_ms: int = doc("How often each replica's `GET /v1/models` is read, for the models routed here "
                                  "with `names_from_replicas` or without `cost.max_context_tokens` (not read "
                                  "otherwise).", 2000, minimum=200)
    limit: PoolLimitSpec = doc("The pool-wide limit (off unless enabled).", factory=PoolLimitSpec)

    @property
    def scraped(self) -> bool:
        """Whether it names anything to scrape (replicas, or an Envoy admin to find them through)."""
        return bool(self.replicas or self.envoy_admin)


@dataclass(frozen=True)
class FairnessSpec:
    """How a class's queue picks between the flows (tenants) waiting in it (docs/overload.md)."""

    mode: Literal["fifo", "round_robin", "fair"] = doc(
        "`fifo`: one line in arrival order, whoever sent it. `round_robin`: flows take turns, one grant each. `fair`: "
        "the waiting flow that was admitted the fewest GPU-seconds relative to its tenant's `weight` goes next "
        "(virtual-time fairness in the cost model's units, corrected by learned usage: the requests whose usage is read"
        " (`learn_sample`) are charged what they cost, and teach their flow the ratio of cost to estimate that its "
        "other requests are charged at, so a client asking a large `max_tokens` for short answers is charged its "
        "answers), a flow under its tenant's `guaranteed_share` first. Work-conserving in every mode: a release hands "
        "its room to the next waiter in the mode's order while it fits (not when a waiter times out: the ones "
        "behind it wait for the next release, docs/overload.md); one too large for the class's "
        "`max_inflight_gpu_seconds` left holds the ones behind it, so that large requests are never passed over "
        "for good. Inside a flow (round_robin, fair) the earliest deadline goes first. Under a "
        "pool-wide limit (round_robin, fair), a flow holding no more than its weighted share (fair: at least its "
        "tenant's `guaranteed_share`) of what the class holds on the pool goes in even when the limit is full (while "
        "the pool holds under twice the limit); the flows over their share wait until the pool is back under it.",
        "fifo")
    key: Literal["tenant", "header"] = doc(
        "The flow a request counts against: its tenant, or the value of `classify.fairness_header` inside its "
        "tenant's share (needs it set; a request without the header counts against its tenant).", "tenant")


@dataclass(frozen=True)
class ClassSpec:
    """One traffic class: its concurrency cap, its bounded deadline queue, its SLO and breakers."""

    max_concurrency: int = doc("Requests of this class admitted at once (the cap). A request with `n` > 1 or a "
                               "completions prompt list takes one slot, though vLLM runs each output as a request of "
                               "its own: `max_inflight_gpu_seconds` and a pool limit count all of them.", minimum=1,
                               maximum=1_000_000)
    max_queue: int = doc("Requests that may wait for a slot; arrivals beyond it get 429.", 20, minimum=0)
    max_wait_ms: int = doc("Longest a request waits in the queue before it gets 429. At most 29 s: Envoy's "
                           "`max_message_timeout` (30 s in envoy/envoy.yaml) must cover the wait and the ext_proc's "
                           "0.5 s grace, or Envoy stops waiting and `failure_mode_allow` forwards the request "
                           "unadmitted. For the first class under a pool-wide limit, keep it within (1 - the "
                           "limit's `target`) x `slo_p95_ms` (15% at the default target): the limit aims the served "
                           "p95 at `target` x the SLO and the wait comes on top (docs/overload.md, \"Writing the "
                           "policy\").", 200, minimum=0, maximum=29_000)
    slo_p95_ms: int | None = doc("The class's end-to-end latency SLO (p95). Enables the latency breaker.", None,
                                 minimum=1)
    max_inflight_gpu_seconds: float | None = doc(
        "Budget of estimated GPU-seconds in flight for the class, on top of `max_concurrency`: a request is "
        "admitted only when both hold. A single request larger than the whole budget is refused (413).", None,
        minimum=0.001)
    latency_breaker: LatencyBreakerSpec = doc("Latency breaker knobs (active when `slo_p95_ms` is set).",
                                              factory=LatencyBreakerSpec)
    error_breaker: ErrorBreakerSpec = doc("Error breaker knobs.", factory=ErrorBreakerSpec)
    fallback: FallbackSpec = doc("What requests get while a breaker of this class is open, and on overflow with "
                                 "`on_overflow: fallback` (only then: `extproc check` warns).",
                                 factory=FallbackSpec)
    on_overflow: Literal["reject", "fallback"] = doc(
        "When the queue is full, the wait expires or early rejection finds the deadline out of reach: `reject` "
        "with 429, or take the `fallback` (e.g. send interactive overflow to the small model).", "reject")
    shadow: bool = doc("Shadow this class only: decide and count, but admit everything.", False)
    adaptive: AdaptiveSpec = doc("Adaptive cap.", factory=AdaptiveSpec)
    vllm_priority: int | None = doc(
        "Set the body's `priority` to this for vLLM started with `--scheduling-policy priority` (lower runs "
        "first). A client-sent `priority` never reaches vLLM either way: it is removed.", None)
    min_share: float = doc("Under a pool-wide limit (`pools.<name>.limit`): the share of that limit this class "
                           "may always use, even while higher classes wait. A class holding nothing on the pool may "
                           "also run one request larger than its share, then rests in proportion, so that it holds "
                           "its share on average (1% of the limit when its share is less; a minute's rest at "
                           "most): nothing starves. Not for the first class, which waits behind none (`extproc "
                           "check` warns).", 0.0,
                           minimum=0,
                           maximum=1)
    early_reject: bool = doc("Refuse (or fall back) at arrival when the queue ahead, at the class's observed "
                             "drain rate, cannot clear within `max_wait_ms` - instead of letting the request wait "
                             "first and time out.", True)
    fairness: FairnessSpec = doc("How the class's queue shares slots between tenants.", factory=FairnessSpec)


@dataclass(frozen=True)
class ClassifySpec:
    """Where a request may claim its class. Header names are case-insensitive (lower-cased on load), and so are
    claims: every claim (class header, objective header, body field) is lower-cased before it is matched against
    the class names, which are lower case. A header is read for one thing: a name given to two of these headers
    and `sessions.header`, or one the ext_proc reads itself (`authorization`, `api-key`, `content-encoding`,
    `x-request-id`), is refused."""

    header: str = doc("Request header holding the claimed class name.", "x-priority", header_name=True)
    body_field: str = doc("Top-level JSON body field holding the claimed class name. Removed from the body "
                          "before it reaches vLLM when it names a class (vLLM's own `priority` is an integer).",
                          "priority")
    objective_header: str | None = doc(
        "Request header naming the request's objective, read as a class claim after `header` and before "
        "`body_field` (Gateway API Inference Extension: `x-gateway-inference-objective`, an "
        "InferenceObjective's name; newer llm-d routers call it `x-llm-d-router-inference-objective`). Its value "
        "is lower-cased like any claim, and like any claim it is capped by the tenant's `max_class`. Unset: not "
        "read.", None, header_name=True)
    objectives: dict[str, str] = doc("Objective name (lower case, as Kubernetes names are) -> class, for "
                                     "`objective_header`; a name not listed is taken as a class name.",
                                     factory=dict)
    fairness_header: str | None = doc(
        "Request header whose value is the fairness key (the flow whose share a request counts against) instead "
        "of the tenant (Gateway API Inference Extension: `x-gateway-inference-fairness-id`), in the classes that "
        "set `fairness.key: header` with a fairness mode (read by no other; `extproc check` warns). Keys live inside "
        "the request's tenant: a request whose API key names a tenant counts inside that tenant's share, its key "
        "only splitting that share between the tenant's own keys (however many it sends, and whatever tenant a "
        "key names), and is labelled by its tenant in metrics. A request with no known API key counts inside the "
        "`anonymous` tenant's share, where the key is believed: a key that is a tenant's name takes that "
        "tenant's `weight`, `guaranteed_share` and metric label, other keys `other`. So set it only where the "
        "gateway in front sets or strips that header: there an anonymous client that picks its own key can "
        "join another flow or split the anonymous share over many. Values are cut to 128 characters. Unset: "
        "the tenant is the key.", None, header_name=True)
    deadline_header: str | None = doc(
        "Request header carrying the request's own deadline, in milliseconds from its arrival. It waits for a "
        "slot at most that long (its class's queue, and with `store.kind: redis` the global slot; never longer "
        "than the class's `max_wait_ms`), and queues with a "
        "fairness mode serve the earliest deadline of a flow first: a deadline reorders its own flow's "
        "requests only, never another flow's or tenant's. A value that is not a finite number >= 0 (empty, "
        "negative, NaN, several values joined by a comma) is ignored. Unset: not read.", None, header_name=True)


@dataclass(frozen=True)
class TenantSpec:
    """A tenant: who it is (its API keys) and which classes it may use."""

    name: str = doc("Tenant name; used as a metric label, so it comes from config only.")
    api_keys: list[str] = doc('Keys matched against "Authorization: Bearer <key>" or "api-key: <key>". A '
                              'presented key is trimmed and cut at commas, and no header carries a control '
                              'character but a tab, so a key that is empty, has surrounding whitespace or holds a '
                              'comma or such a character is refused.',
                              factory=list, secret="quote the key")
    max_class: str | None = doc("Highest class this tenant may claim; higher claims are demoted to it. "
                                "Default: the highest class.", None)
    default_class: str | None = doc("Class of this tenant's requests that claim none. Default: the policy's "
                                    "`default_class`, capped by `max_class`.", None)
    requests_per_minute: int | None = doc("Rate limit (token bucket) on requests; 429 beyond it.", None, minimum=1)
    tokens_per_minute: int | None = doc("Rate limit on tokens (estimated prompt + expected output, corrected "
                                        "with real usage when it is learned).", None, minimum=1)
    burst_s: float = doc("Bucket depth, in seconds of the rate (how much of a burst is allowed).", 60.0,
                         minimum=1)
    weight: float = doc("Its share of a class with `fairness.mode: fair`, relative to the other tenants' (a "
                        "tenant of weight 2 is served twice the GPU-seconds of one of weight 1 while both wait). "
                        "`round_robin` takes turns whatever the weight, except under a pool-wide limit, where "
                        "the owner's return shares by weight in both modes.", 1.0, minimum=0.001)
    guaranteed_share: float = doc("In a class with `fairness.mode: fair`: the share of the class's slots this "
                                  "tenant is served first up to, whatever it was served before. Idle share is "
                                  "lent to the tenants that wait. Under a pool-wide limit it is also the least "
                                  "share of what the class holds on the pool that the tenant goes in up to when "
                                  "the limit is full (the others share the rest by weight).", 0.0, minimum=0,
                                  maximum=1)
    max_body_bytes: int | None = doc("Largest request body this tenant may send; larger ones get 413 "
                                     "`body_too_large` before they are parsed. Parsing is the ext_proc's one "
                                     "per-request cost that grows with the body (a 4 MiB body of numbers ~60 ms of "
                                     "its event loop): a low-priority tenant's cap keeps it from stalling everyone's "
                                     "admission. Default: the ext_proc's `--max-body-bytes`.", None, minimum=1024)


@dataclass(frozen=True)
class SessionSpec:
    """Agent sessions: requests carrying the same session id share one budget, like one customer."""

    header: str = doc("Request header carrying the session id (case-insensitive).", "x-session-id",
                      header_name=True)
    max_inflight_gpu_seconds: float | None = doc("GPU-seconds a session may have in flight at once.", None,
                                                 minimum=0.001)
    gpu_seconds_per_minute: float | None = doc("GPU-seconds a session may start per minute (token bucket).",
                                               None, minimum=0.001)
    max_sessions: int = doc("Sessions tracked at once (the least recently seen or ended are forgotten first; one "
                            "with a request in flight is kept, so the table may pass this by the sessions running). "
                            "Session ids "
                            "are read to 256 characters; a session takes up to ~700 bytes, so the default holds "
                            "up to ~70 MB.", 100_000,
                            minimum=1)


@dataclass(frozen=True)
class FleetSpec:
    """What the fleet can serve, for `extproc check` to warn when tenant rate limits promise more."""

    requests_per_minute: int | None = doc("Requests per minute the fleet sustains within its SLOs.", None,
                                          minimum=1)
    tokens_per_minute: int | None = doc("Tokens per minute the fleet sustains within its SLOs.", None,
                                        minimum=1)


@dataclass(frozen=True)
class AnonymousSpec:
    """Requests with no API key, or a key no tenant owns: one tenant named `anonymous`."""

    allow: bool = doc("`false`: refuse them with 401 (`missing_api_key` / `invalid_api_key`) before anything "
                      "else is read.", True)
    max_class: str | None = doc("Highest class an anonymous request may claim. Default: the lowest class, so "
                                "dropping or mangling a key never raises a request's class.", None)
    default_class: str | None = doc("Class of anonymous requests that claim none. Default: `default_class`, "
                                    "capped by `max_class`. Set above `max_class` (or above the lowest class, "
                                    "when `max_class` is unset), it is refused.", None)
    requests_per_minute: int | None = doc("Rate limit shared by all anonymous requests; 429 beyond it.", None,
                                          minimum=1)
    tokens_per_minute: int | None = doc("Token rate limit shared by all anonymous requests.", None, minimum=1)
    burst_s: float = doc("Bucket depth, in seconds of the rate.", 60.0, minimum=1)
    max_body_bytes: int | None = doc("Largest request body an anonymous request may send (413 beyond it, before "
                                     "parsing; see `tenants[].max_body_bytes`). Default: the ext_proc's "
                                     "`--max-body-bytes`.", None, minimum=1024)

    def as_tenant(self) -> "TenantSpec":
        return TenantSpec(name="anonymous", max_class=self.max_class, default_class=self.default_class,
                          requests_per_minute=self.requests_per_minute, tokens_per_minute=self.tokens_per_minute,
                          burst_s=self.burst_s, max_body_bytes=self.max_body_bytes)


@dataclass(frozen=True)
class EndpointsSpec:
    """Which of vLLM's compute endpoints are admitted. envoy/envoy.yaml sends every one of them to the ext_proc;
    a switched-off group is refused with 404 `unsupported_endpoint`, so nothing computes unadmitted. vLLM's
    audio endpoints (multipart uploads we cannot cost) are always refused."""

    chat: bool = doc("/v1/chat/completions.", True)
    completions: bool = doc("/v1/completions.", True)
    responses: bool = doc("/v1/responses (OpenAI Responses API): cost from `input` and `instructions`, output "
                          "capped by `max_output_tokens`; a `canned` fallback is refused instead.", True)
    invocations: bool = doc("/invocations (SageMaker style): admitted as chat, completions or embeddings by its "
                            "body (`messages`, `prompt` or `prompt_embeds`, `input`), each under its own switch; a "
                            "body with both `messages` and a prompt is refused (400), since vLLM runs it as "
                            "completions whenever its chat reading fails validation, and so is one whose "
                            "`messages` is null, a number or a boolean beside a prompt or without `input` (vLLM "
                            "refuses it, 400, rather than try completions).", True)
    embeddings: bool = doc("/v1/embeddings, /pooling, /classify, /score, /v1/score, /rerank, /v1/rerank, "
                           "/v2/rerank: prefill-only cost (all text in the body, an image, audio or video part at "
                           "its fixed count as in a chat, a score or rerank query once per "
                           "document vLLM pairs it with), no output; fallbacks other than `reject` are refused "
                           "instead (another model's vectors are not an answer).", False)
    tokenize: bool = doc("/tokenize, /detokenize: CPU work on the replica's API server, admitted as "
                         "prefill-only requests so they count against caps and rate limits.", False)

    def serves(self, group: str) -> bool:
        return bool(getattr(self, group, False))


@dataclass(frozen=True)
class CostSpec:
    """A model's GPU-time profile: what one request costs, in GPU-seconds, before it runs. `fair` queues, tenant
    GPU-second budgets and `max_inflight_gpu_seconds` count in these, at the coefficients as configured (usage
    read corrects the output length, not the coefficients). Only their proportions matter to `fair`: set them in
    your engine's, from its step times (the prefill time per token; a decode step's time over the sequences it ran
    at your usual batch; how much that grows per 1K tokens of context), or a tenant of long prompts is charged a
    fraction of what the engine spends on it (docs/demo.md, "Every tenant backlogged")."""

    prefill_s_per_1k_tokens: float = doc("GPU-seconds to prefill 1,000 prompt tokens.", 0.08, minimum=0)
    decode_s_per_token: float = doc("GPU-seconds per generated token at the reference batch (the request's "
                                    "share of a decode step: the step's time over the sequences it ran) and short "
                                    "context.", 0.0011, minimum=0)
    decode_s_per_1k_context: float = doc(
        "GPU-seconds each generated token adds per 1,000 tokens of context it attends to (its prompt and the output "
        "before it): a decode step reads every running sequence's KV cache, so an answer to a long prompt costs more "
        "a token. Measure it as how much the step time over the sequences grows per 1K tokens of context. 0: an "
        "output token costs `decode_s_per_token` whatever its context, and a tenant of long prompts is charged less "
        "than the engine spends on it.", 0.0, minimum=0)
    variance_margin: float = doc("Added to every estimate as a fraction (MoE models and speculative decoding "
                                 "vary more per request: 0.3-0.4).", 0.0, minimum=0, maximum=5)
    default_max_tokens: int = doc("Output tokens assumed when a chat or Responses API request sets no max_tokens "
                                  "(vLLM's default is the rest of the context); one whose output cannot end early "
                                  "(`ignore_eos`, `use_beam_search`, a larger `min_tokens`) is costed to the rest of "
                                  "the context (`max_context_tokens`, else the learned one), or to its `min_tokens`. "
                                  "A completions request without one is costed at the 16 tokens that API defaults "
                                  "to.", 1024, minimum=1)
    max_context_tokens: int | None = doc(
        "Context length: prompt + output are clamped to it as vLLM does, and a max_tokens beyond it is refused with "
        "400. Unset: learned from the replicas' `GET /v1/models` where the pool is scraped (`pools.<cluster>` with "
        "`replicas` or `envoy_admin`), the largest `max_model_len` they list for the model: the estimate and a "
        "degrade's clamp use it, the 400 is left to the replica. Unset and not learned: no clamp.", None,
        minimum=16)
    chars_per_token: float = doc(
        "Fast prompt estimate: UTF-8 bytes of prompt text per token (one byte is one character of English; CJK "
        "takes 3 a character, about a token). 4 holds within ~1.4x for the common tokenizers and scripts; "
        "`tokenizer` is exact.", 4.0, minimum=0.5, maximum=16)
    tokenizer: str | None = doc("Path to a Hugging Face tokenizer.json for exact prompt counts (needs the "
                                "`tokenizers` package; falls back to the fast estimate without it). Exact for the "
                                "first 16,384 characters of a prompt; the rest is counted at the rate of those, "
                                "never below the fast estimate's, so a huge prompt cannot hold the event loop.",
                                None)
    image_tokens: int = doc("Prompt tokens one image part fills (`image_url`, `input_image`, image embeds). 768 is a "
                            "fixed-resolution encoder's; a dynamic-resolution one (the Qwen2-VL family) takes up to "
                            "its `max_pixels` / 784 for a large image (about 16K at its defaults): set what your "
                            "model's largest accepted image takes, or a client's images are admitted at a fraction "
                            "of their prefill.", 768, minimum=0)
    audio_tokens: int = doc("Prompt tokens one audio part fills (`input_audio`, `audio_url`, audio embeds).", 512,
                            minimum=0)
    video_tokens: int = doc("Prompt tokens one video part fills (`video_url`, video embeds): vLLM samples 32 frames "
                            "by default, about 128 tokens a frame after merging.", 4096, minimum=0)
    learn: bool = doc("Learn online from real usage the output ratio (output tokens per max_tokens asked) and the "
                      "service-time fit the SLO's early rejection predicts with. The GPU-second coefficients above "
                      "stay as configured: a request's service time is how long it held a place in the batch, not "
                      "its share of the GPU.", True)


@dataclass(frozen=True)
class ModelSpec:
    """A model name clients send in the body's `model`, and the Envoy cluster (pool) that serves it."""

    cluster: str = doc("Envoy cluster name that serves this model. It must exist in envoy.yaml, or Envoy answers "
                       "the model's requests 503 `cluster_not_found` (`extproc check --envoy ENVOY_YAML` checks; "
                       "at runtime the ext_proc names it where a pool gives it Envoy's admin, `envoy_admin`).")
    cost: CostSpec = doc("GPU-time profile used by cost-aware admission.", factory=CostSpec)
    aliases: list[str] = doc(
        "Other names clients send for this model, routed to its cluster unchanged: its other "
        "`--served-model-name`s and the LoRA adapters its replicas serve (`--lora-modules`). They are admitted, "
        "estimated, learned from and counted in metrics as this model (an adapter runs at its base model's speed). "
        "A name is a key or an alias of one model only.", factory=list)
    names_from_replicas: bool = doc(
        "Also admit, as this model, every other name its pool's replicas list in `GET /v1/models` for it: their "
        "other served names and the LoRA adapters whose `parent` is one of them, including adapters loaded at "
        "runtime (`/v1/load_lora_adapter`), admitted within `pools.<cluster>.models_interval_ms` of the first "
        "replica listing them and until none does. Needs the cluster under `pools` with `replicas` or "
        "`envoy_admin`. A name the policy names keeps its own model; a name two pools list is refused (404).",
        False)


@dataclass(frozen=True)
class StoreSpec:
    """Where class slots are counted: in this process only, or in Redis shared by every ext_proc replica."""

    kind: Literal["memory", "redis"] = doc(
        "`memory`: each ext_proc counts its own slots (one replica, or caps meant per replica); the workers of one "
        "`extproc serve --workers N` share them through the host's memory. `redis`: every "
        "replica pointing at the same Redis and `key_prefix` shares each class's `max_concurrency` and "
        "`max_inflight_gpu_seconds`; a request admitted locally also takes a global slot (one round trip) and "
        "waits up to the class's `max_wait_ms` (or the request's own shorter deadline, "
        "`classify.deadline_header`) for one. Changes to this section apply on restart.", "memory")
    url: str = doc("redis: the server, as a redis-py URL (`redis://host:6379/0`, `rediss://` for TLS, "
                   "`unix:///path`).", "redis://127.0.0.1:6379/0", secret=True)
    key_prefix: str = doc("redis: prefix of every key and of the release channel; replicas that share caps use "
                          "the same prefix, separate fleets use different ones.", "extproc:")
    lease_ms: int = doc("redis: a global slot expires this long after its last renewal. Live requests are "
                        "renewed every second, so a killed replica's slots free themselves within this time.",
                        10_000, minimum=2_000, maximum=600_000)
    timeout_ms: int = doc("redis: longest wait for one Redis call; a slower or failed call switches to "
                          "`on_failure` until a probe (every second) finds Redis answering again.", 50,
                          minimum=1, maximum=10_000)
    poll_ms: int = doc("redis, and `memory` with `serve --workers`: a request waiting for a global slot retries "
                       "at least this often. Releases are announced (Redis: a pub/sub channel; workers: a datagram "
                       "to the waiting worker), so most waits end sooner; expired leases (Redis) and the slots of a "
                       "worker that died are not announced, and this bounds how late they are noticed.", 100,
                       minimum=10, maximum=5_000)
    instances: int = doc("redis: ext_proc replicas sharing the caps (each `extproc serve`, however many "
                         "`--workers` it runs). Only used while Redis is unreachable with `on_failure: local`: "
                         "each replica then admits its share, the cap divided by this (at least 1 per class), "
                         "and each of its N workers a further 1/N of that.", 1, minimum=1)
    on_failure: Literal["local", "closed"] = doc(
        "redis: while Redis is unreachable or slower than `timeout_ms`: `local` admits against per-replica "
        "caps (fail open), `closed` refuses requests that would need a global slot with 503 "
        "`store_unavailable` (fail closed). Either way the switch is logged, counted in "
        "extproc_store_switches_total, and undone when Redis answers again.", "local")


@dataclass(frozen=True)
class Policy:
    """The admission policy."""

    classes: dict[str, ClassSpec] = doc("Traffic classes, highest priority first (order matters for shedding "
                                        "and tenant caps). Names are lower case ASCII: claims are lower-cased "
                                        "before they are matched, and a name is also a metric label and a "
                                        "header value, so it has one spelling.")
    models: dict[str, ModelSpec] = doc("Models by the name clients send; any other model gets 404.")
    default_class: str | None = doc("Class of requests that claim none and have no tenant default. "
                                    "Default: the first class.", None)
    classify: ClassifySpec = doc("Where requests claim a class.", factory=ClassifySpec)
    tenants: list[TenantSpec] = doc("Tenants and their class limits.", factory=list)
    anonymous: AnonymousSpec = doc("Requests without a known API key.", factory=AnonymousSpec)
    endpoints: EndpointsSpec = doc("Which vLLM compute endpoints are admitted (the rest get 404).",
                                   factory=EndpointsSpec)
    pools: dict[str, PoolSpec] = doc("Envoy clusters whose replicas are scraped for saturation (used by adaptive "
                                     "caps).", factory=dict)
    sessions: SessionSpec = doc("Agent-session budgets.", factory=SessionSpec)
    fleet: FleetSpec = doc("Fleet capacity, for sanity checks of rate limits.", factory=FleetSpec)
    learn_sample: float = doc("Share of requests whose response usage is read for cost learning (a streamed "
                              "one costs an ext_proc message per chunk). Besides these, every non-streamed "
                              "response of a tenant with `tokens_per_minute` is read to refund what it did not "
                              "use: one message, or, for a JSON answer larger than `serve --max-body-bytes` or "
                              "without a Content-Length, a message per piece Envoy hands over (a 5 MB answer took "
                              "4 to 6 on loopback), passed on unchanged and its usage read from its last 4 KiB. A "
                              "compressed answer, or one whose `usage` is not within its last 4 KiB (vLLM writes it "
                              "a few hundred bytes before the end), keeps the worst case charged up front.", 0.05,
                              minimum=0, maximum=1)
    shed: dict[str, list[str]] | None = doc(
        "While the class named by a key is saturated (all its slots taken), new and queued requests of the "
        "listed classes are shed with 503, on the pools that class has been sent to and that have no pool-wide "
        "limit (`pools.<name>.limit`: there the limit's strict priority makes the lower classes yield instead). "
        "Default: the first class protects every other class. `{}` disables shedding.", None)
    mode: Literal["enforce", "shadow"] = doc(
        "`shadow` computes and counts every admission decision (caps, queues, shedding, breakers, rate limits and "
        "budgets: extproc_shadow_decisions_total) but rejects, sheds and degrades nothing. Ship in shadow first. "
        "Requests the policy does not take at all are still refused in shadow: no or an unknown API key under "
        "`anonymous.allow: false` (401), a switched-off `endpoints` group or an unknown model (404), a body over "
        "`max_body_bytes` (413), `max_tokens` over `max_context_tokens` (400); turn those on with enforce.",
        "enforce")
    lease_ms: int = doc("Safety net: a slot whose request was never seen to end is freed after this long, "
                        "unless its gRPC stream is still alive (live streams renew their lease).", 600_000,
                        minimum=1_000)
    sustained_window_s: float = doc("Window of the ext_proc's own sustained-load gauges (extproc_queue_depth_avg, "
                                    "extproc_inflight_ratio_avg; each instance's own, its ratio over its own cap). "
                                    "The shipped dashboard and KEDA example read Prometheus's 5-minute recording "
                                    "rules instead, which add the instances up (docs/autoscaling.md).", 300.0,
                                    minimum=10)
    retry_after_max_s: int = doc("Upper bound on the Retry-After seconds of load refusals (429/503 from caps, "
                                 "queues, shedding, breakers), which are estimates. Rate-limit refusals say "
                                 "exactly when the bucket will hold the request, however long that is.", 60,
                                 minimum=1)
    store: StoreSpec = doc("Where class slots are counted (per replica, or shared through Redis).",
                           factory=StoreSpec)

    # --- derived views (not part of the YAML) ---
    def class_names(self) -> list[str]:
        return list(self.classes)

    def fallback_class(self) -> str:
        """`default_class` with its default applied."""
        return self.default_class or next(iter(self.classes))

    def shed_map(self) -> dict[str, list[str]]:
        """Protecting class -> classes shed while it is saturated, with the default applied."""
        if self.shed is not None:
            return self.shed
        names = self.class_names()
        return {names[0]: names[1:]} if len(names) > 1 else {}


# --- loading and validation --------------------------------------------------------------------------------------

def load_policy(data: Any) -> Policy:
    """Build a Policy from parsed YAML, or raise PolicyError listing every problem with its key path."""
    errors: list[str] = []
    policy = _build(Policy, data, "", errors)
    if policy is not None:
        # Cross-field rules too when some field is wrong: every problem at once, not a second round after the first
        # is fixed. A part that failed to build may trip them; its own error is already listed.
        try:
            _check_references(policy, errors)
            _check_pools(policy, errors)
        except (AttributeError, TypeError, KeyError, ValueError):
            pass
    if errors or policy is None:
        raise PolicyError(errors or ["(root): not a mapping"])
    return policy


def policy_warnings(p: Policy) -> list[str]:
    """Things that validate but are probably wrong: e.g. tenant rate limits that sum past the fleet."""
    return (_rate_limit_warnings(p) + _pool_warnings(p) + _slip_warnings(p) + _fallback_warnings(p)
            + _first_class_warnings(p) + _reach_warnings(p))


def _fallback_warnings(p: Policy) -> list[str]:
    """Fallbacks that are never taken, or taken to no effect (found by writing policies from the docs)."""
    out = []
    for name, c in p.classes.items():
        fb, where = c.fallback, f"classes.{name}"
        breakable = c.error_breaker.enabled or (c.slo_p95_ms is not None and c.latency_breaker.enabled)
        if c.on_overflow == "fallback" and fb.action == "reject":
            out.append(f"{where}.on_overflow: `fallback`, and the fallback's action is `reject` (the default), "
                       "so overflow is refused with 429 as with `on_overflow: reject`: set `fallback.action` to "
                       "`degrade` or `canned`")
        elif fb.action != "reject" and c.on_overflow == "reject" and not breakable:
            out.append(f"{where}.fallback: its `{fb.action}` is never used: both breakers are off "
                       "(error_breaker.enabled false; no slo_p95_ms or latency_breaker.enabled false) and "
                       "on_overflow is `reject`: set `on_overflow: fallback`, or remove the fallback")
        elif fb.action != "reject" and c.on_overflow == "reject":
            # AdmissionController takes the fallback on overflow only with `on_overflow: fallback`; a breaker
            # that opens takes it whatever on_overflow says.
            out.append(f"{where}.fallback: its `{fb.action}` serves only while one of the class's breakers is open; "
                       "overflow (queue full, wait expired, early reject) is refused with 429, since on_overflow is "
                       "`reject`: set `on_overflow: fallback` to send overflow to it too")
        if fb.action == "degrade" and _degrade_changes_nothing(p, fb):
            out.append(f"{where}.fallback: a degrade to {fb.model!r} stays on {p.models[fb.model].cluster!r}, the "
                       "pool of every model, and changes nothing else (no `max_tokens`, no `stream: false`): the "
                       "request would go back unchanged to the pool that had no room, so each one the fallback "
                       "takes is refused instead (429 on overflow, 503 while a breaker is open): name a smaller "
                       "model on another pool, or clamp `max_tokens`")
    return out


def _degrade_changes_nothing(p: Policy, fb: FallbackSpec) -> bool:
    """A degrade that only names a model on the pool of every model the policy routes (one with nothing at all is
    an error): it leaves every request on its own pool unchanged, and Fallbacks.answer refuses those."""
    if fb.max_tokens is not None or fb.stream is False or fb.model not in p.models:
        return False
    return all(m.cluster == p.models[fb.model].cluster for m in p.models.values())


def _first_class_warnings(p: Policy) -> list[str]:
    """The first class's settings that docs/overload.md ("Writing the policy") rules out."""
    names = p.class_names()
    out = []
    limited = any(pool.limit.enabled for pool in p.pools.values())  # without: _slip_warnings says so
    if p.classes[names[0]].min_share and limited:
        # PoolGate: a class within its share is admitted whatever waits above it, and nothing is above the first.
        out.append(f"classes.{names[0]}.min_share: the first class waits behind no class, so its share guarantees "
                   "nothing; its one effect is to admit it past a pool's limit while it holds under that share: "
                   "remove it (shares are for the classes below)")
    first = next((n for n in names if p.classes[n].slo_p95_ms is not None), None)
    if first is None:
        return out
    c = p.classes[first]
    # Rounded: (1 - 0.8) x 1500 is 299.99999999999994 in floats, and a wait of 300 ms is within it.
    bounds = {pname: round((1 - pool.limit.target) * c.slo_p95_ms, 6) for pname, pool in p.pools.items()
              if pool.limit.enabled}
    over = {pname: bound for pname, bound in bounds.items() if c.max_wait_ms > bound}
    if over:
        pname, bound = min(over.items(), key=lambda kv: kv[1])
        target = p.pools[pname].limit.target
        out.append(f"classes.{first}.max_wait_ms: {c.max_wait_ms} ms is over (1 - pools.{pname}.limit.target "
                   f"{target:g}) x slo_p95_ms {c.slo_p95_ms} = {bound:.0f} ms: the limit aims the served p95 at "
                   f"{target:g} x the SLO and a queued request's wait comes on top, so its p95 can pass the SLO; keep "
                   "it within that unless its answers take a small part of the SLO (docs/overload.md, \"Writing "
                   "the policy\", rule 1)")
    return out


def _reach_warnings(p: Policy) -> list[str]:
    """Classes no request can be in: a request's class is capped by its tenant's `max_class`, and one without a
    known key is anonymous, capped at the lowest class unless `anonymous.max_class` says otherwise. A policy of its
    own classes and no tenants (found by writing one from the docs) put every request in its last class, and the
    classes above it, their fallbacks and shedding, served nothing while the file checked ok."""
    names = p.class_names()
    rank = {n: i for i, n in enumerate(names)}
    reach = [rank.get(t.max_class or names[0], 0) for t in p.tenants if t.api_keys]
    if p.anonymous.allow:
        reach.append(rank.get(p.anonymous.max_class or names[-1], len(names) - 1))
    if not reach:
        return ["anonymous.allow: false and no tenant has `api_keys`, so every request is refused with 401"]
    top = min(reach)
    if top == 0:
        return []
    how = ("anonymous requests are capped at " + repr(names[-1]) + " (`anonymous.max_class` defaults to the lowest "
           "class)" if p.anonymous.allow and p.anonymous.max_class is None else
           f"no tenant's `max_class` (nor `anonymous.max_class`) reaches above {names[top]!r}")
    unreachable = ", ".join(names[:top])
    return [f"classes: no request can be in {unreachable}: {how}; give the tenants that may use "
            f"{'them' if top > 1 else 'it'} API keys and a `max_class`, or set `anonymous.max_class`"]


def _slip_warnings(p: Policy) -> list[str]:
    """Values a user writes by mistake that still load (found by writing policies from the docs)."""
    out = []
    limited = any(pool.limit.enabled for pool in p.pools.values())
    fair = any(c.fairness.mode != "fifo" for c in p.classes.values())
    for name, c in p.classes.items():
        if c.slo_p95_ms is not None and c.slo_p95_ms < 50:
            out.append(f"classes.{name}.slo_p95_ms: {c.slo_p95_ms} ms; the SLO is in milliseconds "
                       f"({c.slo_p95_ms * 1000} for {c.slo_p95_ms} s)")
        if c.slo_p95_ms is not None and c.slo_p95_ms / 1000 >= max(LATENCY_BUCKETS):
            out.append(f"classes.{name}.slo_p95_ms: {c.slo_p95_ms} ms is at or past "
                       f"{max(LATENCY_BUCKETS):g} s, the longest latency extproc_request_duration_seconds "
                       "measures: its p95 never reads above it, so the dashboard never shows the SLO missed and "
                       "ExtprocLatencyOverSLO cannot fire (the latency breaker still works)")
        a = c.adaptive
        if a.enabled and not a.min_limit <= c.max_concurrency <= a.max_limit:
            out.append(f"classes.{name}.max_concurrency: {c.max_concurrency} is outside adaptive.min_limit .. "
                       f"max_limit ({a.min_limit} .. {a.max_limit}); the cap starts at the nearest bound")
        if c.min_share and not limited:
            out.append(f"classes.{name}.min_share: no pool has a `limit`, so the share guarantees nothing")
    for pname, pool in p.pools.items():
        if pool.stale_ms <= pool.scrape_interval_ms:
            out.append(f"pools.{pname}.stale_ms: {pool.stale_ms} ms is not longer than scrape_interval_ms "
                       f"({pool.scrape_interval_ms} ms): readings go stale between scrapes and the pool counts as "
                       "saturated; give it a few intervals (e.g. 10x)")
    rank = {n: i for i, n in enumerate(p.classes)}
    for protector, shed in (p.shed or {}).items():
        for j, c in enumerate(shed):
            if c in rank and protector in rank and rank[c] < rank[protector]:
                out.append(f"shed.{protector}[{j}]: {c} is listed above {protector} in `classes` (higher priority), "
                           f"yet it is shed whenever {protector} is saturated; a class normally sheds those below it")
    # The header is read only as the flow key of a fairness queue: set alone it splits nothing.
    keyed = [n for n, c in p.classes.items() if c.fairness.key == "header"]
    for n in keyed:
        if p.classes[n].fairness.mode == "fifo":
            out.append(f"classes.{n}.fairness.key: `header` in a `fifo` queue orders nothing (fifo ignores flows); "
                       "set `fairness.mode: fair` or `round_robin`")
    if p.classify.fairness_header is not None and not any(p.classes[n].fairness.mode != "fifo" for n in keyed):
        out.append("classify.fairness_header: no class has `fairness.key: header` (with `fairness.mode: fair` or "
                   "`round_robin`), so the header is read by nothing and each tenant stays one flow")
    weighted = any(c.fairness.mode == "fair" for c in p.classes.values())  # round_robin takes turns
    for t in p.tenants:
        if t.guaranteed_share and not weighted:
            out.append(f"tenants.{t.name}.guaranteed_share: no class has `fairness.mode: fair` (round_robin takes "
                       "turns whatever the guarantee), so the share guarantees nothing")
        if t.weight != 1.0 and not fair:  # round_robin reads it under a pool-wide limit (the owner's return)
            out.append(f"tenants.{t.name}.weight: no class has a fairness mode (fifo serves in arrival order), so "
                       "the weight weighs nothing")
    return out


def _rate_limit_warnings(p: Policy) -> list[str]:
    warnings = []
    for key, unit in (("requests_per_minute", "requests/min"), ("tokens_per_minute", "tokens/min")):
        fleet = getattr(p.fleet, key)
        # Anonymous callers share one bucket of their own: it counts against the fleet like a tenant.
        limited = [*p.tenants, p.anonymous] if p.anonymous.allow else list(p.tenants)
        total = sum(getattr(t, key) or 0 for t in limited)
        unlimited = [t.name for t in p.tenants if getattr(t, key) is None]
        if fleet is None:
            continue
        if total > fleet:
            warnings.append(f"tenants: {key} sum to {total} {unit}, past fleet.{key} = {fleet}: the limits "
                            "protect nothing when every tenant uses its share")
        elif unlimited:
            warnings.append(f"tenants: {', '.join(unlimited)} have no {key} while fleet.{key} = {fleet}")
    return warnings


def _pool_warnings(p: Policy) -> list[str]:
    fix = "list the vLLM replicas as HOST:PORT in `replicas`, or set `envoy_admin` to read them from Envoy"
    slo = any(c.slo_p95_ms for c in p.classes.values())
    out = []
    for name, pool in p.pools.items():
        if pool.scraped:
            continue
        if pool.limit.enabled and not slo:
            out.append(f"pools.{name}: names neither `replicas` nor `envoy_admin` and no class has `slo_p95_ms`, "
                       f"so its limit has nothing to move on and stays at its `max`: {fix}, or give a class an SLO")
        else:
            out.append(f"pools.{name}: names neither `replicas` nor `envoy_admin`, so nothing is scraped and its "
                       f"limit (and the adaptive caps on it) run on latency only: {fix}")
    return out


def load_policy_file(path: str) -> Policy:
    """Read, parse and validate a policy file; any problem with it is a PolicyError (a reload counts it as
    refused and keeps the running policy)."""
    return load_policy_bytes(path, read_policy_bytes(str(path)))


def load_policy_bytes(path: str, raw: bytes) -> Policy:
    """load_policy_file for the file's bytes already read (read_policy_bytes): a reload parses the very bytes it
    compared with the applied file's."""
    return load_policy(_policy_doc(str(path), raw))


def load_policy_pipe() -> None:
    """A child process's part of a reload (extproc serve, for a big file): the policy file's bytes from stdin,
    named argv[1]; the pickled result to stdout: ("policy", Policy) or ("errors", PolicyError's errors)."""
    import pickle

    try:
        result: tuple = ("policy", load_policy_bytes(sys.argv[1], sys.stdin.buffer.read()))
    except PolicyError as e:
        result = ("errors", e.errors)
    sys.stdout.buffer.write(pickle.dumps(result))


def read_policy_doc(path: str) -> Any:
    """The policy file's YAML document, read as `extproc check` and `serve` read it (UTF-8, no key given twice),
    before validation: for the tools that edit it first (the demo scales its durations)."""
    return _policy_doc(str(path), read_policy_bytes(str(path)))


def _policy_doc(path: str, raw: bytes) -> Any:
    return _parse_yaml(path, _decode(path, raw))


def read_policy_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise PolicyError([f"{path}: {e.strerror}"]) from e


def _decode(path: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PolicyError([f"{path}: not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} (line {line}); "
                           "save the file as UTF-8"]) from e


def _parse_yaml(path: str, text: str) -> Any:
    import yaml  # local: the core stays importable without YAML when policies are built in code

    try:
        loader = _strict_loader()(text)
    except yaml.reader.ReaderError as e:  # the reader refuses a control character before anything is parsed
        e.name = path
        line = text.count("\n", 0, e.position) + 1
        raise PolicyError([f"{path}: not valid YAML: {_one_line(str(e))} (line {line})"]) from e
    loader.name = path  # errors point into the file, not "<unicode string>"
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        for mark in (getattr(e, "context_mark", None), getattr(e, "problem_mark", None)):
            if mark is not None:
                mark.buffer = None  # the line and column, not the line's text: it may hold an api key
        raise PolicyError([f"{path}: not valid YAML: {_one_line(str(e))}"]) from e
    except RecursionError as e:  # PyYAML parses nested collections recursively
        raise PolicyError([f"{path}: not valid YAML: nested too deeply (a policy needs a few levels)"]) from e
    finally:
        loader.dispose()


def _one_line(message: str) -> str:
    """PyYAML's message on one line, as every policy error is (it writes each part and each "in FILE, line N"
    on a line of its own): a place joins the part before it, the parts are joined by "; "."""
    out = ""
    for line in filter(None, map(str.strip, message.splitlines())):
        out += (" " if line.startswith("in ") else "; ") + line if out else line
    return out


@functools.cache
def _strict_loader() -> type:
    """yaml.SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one silently, so a
    second `classes:` block would replace the first without a word."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
            _refuse_duplicate_keys(self, node)
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
            # Python refuses to read an int of more than 4,300 digits (a ValueError, not a YAML error).
            try:
                return super().construct_yaml_int(node)
            except ValueError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a number of {len(node.value)} digits is too long to read", node.start_mark) from None

    StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)
    return StrictLoader


def _refuse_duplicate_keys(loader: Any, node: Any) -> None:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *defaults`: keys written next to it may override the merged ones
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = first_line.get(key)
        except TypeError:
            continue  # an unhashable key: the constructor reports it
        if first is not None:
            raise PolicyError([f"{loader.name}: line {line}: duplicate key {key!r} (first at line {first})"])
        first_line[key] = line


# A value quoted in an error: a few items and levels of it. YAML aliases can make a small file name millions of
# values (each list aliasing the one before nine times), and a full repr() of those took 30 s and gigabytes.
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict, _QUOTE.maxstring, _QUOTE.maxother = 2, 4, 4, 80, 80


def _quoted(value: Any) -> str:
    return _QUOTE.repr(value)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _build(tp: Any, value: Any, path: str, errors: list[str], secret: bool | str = False) -> Any:
    """Convert `value` to type `tp`, appending "path: message" to errors on mismatch (never quoting a `secret`
    value: policy errors end up in logs)."""
    where = path or "(root)"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _build(args[0], value, path, errors, secret)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            errors.append(f"{where}: must be one of {', '.join(map(str, choices))}, got {_quoted(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{where}: must be a list, got {type(value).__name__}")
            return []
        (item,) = typing.get_args(tp)
        return [_build(item, v, f"{path}[{i}]", errors, secret) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{where}: must be a mapping, got {type(value).__name__}")
            return {}
        _, item = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                errors.append(f"{where}: keys must be non-empty strings, got {_quoted(k)}")
                continue
            out[k] = _build(item, v, _join(path, k), errors)
        return out
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path, errors)
    return _build_scalar(tp, value, where, errors, secret)


def _build_scalar(tp: type, value: Any, where: str, errors: list[str], secret: bool | str = False) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = _int_to_float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        kind = type(value).__name__
        hint = f" ({secret})" if isinstance(secret, str) else ""
        got = f"a{'n' if kind[0] in 'aeiou' else ''} {kind}{hint}" if secret else _quoted(value)
        errors.append(f"{where}: must be {_type_name(tp)}, got {got}")
        return None
    if tp is float and not math.isfinite(value):
        # NaN passes every bound (each comparison with it is false) and an infinite one never moves anything.
        errors.append(f"{where}: must be a finite number, got {value}")
        return None
    if tp is int and math.isinf(_int_to_float(value)):
        # YAML reads any run of digits as an int: every place that divides or scales it raised OverflowError.
        errors.append(f"{where}: must be a finite number, got a number of {len(str(abs(value)))} digits")
        return None
    return value


def _int_to_float(value: int) -> float:
    try:
        return float(value)
    except OverflowError:
        return math.inf  # past the largest float: refused as not finite


def _type_name(tp: type) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, tp.__name__)


# Per class, once: get_type_hints evaluates the string annotations on every call, and it was 80% of validating a
# policy of 20,000 tenants (4.7 of 5.9 s).
_type_hints = functools.cache(typing.get_type_hints)


def _build_dataclass(cls: type, value: Any, path: str, errors: list[str]) -> Any:
    where = path or "(root)"
    if not isinstance(value, dict):
        errors.append(f"{where}: must be a mapping, got {type(value).__name__}")
        return None
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            errors.append(f"{_join(path, str(key))}: unknown key (allowed: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        key_path = _join(path, name)
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                errors.append(f"{key_path}: required")
            continue
        built = _build(hints[name], value[name], key_path, errors, f.metadata.get("secret", False))
        _check_bounds(f, built, key_path, errors)
        if f.metadata.get("header_name") and isinstance(built, str):
            built = built.lower()  # Envoy hands the ext_proc lower-case header keys
            if not _HEADER_NAME.fullmatch(built):
                errors.append(f"{key_path}: {value[name]!r} is not an HTTP header name (letters, digits and "
                              "!#$%&'*+-.^_`|~ only; no spaces or colons)")
        kwargs[name] = built
    try:
        return cls(**kwargs)
    except TypeError:
        return None  # a required key was missing; already reported


def _check_bounds(f: dataclasses.Field, value: Any, path: str, errors: list[str]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    if lo is not None and value < lo:
        errors.append(f"{path}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        errors.append(f"{path}: must be <= {hi}, got {value}")


def _check_references(p: Policy, errors: list[str]) -> None:
    """Cross-field rules: every class name used anywhere must be defined; keys are unique."""
    names = p.class_names()
    rank = {n: i for i, n in enumerate(names)}
    if not names:
        errors.append("classes: at least one class is required")
    if not p.models:
        errors.append("models: at least one model is required")
    _check_model_names(p, errors)

    def need_class(value: str | None, path: str) -> None:
        if value is not None and value not in rank:
            errors.append(f"{path}: unknown class {value!r} (classes: {', '.join(names)})")

    def default_under_max(max_class: str | None, default_class: str | None, base: str, note: str = "") -> None:
        if max_class in rank and default_class in rank and rank[default_class] < rank[max_class]:
            errors.append(f"{base}.default_class: {default_class!r} is above max_class {max_class!r}{note}")

    if len(names) > MAX_CLASSES:
        errors.append(f"classes: {len(names)} classes; at most {MAX_CLASSES} (each is a row of the workers' shared "
                      "table, a set of metric series and a queue)")
    for name in names:
        if len(name.encode()) > MAX_CLASS_NAME:
            errors.append(f"classes.{name[:40]}...: class names are at most {MAX_CLASS_NAME} bytes (a name is a "
                          "metric label and a header value)")
        if name != name.lower():
            errors.append(f"classes.{name}: class names must be lower case (claims are lower-cased before they are "
                          f"matched, so this one could never be claimed): write {name.lower()!r}")
        if not name.isascii():
            errors.append(f"classes.{name}: class names are ASCII (a claim's header is read byte for byte, so a "
                          "client sending UTF-8 could never claim this one)")
        elif _has_control(name):
            errors.append(f"classes.{name!r}: holds a control character; a class's name is a header value (Envoy "
                          "refuses one with a control character) and a metric label")
    need_class(p.default_class, "default_class")
    need_class(p.anonymous.max_class, "anonymous.max_class")
    need_class(p.anonymous.default_class, "anonymous.default_class")
    if names:  # anonymous.max_class defaults to the lowest class
        default_under_max(p.anonymous.max_class or names[-1], p.anonymous.default_class, "anonymous",
                          "" if p.anonymous.max_class else " (anonymous.max_class defaults to the lowest class)")
    seen_keys: dict[str, str] = {}
    seen_names: set[str] = set()
    for i, t in enumerate(p.tenants):
        base = f"tenants[{i}]"
        if t.name in seen_names:
            errors.append(f"{base}.name: duplicate tenant {t.name!r}")
        if not t.name.strip():
            errors.append(f"{base}.name: empty; a tenant's name is its metric label and log name")
        elif _has_control(t.name):  # a NUL is the fair queue's key separator
            errors.append(f"{base}.name: {t.name!r} holds a control character; a tenant's name is its metric label "
                          "and its fairness key")
        if t.name == "other" and p.classify.fairness_header is not None:
            errors.append(f"{base}.name: 'other' is the metric label of the classify.fairness_header keys that are "
                          "no tenant's: name the tenant otherwise")
        if t.name == "anonymous":
            errors.append(f"{base}.name: 'anonymous' is reserved for requests without a known key "
                          "(configure it under `anonymous:`)")
        seen_names.add(t.name)
        need_class(t.max_class, f"{base}.max_class")
        need_class(t.default_class, f"{base}.default_class")
        default_under_max(t.max_class, t.default_class, base)
        for j, key in enumerate(t.api_keys):
            why = _unmatchable(key)
            if why:
                errors.append(f"{base}.api_keys[{j}]: a key of tenant {t.name!r} {why}, so no request can present "
                              "it (its requests would count as anonymous): write the key exactly as clients send it")
            if key in seen_keys:
                # Never echo the key itself: policy errors end up in logs.
                errors.append(f"{base}.api_keys[{j}]: key already belongs to tenant {seen_keys[key]!r}")
            seen_keys[key] = t.name
    for base, t in [*((f"tenants[{i}]", t) for i, t in enumerate(p.tenants)), ("anonymous", p.anonymous)]:
        for key in ("requests_per_minute", "tokens_per_minute"):
            rate = getattr(t, key)
            # Its bucket holds rate * burst_s / 60 in a float: past the largest float it crashed at run time
            # (OverflowError building the bucket, or writing the x-ratelimit-remaining header of an infinite one).
            if (isinstance(rate, int) and rate and isinstance(t.burst_s, float)
                    and not math.isfinite(_int_to_float(rate) * t.burst_s)):
                errors.append(f"{base}.{key}: {key} * burst_s is past the largest number a bucket can hold")
    if sum(spec.min_share for spec in p.classes.values()) > 1 + SHARES_SLACK:
        errors.append("classes: the min_share of every class add up to more than 1")
    for name, spec in p.classes.items():
        ad = spec.adaptive
        if ad.enabled and not spec.slo_p95_ms:
            errors.append(f"classes.{name}.adaptive: needs the class's slo_p95_ms (the target it adapts to)")
        if ad.min_limit > ad.max_limit:
            errors.append(f"classes.{name}.adaptive.min_limit: above max_limit")
        if ad.raise_below >= ad.cut_at:
            errors.append(f"classes.{name}.adaptive.raise_below: must be below cut_at (the hold band)")
        fb = spec.fallback
        if fb.model is not None and fb.model not in p.models:
            errors.append(f"classes.{name}.fallback.model: unknown model {fb.model!r} "
                          f"(models: {', '.join(p.models)})")
        if fb.stream is True:  # the gateway turns streams off, never on: `true` would read as doing something
            errors.append(f"classes.{name}.fallback.stream: only `false` (answer in one piece instead of a "
                          f"stream) is a degrade; leave it out to keep each request's own choice")
        elif fb.action == "degrade" and fb.model is None and fb.max_tokens is None and fb.stream is None:
            errors.append(f"classes.{name}.fallback: action degrade needs model, max_tokens or stream: false")
        for key in _DEGRADE_ONLY:
            if fb.action != "degrade" and getattr(fb, key) is not None:
                errors.append(f"classes.{name}.fallback.{key}: only action degrade uses it, and the action is "
                              f"{fb.action!r} (the default is reject): add `action: degrade`, or remove it")
    if sum(t.guaranteed_share for t in p.tenants) > 1 + SHARES_SLACK:
        errors.append("tenants: the guaranteed_share of every tenant add up to more than 1")
    for name, spec in p.classes.items():
        if spec.fairness.key == "header" and p.classify.fairness_header is None:
            errors.append(f"classes.{name}.fairness.key: `header` needs classify.fairness_header")
    _check_header_names(p, errors)
    for objective, cls in p.classify.objectives.items():
        need_class(cls, f"classify.objectives.{objective}")
        if objective != objective.lower():
            errors.append(f"classify.objectives.{objective}: objective names must be lower case (the header's "
                          f"value is lower-cased before it is matched): write {objective.lower()!r}")
        if not objective.isascii():
            errors.append(f"classify.objectives.{objective}: objective names are ASCII (the header is read byte for "
                          "byte, so a client sending UTF-8 could never name this one)")
    if p.store.kind == "redis" and not p.store.url.startswith(("redis://", "rediss://", "unix://")):
        # Quoted less what comes before an @ (user and password), as changes.py never shows it at all: up to the
        # last @, as redis-py reads the userinfo (a password may hold an @ or a /).
        shown = _without_userinfo(p.store.url)
        errors.append(f"store.url: {shown!r} is not a Redis URL (redis://host:6379/0, rediss:// or unix://)")
    for protector, shed in p.shed_map().items():
        need_class(protector, f"shed.{protector}")
        for j, c in enumerate(shed):
            need_class(c, f"shed.{protector}[{j}]")
            if c == protector:
                errors.append(f"shed.{protector}[{j}]: a class cannot shed itself")


def _has_control(name: str) -> bool:
    """Whether a name holds an ASCII control character (no header value or metric label takes one)."""
    return any(ord(c) < 32 or ord(c) == 127 for c in name)


def _without_userinfo(url: str) -> str:
    """The URL with everything between its scheme and its last @ shown as ***."""
    head, at, host = url.rpartition("@")
    if not at:
        return url
    scheme = re.match(r"[a-z][a-z0-9+.-]*(?::/*|/+)", head, re.IGNORECASE)
    return (scheme.group() if scheme else "") + "***@" + host


def _check_header_names(p: Policy, errors: list[str]) -> None:
    """Each request header is read as one thing (protocol.read_request_headers): a name given twice, or one the
    ext_proc reads for itself, leaves the other field's value unread (fairness by x-session-id split nothing)."""
    c = p.classify
    first: dict[str, str] = {}
    for path, name in (("classify.header", c.header), ("sessions.header", p.sessions.header),
                       ("classify.objective_header", c.objective_header),
                       ("classify.fairness_header", c.fairness_header),
                       ("classify.deadline_header", c.deadline_header)):
        if name is None:
            continue
        also = "is a header the ext_proc reads for itself" if name in READ_HEADERS else (
            f"is also {first[name]}" if name in first else None)
        if also:
            errors.append(f"{path}: {name!r} {also}: a request header is read as one thing only; name another")
        first.setdefault(name, path)


# FallbackSpec keys a degrade reads; with another action they would be ignored (`fallback: {model: llama-8b}`
# without an action rejected while its writer expected the small model).
_DEGRADE_ONLY = ("model", "max_tokens", "stream", "max_concurrency")


def _unmatchable(key: str) -> str | None:
    """Why a configured API key can never equal a presented one (never echoing it: errors end up in logs).
    Presented keys are trimmed, and cut at commas (Envoy joins repeated headers with one)."""
    if not key.strip():
        return "is empty"
    if key != key.strip():
        return "starts or ends with whitespace"
    if "," in key:
        return "holds a comma"
    if _has_control(key.replace("\t", "")):
        return "holds a control character (no HTTP header value carries one but a tab: Envoy refuses the request)"
    return None


def _check_model_names(p: Policy, errors: list[str]) -> None:
    """Every name a client may send routes to one model: an alias is no other model's key or alias."""
    owner = {name: name for name in p.models}
    for name, m in p.models.items():
        for j, alias in enumerate(m.aliases):
            where = f"models.{name}.aliases[{j}]"
            if not alias:
                errors.append(f"{where}: empty name")
            elif alias in owner:
                errors.append(f"{where}: {alias!r} already names model {owner[alias]!r}")
            else:
                owner[alias] = name


def _check_pools(p: Policy, errors: list[str]) -> None:
    clusters = {m.cluster for m in p.models.values()}
    for name, m in p.models.items():
        if not m.cluster.strip():
            errors.append(f"models.{name}.cluster: empty; name the Envoy cluster that serves this model")
        if m.names_from_replicas and not (m.cluster in p.pools and p.pools[m.cluster].scraped):
            errors.append(f"models.{name}.names_from_replicas: needs pools.{m.cluster} with `replicas` or "
                          "`envoy_admin` (the replicas whose /v1/models name what this model serves)")
    for name, pool in p.pools.items():
        if name not in clusters:
            errors.append(f"pools.{name}: no model routes to this cluster (clusters: {', '.join(sorted(clusters))})")
        if pool.envoy_admin is not None and not _is_base_url(pool.envoy_admin):
            errors.append(f"pools.{name}.envoy_admin: {pool.envoy_admin!r} is not the admin's base URL (http:// or "
                          "https://, a host, no path: e.g. http://127.0.0.1:9901)")
        for j, address in enumerate(pool.replicas):
            if not _is_host_port(address):
                errors.append(f"pools.{name}.replicas[{j}]: {address!r} is not HOST:PORT (no scheme, no path: "
                              "e.g. 10.0.0.1:8000)")
        if 0 < pool.slow_ratio <= 1:
            errors.append(f"pools.{name}.slow_ratio: {pool.slow_ratio:g} would call the fastest replica slow (over 1, "
                          "or 0: off)")
        lim = pool.limit
        if lim.min > lim.max:
            errors.append(f"pools.{name}.limit.min: above max")
        if lim.initial is not None and not lim.min <= lim.initial <= lim.max:
            errors.append(f"pools.{name}.limit.initial: outside min..max")


def _is_base_url(url: str) -> bool:
    """scheme://host[:port][/], as the scraper puts it before /clusters?format=json."""
    try:
        u = urllib.parse.urlsplit(url)
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname) and u.path in ("", "/") and not u.query


def _is_host_port(address: str) -> bool:
    """HOST:PORT as the scraper puts it into http://HOST:PORT/metrics ([::1]:8000 for IPv6)."""
    host, _, port = address.rpartition(":")
    return (bool(host) and not any(c in "/@ " for c in host) and port.isascii() and port.isdigit()
            and 0 < int(port) < 65536)
