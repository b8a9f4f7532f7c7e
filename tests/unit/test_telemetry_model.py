"""A model-based test of what the ext_proc exports: the core driven through random arrivals (configured tenants,
anonymous requests, unknown keys, fairness-header keys), queueing, completions with and without usage or Envoy's
report, withdrawals, lease expiry, clients leaving the queue, time passing, a shared store's waits, grants and
refusals, saturation readings, breakers opening, and reloads that add and remove classes, tenants and pools, with
the real Telemetry attached to the registry the server builds, its /metrics text rendered and parsed after every
step (prometheus_client.parser).

Checked after every step: every in-flight, waiting and limit gauge is what the core says (snapshot()) and what the
model holds, per class, per tenant label (the label docs/configuration.md gives a request: classify.fairness_header)
and per pool; per class, the tenants' gauges add up to the class's (a removed class's too, while its requests run);
served GPU-seconds are charged less refunded; counters never go down while their series lives; decisions balance
(one final decision a request: their sum is the arrivals less those still waiting, queue entries the requests that
queued, durations at most the requests that ran); the series alerts take increase() of exist at 0; tenant labels
stay within the configured tenants, `anonymous` and `other` (a reload ends a removed tenant's series), class labels
within the classes ever configured. At the end, everything drained: every in-flight and waiting gauge (the
sustained averages included) is exactly 0, every request decided once, every request that ran has exactly one
duration, and `promtool check metrics` accepts the text (every 25th run: it is a process start).
"""

from __future__ import annotations

import logging
import shutil
import subprocess

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client import ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import QUEUE, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.schema import load_policy
from extproc.policy.sustained import SustainedLoad
from extproc.telemetry import StoreTelemetry, Telemetry
from tests.conftest import FakeClock

MODELS = {"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}}
FEW_ERRORS = {"min_requests": 3, "window_s": 10, "cooldown_s": 1, "trickle_s": 2}
DEGRADE_SMALL = {"action": "degrade", "model": "small", "max_tokens": 16, "max_concurrency": 1}
POOL_LIMIT = {"limit": {"enabled": True, "unit": "requests", "initial": 3, "min": 1, "interval_s": 0.1}}


def doc(classes: dict, tenants: list[str], pools: dict, **rest) -> dict:
    return {"classes": classes, "default_class": next(iter(classes)),
            "tenants": [{"name": t, "api_keys": [f"sk-{t}"]} for t in tenants],
            "anonymous": {"max_class": next(iter(classes))}, "models": MODELS, "pools": pools,
            "classify": {"fairness_header": "x-flow"}, "shed": {}, **rest}


POLICIES = [load_policy(p) for p in (
    # tenants a, b; a fair queue keyed by the header in `lo`; a pool-wide limit on pool_a
    doc({"hi": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 300, "on_overflow": "fallback",
                "fallback": DEGRADE_SMALL, "error_breaker": FEW_ERRORS},
         "lo": {"max_concurrency": 2, "max_queue": 4, "max_wait_ms": 1500,
                "fairness": {"mode": "fair", "key": "header"}}},
        ["a", "b"], {"pool_a": POOL_LIMIT}),
    # tenant b removed, c added, a class added between, pool_b limited instead of pool_a
    doc({"hi": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 200, "error_breaker": FEW_ERRORS},
         "mid": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 500, "fairness": {"mode": "round_robin"}},
         "lo": {"max_concurrency": 3, "max_queue": 3, "max_wait_ms": 800,
                "fairness": {"mode": "fair", "key": "header"}}},
        ["a", "c"], {"pool_b": POOL_LIMIT}),
    # class lo removed, no pool limits, tenant b back
    doc({"hi": {"max_concurrency": 3, "max_queue": 3, "max_wait_ms": 600, "fairness": {"mode": "fair",
                                                                                         "key": "header"}},
         "mid": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 1000, "on_overflow": "fallback",
                 "fallback": {"action": "canned", "status": 429}}},
        ["a", "b", "c"], {}),
    # keys only (anonymous gets 401, and so do the queued requests of a tenant removed), a token pool limit,
    # weights and a guarantee in a class keyed by the header
    {**doc({"hi": {"max_concurrency": 2, "max_queue": 3, "max_wait_ms": 500, "on_overflow": "fallback",
                   "fallback": DEGRADE_SMALL, "fairness": {"mode": "fair", "key": "header"}},
            "lo": {"max_concurrency": 2, "max_queue": 3, "max_wait_ms": 900, "fairness": {"mode": "round_robin"}}},
           ["a"], {"pool_a": {"limit": {"enabled": True, "unit": "tokens", "initial": 3000, "min": 500}}}),
     "anonymous": {"allow": False}, "tenants": [{"name": "a", "api_keys": ["sk-a"], "weight": 3,
                                                 "guaranteed_share": 0.5}]},
)]

