"""What the core learns when an admitted request has ended: one completion event, fed to each listener."""

from __future__ import annotations

import math
from typing import Protocol

from .breakers import LatencyBreaker
from .limits import Completion, Outcome, StaticLimit, Ticket


class Completed:
    """One admitted request, ended and accounted: how it ended and how long it took."""

    __slots__ = ("ticket", "outcome", "report", "status", "latency_s", "now", "served", "speaks_for_its_pool")

    def __init__(self, ticket: Ticket, outcome: Outcome, report: Completion | None, latency_s: float, now: float,
                 class_exists: bool):
        self.ticket = ticket
        self.outcome = outcome
        self.report = report          # the data plane's account, when it arrived
        # The response's status: the report's, else what the stream read (without Envoy's access log the
        # response headers of the answers read for their usage), else 0.
        self.status = report.status if report is not None else ticket.stream_status
        self.latency_s = latency_s    # arrival to end, queueing included
        self.now = now
        # It ran to its end (a complete answer, or an end the stream saw as normal).
        self.served = outcome is Outcome.OK or outcome is Outcome.ENDED
        # Served by the class's own pool under a class that still exists (a reload may have removed it): its
        # latency and errors are evidence about that pool; a degraded request ran elsewhere. Not one the replica
        # refused with a 4xx (vLLM's 400 for a prompt past its context, a body it cannot run): answered in a few
        # milliseconds before anything ran, a client's many such answers read as a fast, healthy pool and hid one
        # that missed its SLO or failed every generation.
        self.speaks_for_its_pool = not ticket.degraded and class_exists and not 400 <= self.status < 500


class OutcomeListener(Protocol):
    def completed(self, c: Completed) -> None: ...


LEARN, REFUND = "learn", "refund"


class UsageSample:
    """Which responses are read for their token usage: a deterministic `learn_sample` share for cost learning
    (every request counts towards it, refused ones too, as each is decided), else those of a tenant whose
    tokens-per-minute bucket is refunded from the real count. One per process: the ext_proc reads what it picks,
    the what-if hands the same share's usage to its core."""

    __slots__ = ("_credit",)

    def __init__(self) -> None:
        self._credit = 0.0

    def pick(self, core, api_key: str | None) -> str | None:
        """LEARN, REFUND or None (not read), for the request about to be decided."""
        self._credit += core.policy.learn_sample
        if self._credit >= 1.0:
            self._credit -= 1.0
            return LEARN
        return REFUND if core.reads_usage(api_key) else None


def reads_answer(learn: bool, stream: bool) -> bool:
    """Whether a picked request's answer is read for its usage: a learning sample always, a refund-only pick
    (UsageSample.pick's REFUND) only when not streamed (a stream's usage costs an ext_proc message a chunk)."""
    return learn or not stream


