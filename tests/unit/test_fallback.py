"""Breakers, fallbacks and shadow mode inside the admission core."""

import pytest

from extproc.policy.admission import (ACCEPT, CANNED_MAX_CHOICES, DEGRADE, QUEUE, REJECT, SHED, AdmissionController,
                                      RequestFacts)
from extproc.policy.limits import Completion, Outcome
from tests.conftest import FakeClock, RecordedEvents, make_policy


def req(cls="interactive", model="llama"):
    return RequestFacts(header_class=cls, model=model)


def policy(fallback=None, shadow_mode=False, **interactive):
    spec = {"max_concurrency": 2, "max_queue": 1, "max_wait_ms": 200, "slo_p95_ms": 2000,
            "latency_breaker": {"min_samples": 5, "cooldown_s": 10, "trickle": 0.5, "trickle_s": 30},
            "error_breaker": {"min_requests": 4, "cooldown_s": 10}}
    if fallback:
        spec["fallback"] = fallback
    spec.update(interactive)
    extra = {"mode": "shadow"} if shadow_mode else {}
    return make_policy(classes={"interactive": spec, "batch": {"max_concurrency": 2, "max_queue": 0,
                                                                "max_wait_ms": 0}},
                       tenants=[], **extra)


def run_slow(core, clock, n, seconds, cls="interactive", outcome=Outcome.OK):
    for _ in range(n):
        d = core.decide(req(cls))
        assert d.ticket is not None, d
        clock.advance(seconds)
        core.finish(d.ticket, outcome)
        core.report(d.ticket.id, Completion(outcome, 500 if outcome is Outcome.UPSTREAM_ERROR else 200, 0.1,
                                            seconds))


def test_open_latency_breaker_fails_fast_with_503_by_default(clock):
    core = AdmissionController(policy(), clock=clock)
    run_slow(core, clock, 5, 3.0)
    d = core.decide(req())
    assert (d.kind, d.status, d.reason) == (REJECT, 503, "latency_breaker_open")
    assert d.retry_after >= 1


def test_an_open_breakers_retry_after_is_the_rest_of_its_cooldown(clock):
    # It was the class's drain estimate (1 s with no drain rate yet) while the breaker stays open for its cooldown
    # (10 s here): a client that honours Retry-After (the OpenAI SDK's two retries) was refused again each time.
    core = AdmissionController(policy(), clock=clock)
    run_slow(core, clock, 5, 3.0)
    clock.advance(2.5)
    d = core.decide(req())
    assert d.reason == "latency_breaker_open" and d.retry_after == 8  # ceil(10 - 2.5)


def test_open_breaker_degrades_to_the_fallback_model(clock):
    core = AdmissionController(policy({"action": "degrade", "model": "small", "max_tokens": 64}), clock=clock)
    run_slow(core, clock, 5, 3.0)
    d = core.decide(req())
    assert d.kind == DEGRADE and d.cluster == "pool_b" and d.fallback.max_tokens == 64
    assert d.ticket.degraded and core.degraded["interactive"].inflight == 1
    core.finish(d.ticket, Outcome.OK)
    assert core.degraded["interactive"].inflight == 0


def test_a_full_degraded_capacity_sheds_no_lower_class(clock):
    # The degraded slots' limiter bears its class's name: filling it shed the lower classes' queues as if the
    # class were saturated, while the class had nothing in flight and their new arrivals were still taken.
    core = AdmissionController(make_policy(classes={
        "interactive": {"max_concurrency": 2, "max_queue": 1, "max_wait_ms": 200, "slo_p95_ms": 2000,
                        "latency_breaker": {"min_samples": 5, "cooldown_s": 10},
                        "fallback": {"action": "degrade", "model": "small", "max_concurrency": 1}},
        "batch": {"max_concurrency": 1, "max_queue": 3, "max_wait_ms": 5000}}, tenants=[]), clock=clock)
    run_slow(core, clock, 5, 3.0)
    assert [core.decide(req("batch")).kind for _ in range(2)] == [ACCEPT, QUEUE]
    waiter = core.limiters["batch"].queue[0]
    d = core.decide(req())
    assert d.kind == DEGRADE and core.degraded["interactive"].inflight == 1
    assert core.limiters["interactive"].inflight == 0
    assert waiter.pending and core.decide(req("batch")).kind == QUEUE


