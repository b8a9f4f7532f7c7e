"""The core's vocabulary: request facts in, decisions out, and what it tells the outside world."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from .breakers import Breaker
from .classify import Classification
from .cost import CostEstimate
from .limits import Outcome, Ticket, Waiter
from .ratelimit import Session, TenantLimits
from .schema import FallbackSpec

# Decision kinds
ACCEPT, QUEUE, REJECT, SHED, DEGRADE, INVALID = "accept", "queue", "reject", "shed", "degrade", "invalid"


@dataclass(slots=True)
class RequestFacts:
    """What the adapter read off the request; no policy in here."""

    api_key: str | None = None
    header_class: str | None = None
    body_class: str | None = None
    model: str | None = None
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"  # the body field that set it (max_completion_tokens, max_output_tokens)
    stream: bool = False
    request_id: str = ""
    session_id: str | None = None
    doc: dict | None = None      # the parsed JSON body, for the prompt-size estimate
    sequences: int = 1           # outputs generated (n; times the prompts of a completions list)
    prompts: int = 1             # prompts in a completions list, each run in a context of its own
    min_output: int | None = 0   # output tokens each sequence produces at least (min_tokens); None: all of its
                                 # cap (ignore_eos)
    prompt_cap: int | None = None  # tokens the replica keeps of each prompt (truncate_prompt_tokens; -1: its
                                   # context)
    generates: bool = True       # False: a prefill-only endpoint (embeddings, score, ...): no output tokens, and
                                 # no `degrade` fallback (another model's vectors are not an answer)
    cannable: bool = True        # a `canned` fallback can answer it (chat and completions shapes)
    reads_usage: bool = False    # its real usage will be read from the response (then refunded exactly)
    objective: str | None = None     # the policy's objective header (Gateway API: x-gateway-inference-objective)
    fairness_id: str | None = None   # the policy's fairness header (x-gateway-inference-fairness-id)
    deadline_ms: float | None = None  # the policy's deadline header: its own max wait, from arrival


class Charge:
    """What one request is estimated to cost, and whom it is charged to; settled once when it ends."""

    __slots__ = ("model", "estimate", "tenant", "session", "request_id", "tokens", "fallbacks", "prepaid",
                 "reads_usage", "alias", "session_gpu_s", "queued_gpu_s", "streams")

    def __init__(self, model: str, estimate: CostEstimate, tenant: TenantLimits | None, session: Session | None,
                 request_id: str = "", reads_usage: bool = True):
        self.model = model
        self.request_id = request_id
        self.estimate = estimate
        self.tenant = tenant
        self.session = session
        # Tokens a tokens-per-minute limit charges up front: the worst case when real usage will be read and
        # refunded, else the expected output (a request whose usage is never read is never corrected).
        self.reads_usage = reads_usage
        self.tokens = self.tokens_for(estimate)
        self.fallbacks = ("reject", "degrade", "canned")  # the fallback actions this request's endpoint allows
        # A chat or completions stream: the only request a degrade's `stream: false` changes (a Responses API
        # stream keeps streaming, server/openai.degrade_body). True unless the request says otherwise.
        self.streams = True
        # Taken from the tenant's and the session's per-minute buckets when it was queued: a queue must not hold
        # more of a tenant's requests than its rate allows (given back if it is never admitted).
        self.prepaid = False
        self.alias: str | None = None  # the name the client sent, when it is another name of `model`
        # GPU-seconds taken from its session's per-minute bucket: what a refund gives back (none without a bucket).
        self.session_gpu_s = 0.0
        self.queued_gpu_s = 0.0  # what it counts in its session's queued GPU-seconds while it waits


    def tokens_for(self, estimate: CostEstimate) -> int:
        return estimate.tokens if self.reads_usage else estimate.prompt_tokens + math.ceil(estimate.expected_output)


class Decision:
    """What every decision says. Its kind is its type: Admit, Degrade (admitted on a fallback), Queued, Refusal,
    Canned. A type's own fields exist only on it; on the others they read as nothing (None, 0, "") so a consumer
    that logs any decision can ask for them."""

    __slots__ = ("reason", "cls", "tenant", "classification", "cluster", "waited_s", "headers", "charge",
                 "request_id")
    kind = ""
    ticket: Ticket | None = None
    waiter: Waiter | None = None
    status = 200
    retry_after = 0
    message = ""
    fallback: FallbackSpec | None = None
    shadow_would: Decision | None = None

    def __init__(self, reason: str, cls: str, tenant: str, cluster: str | None = None,
                 classification: Classification | None = None, waited_s: float = 0.0):
        self.reason = reason
        self.cls = cls
        self.tenant = tenant
        self.classification = classification
        self.cluster = cluster                    # the pool it goes (or would have gone) to
        self.waited_s = waited_s
        self.headers: list[tuple[str, str]] = []  # extra response headers (x-ratelimit-*)
        self.charge: Charge | None = None         # what the request was estimated to cost (for logs)
        self.request_id = ""                      # the client's x-request-id, for decisions made before a charge

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}, {self.reason}, cls={self.cls}, status={self.status})"


class Admit(Decision):
    """Admitted: the ticket holds its slot until the request ends."""

    __slots__ = ("ticket", "shadow_would")
    kind = ACCEPT

    def __init__(self, reason: str, cls: str, tenant: str, ticket: Ticket, cluster: str | None = None,
                 classification: Classification | None = None, waited_s: float = 0.0):
        Decision.__init__(self, reason, cls, tenant, cluster, classification, waited_s)
        self.ticket = ticket
        self.shadow_would = None  # shadow mode: the decision enforce mode would have made


class Degrade(Admit):
    """Admitted on the class's fallback: another pool and/or a changed body (model, max_tokens, stream)."""

    __slots__ = ("fallback", "message", "context_tokens")
    kind = DEGRADE

    def __init__(self, reason: str, cls: str, tenant: str, ticket: Ticket, fallback: FallbackSpec, message: str,
                 cluster: str | None = None,
                 classification: Classification | None = None, waited_s: float = 0.0,
                 context_tokens: int | None = None):
        Admit.__init__(self, reason, cls, tenant, ticket, cluster, classification, waited_s)
        self.fallback = fallback
        self.message = message    # why it was degraded
        self.context_tokens = context_tokens  # the fallback model's context (its max_context_tokens), if known


