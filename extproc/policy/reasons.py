"""Every reason the ext_proc gives for a decision, in one table: its usual HTTP status, the Retry-After rule, the
message template and the troubleshooting text. Admission, the servicer, the shared-store adapter and
docs/troubleshooting.md (generated from it by `make docs`; a test keeps them equal) all read this table."""

from __future__ import annotations

from dataclasses import dataclass

# Retry-After rules
NO_RETRY = "none"    # not a 429/503: no Retry-After
DRAIN = "drain"      # load: the class's drain estimate, 1..retry_after_max_s (a guess)
BUCKET = "bucket"    # a rate limit: exactly when the bucket will hold the request, uncapped


@dataclass(frozen=True, slots=True)
class Reason:
    code: str          # metric label, error.code, x-extproc-reason, troubleshooting heading
    section: str       # troubleshooting section
    status: int        # usual HTTP status of a refusal for this reason; 0 for admissions
    retry_after: str   # NO_RETRY, DRAIN or BUCKET
    message: str       # str.format template of the error message ("" when nothing is refused)
    help: str          # what it means and what to do (Markdown)

    def say(self, **fields) -> str:
        return self.message.format(**fields)


# Section intros, in the order docs/troubleshooting.md shows them.
SECTIONS: dict[str, str] = {
    "Admitted": "",
    "Queued": "",
    "Rejected (429, 499, 503)": "",
    "Shed (503)": "",
    "Breakers and degrade": "",
    "Budgets and rate limits (429, 413)": "",
    "Shadow mode": "",
    "Invalid requests (400, 401, 404, 405, 413, 415, 500)": """\
Refused before admission; they never hold a slot. The ext_proc answers these with `x-extproc-decision: invalid`;
the reason is in the body's `error.code` and in `x-extproc-reason`.""",
}