def test_degraded_capacity_is_bounded(clock):
    core = AdmissionController(policy({"action": "degrade", "model": "small", "max_concurrency": 1}), clock=clock)
    run_slow(core, clock, 5, 3.0)
    assert core.decide(req()).kind == DEGRADE
    d = core.decide(req())
    assert (d.kind, d.reason, d.status) == (REJECT, "degraded_capacity_full", 503)


def test_a_reload_that_changes_the_degraded_capacity_applies_it(clock):
    """fallback.max_concurrency (or the class cap it defaults to) edited on a reload: the degraded slots follow
    (the degraded limiter kept the cap it was created with: raised, it still refused; lowered, it let more in)."""
    core = AdmissionController(policy({"action": "degrade", "model": "small", "max_concurrency": 1}), clock=clock)
    run_slow(core, clock, 5, 3.0)
    held = core.decide(req())
    assert held.kind == DEGRADE
    core.apply(policy({"action": "degrade", "model": "small", "max_concurrency": 3}))
    assert [core.decide(req()).kind for _ in range(3)] == [DEGRADE, DEGRADE, REJECT]
    core.apply(policy({"action": "degrade", "model": "small"}, max_concurrency=2))  # the class cap, 2 < 3 held
    assert core.degraded["interactive"].inflight == 3  # held slots stay held past the new cap
    core.finish(held.ticket, Outcome.OK)
    assert core.decide(req()).reason == "degraded_capacity_full"


def test_a_removed_class_shows_its_degraded_requests_until_they_end(clock):
    # The snapshot listed a removed class only for its own slots, with degraded_inflight 0: its degraded requests
    # still running were gone from extproc_degraded_inflight (or read 0 beside its running ones).
    core = AdmissionController(policy({"action": "degrade", "model": "small"}), clock=clock)
    run_slow(core, clock, 5, 3.0)
    degraded = core.decide(req())
    assert degraded.kind == DEGRADE
    core.apply(make_policy(classes={"batch": {"max_concurrency": 2}}, default_class="batch", tenants=[]))
    assert core.snapshot()["interactive"]["degraded_inflight"] == 1
    core.finish(degraded.ticket, Outcome.OK)
    assert "interactive" not in core.snapshot()


def test_canned_fallback(clock):
    core = AdmissionController(policy({"action": "canned", "status": 200, "message": "busy"}), clock=clock)
    run_slow(core, clock, 5, 3.0)
    d = core.decide(req())
    assert d.kind == DEGRADE and d.ticket is None and d.message == "busy" and d.status == 200


def test_a_canned_fallback_rejects_a_request_for_more_choices_than_it_writes(clock):
    """Before: the canned answer had one choice per sequence asked for, so `n: 2147483647` on an overflowing class
    built two billion of them on the event loop (n 1,000,000: 1.3 s and a 100 MB answer)."""
    core = AdmissionController(policy({"action": "canned", "status": 200, "message": "busy"}), clock=clock)
    run_slow(core, clock, 5, 3.0)
    many = RequestFacts(header_class="interactive", model="llama", sequences=CANNED_MAX_CHOICES + 1)
    d = core.decide(many)
    assert (d.kind, d.status, d.reason) == (REJECT, 503, "latency_breaker_open"), d
    assert "cannot serve this request" in d.message
    few = RequestFacts(header_class="interactive", model="llama", sequences=CANNED_MAX_CHOICES)
    assert core.decide(few).kind == DEGRADE


def test_breakers_are_per_class_a_slow_batch_never_trips_interactive(clock):
    core = AdmissionController(policy(), clock=clock)
    core.apply(make_policy(classes={"interactive": {"max_concurrency": 2, "slo_p95_ms": 2000,
                                                    "latency_breaker": {"min_samples": 5}},
                                    "batch": {"max_concurrency": 2, "slo_p95_ms": 1000,
                                              "latency_breaker": {"min_samples": 5}}}, tenants=[], shed={}))
    run_slow(core, clock, 5, 3.0, cls="batch")
    assert core.decide(req("batch")).reason == "latency_breaker_open"
    assert core.decide(req("interactive")).kind == ACCEPT


