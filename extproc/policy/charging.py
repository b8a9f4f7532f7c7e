"""Who pays for a request: its tenant's rate limits, its agent session's budgets and its class's GPU-seconds budget.

A request is checked against them at arrival (refusal), charged when admitted (admitted) or, if it queues, when it
queues (prepay: checked only at arrival and charged only at admission, a burst queued ahead of its tenant's limit
and was served in full), given back what it prepaid if it is never admitted (refund), charged less when a degrade
clamps its output (clamp), and released when it ends (released). Capacity (slots, queues, pool limits) is
AdmissionController's; this is money.
"""

from __future__ import annotations

import math

from .classify import Classification
from .decision import REJECT, AdmissionEvents, Charge, Decision, Refusal
from .limits import ClassLimiter
from .reasons import (R_SESSION_INFLIGHT, R_SESSION_RATE, R_TENANT_REQUESTS, R_TENANT_TOKENS, R_TOO_LARGE,
                      say)
from .state import PolicyState


class Charging:
    """The budgets of the running policy (read from `state` at each call: a reload replaces them)."""

    def __init__(self, state: PolicyState, events: AdmissionEvents):
        self.state = state
        self.events = events

    def refusal(self, c: Classification, lim: ClassLimiter, cluster: str, now: float,
                charge: Charge, field: str = "max_tokens") -> Decision | None:
        """The refusal of a request its budgets cannot pay for now (None: they can): per-tenant rate limits,
        session budgets and the class's GPU-seconds budget. Who pays, not capacity. `field` is the body field of
        the request's output cap, as the client sent it."""
        est = charge.estimate

        def refuse(status: int, reason: str, wait_s: float, **fields) -> Decision:
            # A bucket knows exactly when it will hold the request: say so, uncapped, or a client that obeys
            # Retry-After is refused again. 0 for a request no wait can admit (413).
            retry = max(1, math.ceil(wait_s)) if math.isfinite(wait_s) else 0
            message = say(reason, **fields) + (f"; retry in {retry} s" if retry else "")
            return Refusal(REJECT, reason, c.cls, c.tenant, status, message, retry, classification=c,
                           cluster=cluster)

        if charge.tenant is not None:
            which, wait = charge.tenant.check(charge.tokens, now)
            self.events.rate_limit_checked(c.tenant, which)
            if which is not None:
                reason = R_TENANT_REQUESTS if which == "requests" else R_TENANT_TOKENS
                if charge.session is not None:  # then its session's bucket must hold it too
                    wait = max(wait, self.state.sessions.rate_wait(charge.session, est.gpu_seconds, now))
                return refuse(429, reason, wait, tenant=c.tenant)
        if charge.session is not None:
            which, wait = self.state.sessions.check(charge.session, est.gpu_seconds, now)
            if which is not None:
                reason = R_SESSION_INFLIGHT if which == "session_inflight" else R_SESSION_RATE
                self.events.session_refused(c.tenant, reason)
                if which == "session_inflight":  # frees when one of its requests ends: unknown, so a guess
                    wait = float(lim.retry_after_s(now, self.state.policy.retry_after_max_s))
                return refuse(429, reason, wait)
        budget = lim.spec.max_inflight_gpu_seconds
        if budget is not None and est.gpu_seconds > budget:
            return refuse(413, R_TOO_LARGE, math.inf, gpu_s=est.gpu_seconds, prompt_tokens=est.prompt_tokens,
                          max_tokens=est.max_tokens, cls=c.cls, budget=budget, field=field)
        return None

    def admitted(self, charge: Charge, cost: float, now: float) -> None:
        """The request runs: its tenant's tokens and its session's budgets are charged (the per-minute parts
        already, if it prepaid them while queued)."""
        if charge.tenant is not None and not charge.prepaid:
            charge.tokens = charge.tenant.charge(charge.tokens, now)
        if charge.session is not None:
            if charge.prepaid:  # it was queued: it runs now
                self.state.sessions.dequeue(charge.session, charge.queued_gpu_s)
            taken = self.state.sessions.charge(charge.session, cost, now, rate=not charge.prepaid)
            if not charge.prepaid:
                charge.session_gpu_s = taken

    def prepay(self, charge: Charge, now: float) -> None:
        """A queued request takes its share of the tenant's and the session's per-minute budgets now."""
        if charge.tenant is not None:
            charge.tokens = charge.tenant.charge(charge.tokens, now)
        if charge.session is not None:
            charge.session_gpu_s = self.state.sessions.charge_rate(charge.session, charge.estimate.gpu_seconds, now)
            charge.queued_gpu_s = charge.estimate.gpu_seconds
            self.state.sessions.enqueue(charge.session, charge.queued_gpu_s)
        charge.prepaid = True

    def refund(self, charge: Charge | None) -> None:
        """A queued request that was never admitted gives back what it prepaid."""
        if charge is not None and charge.prepaid:
            if charge.session is not None:
                self.state.sessions.dequeue(charge.session, charge.queued_gpu_s)
            self._give_back(charge)

    def _give_back(self, charge: Charge) -> None:
        """Everything the request was charged (a request, its tokens, its session's rate); it is charged anew if a
        fallback then admits it."""
        charge.prepaid = False
        if charge.tenant is not None:
            charge.tenant.refund(charge.tokens)
            charge.tokens = charge.tokens_for(charge.estimate)  # charged anew in full, not what was last taken
        if charge.session is not None:
            # What it paid, not its estimate: a reload that gave the session a per-minute bucket after the request
            # was charged (none taken) had it refunded GPU-seconds it never paid.
            self.state.sessions.refund_rate(charge.session, charge.session_gpu_s)
            charge.session_gpu_s = 0.0

    def clamp(self, charge: Charge, max_tokens: int) -> None:
        """A degrade that clamps max_tokens: charge (tenant tokens, GPU-seconds) the output the request can still
        get, not what it asked for. An unsampled stream's charge is never corrected from usage, so its tenant paid
        for tokens the gateway itself cut. What a queued request prepaid for the difference is given back."""
        est = charge.estimate
        model = self.state.cost_models.get(charge.model)  # None: a reload removed (or renamed) it while it queued
        if model is None or not est.max_tokens or est.max_tokens <= max_tokens * est.sequences:
            return
        clamped = model.estimate(est.prompt_tokens, max_tokens, est.sequences, prompts=est.prompts,
                                 min_output=est.min_output)
        tokens = charge.tokens_for(clamped)
        if charge.prepaid:
            if charge.tenant is not None:
                charge.tenant.correct(charge.tokens, min(tokens, charge.tokens))
            if charge.session is not None:
                back = min(max(est.gpu_seconds - clamped.gpu_seconds, 0.0), charge.session_gpu_s)
                self.state.sessions.refund_rate(charge.session, back)
                charge.session_gpu_s -= back
        charge.estimate, charge.tokens = clamped, min(tokens, charge.tokens)

    def released(self, charge: Charge, cost: float, ran: bool) -> None:
        """The request's slot is given back: its session's in-flight budget too, and a request that never ran (its
        admission was revoked) gets back what it was charged."""
        if charge.session is not None:
            self.state.sessions.release(charge.session, cost)
        if not ran:
            # All it was charged (when queued or when admitted) goes back, as for a waiter never admitted, so a
            # fallback that then admits it (a revoke's degrade) charges it anew. With its tokens alone given back, a
            # prepaid one's clamp refunded the clamped part twice, and one admitted at once paid two requests.
            self._give_back(charge)