REASONS: dict[str, Reason] = {r.code: r for r in (
    Reason("slot_free", "Admitted", 0, NO_RETRY,
           "",
           """\
Admitted at once: the class had a free slot and nobody queued ahead. Nothing to fix. If latency is high while
requests are admitted this way, the cap admits more than the replicas serve within the SLO: see `docs/tuning.md`."""),
    Reason("dequeued", "Admitted", 0, NO_RETRY,
           "",
           """\
Admitted after waiting in the class queue; `x-extproc-queue-wait-ms` says how long. Occasional waits are the queue
doing its job (absorbing a burst). If most requests of a class are dequeued, the class runs at its cap: check "In-flight
vs cap" and the sustained queue depth on the dashboard, and `docs/autoscaling.md`."""),
    Reason("class_full", "Queued", 0, NO_RETRY,
           "",
           """\
Not a final answer: the class's cap was full, or its pool-wide limit had no room for it (strict priority, the
class's share, see `queue_timeout`), so the request joined the class queue (counted in
`extproc_queue_entries_total`; those waiting for the pool also in `extproc_pool_waiting_requests`). It ends as
`dequeued`, `queue_timeout`, `client_disconnected`, `higher_class_saturated` (shed while waiting) or
`class_removed`; only that final reason is counted in `extproc_requests_total`."""),
    Reason("queue_full", "Rejected (429, 499, 503)", 429, DRAIN,
           "class {cls!r} is at capacity ({detail})",
           """\
**429.** The class's cap was full and its queue already held `max_queue` requests. This is admission control
refusing work the fleet cannot serve in time, by design: the client should back off for `Retry-After` seconds.
- Short bursts of it: expected. Do not raise `max_queue` to hide them: long queues turn into long waits and
  abandoned requests (a queue of 500 once gave a 45 s p99).
- Sustained (alert `ExtprocRejectionRatioHigh`, or `ExtprocDegradedRatioHigh` with `on_overflow: fallback`):
  demand exceeds capacity. Add replicas (`docs/autoscaling.md`), or re-run the cap-tuning ritual if the model,
  hardware or vLLM version changed (`docs/tuning.md`).
- One tenant causing it: that is a fairness problem for per-tenant rate limits or the class's `fairness.mode`, not
  for the cap. Under `round_robin` or `fair` a full queue gives the place of the last waiter of the tenant with the
  most waiting to an arrival of a tenant with at least two fewer: that waiter gets this reason.
- The message starts `its queue waits for pool '<pool>': ...`: the class's cap had room, its queue filled with
  requests waiting for the pool-wide limit (why, as for `queue_timeout`); raising the cap or `max_queue` changes
  nothing there."""),
    Reason("deadline_unmeetable", "Rejected (429, 499, 503)", 429, DRAIN,
           (
            "class {cls!r} would not reach this request {within} ({queued} ahead at its current drain "
            "rate)"),
           """\
**429** (or the class's fallback with `on_overflow: fallback`). Deadline-aware early rejection: at arrival, the
queue ahead of this request, at the class's observed drain rate (completions per second while it is busy), would take longer than
`max_wait_ms` to clear (or the request's own deadline, `classify.deadline_header`, when shorter) - so the request
is refused at once instead of waiting and then timing out. Once the model's service-time fit has learned from 20
answers it also refuses when that wait plus the predicted service time exceeds the class's `slo_p95_ms`. The message names the
bound it missed: `its N ms queue deadline`, `the request's own N ms deadline` (the client asked for less than the
class allows: nothing to tune here) or `its N ms SLO (predicted wait + service)`. It is the early form of
`queue_timeout`: the same causes and fixes. Turn it off per class with `early_reject: false`."""),
    Reason("queue_timeout", "Rejected (429, 499, 503)", 429, DRAIN,
           "class {cls!r} had no free slot{where} within {max_wait_ms} ms",
           """\
**429.** The request waited `max_wait_ms` in the class queue without a slot freeing up. The class's requests take
longer than its queue deadline to drain: either the queue is deeper than the drain rate allows (lower `max_queue`,
so arrivals get a fast `queue_full` instead of a slow timeout) or the cap is too low for the traffic.
When the class's cap had room and a pool-wide limit held the request, the message (also in the decision log) says
`on pool '<pool>' (...)` and why: a higher class waited for the pool (strict priority), the class was resting
after a request over its `min_share` or held to it while a higher class's latency breaker was open, the limit
was full, or `room came back without a release`: a rest or squeeze ran out (or a stalled replica's requests were
left out) after the last release, and waiters are granted only at releases ("Room a timeout leaves" in
`docs/overload.md`). Raising the cap then changes nothing: see `docs/overload.md` and the "Pool-wide limit and
priority" row of the dashboard. With `on_overflow: fallback` the same text is in the degrade's log line."""),
    Reason("client_disconnected", "Rejected (429, 499, 503)", 499, NO_RETRY,
           "client disconnected while {waiting}",
           """\
**499**, counted only: the client went away while its request was queued, so nothing reaches it (also when a slot
was granted to it in the very moment it left: that request never went upstream, so it is no `accept` and has no
`extproc_request_duration_seconds` outcome). The client's own timeout is shorter than the class's `max_wait_ms`. Lower `max_wait_ms` below typical client timeouts, or ask the
client to wait longer; many of these mean the queue only adds latency that nobody waits for."""),
    Reason("class_removed", "Rejected (429, 499, 503)", 503, DRAIN,
           "class {cls!r} was removed from the policy while this request waited",
           """\
**503.** A policy reload removed the class while this request waited in its queue. Requests already admitted under
the class finish normally (their slots are released against the old class; a reload that puts the class back while
they run counts them against its cap again). Expected once per reload that drops a class; if clients still send that
class, they now land in their tenant's default class."""),
    Reason("store_unavailable", "Rejected (429, 499, 503)", 503, DRAIN,
           (
            "the shared slot store is unreachable and the policy fails closed (store.on_failure: "
            "closed)"),
           """\
**503**, only with `store: {kind: redis, on_failure: closed}`: Redis did not answer within `store.timeout_ms`, so
no replica can know whether the class has a free slot, and the policy chose to refuse rather than guess. Check
`extproc_store_state` (alert `ExtprocStoreNotShared` after a minute) and the ext_proc log (`store state -> closed:
...`); the ext_proc probes Redis every second and switches back by itself (`store state -> shared`). With
`on_failure: local` the replicas admit against their share of each cap instead (the cap divided by
`store.instances`, and by N for each of `--workers N`)."""),
    Reason("bodies_pending", "Rejected (429, 499, 503)", 503, DRAIN,
           "the gateway already holds {held} requests whose body has not arrived (--max-pending-bodies)",
           """\
**503** with `Retry-After: 1`, before the request is classified. Each request holds an ext_proc stream (and one
of Envoy's `extproc` circuit-breaker slots) from its headers on, also while its body is still on the way. A client
that sends headers and then withholds or trickles its bodies could hold enough of them to fill the breaker, past
which Envoy stops asking the ext_proc and `failure_mode_allow` lets every request through unadmitted; this bound,
per ext_proc process, refuses new requests instead (fail closed) and keeps the breaker out of reach. Seen in normal
traffic it means thousands of uploads in flight at once: raise `extproc serve --max-pending-bodies` (keep it, times
the workers and instances, well under the breaker's 100,000), or find the client holding them (Envoy's
`downstream_cx_active`, the access log's slow requests)."""),
    Reason("higher_class_saturated", "Shed (503)", 503, DRAIN,
           "class {cls!r} is shed while class {protector!r} is saturated",
           """\
**503.** A class that protects this one (policy `shed`, by default the first class protects all others) had every
slot taken, so this class's new requests are refused and its queued ones are dropped, to leave the replicas to the
higher class: only for a pool the higher class has been sent to and that has no pool-wide limit (on a pool with
one, the limit's strict priority makes this class wait instead, and this reason never appears). Batch seeing this
during interactive peaks is the design working. If it lasts:
- interactive is at its cap most of the time: add capacity, or check that its cap is not set too low;
- a batch client that cannot tolerate it should retry after `Retry-After` (the protector's drain estimate);
- to stop shedding for a pair of classes, change `shed` (`{}` disables shedding entirely)."""),
    Reason("latency_breaker_open", "Breakers and degrade", 0, DRAIN,
           "the latency breaker of class {cls!r} is open (p95 above its SLO)",
           """\
The class's latency breaker is open: the rolling p95 of its completed requests exceeded the class SLO (with enough
samples), so new requests take the class's fallback (a smaller model, a canned response, or a fast 503) instead of
making the pool slower. It half-opens after the cooldown and lets a trickle through; one slow trickle request
re-opens it. Look at the pool's replicas (vLLM's running/waiting requests and KV-cache usage on the dashboard):
usually the cap admits more than the SLO allows, a replica is degraded, or the prompt mix shifted to long prompts.
On a pool with a pool-wide limit an open latency breaker is the last resort: while the limit can still come down
(it is over its `min`) or a lower class holds more than its `min_share`, the class's requests go on to the limit
instead (the lower classes are held to their share for a cooldown, `extproc_pool_held_to_share_seconds`, and the
limit cuts for the same latency, `extproc_pool_limit_moves_total{action="cut_latency"}`): the breaker's state then
says the class's latency is over its SLO, and no request is degraded for this reason.
Alert `ExtprocBreakerNotClosed` fires when a breaker has kept tripping for 5 minutes (open or half-open at some
point of every 3 minutes: under a persistently slow replica it closes for a few seconds between trips)."""),
    Reason("error_breaker_open", "Breakers and degrade", 0, DRAIN,
           "the error breaker of class {cls!r} is open (upstream failures)",
           """\
The class's error breaker is open: the share of 5xx, upstream resets, connect failures and lease expiries in its
window crossed the threshold. The upstream is failing, not slow: check replica health (`/health`), Envoy's cluster
stats (`upstream_rq_5xx`, `upstream_cx_connect_fail`) and the vLLM logs. Same half-open cycle and alert as above.
A replica that hangs without answering is not seen here: the route has no timeout (generation may take minutes),
so such a request ends when its client gives up, counted as a client abort; Envoy's health checks take the
replica out when `/health` stops answering too.

Either breaker reason also appears with `decision="degrade"` when the class's `fallback.action` is `degrade` or
`canned`; the response then carries `x-extproc-degraded: <what changed>; reason=<reason>`. With
`on_overflow: fallback`, `queue_full`, `queue_timeout` and `deadline_unmeetable` appear with `decision="degrade"`
too. Those are not refusals, so `ExtprocRejectionRatioHigh` stays quiet however short the class is; alert
`ExtprocDegradedRatioHigh` fires when over 10% of a class's requests got its fallback for 10 minutes (a canned
answer with a 4xx/5xx status counts as refused instead)."""),
    Reason("degraded_capacity_full", "Breakers and degrade", 503, DRAIN,
           "{why}, and its degraded capacity is full too",
           """\
**503** (breaker) or **429** (overflow). The class's fallback is `degrade`, but its degraded requests already fill
`fallback.max_concurrency` (default: the class's own cap), or the fallback pool has a pool-wide limit and no room
under it (the message names the pool). The fallback pool is protected like any other: raise that cap only if the
small model's replicas have room (watch `extproc_degraded_inflight`), or add replicas there."""),
    Reason("degraded_answer_too_large", "Breakers and degrade", 0, NO_RETRY,
           "The degraded answer is larger than the {limit} bytes the gateway turns back into the stream this "
           "request asked for; ask again without `stream`, or for less output (fewer tokens, `top_logprobs` or `n`).",
           """\
Not a refusal: the last event of an admitted stream (HTTP 200). A degrade with `fallback.stream: false` asks the
replica for one answer and sends it on as the stream the client asked for; an answer over the ext_proc's
`--max-body-bytes` (Envoy's buffer, 4 MiB by default: about 3,500 tokens with `top_logprobs: 20`), or compressed,
cannot be, so the stream ends with `data: {"error": {..., "code": "degraded_answer_too_large"}}` and `[DONE]`, which
the openai SDK raises as `APIError` (a JSON body sent on instead reads as an empty stream, without an error). The
replica's answer is lost: if it happens often, leave `stream` out of the fallback for classes that ask for long
answers with logprobs."""),
    Reason("tenant_requests_per_minute", "Budgets and rate limits (429, 413)", 429, BUCKET,
           "tenant {tenant!r} is over its requests per minute limit",
           """\
**429.** The tenant's `requests_per_minute` token bucket is empty. `Retry-After` is the time until one request's
worth refills; `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests` and `x-ratelimit-reset-requests`
say where the bucket stands (as OpenAI reports them). This is per-client fairness, separate from admission: it
fires even when the fleet is idle. A request that waits in a class queue has paid on arrival (and is refunded if it
is never admitted), so a queue never holds more of a tenant's requests than its bucket allowed. Raise the tenant's
limit or `burst_s` if the tenant is entitled to more;
`extproc check` warns when the tenants' limits add up past `fleet`."""),
    Reason("tenant_tokens_per_minute", "Budgets and rate limits (429, 413)", 429, BUCKET,
           "tenant {tenant!r} is over its tokens per minute limit",
           """\
**429.** The tenant's `tokens_per_minute` bucket cannot cover this request's prompt plus its output. A non-streamed
request is charged prompt + `max_tokens` (times `n`) up front and settled from the response's `usage` (refunded, or
the rest charged when a request without `max_tokens` outgrew `default_max_tokens`), which is read for every such
request of a tenant with this limit (one ext_proc message; an answer over `--max-body-bytes`, say `top_logprobs: 20`
at ~1.2 KB a token, or one without a Content-Length, a message per piece Envoy hands over, its usage read from its
end; a compressed answer, or one with long `prompt_logprobs` after its usage, keeps its charge). A stream's usage
costs a message per chunk, so only the sampled share (`learn_sample`) is read: other streams are charged prompt +
expected output (the model's learned output ratio times `max_tokens`) and not corrected. Headers as above, with
`-tokens`."""),
    Reason("session_inflight_budget", "Budgets and rate limits (429, 413)", 429, DRAIN,
           "this agent session is over its GPU-seconds budget (in flight)",
           """\
**429.** Requests carrying the same session id (`sessions.header`, default `x-session-id`) already hold
`sessions.max_inflight_gpu_seconds` of estimated GPU time in flight, or queued (granted, they run together): an
agent loop fanning out counts as one customer. It clears as the session's requests finish (`Retry-After`: the
class's drain estimate, like the load refusals). A single request larger than the budget
is still admitted when the session has nothing else in flight or queued. Counted in `extproc_session_rejections_total`."""),
    Reason("session_gpu_seconds_per_minute", "Budgets and rate limits (429, 413)", 429, BUCKET,
           "this agent session is over its GPU-seconds budget (per minute)",
           """\
**429.** The session's `sessions.gpu_seconds_per_minute` bucket is empty: a long-running agent loop has used its
share for now; `Retry-After` is the refill time."""),
    Reason("request_too_large", "Budgets and rate limits (429, 413)", 413, NO_RETRY,
           (
            "this request is estimated at {gpu_s:.1f} GPU-seconds ({prompt_tokens} prompt tokens, up to "
            "{max_tokens} output tokens), more than class {cls!r}'s whole budget of {budget:g}: shorten "
            "the prompt or lower {field}"),
           """\
**413.** This one request's estimated GPU-seconds exceed the class's whole `max_inflight_gpu_seconds` budget, so it
could never be admitted; it is refused at once rather than queued forever. The message gives the estimate (prompt
tokens, output tokens). Shorten the prompt, lower the output cap (`max_tokens`; chat's `max_completion_tokens`, the
Responses API's `max_output_tokens`: the message names the field the client sent, or the endpoint's own when it sent
none), or raise the budget; check the model's `cost` profile with `extproc_cost_model` if estimates look off."""),
    Reason("max_tokens_too_large", "Budgets and rate limits (429, 413)", 400, NO_RETRY,
           "{field} {max_tokens} exceeds the model's context of {context} tokens.",
           """\
**400.** The output cap (`max_tokens`; chat's `max_completion_tokens`, the Responses API's `max_output_tokens`)
exceeds the model's `cost.max_context_tokens`; vLLM would refuse it too. The message and the error's `param` name
the field the client sent."""),
    Reason("shadow", "Shadow mode", 0, NO_RETRY,
           "",
           """\
**Admitted** (`decision="accept"`, `reason="shadow"`): the policy (or the class) is in shadow mode and enforce
mode would have refused, shed or degraded this request. What it would have done is in the response header
`x-extproc-shadow: would-<decision>; reason=<reason>` and in `extproc_shadow_decisions_total{would, reason}`.
Compare those counts with the SLO before switching to `mode: enforce` (`docs/tuning.md`)."""),
    Reason("ended_while_queued", "Shadow mode", 0, NO_RETRY,
           "",
           """\
Shadow only (`extproc_shadow_decisions_total{would="queue"}`): enforce mode would still have had this request
waiting in the queue when it actually finished. Many of these mean the queue would be holding requests for about
as long as they take to serve: the class cap is tight for the load."""),
    Reason("unknown_model", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 404, NO_RETRY,
           "The model `{model}` does not exist.",
           """\
**404.** The body's `model` is neither a key of the policy's `models:` nor one of their `aliases`, nor a name the
replicas of a model with `names_from_replicas` list for it. Add the model (mapped to its Envoy cluster), or the
name to the `aliases` of the model that serves it (another `--served-model-name`, a LoRA adapter), or set
`names_from_replicas` on that model; or fix the client's model name. `GET /v1/models` lists every name the gateway
admits (`GET /v1/models/{id}` answers this 404 for the others). A LoRA adapter just loaded at runtime is admitted once a replica lists it (within the pool's
`models_interval_ms`); one listed by replicas of two pools is refused."""),
    Reason("invalid_json", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 400, NO_RETRY,
           "",
           """\
**400.** The body is not JSON, or not a JSON object. Also numbers JSON cannot hold as a double (`1e400`) and
`NaN`/`Infinity`, which are not JSON."""),
    Reason("json_too_deep", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 400, NO_RETRY,
           "The request body nests JSON deeper than {depth} levels.",
           """\
**400.** The body nests objects/arrays more than 64 levels deep (a tool's parameter schema rarely passes 20).
Deeper bodies are refused before anything walks them: they used to exhaust Python's recursion."""),
    Reason("json_too_many_containers", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 400, NO_RETRY,
           "The request body holds {count} JSON objects and arrays; at most {limit} are accepted.",
           """\
**400.** The body holds more than 20,000 JSON objects and arrays (outside strings). A real request needs a few per
message, content part or tool, so no context window holds a request that large; a body of a million empty arrays
made the ext_proc's parse take a second, past Envoy's `message_timeout`, which with `failure_mode_allow` let
requests through unadmitted. Counted on the raw bytes before the body is parsed."""),
    Reason("json_too_many_strings", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 400, NO_RETRY,
           "The request body holds {count} JSON strings; at most {limit} are accepted.",
           """\
**400.** The body holds more than 100,000 JSON strings (keys included). A chat message needs four, a content part
or a prompt of a list two or more, so no context window holds a request that large; a completions `prompt` of a
million empty strings cost the ext_proc's event loop ~180 ms, and a few such bodies a second held other clients'
requests past Envoy's `message_timeout` (`failure_mode_allow` then let them through unadmitted). Counted on the
raw bytes before the body is parsed."""),
    Reason("invalid_body", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 400, NO_RETRY,
           "",
           """\
**400.** The JSON is an object but a field admission reads is wrong; `error.param` names it: `model` missing or
not a non-empty string, the output cap vLLM obeys not a positive integer (chat's `max_completion_tokens`, or its
`max_tokens` when that is null or absent: the other need only be an integer, as vLLM only type-checks it, and is
not charged; a completions request with `echo: true` may set `max_tokens: 0`, to read its prompt's logprobs, as
vLLM allows), `stream` not a boolean, or the
class field (`classify.body_field`, default `priority`) neither a class name nor an integer, or `n` not a positive
integer (`best_of`, which vLLM 0.32 ignores, is neither read nor counted). Integers are read as vLLM's models read
them: `"8"`, `8.0` and `true` are 8, 8 and 1, and a `stream` of `"yes"` or `1` streams, one of `"false"` or `0`
does not. Also an empty body on a compute endpoint, and the bodies vLLM answers 400 before it runs anything: a chat
request whose `messages` is missing, not a list, empty, or holds an entry that is not an object with a string
`role` (nor openai_harmony's `author`), or a message whose `content` is a number, a boolean, a non-empty object, a
list holding anything but objects and strings, or null (but an assistant's or function's); a completions request
whose `prompt` is neither a string nor a list, has nothing to run (`prompt` missing, null, `""` or `[]`, and no
`prompt_embeds`), or is a list that fits none of vLLM's prompt types: strings, token ids (integers >= 0, read as
vLLM reads them: `"5"`, `5.0` and `true` are token ids), or lists of token ids, none empty (`[5, "a"]`, `[-1]`,
`[[5], []]`, `[[5], "a"]` and `[[[5]]]` are refused; `param` is `prompt` and the message names the entry); a
Responses request whose `input` is missing, neither a string nor a list, empty, or holds anything but objects; a
pooling request (when `endpoints.embeddings` is on) that none of its route's request types takes: `/v1/embeddings`
and `/classify` need `input` (a string or a list) or `messages` (a list), `/pooling` also takes `data`, `/score`
needs `queries` and `documents` (or `items`), `text_1` and `text_2`, or `data_1` and `data_2`, `/rerank` needs
`query` and `documents` (a missing field, null, a number or a boolean is refused; `param` names the field). What
a content part or an input item holds, and a token id past the vocabulary, are left for vLLM to refuse; so is
`prompt_embeds` on a server started without `--enable-prompt-embeds`, which the gateway cannot know. (A client's integer
`priority`, vLLM's scheduling priority, is accepted and removed: the policy's `classes.<name>.vllm_priority` sets
it.)"""),
    Reason("body_too_large", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 413, NO_RETRY,
           "The request body exceeds {limit} bytes.",
           """\
**413.** The body is larger than the ext_proc's `--max-body-bytes` (default 4 MiB), or than its tenant's
`max_body_bytes` (`tenants[].max_body_bytes`, `anonymous.max_body_bytes`). Bodies larger than Envoy's
`per_connection_buffer_limit_bytes` get a 413 from Envoy itself, without `x-extproc-*` headers. Keep those two
limits equal."""),
    Reason("unsupported_content_encoding", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 415, NO_RETRY,
           "Request bodies with Content-Encoding `{encoding}` are not supported; send the JSON uncompressed.",
           """\
**415.** The request carries a `Content-Encoding` other than `identity` (gzip, deflate, br, ...). Neither the
gateway nor vLLM decompresses request bodies, so a compressed body could not be read for admission and would be
refused by the replica anyway. Send it uncompressed."""),
    Reason("unsupported_media_type", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 400, NO_RETRY,
           "Unsupported Media Type: Only 'application/json' is allowed ({content_type}).",
           """\
**400.** The request's `Content-Type` is not `application/json` (parameters such as `; charset=utf-8` and any
letter case are fine), or it has none. vLLM refuses such a request with this 400 whatever its body holds, so the
gateway refuses it before admission rather than hold a slot while the replica answers it. Send
`Content-Type: application/json` (the OpenAI SDKs and `curl --json` do; `curl -d` sends
`application/x-www-form-urlencoded`)."""),
    Reason("unknown_url", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 404, NO_RETRY,
           "Invalid URL ({method} {path}).",
           """\
**404.** The path is not one the gateway serves: Envoy's default route answers it (`x-extproc-*` headers absent)
without reaching a replica. Served paths: vLLM's compute endpoints (through admission), `GET /v1/models` and
`/v1/models/{id}` (answered by the ext_proc), `/health`, `/ping`, `/version` (docs/envoy-integration.md §3). Case and trailing slashes matter, as in vLLM."""),
    Reason("method_not_allowed", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 405, NO_RETRY,
           "{path} takes POST, not {method}.",
           """\
**405.** A compute endpoint called with another method than POST."""),
    Reason("connect_not_supported", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 405, NO_RETRY,
           (
            "CONNECT {target} is not served: this gateway is an HTTP API (POST to vLLM's endpoints, GET "
            "/v1/models), not a proxy for tunnels."),
           """\
**405.** A `CONNECT` request (a tunnel to its authority, usually with no path): the gateway serves no tunnels.
The shipped envoy.yaml enables no upgrades, so Envoy refuses a CONNECT itself (403 `upgrade_failed`) before the
ext_proc sees it; this answer comes from a config whose `upgrade_configs` let CONNECT through. Point the client at
the gateway as its API base URL, not as its HTTP proxy."""),
    Reason("unsupported_endpoint", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 404, NO_RETRY,
           (
            "{path} is not served here: the gateway's policy does not admit `{group}` requests (policy "
            "`endpoints`)."),
           """\
**404.** A vLLM compute endpoint whose group the policy's `endpoints` switches off (embeddings and tokenize are off
by default; audio is always refused, its uploads cannot be costed). Switch the group on if the replicas should
serve it; the request never reached one."""),
    Reason("missing_api_key", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 401, NO_RETRY,
           (
            "You didn't provide an API key. Send it as `Authorization: Bearer <key>` (or `api-key: "
            "<key>`)."),
           """\
**401.** `anonymous.allow: false` and the request has no key in `Authorization: Bearer <key>` or `api-key`.
Other Authorization schemes (Basic, ...) carry no key for us."""),
    Reason("invalid_api_key", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 401, NO_RETRY,
           "Incorrect API key provided.",
           """\
**401.** `anonymous.allow: false` and the key belongs to no tenant. The key is never echoed or logged."""),
    Reason("conflicting_api_keys", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 401, NO_RETRY,
           (
            "The request presents more than one API key (several Authorization or api-key headers): "
            "send exactly one."),
           """\
**401.** The request carries two different keys (two `Authorization` headers, which Envoy joins with a comma, or a
Bearer key and a different `api-key`). Send one."""),
    Reason("request_not_sent", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 500, NO_RETRY,
           (
            "The gateway is configured not to show this request's {part} to the admission service "
            "({setting}), so it cannot be admitted; it was not forwarded. Report it to the gateway's operator."),
           """\
**500.** Envoy's ext_proc filter, on this route, does not send the request headers and the whole buffered body
(a route's `typed_per_filter_config` that overrides `processing_mode`, or the filter's own mode): the ext_proc
decides on both, and without them the request would reach a replica unadmitted. Fix the route or the filter
(`request_header_mode: SEND`, `request_body_mode: BUFFERED`; `extproc check --envoy` flags it). The answer carries
`x-should-retry: false`: every retry would get the same, and the OpenAI SDKs retry a 500 twice unless told not to."""),
    Reason("admission_error", "Invalid requests (400, 401, 404, 405, 413, 415, 500)", 500, NO_RETRY,
           (
            "The admission service failed on this request; it was not forwarded. Retrying may help; "
            "report it if it persists."),
           """\
**500.** The ext_proc failed on this request before deciding it (a bug; `extproc_stream_errors_total` counts it).
The request was refused, not passed on unadmitted. Report it with the traceback from the log."""),
)}
# The codes, for code that names one (each is a key of REASONS).
R_SLOT_FREE = "slot_free"
R_DEQUEUED = "dequeued"
R_CLASS_FULL = "class_full"
R_QUEUE_FULL = "queue_full"
R_DEADLINE = "deadline_unmeetable"
R_QUEUE_TIMEOUT = "queue_timeout"
R_CLIENT_GONE = "client_disconnected"
R_CLASS_REMOVED = "class_removed"
R_STORE_UNAVAILABLE = "store_unavailable"
R_HIGHER_SATURATED = "higher_class_saturated"
R_BODIES_PENDING = "bodies_pending"
R_LATENCY_BREAKER = "latency_breaker_open"
R_ERROR_BREAKER = "error_breaker_open"
R_DEGRADED_FULL = "degraded_capacity_full"
R_DEGRADED_TOO_LARGE = "degraded_answer_too_large"
R_TENANT_REQUESTS = "tenant_requests_per_minute"
R_TENANT_TOKENS = "tenant_tokens_per_minute"
R_SESSION_INFLIGHT = "session_inflight_budget"
R_SESSION_RATE = "session_gpu_seconds_per_minute"
R_TOO_LARGE = "request_too_large"
R_MAX_TOKENS = "max_tokens_too_large"
R_SHADOW = "shadow"
R_ENDED_WHILE_QUEUED = "ended_while_queued"
R_UNKNOWN_MODEL = "unknown_model"
R_MISSING_KEY = "missing_api_key"
R_INVALID_KEY = "invalid_api_key"
R_CONFLICTING_KEYS = "conflicting_api_keys"
R_INVALID_JSON = "invalid_json"
R_JSON_TOO_DEEP = "json_too_deep"
R_JSON_TOO_MANY = "json_too_many_containers"
R_JSON_TOO_MANY_STRINGS = "json_too_many_strings"
R_INVALID_BODY = "invalid_body"
R_BODY_TOO_LARGE = "body_too_large"
R_UNKNOWN_URL = "unknown_url"
R_UNSUPPORTED_ENCODING = "unsupported_content_encoding"
R_UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
R_METHOD_NOT_ALLOWED = "method_not_allowed"
R_CONNECT = "connect_not_supported"
R_UNSUPPORTED_ENDPOINT = "unsupported_endpoint"
R_ADMISSION_ERROR = "admission_error"
R_REQUEST_NOT_SENT = "request_not_sent"


_TEMPLATES = {code: r.message.format for code, r in REASONS.items()}


def say(code: str, **fields) -> str:
    """The message of a refusal for `code`, its template filled in."""
    return _TEMPLATES[code](**fields)


# OpenAI's error `type` by status (vLLM uses the same shapes).
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               499: "client_closed_request", 500: "server_error", 503: "service_unavailable_error"}


def error_type(status: int) -> str:
    """Any other 4xx is the client's to fix, any other 5xx ours (a canned fallback may use any status; a 415 was
    typed `api_error`, OpenAI's type for its own failures)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    if 400 <= status < 500:
        return "invalid_request_error"
    return "server_error" if status >= 500 else "api_error"