def test_breakers_are_per_pool(clock):
    core = AdmissionController(policy(), clock=clock)
    run_slow(core, clock, 5, 3.0)
    assert core.decide(req(model="llama")).kind == REJECT
    assert core.decide(req(model="small")).kind == ACCEPT


def test_error_breaker_trips_on_upstream_errors_but_not_on_client_aborts(clock):
    core = AdmissionController(policy(), clock=clock)
    run_slow(core, clock, 10, 0.1, outcome=Outcome.CLIENT_ABORT)
    assert core.decide(req()).kind == ACCEPT
    run_slow(core, clock, 4, 0.1, outcome=Outcome.UPSTREAM_ERROR)
    d = core.decide(req())
    assert d.reason == "error_breaker_open"


def test_a_reload_that_tunes_an_open_breaker_keeps_it_open(clock):
    # Mid-incident an operator lengthens the cooldown (or gives the class an SLO): the rebuilt breakers started
    # closed, and the reload sent the class's whole traffic back to the pool the breaker was keeping it off.
    core = AdmissionController(policy(), clock=clock)
    run_slow(core, clock, 4, 0.1, outcome=Outcome.UPSTREAM_ERROR)
    assert core.decide(req()).reason == "error_breaker_open"
    core.apply(policy(error_breaker={"min_requests": 4, "cooldown_s": 60}, slo_p95_ms=1500))
    clock.advance(20)  # past the old cooldown, inside the new one
    d = core.decide(req())
    assert (d.kind, d.status, d.reason) == (REJECT, 503, "error_breaker_open")
    assert [b.state for b in core.pool_breakers("interactive", "pool_a")] == ["closed", "open"]
    clock.advance(41)  # the new cooldown, counted from when it opened: half-open
    core.decide(req())
    assert core.pool_breakers("interactive", "pool_a")[1].state == "half_open"


def test_half_open_probes_pass_and_a_fast_probe_period_closes(clock):
    core = AdmissionController(policy(), clock=clock)
    run_slow(core, clock, 5, 3.0)
    clock.advance(10)
    kinds = [core.decide(req()) for _ in range(2)]
    probe = next(d for d in kinds if d.kind == ACCEPT)
    assert probe.ticket.trickle
    core.finish(probe.ticket, Outcome.OK)
    core.report(probe.ticket.id, Completion(Outcome.OK, 200, 0.1, 0.5))
    clock.advance(31)
    assert core.decide(req()).kind == ACCEPT
    assert core.pool_breakers("interactive", "pool_a")[0].state == "closed"


def test_overflow_can_take_the_fallback_instead_of_429(clock):
    core = AdmissionController(policy({"action": "degrade", "model": "small"}, on_overflow="fallback"),
                               clock=clock)
    core.decide(req()), core.decide(req())
    assert core.decide(req()).kind == QUEUE
    d = core.decide(req())
    assert (d.kind, d.reason, d.cluster) == (DEGRADE, "queue_full", "pool_b")


def test_queue_timeout_can_take_the_fallback(clock):
    core = AdmissionController(policy({"action": "degrade", "model": "small"}, on_overflow="fallback"),
                               clock=clock)
    core.decide(req()), core.decide(req())
    q = core.decide(req())
    clock.advance(0.3)
    d = core.abandon(q.waiter, timed_out=True)
    assert (d.kind, d.reason) == (DEGRADE, "queue_timeout") and d.waited_s > 0.2


def sequence(core, clock):
    """A fixed request sequence: 6 arrivals while 2 slots, 1 queue place; then everything ends."""
    ds = [core.decide(req()) for _ in range(4)]
    ds.append(core.decide(req("batch")))
    clock.advance(0.3)
    core.reap()
    for d in ds:
        if d.ticket is not None:
            core.finish(d.ticket, Outcome.OK)
    return ds