class Queued(Decision):
    """Waiting in the class queue; the waiter gets the final decision."""

    __slots__ = ("waiter",)
    kind = QUEUE

    def __init__(self, reason: str, cls: str, tenant: str, waiter: Waiter, cluster: str | None = None,
                 classification: Classification | None = None, waited_s: float = 0.0):
        Decision.__init__(self, reason, cls, tenant, cluster, classification, waited_s)
        self.waiter = waiter


class Refusal(Decision):
    """Refused (reject, shed, invalid): an OpenAI-style error with its status and, for 429/503, Retry-After."""

    __slots__ = ("kind", "status", "retry_after", "message", "param")

    def __init__(self, kind: str, reason: str, cls: str, tenant: str, status: int, message: str,
                 retry_after: int = 0, cluster: str | None = None,
                 classification: Classification | None = None, waited_s: float = 0.0, param: str | None = None):
        Decision.__init__(self, reason, cls, tenant, cluster, classification, waited_s)
        self.kind = kind
        self.status = status
        self.retry_after = retry_after
        self.message = message
        self.param = param  # the body field the error is about (the error's `param`), if one is


class Canned(Decision):
    """Answered at once with the class's canned fallback (an OpenAI-shaped reply, or an error with its status)."""

    __slots__ = ("fallback", "status", "retry_after", "message")
    kind = DEGRADE

    def __init__(self, reason: str, cls: str, tenant: str, fallback: FallbackSpec, retry_after: int = 0,
                 cluster: str | None = None,
                 classification: Classification | None = None, waited_s: float = 0.0):
        Decision.__init__(self, reason, cls, tenant, cluster, classification, waited_s)
        self.fallback = fallback
        self.status = fallback.status
        self.message = fallback.message
        self.retry_after = retry_after


class AdmissionEvents(Protocol):
    """What the core tells the outside world (metrics, logs). Implementations must be cheap and never raise."""

    def decided(self, decision: Decision) -> None: ...
    # A request started waiting: in its class queue (a Waiter), or for a shared store's global slot (its Ticket).
    def queued(self, waiter: Waiter | Ticket) -> None: ...
    # An admitted request was accounted; `latency_s`: request start to end as the client saw it.
    def finished(self, ticket: Ticket, outcome: Outcome, latency_s: float) -> None: ...
    def shadow(self, cls: str, would: str, reason: str) -> None: ...
    # A class's breaker on a pool was created (on the class's first request to the pool), closed.
    def breaker_created(self, cls: str, pool: str, breaker: Breaker) -> None: ...
    def breaker_changed(self, cls: str, pool: str, breaker: Breaker, state: str) -> None: ...
    def cost_observed(self, ticket: Ticket, estimated_s: float, actual_s: float) -> None: ...
    def first_token(self, ticket: Ticket, seconds: float) -> None: ...
    # A tenant rate-limit check: `exceeded` is the limit it is over ("requests" or "tokens"), None if it fits.
    def rate_limit_checked(self, tenant: str, exceeded: str | None) -> None: ...
    def session_refused(self, tenant: str, reason: str) -> None: ...
    # A latency breaker of `cls` on `pool` would have degraded it; the classes below gave way instead.
    def pool_yielded(self, pool: str, cls: str) -> None: ...
    # A pool-wide limit moved (`action`: PoolLimit.last_action) from `before` to `after`, with `inflight` held;
    # a cut was sized on `sized_on` (PoolLimit.sized_on: for a latency cut, the in-flight averaged over the window).
    def pool_limit_moved(self, pool: str, action: str, before: float, after: float, sized_on: float,
                         inflight: float) -> None: ...


class NoEvents:
    def decided(self, decision: Decision) -> None:
        pass

    def queued(self, waiter: Waiter | Ticket) -> None:
        pass

    def finished(self, ticket: Ticket, outcome: Outcome, latency_s: float) -> None:
        pass

    def shadow(self, cls: str, would: str, reason: str) -> None:
        pass

    def breaker_created(self, cls: str, pool: str, breaker: Breaker) -> None:
        pass

    def breaker_changed(self, cls: str, pool: str, breaker: Breaker, state: str) -> None:
        pass

    def cost_observed(self, ticket: Ticket, estimated_s: float, actual_s: float) -> None:
        pass

    def first_token(self, ticket: Ticket, seconds: float) -> None:
        pass

    def rate_limit_checked(self, tenant: str, exceeded: str | None) -> None:
        pass

    def session_refused(self, tenant: str, reason: str) -> None:
        pass

    def pool_yielded(self, pool: str, cls: str) -> None:
        pass

    def pool_limit_moved(self, pool: str, action: str, before: float, after: float, sized_on: float,
                         inflight: float) -> None:
        pass