class CostLearning:
    """Real usage corrects the model's cost coefficients and refunds (or charges) the tenant's token bucket."""

    def __init__(self, state, events):
        self.state = state
        self.events = events

    def completed(self, c: Completed) -> None:
        t = c.ticket
        if t.usage is None:
            if t.holds_slot and (400 <= c.status < 500 or c.outcome is Outcome.NOT_ROUTED):
                self._refund_refused(c)
            elif t.charge is not None:
                self._settle_unread(c)
            if t.charge is not None:
                self._settle_without_usage(c)
            return
        if t.charge is None:
            return
        charge, (prompt, completion) = t.charge, t.usage
        model = self.state.cost_models.get(charge.model)
        if model is not None:  # None: a reload removed its model; nothing to teach, but the tenant is still settled
            self._learn(c, model, prompt, completion)
        if charge.tenant is not None and t.holds_slot:
            charge.tenant.correct(charge.tokens, prompt + completion)

    def _learn(self, c: Completed, model, prompt: int, completion: int) -> None:
        """What the real usage teaches: the metrics, the fair queue's charge and the cost model."""
        t, charge = c.ticket, c.ticket.charge
        est = charge.estimate
        actual = model.actual(prompt, completion, est.sequences, est.prompts)
        self.events.cost_observed(t, est.gpu_seconds, actual)
        if t.holds_slot and not t.degraded:  # the fair queue charged its flow the scaled estimate: correct it
            t.limiter.queue.settle(t.flow, t.fair_charge, actual, t.fair_flow, t.fair_stats)
            t.limiter.queue.teach(t.flow, model.repriced(est), actual)
        r = c.report
        service = (r.total_s - t.waited_s) if r is not None and r.total_s else t.released_at - t.admitted_at
        if not t.degraded:
            # A degraded answer came clamped to the fallback's max_tokens, or from another model: its length says
            # nothing about how the requested model answers, and learning it drove that model's output ratio
            # down under overload (when degrades are many), making its estimates too low just when they matter.
            model.learn(est, prompt, completion, service)

    @staticmethod
    def _refund_refused(c: Completed) -> None:
        """Refused before anything ran (the replica's 4xx: vLLM's 400 for max_tokens past its context; or Envoy
        answered without a replica): the fair queue's charge goes back. Kept, one request of max_tokens 2^31
        (about 2e6 GPU-seconds at the estimate) put its tenant behind every other tenant of a `fair` class for as
        long as they had requests waiting (a hostile-client audit). A 5xx or a reset stays charged here: the
        engine may have run it, and a flow whose requests fail late must not be granted first for it. (The
        budgets, which are what the client pays, are refunded for those too: _settle_without_usage.)"""
        t = c.ticket
        t.limiter.queue.settle(t.flow, t.fair_charge, 0.0, t.fair_flow, t.fair_stats)

    def _settle_unread(self, c: Completed) -> None:
        """A fair queue's answer whose usage was not read: while its flow has learned no scale, what it was charged
        is kept, to be charged again at the first scale the flow learns (FairQueue.settle_unread)."""
        t = c.ticket
        q = t.limiter.queue
        if not t.holds_slot or t.degraded or c.outcome is not Outcome.OK or q.mode != "fair" or q.has_scale(t.flow):
            return  # the common case: the flow has its scale, and its answer stays as charged (no repricing)
        model = self.state.cost_models.get(t.charge.model)
        if model is not None:
            q.settle_unread(t.flow, t.fair_charge, model.repriced(t.charge.estimate), t.fair_flow, t.fair_stats)

    def _settle_without_usage(self, c: Completed) -> None:
        """A tokens-per-minute tenant is charged the worst case up front and refunded from the usage it reads. With
        no usage to read, the worst case stood: a request the replica refused (max_tokens past its context: a 400)
        cost the tenant its whole bucket. Refused, or failed before the replica answered: nothing to charge, to
        the tenant or to its session's GPU-seconds per minute. Ended early, by the client or after the replica's
        2xx: the expected output, not the worst case (a client that stops reading a large answer is cut by Envoy's
        stream_idle_timeout, reported like a replica that failed mid-answer, and a full refund made such answers
        free)."""
        t, charge = c.ticket, c.ticket.charge
        if not t.holds_slot:
            return
        est = charge.estimate
        status = c.status
        if status >= 400 or (c.outcome is Outcome.UPSTREAM_ERROR and not 200 <= status < 300):
            if charge.tenant is not None:
                charge.tenant.correct(charge.tokens, 0)
            if charge.session is not None:  # its GPU-seconds per minute too: one refused request took them all
                self.state.sessions.refund_rate(charge.session, charge.session_gpu_s)
                charge.session_gpu_s = 0.0
        elif c.outcome in _ENDED_EARLY and charge.tenant is not None:
            charge.tenant.correct(charge.tokens, min(charge.tokens, est.prompt_tokens + math.ceil(est.expected_output)))


# Ended before the answer did, by the client, the replica or the ext_proc, with no usage read: the expected output.
_ENDED_EARLY = (Outcome.CLIENT_ABORT, Outcome.UPSTREAM_ERROR, Outcome.EXTPROC_ERROR)
# Ended by the ext_proc's own failure, or answered by Envoy itself without a replica (no such cluster, no route).
_NOT_THE_POOLS = (Outcome.EXTPROC_ERROR, Outcome.NOT_ROUTED)


class PoolLearning:
    """What a request says about its class's pool: the class's limit algorithm sees the latency of requests served
    to the end; its breakers see the latency (latency breaker) and whether it failed (error breaker)."""

    def __init__(self, state):
        self.pool_breakers = state.pool_breakers

    def completed(self, c: Completed) -> None:
        if not c.speaks_for_its_pool or c.outcome in _NOT_THE_POOLS:
            return  # the time to it and the error say nothing of the pool
        t, outcome = c.ticket, c.outcome
        limit = t.limiter.controller
        # The limits steer on the pool's service time: our own queueing is not the pool's, and a limit that read
        # it cut itself for the wait its own cut made longer (issue 20 (1)).
        service_s = c.latency_s - t.waited_s
        if c.served and type(limit) is not StaticLimit:  # a static cap learns nothing
            limit.observe(c.now, service_s, t.admitted_at)
        if c.served and t.gate is not None:
            t.gate.controller.observe(t.rank, t.admitted_at, c.now, service_s)
        for b in self.pool_breakers(t.cls, t.pool):
            if isinstance(b, LatencyBreaker):
                # An aborted request's duration is a lower bound: it only counts once it is already too slow.
                if c.served or c.latency_s > b.slo_s:
                    b.observe(c.now, c.latency_s, t.trickle)
            elif outcome is not Outcome.CLIENT_ABORT:
                b.observe(c.now, outcome is Outcome.UPSTREAM_ERROR or outcome is Outcome.LEASE_EXPIRED, t.trickle)