def test_shadow_mode_admits_everything_and_counts_exactly_what_enforce_refuses(clock):
    enforce_events, shadow_events = RecordedEvents(), RecordedEvents()
    enforce = AdmissionController(policy(), clock=clock, events=enforce_events)
    ds = sequence(enforce, clock)
    refused = sorted((d.kind, d.reason) for d in ds if d.kind not in (ACCEPT, QUEUE))
    refused += sorted((d.waiter.result.kind, d.waiter.result.reason) for d in ds if d.kind == QUEUE)
    shadow = AdmissionController(policy(shadow_mode=True), clock=clock, events=shadow_events)
    sds = sequence(shadow, clock)
    assert all(d.kind == ACCEPT and d.ticket is not None for d in sds)
    would = sorted((w, r) for _, w, r in shadow_events.shadow_calls)
    assert would == sorted(refused)
    assert sorted(refused) == [(REJECT, "queue_full"), (REJECT, "queue_timeout"), (SHED, "higher_class_saturated")]
    assert shadow.limiters["interactive"].inflight == 0 and not shadow.limiters["interactive"].queue


def test_shadow_per_class_only_affects_that_class(clock):
    core = AdmissionController(make_policy(classes={
        "interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0, "shadow": True},
        "batch": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0}}, tenants=[], shed={}), clock=clock)
    assert [core.decide(req()).kind for _ in range(3)] == [ACCEPT] * 3
    assert [core.decide(req("batch")).kind for _ in range(2)] == [ACCEPT, REJECT]


def test_in_shadow_a_place_that_times_out_into_the_fallback_frees_its_degraded_slot_when_the_request_ends(clock):
    # The virtual place's overflow took a degraded slot for a request that already runs in its place: it was
    # held by a ticket nobody finishes, so the class's degraded capacity leaked until the lease ran out.
    core = AdmissionController(policy({"action": "degrade", "model": "small", "max_concurrency": 1},
                                      on_overflow="fallback", shadow=True), clock=clock)
    ds = [core.decide(req()) for _ in range(3)]  # 2 slots, the third waits in a virtual place
    assert all(d.kind == ACCEPT for d in ds) and len(core.limiters["interactive"].queue) == 1
    clock.advance(0.3)
    core.reap()  # its place timed out: enforce mode would have degraded it
    assert core.degraded["interactive"].inflight == 1
    for d in ds:
        core.finish(d.ticket, Outcome.OK)
    assert core.degraded["interactive"].inflight == 0 and core.limiters["interactive"].inflight == 0
    assert not core.tickets


def test_a_queued_request_whose_model_a_reload_renamed_still_takes_its_clamping_fallback(clock):
    # The clamp re-estimated the request with its model's cost model, gone from the reloaded policy: a KeyError
    # in the timeout, and through Envoy a 500 and a stream error for the client that had waited.
    def renamed(name):
        return make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 200,
                                                    "on_overflow": "fallback", "fallback": {
                                                        "action": "degrade", "model": "small", "max_tokens": 8}}},
                           models={name: {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}}, tenants=[])

    core = AdmissionController(renamed("llama"), clock=clock)
    running = core.decide(RequestFacts(model="llama", max_tokens=500))
    queued = core.decide(RequestFacts(model="llama", max_tokens=500))
    core.apply(renamed("llama-3"))
    clock.advance(0.3)
    core.reap()
    d = queued.waiter.result
    assert (d.kind, d.reason, d.cluster) == (DEGRADE, "queue_timeout", "pool_b")
    assert d.charge.estimate.max_tokens == 500  # no cost model left to re-estimate it with: it stands
    for t in (running.ticket, d.ticket):
        core.finish(t, Outcome.OK)
    assert not core.tickets


def test_a_degraded_answer_teaches_the_cost_model_nothing(clock):
    # A degrade clamps max_tokens (and may answer from another model): its short answer is the gateway's doing,
    # not how long the requested model answers. Learned, it drove the full model's output ratio down under
    # overload, exactly when its estimates had to stay honest.
    core = AdmissionController(policy({"action": "degrade", "model": "small", "max_tokens": 8}), clock=clock)
    run_slow(core, clock, 5, 3.0)
    before = {name: (m.output_ratio, m.samples) for name, m in core.cost_models.items()}
    for _ in range(20):
        d = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=1000))
        assert d.kind == DEGRADE
        core.usage(d.ticket, 20, 8)
        core.finish(d.ticket, Outcome.OK)
        core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.1, 0.2))
    assert {name: (m.output_ratio, m.samples) for name, m in core.cost_models.items()} == before


