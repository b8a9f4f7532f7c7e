"""A class's fallback for a request its pool cannot take now (a breaker open, or overflow): a canned answer, a
degrade (a smaller model's pool, clamped max_tokens, no streaming: a cheaper answer, held to the degraded cap and
to the target pool's limit like any request of the class), or the refusal, which says why the fallback could not
serve it. Like ShadowMode, it reads the running policy from the controller it serves.
"""

from __future__ import annotations

import math

from .classify import Classification
from .decision import REJECT, Canned, Charge, Decision, Degrade, Refusal
from .limits import ClassLimiter
from .reasons import R_DEGRADED_FULL, say


class Fallbacks:
    """The fallback step of AdmissionController's pipeline."""

    def __init__(self, core):
        self.core = core

    def answer(self, lim: ClassLimiter, cls: str, tenant: str, cluster: str, reason: str, now: float,
               overflow: bool, c: Classification | None = None, waited_s: float = 0.0,
               charge: Charge | None = None, held: str = "", why: str = "", closed_in: float = 0.0,
               max_wait_ms: int | None = None) -> Decision:
        """The class's fallback for a request its pool cannot take now (breaker open, or overflow; `held`: what
        of the pool's limit held a waiter, see AdmissionController._pool_hold; `why`: the refusal's message, when
        already said; `closed_in`: seconds until the open breaker that refused it half-opens; `max_wait_ms`: the
        wait a queued request had, when its own deadline made it shorter than the class's)."""
        core, fb = self.core, lim.spec.fallback
        allowed = charge is None or fb.action in charge.fallbacks
        why = why or say(reason, cls=cls, max_wait_ms=max_wait_ms or lim.spec.max_wait_ms, queued=len(lim.queue),
                         where=on_pool(cluster, held), detail=f"{lim.inflight} running, queue full")
        if fb.action == "canned" and allowed:
            retry = self._retry_after(lim, now, closed_in) if fb.status in (429, 503) else 0
            return Canned(reason, cls, tenant, fb, retry, classification=c, cluster=cluster, waited_s=waited_s)
        if fb.action != "reject" and not allowed:
            why += f" (its `{fb.action}` fallback cannot serve this request)"
        target = core.clusters[fb.model] if fb.model else cluster
        if fb.action == "degrade" and allowed and target == cluster and not self._changes(fb, charge):
            # A degrade that would send the request unchanged to the pool that just had no room, counted as
            # degraded: a request for the fallback's own model (the small model's customers in a class that
            # degrades to it), or one already within the fallback's max_tokens (scenarios/code-completion.yaml:
            # a quarter of the requests asked for the 16 tokens its degrade clamps to).
            allowed = False
            why += f" (its degrade fallback {self._unchanged(fb)})"
        if fb.action == "degrade" and allowed and not self._fits_context(fb.model, charge):
            # vLLM answers a prompt its context cannot hold with a 400: a retry later on the requested model is
            # the answer that can still succeed.
            allowed = False
            why += f" (its prompt does not fit the degrade model {fb.model}'s context)"
        if fb.action == "degrade" and allowed:
            deg = core.degraded[cls]
            # A degrade onto a pool with a limit (its own pool with fewer tokens, or another) weighs on that
            # limit like any request of its class: it is a cheaper answer, not a way around the pool's limit.
            gate = core.gates.get(target) if core.gates else None
            units = self._degraded_units(gate, charge, fb) if gate is not None else 0.0
            if deg.has_room() and (gate is None or core._pool_admits(gate, deg, units, now)):
                # The degrade body caps max_tokens at the fallback model's context too (vLLM refuses more): the
                # one its replicas list where the policy sets none, which is the length they refuse past.
                context = core.cost_models[fb.model].context_tokens if fb.model else None
                ceilings = [t for t in (fb.max_tokens, context) if t]
                # In shadow the request runs as it asked on its own pool: charged as asked, too.
                if charge is not None and ceilings and not (core.shadow.everything or lim.spec.shadow):
                    core.charging.clamp(charge, min(ceilings))
                ticket = core._admit(deg, tenant, target, now, charge, waited_s, gate, units)
                ticket.degraded = True
                return Degrade(reason, cls, tenant, ticket, fb, why, cluster=target, classification=c,
                               waited_s=waited_s, context_tokens=context)
            if deg.has_room():
                why += f" (the degraded answer's pool {target} is at its limit too)"
            reason, why = R_DEGRADED_FULL, say(R_DEGRADED_FULL, why=why)
        return Refusal(REJECT, reason, cls, tenant, 429 if overflow else 503, why,
                       self._retry_after(lim, now, closed_in), classification=c, cluster=cluster, waited_s=waited_s)

    def _retry_after(self, lim: ClassLimiter, now: float, closed_in: float) -> int:
        """A refusal's Retry-After: when the class has likely drained, and for an open breaker's no sooner than it
        half-opens (the drain estimate, often 1 s, sent a client that honours it back into the same cooldown)."""
        ceiling = self.core._retry_ceiling
        return max(lim.retry_after_s(now, ceiling), min(ceiling, math.ceil(closed_in)))

    @staticmethod
    def _changes(fb, charge: Charge | None) -> bool:
        """Whether a degrade on the request's own model changes the request: `stream: false` on a chat or
        completions stream (an unknown request: a change), or a `max_tokens` below the request's own cap (no cap
        of its own, or an unknown one: a change)."""
        if fb.stream is False and (charge is None or charge.streams):
            return True
        if fb.max_tokens is None:
            return False
        if charge is None:
            return True
        est = charge.estimate
        cap = est.most_output // max(est.sequences, 1) if est.most_output else 0
        return not cap or cap > fb.max_tokens

    @staticmethod
    def _unchanged(fb) -> str:
        """Why a degrade on the request's own model leaves it as it is (the refusal's message)."""
        kept = [f"it asked for no more than {fb.max_tokens} tokens"] if fb.max_tokens is not None else []
        if fb.stream is False:
            kept.append("it is not a chat or completions stream")
        return f"would not change it: {' and '.join(kept)}" if kept else "is the model it asked for"

    def _fits_context(self, model: str | None, charge: Charge | None) -> bool:
        """Whether the request's prompt (estimated, each prompt of a list on its own) fits `model`'s context
        (configured, else as its replicas list it: vLLM answers 400 past either)."""
        context = self.core.cost_models[model].context_tokens if model else None
        if not context or charge is None:
            return True
        est = charge.estimate
        return est.prompt_tokens / max(est.prompts, 1) < context

    @staticmethod
    def _degraded_units(gate, charge: Charge | None, fb) -> float:
        """What a degraded request weighs on its pool's limit: each of its outputs clamped to the fallback's
        max_tokens."""
        if charge is None:
            return gate.units(0, 0.0)
        est = charge.estimate
        output = min(est.max_tokens, fb.max_tokens * est.sequences) if fb.max_tokens else est.max_tokens
        return gate.units(est.prompt_tokens, output, est.sequences)


def on_pool(pool: str, held: str) -> str:
    """The `where` of a wait's refusal held by a pool-wide limit (AdmissionController._pool_hold); "" when the
    class's cap held it."""
    return f" on pool {pool!r} ({held})" if held else ""