KEYS = {"a": "sk-a", "b": "sk-b", "c": "sk-c", "anonymous": None}
STATUS = {Outcome.OK: 200, Outcome.UPSTREAM_ERROR: 503, Outcome.CLIENT_ABORT: 499}
# Gauges that count requests: 0 once everything ended.
DRAINED = ("extproc_inflight", "extproc_degraded_inflight", "extproc_queue_depth", "extproc_inflight_gpu_seconds",
           "extproc_tenant_inflight", "extproc_tenant_waiting", "extproc_pool_inflight",
           "extproc_pool_waiting_requests", "extproc_queue_depth_avg", "extproc_inflight_ratio_avg")
TENANT_LABELLED = ("extproc_tenant_inflight", "extproc_tenant_waiting", "extproc_tenant_served_gpu_seconds",
                   "extproc_tenant_charged_gpu_seconds_total", "extproc_tenant_refunded_gpu_seconds_total",
                   "extproc_tenant_queue_waited_seconds_total", "extproc_tenant_queue_wait_seconds_count",
                   "extproc_class_demotions_total", "extproc_unknown_class_claims_total",
                   "extproc_ratelimit_decisions_total", "extproc_session_rejections_total")
promtool_runs = [0]


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, for every sample of the text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def _without_process(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("process_")]


def series(samples: dict, name: str) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def by(samples: dict, name: str, *labels: str) -> dict[tuple, float]:
    """A metric's values keyed by the values of `labels` (each label set must be distinct)."""
    out = {}
    for ls, v in series(samples, name).items():
        d = dict(ls)
        out[tuple(d[k] for k in labels)] = v
    return out


def is_counter(name: str) -> bool:
    return name.endswith(("_total", "_count", "_sum", "_bucket"))


class Arrival:
    """Who sent a request: its tenant as classified at arrival (`anonymous` for no key or an unknown one), its
    fairness-header key, and the name its flow key gives it (the key is fixed when the request is decided)."""

    def __init__(self, tenant: str, flow: str | None):
        self.tenant, self.flow = tenant, flow
        self.name: str | None = None  # what its flow key names, in the class it first landed in