def clamping(clock, max_queue: int) -> AdmissionController:
    return AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 1, "max_queue": max_queue, "max_wait_ms": 100,
                                 "on_overflow": "fallback", "fallback": {"action": "degrade", "max_tokens": 8}}},
        tenants=[{"name": "t", "api_keys": ["k"], "tokens_per_minute": 60_000, "max_class": "interactive"}]),
        clock=clock)


def stream_of(max_tokens: int, sequences: int = 1) -> RequestFacts:
    return RequestFacts(api_key="k", model="llama", max_tokens=max_tokens, stream=True, sequences=sequences)


def test_a_clamping_degrade_charges_the_tenant_for_the_output_it_can_still_get(clock):
    # An unsampled stream's charge is never corrected from usage: charged for its own max_tokens, a stream the
    # degrade cut to 8 tokens cost its tenant 1,000 tokens of its per-minute budget, 125x what it could receive.
    core = clamping(clock, max_queue=0)
    bucket = core.tenant_limits["t"].tokens
    held = core.decide(stream_of(1000))
    assert held.kind == ACCEPT and bucket.level == 60_000 - 1000
    d = core.decide(stream_of(1000))
    assert d.kind == DEGRADE and d.charge.tokens == 8 and bucket.level == 60_000 - 1000 - 8
    assert d.charge.estimate.max_tokens == 8 and d.ticket.cost < held.ticket.cost


def test_a_queued_request_degraded_when_its_wait_ends_gets_the_clamped_part_back(clock):
    core = clamping(clock, max_queue=1)
    bucket = core.tenant_limits["t"].tokens
    assert core.decide(stream_of(1000)).kind == ACCEPT
    queued = core.decide(stream_of(1000, sequences=2))  # its tokens are taken when it is queued
    assert queued.kind == QUEUE and bucket.level == 60_000 - 1000 - 2000
    d = core.abandon(queued.waiter, timed_out=True)
    assert d.kind == DEGRADE and d.charge.tokens == 16 and bucket.level == 60_000 - 1000 - 16



def test_a_degrade_to_a_smaller_context_is_charged_and_told_that_context(clock):
    # The body is capped at the fallback model's context (vLLM refuses a max_tokens beyond it): so is the charge.
    core = AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 1, "max_queue": 0, "on_overflow": "fallback",
                                 "fallback": {"action": "degrade", "model": "small"}}},
        models={"llama": {"cluster": "pool_a", "cost": {"max_context_tokens": 32768}},
                "small": {"cluster": "pool_b", "cost": {"max_context_tokens": 8192}}},
        tenants=[{"name": "t", "api_keys": ["k"], "tokens_per_minute": 60_000, "max_class": "interactive"}]),
        clock=clock)
    assert core.decide(stream_of(16_000)).kind == ACCEPT
    d = core.decide(stream_of(16_000))
    assert d.kind == DEGRADE and d.context_tokens == 8192 and d.charge.estimate.max_tokens == 8192
    core.finish(d.ticket)
    # A prompt the smaller context cannot hold would get vLLM's 400 there: the request is refused to retry instead.
    long = RequestFacts(api_key="k", model="llama", max_tokens=10, doc={"prompt": "x" * 4 * 9000})
    d = core.decide(long)
    assert d.kind == REJECT and d.status == 429 and "does not fit the degrade model small's context" in d.message

def test_in_shadow_a_would_be_clamped_request_is_charged_as_it_asked(clock):
    # Shadow degrades nothing: the request runs with its own max_tokens, so its tenant pays for that.
    core = AdmissionController(make_policy(
        mode="shadow", classes={"interactive": {"max_concurrency": 1, "max_queue": 0, "on_overflow": "fallback",
                                                "fallback": {"action": "degrade", "max_tokens": 8}}},
        tenants=[{"name": "t", "api_keys": ["k"], "tokens_per_minute": 60_000, "max_class": "interactive"}]),
        clock=clock)
    core.decide(stream_of(1000))
    d = core.decide(stream_of(1000))
    assert d.shadow_would.kind == DEGRADE and d.charge.tokens == 1000


