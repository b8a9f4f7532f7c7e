"""A model-based test of usage settlement: requests of tokens-per-minute tenants and of agent sessions with GPU-seconds
budgets, admitted, queued, degraded or passed in shadow, end with their real usage (usage()) and the data plane's
report (report()) arriving before or after finish(), once, twice or never, with usage from none to the most the
adapter lets through (server/stream.py `_plausible`: 0 to USAGE_CEILING prompt tokens, 0 to the request's most
output), with leases running out, across reloads (one of them to shadow mode).

Checked after every step, per request: its tenant's token bucket was charged at most one request at a time and
settled from usage at most once; it never got back more tokens than it was charged (its net charge is never below
0), and once settled it holds what its usage says (or nothing, for a request that failed before any answer, or the
expected output for one cut short), never more than the larger of its charge and its usage. The cost models'
learned coefficients stay within their bounds (cost.py: [1/4, 4] times the configured ones; the output ratio within
[0.05, 1]); each session's in-flight budget is what its running requests hold; every ticket is accounted once, and
caps hold. At the end everything is drained: sessions, slots and queues read zero.
"""

from __future__ import annotations

import math
from collections import defaultdict

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from extproc.policy import charging, outcomes
from extproc.policy.admission import QUEUE, AdmissionController, RequestFacts
from extproc.policy.decision import NoEvents
from extproc.policy.limits import Completion, Outcome
from extproc.policy.ratelimit import TenantLimits
from extproc.policy.schema import load_policy
from extproc.server.stream import USAGE_CEILING
from tests.conftest import FakeClock

MODELS = {"llama": {"cluster": "pool_a", "cost": {"max_context_tokens": 8192}},
          "small": {"cluster": "pool_b", "cost": {"decode_s_per_token": 0.0}}}
TENANTS = [{"name": "a", "api_keys": ["sk-a"], "tokens_per_minute": 12000, "burst_s": 10},
           {"name": "b", "api_keys": ["sk-b"], "tokens_per_minute": 60000, "max_class": "lo"}]
KEYS = {"a": "sk-a", "b": "sk-b", "anonymous": None}
STATUS = {Outcome.OK: 200, Outcome.UPSTREAM_ERROR: 503, Outcome.CLIENT_ABORT: 499}


def doc(hi_cap: int, **rest) -> dict:
    return {"classes": {"hi": {"max_concurrency": hi_cap, "max_queue": 2, "max_wait_ms": 300,
                               "on_overflow": "fallback",
                               "fallback": {"action": "degrade", "model": "small", "max_tokens": 16,
                                            "max_concurrency": 1}},
                        "lo": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 800,
                               "max_inflight_gpu_seconds": 3.0}},
            "default_class": "hi", "tenants": TENANTS, "anonymous": {"max_class": "hi"}, "models": MODELS,
            "sessions": {"max_inflight_gpu_seconds": 2.0, "gpu_seconds_per_minute": 20, "max_sessions": 2}, **rest}


LOADED = [load_policy(doc(2)), load_policy(doc(1)), load_policy(doc(2, mode="shadow"))]

SAVED = {"charge": TenantLimits.charge, "refund": TenantLimits.refund, "correct": TenantLimits.correct,
         "completed": outcomes.CostLearning.completed, "admitted": charging.Charging.admitted,
         "prepay": charging.Charging.prepay, "give_back": charging.Charging._give_back,
         "clamp": charging.Charging.clamp}


class Ledger:
    """Per request (its Charge): the tenant-bucket calls made for it, found by which of the core's steps (each
    names the charge) made them."""

    def __init__(self) -> None:
        self.requests: dict[int, int] = defaultdict(int)    # charges minus refunds of a request
        self.tokens: dict[int, int] = defaultdict(int)      # tokens taken, net
        self.charged: dict[int, int] = defaultdict(int)     # the most tokens it was charged at once
        self.settled: dict[int, int] = defaultdict(int)     # corrections from its completion
        self.current = None
        self.settling = False
        ledger = self

        def within(name, settling=False):
            def call(self_, charge, *args, **kw):
                before, ledger.current, was = ledger.current, charge, ledger.settling
                ledger.settling = settling
                try:
                    return SAVED[name](self_, charge, *args, **kw)
                finally:
                    ledger.current, ledger.settling = before, was
            return call

        def completed(self_, c):
            before, ledger.current, was = ledger.current, c.ticket.charge, ledger.settling
            ledger.settling = True
            try:
                return SAVED["completed"](self_, c)
            finally:
                ledger.current, ledger.settling = before, was

        def charge(limits, tokens, now):
            taken = SAVED["charge"](limits, tokens, now)
            if limits.tokens is not None:
                key = id(ledger.current)
                ledger.requests[key] += 1
                ledger.tokens[key] += taken
                ledger.charged[key] = max(ledger.charged[key], ledger.tokens[key])
            return taken

        def refund(limits, tokens):
            SAVED["refund"](limits, tokens)
            if limits.tokens is not None:
                ledger.requests[id(ledger.current)] -= 1
                ledger.tokens[id(ledger.current)] -= tokens

        def correct(limits, charged, actual):
            level = limits.tokens.level if limits.tokens is not None else 0.0
            SAVED["correct"](limits, charged, actual)
            if limits.tokens is not None:
                key = id(ledger.current)
                ledger.tokens[key] += round(level - limits.tokens.level)  # what the bucket really moved
                if ledger.settling:
                    ledger.settled[key] += 1

        TenantLimits.charge, TenantLimits.refund, TenantLimits.correct = charge, refund, correct
        outcomes.CostLearning.completed = completed
        charging.Charging.admitted = within("admitted")
        charging.Charging.prepay = within("prepay")
        charging.Charging._give_back = within("give_back")
        charging.Charging.clamp = within("clamp")

    @staticmethod
    def close() -> None:
        TenantLimits.charge, TenantLimits.refund, TenantLimits.correct = \
            SAVED["charge"], SAVED["refund"], SAVED["correct"]
        outcomes.CostLearning.completed = SAVED["completed"]
        charging.Charging.admitted, charging.Charging.prepay = SAVED["admitted"], SAVED["prepay"]
        charging.Charging._give_back, charging.Charging.clamp = SAVED["give_back"], SAVED["clamp"]