class TelemetryModel(RuleBasedStateMachine):
    """The core as the server drives it, Telemetry attached as the server attaches it."""

    @initialize(start=st.sampled_from(range(len(POLICIES))), shared=st.booleans())
    def start(self, start: int, shared: bool) -> None:
        logging.getLogger("extproc").setLevel(logging.ERROR)  # a breaker's every move is a warning line
        self.clock = FakeClock()
        self.telemetry = Telemetry(clock=self.clock)
        self.core = AdmissionController(POLICIES[start], clock=self.clock, events=self.telemetry)
        self.sustained = SustainedLoad(window_s=20.0)
        self.telemetry.watch(self.core, self.sustained)  # the registry as Server builds it
        ProcessCollector(registry=self.telemetry.registry)
        self.core.gate_on_store(shared)  # a shared store confirms (or revokes) each admission
        if shared:
            StoreTelemetry(self.telemetry.registry).store_state("shared", switched=False)
        self.gated: dict[int, object] = {}  # ticket id -> its admission, waiting for the store's answer
        self.ever_classes = set(POLICIES[start].classes)
        self.stragglers: set[str] = set()  # tenants of the requests waiting at the last reload
        self.facts: dict[int, Arrival] = {}  # id(ticket or waiter) -> who sent the request
        self.live: dict[int, object] = {}          # ticket id -> Ticket
        self.waiting: list = []                     # pending Waiters
        self.arrivals = 0
        self.queued = 0
        self.ran = 0         # tickets that ended having run: one request duration each, once accounted
        self.last: dict = {}
        self.render()

    # --- the model's side ---

    def _take(self, d, arrival: Arrival) -> None:
        if arrival.name is None and d.cls in self.core.policy.classes:  # its flow key, fixed where it first lands
            by_header = self.core.policy.classes[d.cls].fairness.key == "header"
            arrival.name = arrival.flow if by_header and arrival.tenant == "anonymous" and arrival.flow \
                else arrival.tenant
        if d.kind == QUEUE:
            self.queued += 1
            self.waiting.append(d.waiter)
            self.facts[id(d.waiter)] = arrival
        elif d.ticket is not None:
            self.live[d.ticket.id] = d.ticket
            self.facts[id(d.ticket)] = arrival
            if self.core.gated(d):
                self.gated[d.ticket.id] = d

    def _sweep(self) -> None:
        for w in [w for w in self.waiting if not w.pending]:
            self.waiting.remove(w)
            self._take(w.result, self.facts.pop(id(w)))

    def _end(self, t, ran: bool = True) -> None:
        del self.live[t.id]
        self.gated.pop(t.id, None)
        self.facts.pop(id(t), None)
        self.ran += ran

    def _running(self) -> list[int]:
        return sorted(set(self.live) - set(self.gated))

    def expected_label(self, arrival: Arrival) -> str:
        """The tenant label a request is counted under (docs/configuration.md, classify.fairness_header): its
        tenant if still configured, else `other`; an anonymous request's header key (in a class keyed by the header
        when it arrived) names it if that is a configured tenant (or `anonymous`), else `other`."""
        tenants = {t.name for t in self.core.policy.tenants} | {"anonymous"}
        return arrival.name if arrival.name in tenants else "other"

    # --- rules ---

    @rule(tenant=st.sampled_from(sorted(KEYS)), claim=st.sampled_from([None, "hi", "mid", "lo", "gold"]),
          model=st.sampled_from(["llama", "llama", "small"]), max_tokens=st.sampled_from([None, 16, 512]),
          flow=st.sampled_from([None, None, "f1", "a", "b", "anonymous"]))
    def arrive(self, tenant, claim, model, max_tokens, flow) -> None:
        facts = RequestFacts(api_key=KEYS[tenant], header_class=claim, model=model, max_tokens=max_tokens,
                             doc={"prompt": "x" * 400}, fairness_id=flow)
        arrival = Arrival(tenant if tenant in {t.name for t in self.core.policy.tenants} else "anonymous", flow)
        self.arrivals += 1
        d = self.core.authenticate(facts) or self.core.decide(facts)
        self._take(d, arrival)
        self._sweep()

    @rule(tenant=st.sampled_from(sorted(KEYS)), claim=st.sampled_from(["hi", "mid", "lo"]),
          flow=st.sampled_from([None, "f1", "a"]), n=st.integers(2, 5))
    def burst(self, tenant, claim, flow, n) -> None:
        """One client sends several requests at once: classes fill, queues form."""
        for _ in range(n):
            self.arrive(tenant=tenant, claim=claim, model="llama", max_tokens=64, flow=flow)

    @precondition(lambda self: self._running())
    @rule(data=st.data(), outcome=st.sampled_from([Outcome.OK, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ABORT]),
          report=st.booleans(), usage=st.sampled_from([None, (100, 5), (400, 600)]),
          took=st.sampled_from([0.05, 0.5, 3.0]))
    def complete(self, data, outcome, report, usage, took) -> None:
        t = self.live[data.draw(st.sampled_from(self._running()))]
        if usage is not None:
            self.core.usage(t, *usage)
        if report:
            assert self.core.report(t.id, Completion(outcome, STATUS[outcome], took / 2, took))
        assert self.core.finish(t, outcome)
        self._end(t)
        self._sweep()

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def withdraw(self, data) -> None:
        """The adapter refused an admitted request after the decision (its body over the limit): it never ran."""
        t = self.live[data.draw(st.sampled_from(self._running()))]
        assert self.core.withdraw(t)
        self._end(t, ran=False)
        self._sweep()

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def lease_expires(self, data) -> None:
        t = self.live[data.draw(st.sampled_from(self._running()))]
        t.lease_until = self.clock()
        assert self.core.reap() == [t]
        self._end(t)
        self._sweep()

    @precondition(lambda self: self.gated)
    @rule(data=st.data())
    def store_waits(self, data) -> None:
        """The store has no global slot now: the admission waits for one (a queue entry, unless it queued in its
        class queue before)."""
        d = self.gated[data.draw(st.sampled_from(sorted(self.gated)))]
        self.queued += not d.ticket.queued
        self.core.await_store(d)

    @precondition(lambda self: self.gated)
    @rule(data=st.data(), waited=st.sampled_from([0.0, 0.05]))
    def store_grants(self, data, waited) -> None:
        d = self.gated.pop(data.draw(st.sampled_from(sorted(self.gated))))
        assert self.core.confirm(d, waited) is d
        self._sweep()

    @precondition(lambda self: self.gated)
    @rule(data=st.data(), reason=st.sampled_from(["queue_timeout", "store_unavailable", "client_disconnected"]))
    def store_refuses(self, data, reason) -> None:
        d = self.gated[data.draw(st.sampled_from(sorted(self.gated)))]
        arrival = self.facts[id(d.ticket)]
        self._end(d.ticket, ran=False)
        out = self.core.revoke(d, reason, "refused")
        if out.ticket is not None:  # a timed-out wait's fallback: a degraded admission
            self._take(out, arrival)
        self._sweep()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def client_leaves_queue(self, data) -> None:
        w = data.draw(st.sampled_from(self.waiting))
        assert self.core.abandon(w, timed_out=False) is not None
        self._sweep()

    @rule(dt=st.sampled_from([0.05, 0.3, 1.0, 6.0]))
    def time_passes(self, dt) -> None:
        """Waiters' timers fire at their deadlines (the adapter's), then tick and reap (which accounts the
        completions whose report never came)."""
        until = self.clock() + dt
        for w in sorted(self.waiting, key=lambda w: w.deadline):
            if w.pending and w.deadline <= until:
                self.clock.t = max(self.clock.t, w.deadline)
                self.core.abandon(w, timed_out=True)
            self._sweep()
        self.clock.t = until
        self.core.tick()
        self.core.reap()
        self.sustained.sample(until, self.core.snapshot())  # the server's housekeeping, once a second
        self._sweep()

    @rule(pool=st.sampled_from(["pool_a", "pool_b"]), saturated=st.booleans(),
          kv=st.sampled_from([0.1, 0.95]), waiting=st.sampled_from([0.0, 3.0]), gone=st.booleans())
    def saturation_read(self, pool, saturated, kv, waiting, gone) -> None:
        if gone:  # the server's scrapers stop watching the pool
            self.core.set_saturation(pool, None)
            return
        s = PoolSaturation()
        s.saturated, s.kv_usage, s.waiting, s.updated_at = saturated, kv, waiting, self.clock()
        self.core.set_saturation(pool, s)

    @rule(cls=st.sampled_from(["hi", "mid", "lo"]), pool=st.sampled_from(["pool_a", "pool_b"]))
    def breaker_trips(self, cls, pool) -> None:
        if cls not in self.core.limiters:
            return
        for b in self.core.pool_breakers(cls, pool):
            if b.kind == "error":
                for _ in range(b.min_requests):
                    b.observe(self.clock(), True, False)
        self._sweep()  # an error breaker that opens answers the class's requests queued for its pool

    @rule(which=st.sampled_from(range(len(POLICIES))))
    def reload(self, which) -> None:
        self.core.apply(POLICIES[which])
        self.telemetry.policy_reloaded(applied=True)  # as Server.reload does after an applied reload
        for pool in [p for p in self.core.saturation if p not in POLICIES[which].pools]:
            self.core.set_saturation(pool, None)
        self.ever_classes |= set(POLICIES[which].classes)
        # Requests still waiting (in the queue, or for the store) may bring back a removed tenant's queue-wait
        # series when they are answered, till the next reload (Telemetry._end_removed_tenants).
        self._sweep()
        waiting = [*self.waiting, *(d.ticket for d in self.gated.values())]
        self.stragglers = {self.facts[id(x)].tenant for x in waiting}

    # --- the promises ---

    def render(self) -> dict:
        """/metrics as the server writes it: the core read first (on the loop), the text written from that."""
        t = self.telemetry
        self.text = t.exposition(t.core_families()).decode()
        return parse(self.text)

    @invariant()
    def exposition_matches_the_core(self) -> None:
        if not hasattr(self, "core"):
            return
        now = self.render()
        self._counters_never_go_down(now)
        self._gauges_are_the_models(now)
        self._decisions_balance(now)
        self._alerted_series_exist(now)
        self._labels_stay_bounded(now)
        self.last = now

    def _counters_never_go_down(self, now: dict) -> None:
        for key, v in now.items():
            if is_counter(key[0]) and key in self.last:
                assert v >= self.last[key] - 1e-9, (key, self.last[key], v)

    def _gauges_are_the_models(self, now: dict) -> None:
        core = self.core
        snap = core.snapshot()
        inflight = by(now, "extproc_inflight", "class")
        queue = by(now, "extproc_queue_depth", "class")
        degraded = by(now, "extproc_degraded_inflight", "class")
        limit = by(now, "extproc_class_limit", "class")
        assert set(inflight) == {(c,) for c in snap}, (inflight, snap)
        for cls, s in snap.items():
            assert inflight[cls,] == s["inflight"] and queue[cls,] == s["queue"], cls
            assert degraded[cls,] == s["degraded_inflight"] and limit[cls,] == s["limit"], cls
        # The model's own count: running tickets by class (degraded apart), waiters by class.
        running = {}
        for t in self.live.values():
            key = ("degraded" if t.degraded else "waiting" if t.awaiting_store else "inflight", t.cls)
            running[key] = running.get(key, 0) + 1
        for cls in snap:
            assert inflight[cls,] == running.get(("inflight", cls), 0), (cls, "inflight", self.live)
            assert degraded[cls,] == running.get(("degraded", cls), 0), (cls, "degraded")
            queued = sum(w.limiter.name == cls for w in self.waiting) + running.get(("waiting", cls), 0)
            assert queue[cls,] == queued, (cls, "queue")
        # Per tenant label, what the model says runs and waits; per class, the labels add up to the class.
        tenant_inflight = by(now, "extproc_tenant_inflight", "class", "tenant")
        tenant_waiting = by(now, "extproc_tenant_waiting", "class", "tenant")
        want_inflight, want_waiting = {}, {}
        classes = core.policy.classes
        for t in self.live.values():
            if not t.degraded and t.cls in classes:
                key = (t.cls, self.expected_label(self.facts[id(t)]))
                want = want_waiting if t.awaiting_store else want_inflight
                want[key] = want.get(key, 0) + 1
        for w in self.waiting:
            key = (w.limiter.name, self.expected_label(self.facts[id(w)]))
            want_waiting[key] = want_waiting.get(key, 0) + 1
        assert {k: v for k, v in tenant_inflight.items() if v and k[0] in classes} == want_inflight
        assert {k: v for k, v in tenant_waiting.items() if v and k[0] in classes} == want_waiting
        for cls in snap:
            assert sum(v for (c, _), v in tenant_inflight.items() if c == cls) == inflight[cls,], cls
            assert sum(v for (c, _), v in tenant_waiting.items() if c == cls) == queue[cls,], cls
        # What was served is what was charged less what was refunded; Jain's index is within [1/n, 1].
        charged = by(now, "extproc_tenant_charged_gpu_seconds_total", "class", "tenant")
        refunded = by(now, "extproc_tenant_refunded_gpu_seconds_total", "class", "tenant")
        for key, served in by(now, "extproc_tenant_served_gpu_seconds", "class", "tenant").items():
            assert charged[key] >= 0 and refunded[key] >= 0, key
            assert abs(served - (charged[key] - refunded[key])) <= 1e-9 * max(1.0, charged[key]), key
        for (cls,), index in by(now, "extproc_class_fairness_index", "class").items():
            assert 0 < index <= 1 + 1e-9, (cls, index)
        # Per pool with a limit: what each class holds and waits, by the model.
        held = by(now, "extproc_pool_inflight", "pool", "class")
        assert {p for p, _ in held} == set(core.gates)
        pool_waiting = by(now, "extproc_pool_waiting_requests", "pool", "class")
        for pool, gate in core.gates.items():
            for cls in core.policy.classes:
                mine = [t for t in self.live.values() if t.gate is gate and t.cls == cls]
                assert held[pool, cls] == sum(t.units for t in mine), (pool, cls)
                waits = [w for w in self.waiting if w.pool == pool and w.limiter.name == cls]
                assert pool_waiting[pool, cls] <= len(waits), (pool, cls)
        # Saturation readings: the pools the core has a fresh reading of.
        sat = by(now, "extproc_pool_saturated", "pool")
        fresh = {p for p in core.saturation if core.pool_reading(p, self.clock()) is not None}
        assert set(sat) == {(p,) for p in fresh}
        for p in fresh:
            assert sat[p,] == float(core.saturation[p].saturated)

    def _alerted_series_exist(self, now: dict) -> None:
        """What an alert or panel takes increase() of exists at 0 from the start (Telemetry._alerted_at_zero,
        Telemetry.breaker_created): each class's failed-request durations, each breaker's transitions."""
        durations = by(now, "extproc_request_duration_seconds_count", "class", "outcome")
        for cls in self.core.policy.classes:
            assert (cls, "lease_expired") in durations and (cls, "upstream_error") in durations, cls
        transitions = by(now, "extproc_breaker_transitions_total", "class", "pool", "kind", "to")
        states = by(now, "extproc_breaker_state", "class", "pool", "kind")
        for (cls, pool), breakers in self.core.breakers.items():
            for b in breakers:
                assert (cls, pool, b.kind) in states
                for to in ("open", "half_open", "closed"):
                    assert (cls, pool, b.kind, to) in transitions, (cls, pool, b.kind, to)

    def _decisions_balance(self, now: dict) -> None:
        decided = sum(series(now, "extproc_requests_total").values())
        pending = len(self.waiting) + len(self.gated)  # no final decision yet
        assert decided == self.arrivals - pending, (decided, self.arrivals, pending)
        assert sum(series(now, "extproc_queue_entries_total").values()) == self.queued
        # A request that ran is accounted once: when its report comes, or the report wait after its end.
        assert sum(series(now, "extproc_request_duration_seconds_count").values()) <= self.ran
        # The tenants' waits are the class's, less those of tenants a reload removed (their series end).
        assert sum(series(now, "extproc_queue_wait_seconds_count").values()) >= \
            sum(series(now, "extproc_tenant_queue_wait_seconds_count").values())

    def _labels_stay_bounded(self, now: dict) -> None:
        allowed = {t.name for t in self.core.policy.tenants} | {"anonymous", "other"} | self.stragglers
        for name in TENANT_LABELLED:
            for labels in series(now, name):
                tenant = dict(labels)["tenant"]
                assert tenant in allowed, (name, tenant, allowed)
        classes = self.ever_classes | {"unclassified"}
        for (name, labels), _ in now.items():
            cls = dict(labels).get("class")
            assert cls is None or cls in classes, (name, cls)

    def teardown(self) -> None:
        """Drain: every client leaves or is answered; then every gauge reads 0 and every request is counted."""
        quieted = logging.getLogger("extproc")
        try:
            if hasattr(self, "core"):
                self._drain()
        finally:
            quieted.setLevel(logging.NOTSET)

    def _drain(self) -> None:
        # The server's way (the core read on the loop, the text written from that) writes what one read writes.
        self.render()
        again = generate_latest(self.telemetry.registry).decode()
        assert _without_process(self.text) == _without_process(again)  # all but the CPU time
        for _ in range(20):
            for tid in sorted(self.gated):  # the store answers every admission waiting for it
                self.core.confirm(self.gated.pop(tid))
            for w in list(self.waiting):
                if w.pending:
                    self.core.abandon(w, timed_out=False)
            self._sweep()
            for t in list(self.live.values()):
                assert self.core.finish(t, Outcome.OK)
                self._end(t)
            self._sweep()
            if not self.live and not self.waiting:
                break
        for _ in range(30):  # past the report wait and the sustained window, nothing running
            self.clock.advance(1.0)
            self.sustained.sample(self.clock(), self.core.snapshot())
        self.core.reap()  # accounts the completions whose report never came
        self.exposition_matches_the_core()
        now = self.last
        assert sum(series(now, "extproc_request_duration_seconds_count").values()) == self.ran
        for name in DRAINED:
            assert all(v == 0 for v in series(now, name).values()), (name, series(now, name))
        decided = sum(series(now, "extproc_requests_total").values())
        assert decided == self.arrivals
        promtool_runs[0] += 1
        if promtool_runs[0] % 25 == 1 and shutil.which("promtool"):
            r = subprocess.run(["promtool", "check", "metrics"], input=self.text, capture_output=True, text=True,
                               timeout=30)
            assert r.returncode == 0, r.stdout + r.stderr


# Not shrunk: a replay renders and parses the text at every step, and shrinking a 50-step run took minutes; a
# failure prints its whole run.
TelemetryModel.TestCase.settings = settings(max_examples=30, stateful_step_count=50, deadline=None,
                                            derandomize=True, database=None, report_multiple_bugs=False,
                                            phases=(Phase.explicit, Phase.generate),
                                            suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
TestTelemetryModel = TelemetryModel.TestCase