def test_in_shadow_a_would_be_degraded_request_does_not_wait_for_a_shared_stores_slot(clock):
    # A class's shadow passes stay per replica (gated), but its degraded slots' limiter was not in shadow: a pass
    # holding one waited for a global slot and could be refused when none came, in shadow.
    core = AdmissionController(policy({"action": "degrade", "model": "small"}, shadow=True), clock=clock)
    run_slow(core, clock, 5, 3.0)
    core.gate_on_store(True)
    d = core.decide(req())
    assert d.kind == ACCEPT and d.shadow_would.kind == DEGRADE and d.ticket.holds_slot
    assert not core.gated(d)


def shadow_batch(**tenant):
    """`batch` in shadow behind an enforced `interactive`; 0.3 GPU-s and 1200 tokens a request."""
    return AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 10},
                 "batch": {"max_concurrency": 1, "max_queue": 5, "max_wait_ms": 5000, "shadow": True}},
        default_class="batch", shed={}, sessions={"max_inflight_gpu_seconds": 1.0},
        tenants=[{"name": "a", "api_keys": ["ka"], "max_class": "interactive", **tenant}],
        models={"llama": {"cluster": "x", "cost": {"prefill_s_per_1k_tokens": 0.1, "decode_s_per_token": 0.001}}}),
        clock=FakeClock())


def batch_call(**kw):
    return RequestFacts(api_key="ka", header_class="batch", model="llama", max_tokens=200,
                        doc={"prompt": "x" * 4000}, **kw)


def test_in_shadow_a_request_its_virtual_place_admits_holds_its_session_budget_until_it_ends():
    # The place's slot was taken without the session's in-flight charge, and given back with it when the request
    # ended: the session (shared with enforced classes) counted a request fewer than it ran, or none at all.
    core = shadow_batch()
    a = core.decide(batch_call(session_id="s1"))
    b = core.decide(batch_call(session_id="s1"))
    assert b.shadow_would.kind == QUEUE
    session = core.sessions.sessions[("a", "s1")]
    core.finish(a.ticket, Outcome.OK)  # b's place is granted: it holds the slot now
    assert core.limiters["batch"].inflight == 1 and session.inflight == 1
    assert session.inflight_gpu_s == pytest.approx(0.3)
    core.finish(b.ticket, Outcome.OK)
    assert session.inflight == 0 and core.limiters["batch"].inflight == 0


def test_in_shadow_a_request_that_ends_in_its_virtual_place_gets_back_what_its_place_prepaid():
    # As a waiter whose client leaves does: it kept its tenant's worst-case tokens, never corrected (it held no
    # slot), out of the bucket its enforced classes share.
    core = shadow_batch(tokens_per_minute=6000)
    bucket = core.tenant_limits["a"].tokens
    core.decide(batch_call())
    before = bucket.refill(core.clock())
    b = core.decide(batch_call())
    assert b.shadow_would.kind == QUEUE and bucket.refill(core.clock()) == before - 1200
    core.finish(b.ticket, Outcome.OK)
    assert bucket.refill(core.clock()) == before and not core.limiters["batch"].queue


def test_a_request_for_the_fallback_model_itself_is_not_degraded_onto_the_pool_that_had_no_room(clock):
    # scenarios/shared-small: the 8B's own customers share the class that degrades to the 8B. On overflow their
    # "degrade" sent them unchanged to the same full pool, counted as degraded answers.
    core = AdmissionController(policy({"action": "degrade", "model": "small"}, max_concurrency=1, max_queue=0,
                                      on_overflow="fallback"), clock=clock)
    assert core.decide(req(model="small")).kind == ACCEPT
    d = core.decide(req(model="small"))
    assert (d.kind, d.status, d.reason) == (REJECT, 429, "queue_full")
    assert "the model it asked for" in d.message and core.degraded["interactive"].inflight == 0
    d = core.decide(req(model="llama"))  # the class is full: a request for the large model still degrades
    assert (d.kind, d.cluster) == (DEGRADE, "pool_b")