class Counted(NoEvents):
    def __init__(self) -> None:
        self.completions: dict[int, int] = defaultdict(int)

    def finished(self, ticket, outcome, latency_s) -> None:
        self.completions[ticket.id] += 1


def live(d):
    """The ticket a decision's request runs under, its pending waiter, or None (refused, or ended)."""
    while d is not None and d.kind == QUEUE:
        if d.waiter.pending:
            return d.waiter
        d = d.waiter.result
    return None if d is None or d.ticket is None or d.ticket.closed else d.ticket


class UsageModel(RuleBasedStateMachine):

    @initialize(start=st.sampled_from(range(len(LOADED))))
    def start(self, start: int) -> None:
        self.clock = FakeClock()
        self.events = Counted()
        self.core = AdmissionController(LOADED[start], clock=self.clock, events=self.events)
        self.ledger = Ledger()
        self.decisions: list = []
        self.tickets: dict[int, object] = {}   # every ticket seen

    def _seen(self) -> None:
        for d in self.decisions:
            while d is not None:
                if d.ticket is not None:
                    self.tickets.setdefault(d.ticket.id, d.ticket)
                d = d.waiter.result if d.kind == QUEUE else None

    def _running(self) -> list:
        return [t for t in (live(d) for d in self.decisions) if t is not None and t.__class__.__name__ == "Ticket"]

    @rule(tenant=st.sampled_from(sorted(KEYS)), claim=st.sampled_from([None, "hi", "lo"]),
          model=st.sampled_from(["llama", "llama", "small"]), prompt=st.sampled_from([40, 4000, 20000]),
          max_tokens=st.sampled_from([None, 8, 512, 4096]), session=st.sampled_from([None, "s1", "s2", "s3"]))
    def arrive(self, tenant, claim, model, prompt, max_tokens, session) -> None:
        facts = RequestFacts(api_key=KEYS[tenant], header_class=claim, model=model, max_tokens=max_tokens,
                             doc={"prompt": "x" * prompt}, session_id=session, reads_usage=True)
        self.decisions.append(self.core.decide(facts))
        self._seen()

    @rule(data=st.data(), outcome=st.sampled_from([Outcome.OK, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ABORT]),
          usage_when=st.sampled_from(["before", "before", "twice", "after", "never"]),
          report_when=st.sampled_from(["before", "after", "twice", "never"]),
          prompt=st.sampled_from([0, 1, 37, 5000, USAGE_CEILING]), output=st.sampled_from([0, 1, 300, "most"]),
          status=st.sampled_from([None, 200, 400, 503]), took=st.sampled_from([0.0, 0.05, 2.0, 500.0]))
    def end(self, data, outcome, usage_when, report_when, prompt, output, status, took) -> None:
        running = self._running()
        if not running:
            return
        t = data.draw(st.sampled_from(running))
        est = t.charge.estimate if t.charge is not None else None
        most = est.most_output if est is not None and est.most_output else USAGE_CEILING
        completion = most if output == "most" else min(output, most)
        report = Completion(outcome, status if status is not None else STATUS[outcome], None, took)
        if usage_when in ("before", "twice"):
            self.core.usage(t, prompt, completion)
            if usage_when == "twice":
                self.core.usage(t, prompt, completion)
        if report_when in ("before", "twice"):
            assert self.core.report(t.id, report)
            if report_when == "twice":
                assert self.core.report(t.id, report)
        assert self.core.finish(t, outcome) is True and self.core.finish(t, outcome) is False
        if usage_when == "after":
            self.core.usage(t, prompt, completion)
        if report_when in ("after", "twice"):
            self.core.report(t.id, report)
            assert self.core.report(t.id, report) is False  # accounted: once
        self._seen()

    @rule(data=st.data(), late=st.sampled_from(["usage", "report", "both"]))
    def lease_expires(self, data, late) -> None:
        """A request never seen to end: reap() ends it (accounted at once, without usage); what arrives after
        settles nothing more."""
        running = self._running()
        if not running:
            return
        t = data.draw(st.sampled_from(running))
        t.lease_until = self.clock()
        assert self.core.reap() == [t]
        if late in ("usage", "both"):
            self.core.usage(t, 10, 10)
        if late in ("report", "both"):
            assert self.core.report(t.id, Completion(Outcome.OK, 200, None, 1.0)) is False
        self._seen()

    @rule(data=st.data())
    def client_leaves_queue(self, data) -> None:
        waiting = [w for w in (live(d) for d in self.decisions) if w is not None and w.__class__.__name__ == "Waiter"]
        if waiting:
            self.core.abandon(data.draw(st.sampled_from(waiting)), timed_out=False)
            self._seen()

    @rule(dt=st.sampled_from([0.1, 0.5, 6.0]))
    def time_passes(self, dt) -> None:
        self.clock.advance(dt)
        self.core.tick()
        self.core.reap()
        self._seen()

    @rule(which=st.sampled_from(range(len(LOADED))))
    def reload(self, which) -> None:
        self.core.apply(LOADED[which])
        self._seen()

    # --- the promises ---

    @invariant()
    def charged_and_settled_once(self) -> None:
        if not hasattr(self, "core"):
            return
        lg = self.ledger
        for key, n in lg.requests.items():
            assert n in (0, 1), ("requests charged", n)
            assert lg.tokens[key] >= 0, ("refunded more than it was charged", lg.tokens[key], lg.charged[key])
            assert lg.settled[key] <= 1, ("settled twice", lg.settled[key])
        for t in self.tickets.values():
            ch = t.charge
            if ch is None or ch.tenant is None or ch.tenant.tokens is None or not lg.settled[id(ch)]:
                continue
            usage = t.usage
            if usage is not None:
                most = max(lg.charged[id(ch)], usage[0] + usage[1])
                assert lg.tokens[id(ch)] <= most, ("settled above its usage and its charge", lg.tokens[id(ch)],
                                                   usage, lg.charged[id(ch)])

    @invariant()
    def coefficients_bounded(self) -> None:
        if not hasattr(self, "core"):
            return
        for name, model in self.core.cost_models.items():
            spec = model.spec
            assert (model.prefill_per_token, model.decode_per_token) == (spec.prefill_s_per_1k_tokens / 1000.0,
                                                                         spec.decode_s_per_token), name
            for value, configured in ((model.service_prefill, spec.prefill_s_per_1k_tokens / 1000.0),
                                      (model.service_decode, spec.decode_s_per_token)):
                assert configured / 4 * (1 - 1e-9) <= value <= configured * 4 * (1 + 1e-9), (name, value)
            assert 0.05 - 1e-12 <= model.output_ratio <= 1.0, (name, model.output_ratio)

    @invariant()
    def slots_and_sessions(self) -> None:
        if not hasattr(self, "core"):
            return
        core = self.core
        running = self._running()
        assert set(core.tickets) == {t.id for t in running}
        assert all(n == 1 for n in self.events.completions.values())
        sessions = {}
        for t in self.tickets.values():
            if t.charge is not None and t.charge.session is not None:
                sessions[id(t.charge.session)] = t.charge.session
        for s in sessions.values():
            mine = [t for t in running if t.holds_slot and t.charge is not None and t.charge.session is s]
            assert s.inflight == len(mine), (s.inflight, len(mine))
            assert math.isclose(s.inflight_gpu_s, sum(t.cost for t in mine), abs_tol=1e-9)

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        try:
            for _ in range(20):
                for w in [x for x in (live(d) for d in self.decisions) if x.__class__.__name__ == "Waiter"]:
                    self.core.abandon(w, timed_out=False)
                for t in self._running():
                    self.core.usage(t, 10, 10)
                    self.core.finish(t, Outcome.OK)
                    self.core.report(t.id, Completion(Outcome.OK, 200, None, 0.1))
                self._seen()
                if not self._running():
                    break
            self.clock.advance(10.0)
            assert self.core.reap() == []
            self.charged_and_settled_once()
            self.slots_and_sessions()
            assert not self.core.tickets and not self.core._unreported
            for name, c in self.core.snapshot().items():
                assert (c["inflight"], c["queue"], c["inflight_cost"], c["degraded_inflight"]) == (0, 0, 0.0, 0), \
                    name
            for s in self.core.sessions.sessions.values():
                assert (s.inflight, s.inflight_gpu_s, s.queued) == (0, 0.0, 0)
        finally:
            self.ledger.close()


UsageModel.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None, derandomize=True,
                                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestUsageModel = UsageModel.TestCase