def test_a_clamp_that_leaves_the_request_as_it_is_is_not_a_degrade(clock):
    # scenarios/code-completion: `fallback: {action: degrade, max_tokens: 16}` on the requests' own pool, and a
    # quarter of them ask for 16 tokens (a completions request without max_tokens is 16 too). Their "degrade"
    # sent them unchanged to the pool that had just had no room, counted as degraded, answered with
    # `x-extproc-degraded: none`.
    core = AdmissionController(policy({"action": "degrade", "max_tokens": 16}, max_concurrency=1, max_queue=0,
                                      on_overflow="fallback"), clock=clock)
    assert core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=64)).kind == ACCEPT
    for asked in (16, 8):
        d = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=asked))
        assert (d.kind, d.status, d.reason) == (REJECT, 429, "queue_full")
        assert "would not change it" in d.message and core.degraded["interactive"].inflight == 0
    # One that asked for more is clamped: a degrade.
    d = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=64))
    assert (d.kind, d.cluster) == (DEGRADE, "pool_a") and d.charge.estimate.max_tokens == 16
    core.finish(d.ticket)
    # Without a cap of its own (chat: up to the rest of the context), the clamp is a change.
    assert core.decide(RequestFacts(header_class="interactive", model="llama")).kind == DEGRADE


def test_a_stream_degrade_leaves_a_request_that_does_not_stream_as_it_is_and_is_not_a_degrade(clock):
    # `fallback: {action: degrade, stream: false}` on the requests' own pool: a request that does not stream (or a
    # Responses API stream, which keeps streaming) went unchanged to the pool that had just had no room, counted as
    # degraded and answered with `x-extproc-degraded: none`.
    core = AdmissionController(policy({"action": "degrade", "stream": False}, max_concurrency=1, max_queue=0,
                                      on_overflow="fallback"), clock=clock)
    assert core.decide(req()).kind == ACCEPT
    for facts in (RequestFacts(header_class="interactive", model="llama"),
                  RequestFacts(header_class="interactive", model="llama", stream=True, cannable=False)):
        d = core.decide(facts)
        assert (d.kind, d.status, d.reason) == (REJECT, 429, "queue_full")
        assert "would not change it" in d.message and core.degraded["interactive"].inflight == 0
    # A chat or completions stream is answered in one piece: a degrade.
    d = core.decide(RequestFacts(header_class="interactive", model="llama", stream=True))
    assert (d.kind, d.cluster) == (DEGRADE, "pool_a")


def test_a_queued_request_revoked_then_degraded_pays_for_its_clamped_output_once(clock):
    # A queued request prepaid its tokens; granted, its admission waited for the shared store and was revoked
    # (no global slot within its wait), then degraded by its class's fallback. The revoke refunded all it had
    # prepaid, the clamp refunded the clamped part again, and the degrade took it as still prepaid: the tenant's
    # bucket came out 992 tokens up, paying nothing for the degraded answer.
    core = clamping(clock, max_queue=1)
    core.gate_on_store(True)
    bucket = core.tenant_limits["t"].tokens
    held = core.decide(stream_of(1000))
    core.confirm(held)
    queued = core.decide(stream_of(1000))
    assert queued.kind == QUEUE and bucket.level == 60_000 - 2000
    core.finish(held.ticket, Outcome.OK)
    granted = queued.waiter.result
    assert granted.kind == ACCEPT
    core.await_store(granted)
    d = core.revoke(granted, "queue_timeout", "no global slot")
    assert d.kind == DEGRADE and d.ticket.charge.tokens == 8
    assert bucket.level == 60_000 - 1000 - 8


def test_an_admission_revoked_then_degraded_is_charged_one_request(clock):
    # Admitted at once (not queued), its admission waited for the shared store and was revoked, then degraded. The
    # revoke gave its tokens back and the degrade charged it anew, but the request it had taken from the tenant's
    # requests-per-minute bucket stayed taken: two requests for one answer.
    core = AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 100,
                                 "on_overflow": "fallback", "fallback": {"action": "degrade", "max_tokens": 8}}},
        tenants=[{"name": "t", "api_keys": ["k"], "tokens_per_minute": 60_000, "requests_per_minute": 60,
                  "max_class": "interactive"}]), clock=clock)
    core.gate_on_store(True)
    limits = core.tenant_limits["t"]
    d = core.decide(stream_of(1000))
    assert d.kind == ACCEPT and limits.requests.level == 59
    core.await_store(d)
    out = core.revoke(d, "queue_timeout", "no global slot")
    assert out.kind == DEGRADE and limits.tokens.level == 60_000 - 8
    assert limits.requests.level == 59


def test_in_shadow_a_class_that_first_reaches_a_pool_through_its_virtual_queue_runs_there(clock):
    # Enforce mode records a class's pool when it admits it there (`pools`: the pools whose struggles the class
    # yields to); a shadow place granted on a pool the class had not run on yet was left out of it.
    core = AdmissionController(policy(shadow=True), clock=clock)
    a, b = core.decide(req()), core.decide(req())
    c = core.decide(req(model="small"))  # the class is full: it runs, while its place waits for a slot on pool_b
    assert c.shadow_would.kind == QUEUE and core.limiters["interactive"].pools == {"pool_a"}
    core.finish(a.ticket, Outcome.OK)
    assert core.limiters["interactive"].pools == {"pool_a", "pool_b"}
    for d in (b, c):
        core.finish(d.ticket, Outcome.OK)


def test_in_shadow_a_virtual_place_that_fills_its_class_sheds_the_lower_queues_as_enforce_does(clock):
    # Found by the shadow model test (test_admission_model_shadow.py): a reload raised interactive's cap and shed
    # batch under it; the queue's grant took interactive's last slot, which in enforce sheds batch's queue
    # (higher_class_saturated). In shadow the place took the slot without shedding: batch's places waited on
    # and the two sheds enforce made were never counted.
    def classes(mode, cap, shed):
        return make_policy(mode=mode, tenants=[], shed=shed, classes={
            "interactive": {"max_concurrency": cap, "max_queue": 1, "max_wait_ms": 1000},
            "batch": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 1000}})

    counts = {}
    for mode in ("enforce", "shadow"):
        events = RecordedEvents()
        core = AdmissionController(classes(mode, 1, {}), clock=clock, events=events)
        [core.decide(req(cls)) for cls in ("interactive", "interactive", "batch", "batch", "batch")]
        core.apply(classes(mode, 2, {"interactive": ["batch"]}))  # interactive's waiter takes the new slot
        counts[mode] = (core.limiters["interactive"].inflight, len(core.limiters["batch"].queue))
        if mode == "shadow":
            assert (SHED, "higher_class_saturated") in [(w, r) for _, w, r in events.shadow_calls]
    assert counts["shadow"] == counts["enforce"] == (2, 0)


@pytest.mark.parametrize("fallback, kind", [(None, REJECT), ({"action": "degrade", "model": "small"}, DEGRADE)])
def test_an_error_breaker_that_opens_answers_the_requests_queued_for_its_pool_as_it_answers_arrivals(
        clock, fallback, kind):
    """The requests queued for a pool whose error breaker opened were sent to it one by one as slots freed, while
    new arrivals got the class's fallback. They get the fallback too (503 error_breaker_open, or the degrade) when
    it opens. (The one granted the slot the failure freed is already on its way: the stream ends before Envoy's
    report says it failed.)"""
    core = AdmissionController(policy(fallback, max_queue=3, error_breaker={"min_requests": 3, "cooldown_s": 10}),
                               clock=clock)
    run_slow(core, clock, 2, 0.1, outcome=Outcome.UPSTREAM_ERROR)
    running = [core.decide(req()) for _ in range(2)]
    waiters = [core.decide(req()) for _ in range(3)]
    assert [w.kind for w in waiters] == [QUEUE] * 3
    got = {i: [] for i in range(3)}
    for i, w in enumerate(waiters):
        w.waiter.on_result = got[i].append
    failed = running[0].ticket
    core.finish(failed, Outcome.UPSTREAM_ERROR)
    assert [d.kind for d in got[0]] == [ACCEPT] and not got[1] and not got[2]
    core.report(failed.id, Completion(Outcome.UPSTREAM_ERROR, 500, 0.1, 0.1))  # the third failure: it opens
    assert core.pool_breakers("interactive", "pool_a")[1].state == "open"
    assert [(d.kind, d.reason) for i in (1, 2) for d in got[i]] == [(kind, "error_breaker_open")] * 2
    assert {d.cluster for i in (1, 2) for d in got[i]} == {"pool_b" if kind == DEGRADE else "pool_a"}
    assert not core.limiters["interactive"].queue
