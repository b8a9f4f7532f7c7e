"""The pool-wide limit (extproc/policy/pool.py): strict priority between classes inside one limit, guarantees,
degrade last, exact release on every path, and the controller finding its level from saturation and latency."""

import pytest

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import ACCEPT, DEGRADE, QUEUE, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.pool import PoolGate, PoolLimit, kaplan_meier_quantile
from extproc.policy.schema import PoolLimitSpec
from tests.conftest import make_policy

BIG = {"max_concurrency": 100, "max_queue": 10}


def pool_policy(limit: float = 4, unit: str = "requests", borrow_lower: bool = False, knobs: dict | None = None,
                order: tuple[str, ...] = ("interactive", "batch", "internal"), **classes):
    spec = {"interactive": {**BIG, "max_wait_ms": 200, "slo_p95_ms": 2000, "on_overflow": "fallback",
                            "fallback": {"action": "degrade", "model": "small"},
                            "latency_breaker": {"window_s": 10, "min_samples": 5, "cooldown_s": 5}},
            "batch": {**BIG, "max_wait_ms": 5000},
            "internal": {**BIG, "max_wait_ms": 5000}}
    for name, extra in classes.items():
        spec[name] = {**spec[name], **extra}
    return make_policy(classes={name: spec[name] for name in order}, shed={},
                       pools={"pool_a": {"limit": {"enabled": True, "unit": unit, "initial": limit, "min": 1,
                                                   "max": limit, "borrow_lower": borrow_lower, **(knobs or {})}}})


def req(cls, model="llama", tokens=0):
    doc = {"prompt": "x" * (4 * tokens)} if tokens else None
    return RequestFacts(header_class=cls, model=model, max_tokens=100, doc=doc)


@pytest.fixture
def pcore(clock):
    return AdmissionController(pool_policy(), clock=clock)


def held(core):
    gate = core.gates["pool_a"]
    return gate.inflight, list(gate.count), list(gate.waiting)


def test_the_classes_share_one_limit_and_lower_classes_wait_behind_a_waiting_higher_one(pcore):
    batch = [pcore.decide(req("batch")) for _ in range(4)]
    assert [d.kind for d in batch] == [ACCEPT] * 3 + [QUEUE]  # lower classes fill only 85% of the pool
    i1 = pcore.decide(req("interactive"))
    assert i1.kind == ACCEPT  # the first class has the rest
    i2 = pcore.decide(req("interactive"))
    assert i2.kind == QUEUE
    late_batch = pcore.decide(req("batch"))
    assert late_batch.kind == QUEUE
    order = []
    for name, d in (("i2", i2), ("b4", batch[3]), ("b5", late_batch)):
        d.waiter.notify(lambda r, name=name: order.append((name, r.kind)))
    pcore.finish(batch[0].ticket, Outcome.OK)
    assert order == [("i2", ACCEPT)]  # the freed room goes to the higher class, not to the older batch waiter
    assert held(pcore) == (4, [2, 2, 0], [0, 2, 0])


def test_a_lower_class_alone_on_a_small_pool_is_not_rested_for_taking_it(clock):
    # A limit of 1 request: a lower class never has room under its 85% fill, so each of its requests goes in on its
    # guarantee, was counted as taken over its share while "contended", and rested the class 19 s per second it
    # ran, with the classes above idle: its queue waited out max_wait on an empty pool (found by a review, in the
    # what-if). A request that finds the pool empty, nobody above waiting, takes nothing from anyone.
    core = AdmissionController(pool_policy(limit=1, batch={"max_wait_ms": 20000}), clock=clock)
    first = core.decide(req("batch"))
    second = core.decide(req("batch"))
    assert (first.kind, second.kind) == (ACCEPT, QUEUE)
    clock.advance(1.0)
    core.finish(first.ticket, Outcome.OK)
    assert second.waiter.result is not None and second.waiter.result.kind == ACCEPT
    # Taken beside the first class's request, over its share, it rests as before.
    clock.advance(1.0)
    core.finish(second.waiter.result.ticket, Outcome.OK)
    assert core.decide(req("interactive")).kind == ACCEPT
    third = core.decide(req("batch"))
    assert third.kind == ACCEPT  # it holds nothing: its guarantee, over its share while interactive runs
    clock.advance(1.0)
    core.finish(third.ticket, Outcome.OK)
    assert core.gates["pool_a"].rest_until[1] > clock()


def test_a_resting_lower_class_is_not_held_off_a_pool_that_holds_nothing(clock):
    # A limit of 1 request (a cut to its floor): a lower class has no room under its 85% fill, only its guarantee,
    # which its rest after a request over its share takes away. Once the pool emptied, its next request waited
    # out max_wait on the idle pool for the rest of the rest (up to a minute) though it took nothing from anyone
    # (found by the model-based test, tests/unit/test_pool_limit_model.py): a pool always takes one request.
    core = AdmissionController(pool_policy(limit=1, batch={"max_wait_ms": 20000}), clock=clock)
    interactive = core.decide(req("interactive"))
    batch = core.decide(req("batch"))
    assert (interactive.kind, batch.kind) == (ACCEPT, ACCEPT)  # its guarantee, over its share beside interactive
    clock.advance(1.0)
    core.finish(batch.ticket, Outcome.OK)
    core.finish(interactive.ticket, Outcome.OK)
    gate = core.gates["pool_a"]
    assert gate.rest_until[1] > clock() and gate.holding == 0
    assert core.decide(req("batch")).kind == ACCEPT  # the pool is idle: nobody to rest for
    assert core.decide(req("batch")).kind == QUEUE  # ...and one request is what it takes while resting
    assert core.decide(req("interactive")).kind == ACCEPT  # the first class's guarantee, as before


def test_a_class_keeps_one_request_in_flight_whatever_waits_above_it(pcore):
    for _ in range(4):
        assert pcore.decide(req("interactive")).kind == ACCEPT
    assert pcore.decide(req("interactive")).kind == QUEUE
    assert pcore.decide(req("batch")).kind == ACCEPT  # its guarantee: nothing starves
    assert pcore.decide(req("batch")).kind == QUEUE


def over_share(core, cls="batch"):
    """Interactive fills the pool of 4 and waits; the class, holding nothing, then takes one request over its share
    (its guarantee). Returns that decision."""
    for _ in range(4):
        core.decide(req("interactive"))
    assert core.decide(req("interactive")).kind == QUEUE
    return core.decide(req(cls))


def ran_over_share(core, clock, seconds: float = 10.0):
    """over_share(), its request run `seconds` and finished: the class rests from now. Returns that decision."""
    d = over_share(core)
    clock.advance(seconds)
    core.finish(d.ticket, Outcome.OK)
    return d


def test_a_request_over_the_share_rests_its_class_so_it_holds_its_share_on_average(clock):
    # min_share 0.1 of 4 requests: 0.4, so one batch request is 2.5x the share. Taken while interactive waits, it
    # runs 10 s; the class then takes nothing over its share for 10 x (2.5 - 1) = 15 s: 10 s in 25 on average.
    core = AdmissionController(pool_policy(batch={"min_share": 0.1}), clock=clock)
    first = ran_over_share(core, clock)
    assert first.kind == ACCEPT  # the class held nothing: nothing starves
    clock.advance(14.9)
    waiting = core.decide(req("batch"))
    assert waiting.kind == QUEUE  # resting: its next one waits behind interactive
    core.abandon(waiting.waiter, timed_out=False)
    clock.advance(0.2)
    assert core.decide(req("batch")).kind == ACCEPT


def test_a_class_rests_a_minute_at_most(clock):
    # min_share 0.01 of 4 requests: one request is 25x the share. After 10 s it would owe 240 s; it rests 60.
    core = AdmissionController(pool_policy(batch={"min_share": 0.01}), clock=clock)
    ran_over_share(core, clock)
    assert core.gates["pool_a"].rest_until[1] == pytest.approx(clock() + 60)
    clock.advance(60.1)
    assert core.decide(req("batch")).kind == ACCEPT


def test_a_request_over_the_share_taken_into_room_does_not_rest_its_class(clock):
    core = AdmissionController(pool_policy(batch={"min_share": 0.1}), clock=clock)
    first = core.decide(req("batch"))  # the pool is empty: room, not the guarantee
    clock.advance(10)
    core.finish(first.ticket, Outcome.OK)
    for _ in range(4):
        core.decide(req("interactive"))
    assert core.decide(req("interactive")).kind == QUEUE
    assert core.decide(req("batch")).kind == ACCEPT  # no rest owed: its guarantee holds at once


def test_borrow_lower_lets_the_first_class_use_what_lower_classes_hold_over_their_guarantee(clock):
    def fill(core):
        batch = [core.decide(req("batch")) for _ in range(8)]  # 85% of 10, then queued
        assert [d.kind for d in batch].count(ACCEPT) == 8
        return [core.decide(req("interactive")).kind for _ in range(9)]

    # Off (the default): the first class gets only the room left, 2 of 10.
    plain = AdmissionController(pool_policy(limit=10, batch={"min_share": 0.3}), clock=clock)
    assert fill(plain) == [ACCEPT] * 2 + [QUEUE] * 7
    # On: batch's 8 over its guarantee of 3 are lent, so 5 more go in, the pool at most limit + lent.
    core = AdmissionController(pool_policy(limit=10, borrow_lower=True, batch={"min_share": 0.3}), clock=clock)
    assert fill(core) == [ACCEPT] * 7 + [QUEUE] * 2
    assert core.decide(req("batch")).kind == QUEUE  # and the lower class is not admitted again meanwhile
    assert held(core)[0] == 15


def test_min_share_is_a_guarantee_in_the_limits_unit(clock):
    core = AdmissionController(pool_policy(limit=10, batch={"min_share": 0.3}), clock=clock)
    for _ in range(10):
        core.decide(req("interactive"))
    assert core.decide(req("interactive")).kind == QUEUE
    assert [core.decide(req("batch")).kind for _ in range(4)] == [ACCEPT, ACCEPT, ACCEPT, QUEUE]


def test_token_unit_weighs_prompt_and_output(clock):
    core = AdmissionController(pool_policy(limit=1000, unit="tokens"), clock=clock)
    a = core.decide(req("interactive", tokens=500))
    assert a.kind == ACCEPT and core.gates["pool_a"].inflight == pytest.approx(600)  # 500 prompt + 100 output
    assert core.decide(req("interactive", tokens=500)).kind == QUEUE
    assert core.decide(req("interactive", tokens=200)).kind == QUEUE  # FIFO in the class: no overtaking
    core.finish(a.ticket, Outcome.OK)  # room for 400: the head (600) first, then the 300 behind it fits too
    assert core.gates["pool_a"].inflight == pytest.approx(900)


def test_a_request_weighs_the_output_it_asked_for_however_the_output_ratio_is_learned(clock):
    # The learned ratio (answers use ~60% of max_tokens) shrank the unit under the limit as the ext_proc ran: the
    # same limit then admitted more (what-if: 310 against 278 refused or degraded at 60% load over 11 seeds).
    core = AdmissionController(pool_policy(limit=10_000, unit="tokens"), clock=clock)
    model = core.cost_models["llama"]
    before = core.decide(req("interactive", tokens=500))
    model.output_ratio = 0.3
    after = core.decide(req("interactive", tokens=500))
    assert after.ticket.charge.estimate.expected_output == pytest.approx(30)  # the estimate does learn
    assert before.ticket.units == after.ticket.units == pytest.approx(600)  # 500 prompt + max_tokens 100


def test_a_degraded_request_weighs_each_output_clamped_to_the_fallbacks_max_tokens(clock):
    policy = pool_policy(limit=10_000, unit="tokens", interactive={
        "max_concurrency": 1, "max_queue": 0, "on_overflow": "fallback",
        "fallback": {"action": "degrade", "max_tokens": 10}})
    core = AdmissionController(policy, clock=clock)
    assert core.decide(req("interactive")).kind == ACCEPT
    d = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=100, sequences=4))
    assert d.kind == DEGRADE and d.ticket.units == pytest.approx(4 * 10)  # not 10 for all four outputs


def test_request_unit_weighs_the_sequences_a_replica_runs(clock):
    # vLLM runs each of n outputs (and each prompt of a completions list) as a request of its own: one n=8 chat
    # showed vllm:num_requests_running 8 on the real server. Weighed 1, four of them ran 32 under a limit of 4.
    core = AdmissionController(pool_policy(limit=4), clock=clock)
    a = core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=100, sequences=3))
    assert a.kind == ACCEPT and core.gates["pool_a"].inflight == 3
    assert core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=100,
                                    sequences=2)).kind == QUEUE
    core.finish(a.ticket, Outcome.OK)
    assert held(core) == (2, [1, 0, 0], [0, 0, 0])


def test_every_way_out_of_a_queue_gives_back_its_place_and_every_end_its_units(pcore, clock):
    tickets = [pcore.decide(req("interactive")).ticket for _ in range(4)]
    waiting = pcore.decide(req("interactive"))
    timed_out = pcore.decide(req("interactive"))
    assert pcore.decide(req("batch")).kind == ACCEPT  # its guarantee: one batch request in flight
    gone = pcore.decide(req("batch"))
    pcore.decide(req("batch"))
    assert held(pcore)[2] == [2, 2, 0]
    pcore.abandon(gone.waiter, timed_out=False)
    clock.advance(0.3)
    pcore.reap()  # interactive waiters past 200 ms: degraded (their fallback)
    assert waiting.waiter.result.kind == DEGRADE and timed_out.waiter.result.kind == DEGRADE
    for t in tickets:
        pcore.finish(t, Outcome.UPSTREAM_ERROR)
        pcore.finish(t, Outcome.OK)  # idempotent
    gate = pcore.gates["pool_a"]
    assert gate.waiting == [0, 0, 0] and gate.count[0] == 0
    assert gate.inflight == sum(gate.count) == gate.count[1] == 2  # the guaranteed one, and the one granted since


def test_a_latency_breaker_makes_lower_classes_yield_before_it_degrades(clock):
    core = AdmissionController(pool_policy(limit=8), clock=clock)
    batch = [core.decide(req("batch")) for _ in range(5)]
    assert all(d.kind == ACCEPT for d in batch)
    breaker = core.pool_breakers("interactive", "pool_a")[0]
    for _ in range(5):
        breaker.observe(clock(), 5.0, False)
    assert breaker.state == "open"
    d = core.decide(req("interactive"))
    assert d.kind == ACCEPT  # batch holds more than its guarantee: it yields instead
    assert core.decide(req("batch")).kind == QUEUE  # ...and gets only its guarantee for the cooldown
    clock.advance(5.0)
    core.finish(batch[0].ticket, Outcome.OK)
    assert core.decide(req("batch")).kind == ACCEPT


def test_degrade_is_the_last_resort_when_nothing_is_left_to_yield_or_cut(clock):
    core = AdmissionController(pool_policy(limit=1), clock=clock)  # min == max == 1: the limit cannot come down
    breaker = core.pool_breakers("interactive", "pool_a")[0]
    for _ in range(5):
        breaker.observe(clock(), 5.0, False)
    assert breaker.state == "open"
    assert core.decide(req("interactive")).kind == DEGRADE


def test_a_reload_keeps_what_is_held_and_the_learned_limit(clock):
    core = AdmissionController(pool_policy(), clock=clock)
    t = core.decide(req("batch")).ticket
    gate = core.gates["pool_a"]
    gate.limit = 3.0
    core.apply(pool_policy())
    assert core.gates["pool_a"] is gate and gate.limit == 3.0 and gate.inflight == 1
    core.apply(pool_policy(limit=6))  # a changed limit spec: a new gate takes over what the old one held
    assert gate.inflight == 0 and core.gates["pool_a"].inflight == 1
    core.finish(t, Outcome.OK)
    assert gate.inflight == 0 and core.gates["pool_a"].inflight == 0


def test_a_reload_that_tunes_the_limit_carries_what_is_held_and_waits_so_the_limit_holds(pcore):
    running = [pcore.decide(req("interactive")).ticket for _ in range(4)]
    assert pcore.decide(req("interactive")).kind == QUEUE
    pcore.apply(pool_policy(knobs={"min": 4, "target": 0.8}))  # the limit fixed at 4; one knob tuned
    assert pcore.gates["pool_a"].spec.target == 0.8 and held(pcore) == (4, [4, 0, 0], [1, 0, 0])
    assert pcore.decide(req("interactive")).kind == QUEUE  # not a fifth running against a limit of 4
    for t in running:
        pcore.finish(t, Outcome.OK)  # the old tickets end on the gate that holds them now
        assert 2 <= pcore.gates["pool_a"].inflight <= 4
    assert held(pcore) == (2, [2, 0, 0], [0, 0, 0])  # the two waiters, granted as the old tickets ended


def test_a_class_that_moves_rank_on_a_reload_holds_and_gives_back_under_its_new_rank(pcore):
    batch = pcore.decide(req("batch")).ticket
    old = pcore.gates["pool_a"]
    old.controller.baseline = {1: 0.5}  # batch's calm latency, learned at rank 1
    pcore.apply(pool_policy(order=("batch", "interactive", "internal")))
    gate = pcore.gates["pool_a"]
    assert gate.class_names[0] == "batch" and held(pcore) == (1, [1, 0, 0], [0, 0, 0])
    assert gate.controller.baseline == {0: 0.5}
    pcore.finish(batch, Outcome.OK)
    assert held(pcore) == (0, [0, 0, 0], [0, 0, 0]) and old.inflight == 0


def test_a_class_removed_on_a_reload_holds_the_pool_until_its_requests_end(pcore):
    internal = [pcore.decide(req("internal")).ticket for _ in range(3)]
    pcore.apply(pool_policy(order=("interactive", "batch")))
    assert held(pcore) == (3, [0, 0], [0, 0])  # the pool's, no class's: the limit still counts them
    assert [pcore.decide(req("interactive")).kind for _ in range(2)] == [ACCEPT, QUEUE]
    for t in internal:
        pcore.finish(t, Outcome.OK)
    assert held(pcore) == (2, [2, 0], [0, 0])


def test_a_limit_turned_on_by_a_reload_counts_the_requests_already_running_on_the_pool(clock):
    # The operator enables the pool limit (or turns it back on) during an overload: the requests running had no
    # gate to hold, so the new one started empty and let a whole limit more onto the pool on top of them.
    unlimited = make_policy(classes={name: {**BIG, "max_wait_ms": 5000} for name in ("interactive", "batch",
                                                                                    "internal")}, shed={})
    core = AdmissionController(unlimited, clock=clock)
    running = [core.decide(req("interactive")).ticket for _ in range(4)]
    elsewhere = core.decide(req("batch", model="small")).ticket  # on another pool: not this limit's
    core.apply(pool_policy(limit=4))
    assert held(core) == (4, [4, 0, 0], [0, 0, 0])
    fifth = core.decide(req("interactive"))
    assert fifth.kind == QUEUE
    core.apply(unlimited)
    assert fifth.waiter.result.kind == ACCEPT  # no pool limit: the class has room
    core.apply(pool_policy(limit=4))  # and on again
    assert held(core) == (5, [5, 0, 0], [0, 0, 0])
    assert core.decide(req("interactive")).kind == QUEUE
    for t in running + [elsewhere]:
        core.finish(t, Outcome.OK)
    assert held(core) == (2, [2, 0, 0], [0, 0, 0])  # the fifth, and the sixth granted as the first four ended


def test_the_limit_learned_survives_a_reload_of_its_knobs_within_the_new_bounds(clock):
    core = AdmissionController(pool_policy(limit=10), clock=clock)
    gate = core.gates["pool_a"]
    gate.limit = gate.controller.limit = 6.0
    core.apply(pool_policy(limit=10, knobs={"target": 0.8}))
    assert core.gates["pool_a"] is not gate and core.gates["pool_a"].limit == 6.0
    core.apply(pool_policy(limit=10, knobs={"target": 0.8, "min": 8}))
    assert core.gates["pool_a"].limit == 8.0
    core.apply(pool_policy(limit=10, unit="tokens"))  # another unit: the limit says nothing in it, start again
    assert core.gates["pool_a"].limit == 10.0


def test_a_pool_removed_and_put_back_starts_afresh(clock):
    """Unlike a retuned limit, one a reload removed (the pool, or its limit) keeps nothing: put back, it starts at
    its `initial`, and its pool's breakers closed, whatever the old ones had learned."""
    core = AdmissionController(pool_policy(limit=10), clock=clock)
    core.decide(req("interactive"))
    core.gates["pool_a"].limit = core.gates["pool_a"].controller.limit = 3.0
    for b in core.pool_breakers("interactive", "pool_a"):
        for _ in range(50):
            b.observe(clock(), 60.0 if b.kind == "latency" else True, False)
    assert [b.state for b in core.pool_breakers("interactive", "pool_a")] == ["open", "open"]
    core.apply(make_policy(models={"small": {"cluster": "pool_b"}}, shed={}))
    core.apply(pool_policy(limit=10))
    assert core.gates["pool_a"].limit == 10.0 and core.gates["pool_a"].inflight == 1  # what still runs, held
    assert core.decide(req("interactive")).kind == ACCEPT
    assert [b.state for b in core.pool_breakers("interactive", "pool_a")] == ["closed", "closed"]


def test_a_reload_to_another_unit_weighs_what_is_held_in_the_new_unit(clock):
    core = AdmissionController(pool_policy(limit=1000), clock=clock)
    t = core.decide(req("interactive", tokens=500)).ticket
    core.apply(pool_policy(limit=1000, unit="tokens"))
    assert core.gates["pool_a"].inflight == pytest.approx(600)  # 500 prompt + 100 output
    core.finish(t, Outcome.OK)
    assert held(core) == (0, [0, 0, 0], [0, 0, 0])



def test_a_reload_to_another_unit_tells_the_new_limit_what_still_runs(clock):
    # A new unit starts a new controller (a limit in requests says nothing in tokens). It counted the held units
    # but not the requests still running, so its latency reading took the quick answers that ended after the reload
    # for the whole picture, as it did after a cut before the limit counted what runs (docs/overload.md).
    def running(core):
        return {k for w in core.gates["pool_a"].controller.windows.values() for k in w.running}

    core = AdmissionController(pool_policy(limit=1000), clock=clock)
    tickets = [core.decide(req("interactive", tokens=500)).ticket for _ in range(3)]
    assert running(core) == {t.id for t in tickets}
    before = core.gates["pool_a"].controller
    core.apply(pool_policy(limit=1000, unit="tokens"))
    assert core.gates["pool_a"].controller is not before
    assert running(core) == {t.id for t in tickets}
    core.finish(tickets[0], Outcome.OK)
    assert running(core) == {t.id for t in tickets[1:]}
    # A limit turned off and on again counts them too.
    core.apply(make_policy(classes={n: {**BIG, "max_wait_ms": 5000} for n in ("interactive", "batch", "internal")},
                           shed={}))
    core.apply(pool_policy(limit=1000))
    assert running(core) == {t.id for t in tickets[1:]}
    for t in tickets[1:]:
        core.finish(t, Outcome.OK)
    assert running(core) == set() and held(core) == (0, [0, 0, 0], [0, 0, 0])


FAIR_TENANTS = [{"name": n, "api_keys": [f"sk-{n}"]} for n in ("a", "b", "c", "d", "e")]


def fair_pool_policy(limit: float, tenants: list[dict] = FAIR_TENANTS):
    fair = {**BIG, "max_queue": 20, "max_wait_ms": 5000, "fairness": {"mode": "fair"}}
    return make_policy(classes={"interactive": fair, "batch": fair}, shed={}, tenants=tenants,
                       pools={"pool_a": {"limit": {"enabled": True, "unit": "requests", "initial": limit, "min": 1,
                                                   "max": 10}}})


def asks(core, cls: str, tenant: str, n: int) -> list:
    return [core.decide(RequestFacts(api_key=f"sk-{tenant}", header_class=cls, model="llama", max_tokens=100))
            for _ in range(n)]


def test_the_owners_of_every_class_together_take_the_pool_to_twice_its_limit_at_most(clock):
    """docs/demo.md, the owner's return: the pool holds at most twice the limit. The owners' bound was per class
    (their shares of what their class holds, under its cap): with interactive's flood and owner over the limit,
    batch's owners went on past twice the limit (a limit of 10 held 23)."""
    core = AdmissionController(fair_pool_policy(10), clock=clock)
    gate = core.gates["pool_a"]
    asks(core, "batch", "c", 5)         # c borrows batch's room before the flood
    asks(core, "interactive", "a", 5)   # a's flood fills the limit
    asks(core, "interactive", "b", 5)   # b is owed its half of what the class holds: over the full limit
    assert gate.inflight == 15
    asks(core, "batch", "d", 5)         # d and e are owed their shares of what c holds
    asks(core, "batch", "e", 5)
    assert gate.inflight == 20


def test_a_flow_alone_in_its_class_is_owed_nothing_on_a_pool_another_class_fills(clock):
    """Strict priority: the owner's return gives a flow room its own class's borrowers took, not room another
    class holds. Batch's one tenant, the whole share of a class that held nothing, went in over a pool that
    interactive had filled, and then held room interactive waited for."""
    core = AdmissionController(fair_pool_policy(10), clock=clock)
    gate = core.gates["pool_a"]
    asks(core, "interactive", "a", 10)
    # Its one request a class holding nothing may run (PoolGate.guaranteed), then none over the full pool.
    assert [d.kind for d in asks(core, "batch", "c", 3)] == [ACCEPT, QUEUE, QUEUE] and gate.inflight == 11


SIX_TENANTS = [{"name": n, "api_keys": [f"sk-{n}"]} for n in "abcdef"]


def test_a_flow_whose_share_is_under_one_request_is_owed_one_while_the_borrowers_hold_that_much(clock):
    """The owner's return lets a flow in over the full limit while it stays within its share of what its class
    holds. With many flows a share is under one request, so a flow holding nothing was never owed: with 24
    tenants, small ones asking a fraction of their due lost 3-7% of their requests to the fallback
    (scenarios/audit-zipf-tiers.yaml). It is owed one now while the flows over their shares hold that much over
    them; never a second, and never past twice the limit."""
    core = AdmissionController(fair_pool_policy(4, SIX_TENANTS), clock=clock)
    gate = core.gates["pool_a"]
    asks(core, "interactive", "a", 4)   # a's flood fills the limit
    for tenant in "bcd":                # each within its share of what the class holds (1/2, 1/3, 1/4 of 4)
        assert asks(core, "interactive", tenant, 1)[0].kind == ACCEPT
    # e's share is 1/5 of 4 requests: under its one. a holds 4 of 7 where its share is 1/5: e is owed one.
    assert [d.kind for d in asks(core, "interactive", "e", 2)] == [ACCEPT, QUEUE]
    assert gate.inflight == 8           # twice the limit: f's one is not owed past it
    assert asks(core, "interactive", "f", 1)[0].kind == QUEUE


def test_a_flow_whose_share_is_under_one_request_is_not_owed_when_every_holder_holds_one(clock):
    """A flow's one request is never over its share: with more flows than the limit holds requests, each holder's
    share is under its one too, and counted as borrowers they let every newcomer in, to twice the limit for as
    long as the flood lasted (bench/scale.py's 1,000 tenants)."""
    core = AdmissionController(fair_pool_policy(4, SIX_TENANTS), clock=clock)
    for tenant in "abcd":               # the limit full, one request each
        assert asks(core, "interactive", tenant, 1)[0].kind == ACCEPT
    assert asks(core, "interactive", "e", 1)[0].kind == QUEUE  # its share is 1/5 of 4: under its one request
    assert core.gates["pool_a"].inflight == 4


def test_after_a_reload_that_shrinks_the_limit_owners_go_in_only_under_twice_the_new_limit(clock):
    core = AdmissionController(fair_pool_policy(10), clock=clock)
    gate = core.gates["pool_a"]
    asks(core, "interactive", "a", 10)
    core.apply(fair_pool_policy(4))  # a's 10 run on: the pool is already at more than twice the new limit
    gate = core.gates["pool_a"]
    assert [d.kind for d in asks(core, "interactive", "b", 2)] == [QUEUE, QUEUE] and gate.inflight == 10


def test_what_is_held_is_exactly_zero_once_nothing_holds_it():
    gate = PoolGate("pool_a", spec(unit="tokens"), {}, [0.0], ["interactive"])
    for units in (0.1, 0.2):
        gate.take(0, units)
    for units in (0.1, 0.2):
        gate.give_back(0, units)
    assert gate.inflight == 0.0 and gate.held == [0.0]  # float sums drift: 2.8e-17 is not nothing


def spec(**kw) -> PoolLimitSpec:
    base = {"enabled": True, "unit": "requests", "initial": 20.0, "min": 1.0, "max": 100.0, "interval_s": 0.5,
            "window_s": 5.0, "min_samples": 5}
    return PoolLimitSpec(**{**base, **kw})


def test_saturation_for_two_moves_cuts_below_what_is_in_flight_once_per_drain():
    c = PoolLimit(spec(), {0: 2.0})
    c.update(0.0, 18, False, True)  # one saturated scrape is not enough (a blip behind a long prefill)
    assert c.limit == 20.0
    c.update(0.5, 18, False, True)
    assert c.limit == pytest.approx(14.4) and c.last_action == "cut_saturated"
    # Still saturated, but what is in flight has not come down to the new limit: the cut has not shown yet, and a
    # queue that never drains (a hung replica's) must not take the limit to its floor.
    for t in (1.0, 1.5, 2.0, 2.5):
        c.update(t, 16, False, True)
    assert c.limit == pytest.approx(14.4) and c.last_action == "hold"
    c.update(3.0, 14, False, True)  # drained under it, still saturated: cut again
    assert c.limit == pytest.approx(11.2) and c.last_action == "cut_saturated"


def test_a_fleeting_saturation_reading_counts_only_with_the_latency_near_its_target():
    # scenarios/code-completion.yaml: ~80 completions a second a replica, one request caught between its arrival
    # and the next engine step read as saturation (PoolSaturation.fleeting), and the limit was cut 8 times in the
    # calm minute with the latency at a quarter of its target (0.1 s against 0.425 s).
    c = PoolLimit(spec(), {0: 0.5})
    for t in (0.0, 0.5, 1.0):
        for _ in range(10):
            c.observe(0, t, t, 0.1)
        c.update(t, 18, False, True, fleeting=True)
    assert c.limit >= 20.0 and c.last_action != "cut_saturated"
    # The same reading with the latency near its target is how a ramp's onset shows first: it counts.
    c = PoolLimit(spec(), {0: 0.5})
    for t in (0.0, 0.5):
        for _ in range(10):
            c.observe(0, t, t, 0.3)
        c.update(t, 18, False, True, fleeting=True)
    assert c.last_action == "cut_saturated" and c.limit == pytest.approx(14.4)
    # And a reading that is not fleeting counts whatever the latency, as before.
    c = PoolLimit(spec(), {0: 0.5})
    for t in (0.0, 0.5):
        for _ in range(10):
            c.observe(0, t, t, 0.1)
        c.update(t, 18, False, True)
    assert c.last_action == "cut_saturated"


def test_latency_over_target_cuts_only_when_load_is_what_slows_it():
    c = PoolLimit(spec(), {0: 2.0})
    now = 0.0
    for _ in range(10):  # calm: 1.9 s at low load (long answers), over the 1.7 s target, but not from load
        c.observe(0, now, now, 1.9)
    c.update(now, 20, True, False)
    assert c.limit == 20.0 and c.last_action == "hold"
    now = 1.0
    for _ in range(30):
        c.observe(0, now, now, 3.0)  # now it is load: up from the calm baseline
    c.update(now, 20, True, False)
    assert c.last_action == "cut_latency" and c.limit < 20.0


def test_a_slow_ramp_cannot_drag_the_calm_baseline_up_while_the_limit_binds():
    # Found by a user's ramp (0.3x to 3x in 20 s steps): the baseline drifted 1% an interval whatever the load,
    # kept pace with the latency and the limit froze over the SLO for 90 s. It follows a slower mix only while
    # the limit does not bind.
    c = PoolLimit(spec(), {0: 2.0})
    now, served = 0.0, 1.0
    for _ in range(10):
        c.observe(0, now, now, served)
    c.update(now, 5, False, False)  # calm, not binding: the baseline is learned
    assert c.baseline[0] == 1.0
    actions = []
    for _ in range(120):  # the ramp: latency up 1% an interval while requests wait for room
        now += 0.5
        served *= 1.01
        for _ in range(10):
            c.observe(0, now, now, served)
        c.update(now, 0.95 * c.limit, True, False)
        actions.append(c.last_action)
    assert c.baseline[0] == 1.0
    assert "cut_latency" in actions and c.limit < 20.0


def test_raises_compound_at_most_a_quarter_within_one_median_service_time():
    # Found by a user's long-answer chat (median 1,200 output tokens, 5-15 s requests): a raise every interval
    # took the limit from 27K to 83K tokens before the first raise showed in latency.
    def raised_over(service_s: float, seconds: float) -> float:
        c = PoolLimit(spec(), {0: 40.0})  # an SLO far away: every raise takes its full step
        now = 0.0
        while now < seconds:
            for _ in range(10):
                c.observe(0, now, now, service_s)
            c.update(now, c.limit, True, False)
            now += 0.5
        return c.limit / 20.0
    assert raised_over(10.0, 9.9) == pytest.approx(1.25)   # 20 intervals, one feedback delay: a quarter
    assert raised_over(10.0, 19.9) == pytest.approx(1.25 ** 2, rel=0.05)  # a quarter per delay
    assert raised_over(0.4, 9.9) == pytest.approx(1.05 ** 20)  # short requests: 5% every interval, as before


def test_roomy_replicas_and_latency_under_half_its_target_raise_every_interval_whatever_the_service_time():
    # Found with scenarios/reasoning-spike.yaml (6K-token answers of 20-60 s, the KV cache 6% full, the latency
    # a quarter of its target): the quarter per median service time held the limit through a 2x spike, and 20% of
    # the first class was refused or degraded while the replicas had room for all of it.
    def raised_over(slo_s: float, roomy: bool) -> float:
        c = PoolLimit(spec(), {0: slo_s})
        now = 0.0
        while now < 9.9:
            for _ in range(10):
                c.observe(0, now, now, 10.0)  # 10 s answers
            c.update(now, c.limit, True, False, roomy)
            now += 0.5
        return c.limit / 20.0
    assert raised_over(40.0, roomy=True) == pytest.approx(1.05 ** 20)  # 3.4x room: 5% every interval
    assert raised_over(40.0, roomy=False) == pytest.approx(1.25)  # the replicas busy: a quarter per delay
    assert raised_over(20.0, roomy=True) == pytest.approx(1.25)  # 1.7x room: near the target, the bound holds


def test_an_idle_pool_keeps_half_the_limit_it_last_proved_under_load():
    # An operator audit: after 12 s idle the settle took the limit to its floor (1), and the next burst ran one
    # request at a time for most of a minute while raises climbed back 5% a step.
    c = PoolLimit(spec(), {0: 2.0})
    for _ in range(10):
        c.observe(0, 0.0, 0.0, 1.0)
    c.update(0.0, 20, True, False)  # binding, latency in target: 20 is proven
    now = 0.0
    while now < 60.0:  # idle: nothing in flight
        now += 0.5
        c.update(now, 0, False, False)
    assert c.limit == pytest.approx(10.0) and c.last_action in ("settle", "hold")


def test_an_idle_pool_whose_limit_never_bound_keeps_half_the_peak_it_served_in_target():
    # A pool that served 10 requests at once well within its target, its limit settled above them and never
    # binding (so never "proven"), then idle for 15 s: the settle followed the decaying peak down to the floor (1),
    # and the next burst ran one request at a time while raises climbed back 5% a step. (Found by a review.)
    c = PoolLimit(spec(), {0: 2.0})
    now = 0.0
    while now < 20.0:
        now += 0.5
        for _ in range(5):
            c.observe(0, now, now, 1.0)
        c.update(now, 10, False, False)
    assert c.limit == pytest.approx(15.0)  # the peak + 50%: never binding
    while now < 80.0:  # idle
        now += 0.5
        c.update(now, 0, False, False)
    assert c.limit == pytest.approx(5.0)


def test_raises_in_proportion_to_the_room_left_while_binding_and_settles_when_idle():
    c = PoolLimit(spec(), {0: 2.0})
    now = 0.0
    for _ in range(10):
        c.observe(0, now, now, 1.0)
    c.update(now, 20, True, False)
    assert c.limit == pytest.approx(21.0)  # 5% a step at most
    for _ in range(10):
        c.observe(0, 10.5, 10.5, 1.0)
    c.update(10.5, 2, False, False)
    assert c.last_action == "settle" and 2.0 < c.limit < 21.0


def test_after_a_latency_cut_the_quickest_first_completions_do_not_raise_the_limit():
    # scenarios/big-fleet.yaml: at ~150 completions a second, min_samples came within milliseconds of a cut, all
    # of them the shortest answers; the window read the latency at 40% of its target and the limit rose again
    # before the long answers admitted with them had ended (a saw-tooth, the p99 over the SLO through a spike).
    def cut_at_one_second() -> PoolLimit:
        c = PoolLimit(spec(), {0: 2.0})  # target 0.85 x 2 s = 1.7 s
        for _ in range(10):
            c.observe(0, 0.0, 0.0, 1.0)  # calm
        c.update(0.0, 20, True, False)
        for _ in range(30):
            c.observe(0, 1.0, 1.0, 3.0)  # load
        c.update(1.0, 20, True, False)
        assert c.last_action == "cut_latency"
        for key in range(40):            # the first interval's admissions after the cut
            c.admitted(0, 1.1, key)
        for key in range(10):            # the quickest ten of them are back: 0.4 s each
            c.observe(0, 1.1, 1.5, 0.4)
            c.ended(key)
        return c

    c = cut_at_one_second()
    cut = c.limit
    c.update(1.5, cut, True, False)
    assert c.last_action == "hold" and c.limit == cut  # 10 of 40 served: the window cannot speak for them yet
    for key in range(10, 38):            # 38 of 40 served (95%), well in target
        c.observe(0, 1.1, 2.0, 0.9)
        c.ended(key)
    c.update(2.0, cut, True, False)
    assert c.last_action == "raise" and c.limit > cut
    # A first interval that never completes (aborts, errors: they end unserved) holds the raise for target x SLO
    # at most.
    c = cut_at_one_second()
    for key in range(10, 40):
        c.ended(key)
    c.update(2.0, c.limit, True, False)
    assert c.last_action == "hold"
    c.update(2.8, c.limit, True, False)
    assert c.last_action == "raise"


def test_the_quantile_counts_requests_still_running_as_at_least_their_age():
    # Nothing running: the plain nearest-rank quantile, as RecentLatencies.quantile takes it.
    assert kaplan_meier_quantile([0.1 * i for i in range(1, 21)], [], 0.95) == (pytest.approx(1.9), True)
    # Ten quick answers back, ten still running at 2 s: half of them all may end later, the p95 is unknown yet.
    assert kaplan_meier_quantile([0.4] * 10, [2.0] * 10, 0.95) == (2.0, False)
    # Those ten end at 3 s: the p95 is theirs, not the 0.4 s the first ten read.
    assert kaplan_meier_quantile([0.4] * 10 + [3.0] * 10, [], 0.95) == (3.0, True)
    # A young request still running says little: the answers that ended keep their quantile.
    assert kaplan_meier_quantile([1.0] * 18 + [5.0] * 2, [0.1], 0.95) == (5.0, True)


def test_the_limit_does_not_rise_on_quick_answers_while_the_slow_ones_admitted_with_them_run():
    # The first class's slowest answers take several times its median (512-token answers, a 5 s SLO): requests
    # end in order of length, so the window held the quick ones first, read room that was not there, and the limit
    # rose each time until the long ones ended and cut it (worst 10 s windows 6.2-6.4 s; the policy needed a
    # hand-set max_raise of 0.01).
    c = PoolLimit(spec(), {0: 5.0})  # target 0.85 x 5 s = 4.25 s
    now = 0.0
    for key in range(20):
        c.admitted(0, now, key)
    now = 1.0
    for key in range(12):  # the quick twelve are back
        c.observe(0, 0.0, now, 0.8)
        c.ended(key)
    c.update(now, 20, True, False)
    assert c.last_action == "hold" and c.limit == 20.0  # eight may still take any time: no room is known
    now = 4.0
    for key in range(12, 20):  # the slow ones take 4 s
        c.observe(0, 0.0, now, 4.0)
        c.ended(key)
    c.update(now, 20, True, False)
    assert c.limit <= 20 * 1.015  # the p95 is known now, 4 s: in target with little room, so a crumb at most
    # A request ended unserved (withdrawn, an abort) does not hold the reading either.
    c = PoolLimit(spec(), {0: 5.0})
    for key in range(10):
        c.admitted(0, 0.0, key)
    for key in range(5):
        c.observe(0, 0.0, 1.0, 0.8)
        c.ended(key)
    for key in range(5, 10):
        c.ended(key)
    c.update(1.0, 20, True, False)
    assert c.last_action == "raise"


def test_a_pool_serving_far_under_its_target_settles_with_room_for_a_burst():
    # scenarios/shared-small: a small model's pool beside a large one, answers in a fifth of the SLO and one or
    # two requests in flight. At the recent peak + 50% a burst of three waited out its 200 ms and was refused.
    def settled(latency_s: float, roomy: bool) -> float:
        c = PoolLimit(spec(), {0: 2.0})  # target 0.85 x 2 s
        now = 0.0
        while now < 20.0:
            now += 0.5
            c.observe(0, now, now, latency_s)
            c.update(now, 2, False, False, roomy=roomy)
        return c.limit

    assert settled(0.34, roomy=True) == pytest.approx(2 * (1 + 0.5 * 4), rel=0.05)  # latency at a fifth: 5 - 1
    assert settled(0.34, roomy=False) == pytest.approx(3.0, rel=0.05)  # the replicas' word is needed for more
    assert settled(1.0, roomy=True) == pytest.approx(3.0, rel=0.05)  # nearer the target: + 50%, as before


def test_the_what_if_holds_the_slo_in_the_spike_with_the_pool_limit_and_gives_full_model_answers():
    from extproc.tools.demo.scenario import Scenario
    from extproc.tools.demo.whatif import what_if

    sc = Scenario.load("scenarios/spike.yaml")
    res = what_if(sc, "policies/demo-full.yaml", sc.fleet_capacity())
    start, end = sc.window("spike")
    inter = [r for r in res.records if start <= r.start < end and r.kind == "interactive"]
    full = [r for r in inter if r.ok and not r.degraded]
    assert len(full) > 0.3 * len(inter)
    lat = sorted(r.latency for r in inter if r.ok)
    # One seed's path through a controller that reacts to its own past: it measured 1.98-2.00 s here, the
    # seeds table (bench/seeds.py) judges changes; 2.5% over the SLO still catches a limit that does not hold.
    assert lat[int(0.99 * (len(lat) - 1))] <= 2.05


def test_a_request_waiting_on_its_own_class_cap_does_not_hold_lower_classes_off_a_pool_with_room(clock):
    core = AdmissionController(pool_policy(limit=4, interactive={"max_concurrency": 1}), clock=clock)
    assert core.decide(req("interactive")).kind == ACCEPT
    assert core.decide(req("interactive")).kind == QUEUE  # its class cap is full, not the pool
    assert [core.decide(req("batch")).kind for _ in range(2)] == [ACCEPT, ACCEPT]


def test_when_a_waiter_that_held_lower_classes_back_is_given_up_on_they_are_granted_at_once(clock):
    core = AdmissionController(pool_policy(limit=1000, unit="tokens"), clock=clock)
    assert core.decide(req("batch", tokens=200)).kind == ACCEPT         # 300 (its guarantee)
    assert core.decide(req("interactive", tokens=100)).kind == ACCEPT   # 200: 500 held
    big = core.decide(req("interactive", tokens=500))                   # 600 more: does not fit
    small = core.decide(req("batch"))                                   # 100 fits under 850, but big waits
    assert (big.kind, small.kind) == (QUEUE, QUEUE)
    core.abandon(big.waiter, timed_out=False)  # its client left: nothing waits above batch any more
    assert small.waiter.result.kind == ACCEPT


def test_a_class_that_completes_few_requests_still_steers_the_limit_from_its_last_samples():
    c = PoolLimit(spec(min_samples=5), {0: 2.0})
    for i in range(5):  # one completion every 4 s: never 5 in one 5 s window
        c.observe(0, 4.0 * i, 4.0 * i, 1.0)
    assert c.latency_ratio(16.0)[0] == pytest.approx(0.85 * 2.0 / 1.0)
    assert c.latency_ratio(16.0 + 6 * 5.0)[0] is None  # older than six windows: no longer evidence


def breaker_open_on_a_full_pool(clock) -> AdmissionController:
    """Batch holds 6 of a limit of 8 (its 85%), interactive the rest, and interactive's latency breaker opens: its
    next request queues while batch yields, and batch is squeezed."""
    core = AdmissionController(pool_policy(limit=8), clock=clock)
    for _ in range(6):
        core.decide(req("batch"))
    core.decide(req("interactive"))
    core.decide(req("interactive"))
    breaker = core.pool_breakers("interactive", "pool_a")[0]
    for _ in range(5):
        breaker.observe(clock(), 5.0, False)
    assert core.decide(req("interactive")).kind == QUEUE  # not degraded: batch yields instead
    return core


def test_a_breaker_that_stays_open_squeezes_lower_classes_once(clock):
    core = breaker_open_on_a_full_pool(clock)
    gate = core.gates["pool_a"]
    first_until = gate.squeezed_until(1)  # batch's
    assert first_until > clock()
    clock.advance(1.0)
    core.decide(req("interactive"))
    assert gate.squeezed_until(1) == first_until  # the same opening does not renew it


def test_a_reload_that_replaces_the_gate_keeps_a_squeeze_to_its_one_cooldown(clock):
    # A reload that replaced the pool's gate (borrow_lower toggled, a knob tuned) dropped the squeeze: batch went
    # beyond its guarantee at once with the breaker still open on a full pool, and the next interactive request
    # squeezed it again for a whole new cooldown in the same opening (found by the model-based test).
    core = breaker_open_on_a_full_pool(clock)
    first_until = core.gates["pool_a"].squeezed_until(1)
    clock.advance(1.0)
    core.apply(pool_policy(limit=8, borrow_lower=True))  # a new gate
    gate = core.gates["pool_a"]
    assert gate.held_to_share(1, clock()) == (0.0, first_until - clock())  # still held to its guarantee
    core.decide(req("interactive"))
    assert gate.squeezed_until(1) == first_until  # the same opening does not renew it


def test_two_breakers_squeezing_at_once_each_hold_the_classes_below_them_once_for_their_cooldown():
    # Interactive's and standard's latency breakers open on one full pool, 4 s apart. One (rank, until) for both:
    # standard's squeeze freed standard from interactive's at once, and each request of the other class renewed
    # the squeeze as a new opening, so the classes below were held to their guarantee past one cooldown each.
    gate = PoolGate("pool_a", spec(), {}, [0.0, 0.0, 0.0], ["interactive", "standard", "batch"])
    assert gate.squeeze(0, 100.0, 110.0)  # interactive's breaker, opened at 100 s: the classes below until 110
    assert gate.squeeze(1, 104.0, 114.0)  # standard's, opened at 104 s: batch until 114
    assert gate.held_to_share(1, 105.0) == (0.0, 5.0)  # standard is still held for interactive
    assert gate.held_to_share(2, 105.0) == (0.0, 9.0)
    assert not gate.squeeze(0, 100.0, 116.0)  # interactive's same opening again: once
    assert gate.held_to_share(1, 111.0) == (0.0, 0.0) and gate.held_to_share(2, 111.0) == (0.0, 3.0)
    assert gate.held_to_share(0, 105.0) == (0.0, 0.0)


def tenants_core(clock, mode: str) -> AdmissionController:
    """One interactive class of two tenants of equal weight under a pool limit of 1000 tokens."""
    classes = {"interactive": {**BIG, "max_wait_ms": 200, "fairness": {"mode": mode}},
               "batch": {**BIG, "max_wait_ms": 5000}}
    tenants = [{"name": n, "api_keys": [f"sk-{n}"], "max_class": "interactive", "default_class": "interactive"}
               for n in ("a", "b")]
    return AdmissionController(make_policy(
        classes=classes, shed={}, tenants=tenants,
        pools={"pool_a": {"limit": {"enabled": True, "unit": "tokens", "initial": 1000, "min": 1, "max": 1000}}}),
        clock=clock)


def treq(tenant: str, tokens: int) -> RequestFacts:
    return RequestFacts(api_key=f"sk-{tenant}", model="llama", max_tokens=100, doc={"prompt": "x" * (4 * tokens)})


@pytest.mark.parametrize("mode", ["fifo", "fair"])
def test_a_flow_under_its_share_goes_in_over_a_full_pool_and_the_borrower_waits(clock, mode):
    core = tenants_core(clock, mode)
    gate = core.gates["pool_a"]
    a = [core.decide(treq("a", 400)) for _ in range(2)]  # 500 tokens each: a holds the whole limit
    assert [d.kind for d in a] == [ACCEPT, ACCEPT] and gate.inflight == pytest.approx(1000)
    b = [core.decide(treq("b", 100)) for _ in range(3)]  # 200 each; b's share: half of the class, <= 500
    a3 = core.decide(treq("a", 400))
    assert a3.kind == QUEUE
    if mode == "fifo":  # today: b waits behind the pool a fills
        assert [d.kind for d in b] == [QUEUE] * 3
        return
    # The owner's return: b goes in over the limit up to its share (two of 200, not a third); a, the borrower, waits.
    assert [d.kind for d in b] == [ACCEPT, ACCEPT, QUEUE] and gate.inflight == pytest.approx(1400)
    core.finish(b[0].ticket, Outcome.OK)  # still over the limit: b's waiter is owed its share, a's is not
    assert b[2].waiter.result.kind == ACCEPT and a3.waiter.pending
    assert gate.inflight == pytest.approx(1400) and gate.flows[0]["b"][0] == pytest.approx(400)
    for d in (*a, b[1], b[2]):
        core.finish(d.ticket if d.ticket is not None else d.waiter.result.ticket, Outcome.OK)
    assert a3.waiter.result.kind == ACCEPT and gate.flows[0].keys() == {"a"}
    assert gate.inflight == pytest.approx(500) == gate.flows[0]["a"][0]


def test_the_gpu_seconds_a_class_holds_are_exactly_zero_once_its_requests_end(pcore):
    tickets = [pcore.decide(req("interactive", tokens=n)).ticket for n in (25, 500, 9)]
    for t in tickets:
        pcore.finish(t, Outcome.OK)
    assert pcore.snapshot()["interactive"]["inflight_cost"] == 0.0  # not a float sum's leftover (1e-17)


def test_a_degrade_that_stays_on_its_pool_weighs_on_the_pool_limit(clock):
    # `fallback: {action: degrade, max_tokens: 128}` with no model sends the overflow back to the same pool. It
    # went in without the pool's limit (a user's what-if: worst window 5.98 s against a 3 s SLO); now it holds
    # its units like its class and is refused when the pool has no room for it either.
    policy = pool_policy(limit=2, interactive={"max_wait_ms": 0, "max_queue": 0,
                                               "fallback": {"action": "degrade", "max_tokens": 16}})
    core = AdmissionController(policy, clock=clock)
    a, b = core.decide(req("interactive")), core.decide(req("interactive"))
    assert (a.kind, b.kind) == (ACCEPT, ACCEPT) and held(core)[0] == 2
    over = core.decide(req("interactive"))
    assert over.kind == "reject" and over.reason == "degraded_capacity_full" and "at its limit" in over.message
    core.finish(a.ticket, Outcome.OK)
    assert held(core)[0] == 1  # the refused degrade held nothing


def test_a_degraded_request_holds_its_class_rank_and_clamped_tokens_on_the_fallback_pools_limit(clock):
    policy = make_policy(
        classes={"interactive": {**BIG, "max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0,
                                 "on_overflow": "fallback",
                                 "fallback": {"action": "degrade", "model": "small", "max_tokens": 10}},
                 "batch": {**BIG, "max_wait_ms": 5000}},
        shed={}, pools={"pool_b": {"limit": {"enabled": True, "unit": "tokens", "initial": 1000, "min": 1,
                                             "max": 1000}}})
    core = AdmissionController(policy, clock=clock)
    assert core.decide(req("interactive")).kind == ACCEPT       # pool_a: no limit there
    d = core.decide(req("interactive", tokens=200))              # overflow: degraded onto pool_b
    gate = core.gates["pool_b"]
    assert d.kind == DEGRADE and d.ticket.rank == 0 and gate.count == [1, 0]
    assert 200 <= gate.inflight <= 200 + 10                      # its prompt and at most max_tokens
    core.finish(d.ticket, Outcome.OK)
    assert gate.inflight == 0 and gate.count == [0, 0]


def test_requests_a_stalled_replica_holds_do_not_hold_the_limit_shut():
    gate = PoolGate("pool_a", spec(initial=10.0), {}, [0.0, 0.0], ["interactive", "batch"])
    for _ in range(10):
        gate.take(0, 1.0)
    assert not gate.fits(0, 1.0, 0.0)  # full
    hung = PoolSaturation()
    hung.stalled, hung.stalled_requests = 1, 4.0  # a hung replica holds 4 of the 10
    gate.update(1.0, hung)
    assert gate.stuck == 4.0 and gate.fits(0, 1.0, 1.0) and not gate.full(1.0)
    gate.update(2.0, PoolSaturation())  # it moves again (or its requests ended): they count again
    assert gate.stuck == 0.0 and gate.full(2.0)



def test_requests_a_stalled_replica_may_hold_are_no_latency_of_the_pool():
    # They end only when their clients give up: counted as running, their ages read as the pool's latency and held
    # the limit's raises (and cut it) while the working replicas answered in time.
    gate = PoolGate("pool_a", spec(initial=10.0), {0: 5.0}, [0.0, 0.0], ["interactive", "batch"])
    c = gate.controller
    for key in range(4):
        c.admitted(0, 0.0, key)  # on the replica that hangs
    for i in range(20):
        c.observe(0, 10.0, 20.0 + i * 0.01, 1.0)  # the working replica's answers, 1 s each
    # (target x SLO over the p95, loaded): four of 24 still running at 21 s read a p95 of at least 21 s.
    assert c.latency_ratio(21.0)[0] == pytest.approx(4.25 / 21)
    hung = PoolSaturation()
    hung.stalled, hung.stalled_requests = 1, 4.0
    gate.update(21.0, hung)  # the stall is seen
    assert c.latency_ratio(22.0) == (pytest.approx(4.25), False)  # the working replica's 1 s p95, and calm
    gate.update(23.0, PoolSaturation())  # it moves again: what it holds is the pool's again, 23 s and more
    assert c.last_action == "cut_latency"


def hung(requests: float, now: float) -> PoolSaturation:
    """A reading of a pool with one replica stalled, holding `requests` by its own gauges."""
    sat = PoolSaturation()
    sat.stalled, sat.stalled_requests, sat.updated_at = 1, requests, now
    return sat


@pytest.mark.parametrize("reload", [False, True])
def test_a_hung_replica_s_requests_whose_clients_left_free_no_room_on_the_working_replicas(clock, reload):
    """A wedged engine's gauges keep its requests after their clients gave up (nothing steps to drop them). The
    limit left that many out of what it holds, by then all on the working replicas: they got that many over the
    limit for as long as the hang lasted (docs/reliability.md: only the hung replica's requests are not counted).
    Only requests taken before the stall was seen can be there (the later ones are steered to the others)."""
    core = AdmissionController(pool_policy(limit=4), clock=clock)
    on_hung = [core.decide(req("interactive")).ticket for _ in range(2)]
    before = [core.decide(req("interactive")).ticket for _ in range(2)]  # on the working replica
    core.set_saturation("pool_a", hung(2.0, clock()))
    clock.advance(0.1)
    core.tick()
    gate = core.gates["pool_a"]
    assert gate.stuck == 2.0  # the limit no longer counts them: two more go in, to the working replica
    steered = [core.decide(req("interactive")).ticket for _ in range(2)]
    assert all(steered) and gate.inflight - gate.stuck == 4
    if reload:  # a new gate: what it holds moves there with the stall it was taken in
        core.apply(pool_policy(limit=4, knobs={"interval_s": 2.0}))
        assert core.gates["pool_a"] is not gate
        gate = core.gates["pool_a"]
    for t in on_hung:  # their clients give up; the hung replica still says it holds them
        core.finish(t, Outcome.CLIENT_ABORT)
    for t in before:
        core.finish(t, Outcome.OK)
    core.set_saturation("pool_a", hung(2.0, clock()))
    clock.advance(0.1)
    core.tick()
    # Were 4 more (the hung replica's 2 left out of what the working one held): 6 there on a limit of 4.
    more = [core.decide(req("interactive")) for _ in range(3)]
    assert [d.kind for d in more] == [ACCEPT, ACCEPT, QUEUE] and gate.stuck == 0.0 and gate.inflight == 4


def test_a_stalled_replica_s_sequences_weigh_one_request_unit_each():
    """In requests a request weighs the sequences vLLM runs for it (n x prompts), and a hung replica's gauges count
    sequences: the stalled share is those sequences, not that many mean-sized requests (an n=4 request on the hung
    replica left 16 units out of 8 held, i.e. all of them)."""
    gate = PoolGate("pool_a", spec(initial=10.0), {}, [0.0, 0.0], ["interactive", "batch"])
    gate.take(0, 4.0)  # n=4, on the replica that hangs
    gate.take(0, 4.0)  # n=4, on one that works
    hung = PoolSaturation()
    hung.stalled, hung.stalled_requests = 1, 4.0
    gate.update(1.0, hung)
    assert gate.stuck == 4.0

def test_a_resting_request_of_a_class_a_reload_removed_ends_cleanly(clock):
    core = AdmissionController(pool_policy(internal={"min_share": 0.1}), clock=clock)
    t = over_share(core, "internal").ticket
    assert t.rest > 0
    core.apply(pool_policy(limit=6, order=("interactive", "batch")))  # a new gate; internal has no rank on it
    gate = core.gates["pool_a"]
    holding = gate.holding
    clock.advance(10)
    core.finish(t, Outcome.OK)  # raised TypeError: the rest was set for rank None
    assert gate.holding == holding - 1


@pytest.mark.parametrize("order", [("interactive", "batch", "internal"), ("interactive", "internal", "batch")])
def test_a_class_rests_across_a_reload_that_replaces_its_gate_under_its_new_rank(clock, order):
    core = AdmissionController(pool_policy(batch={"min_share": 0.1}), clock=clock)
    ran_over_share(core, clock)  # batch rests 15 s
    core.apply(pool_policy(limit=5, order=order, batch={"min_share": 0.1}))  # a new gate (limit spec changed)
    core.decide(req("interactive"))
    assert core.decide(req("interactive")).kind == QUEUE
    waiting = core.decide(req("batch"))
    assert waiting.kind == QUEUE  # still resting: the reload did not hand it a fresh request over its share
    core.abandon(waiting.waiter, timed_out=False)
    clock.advance(15.1)
    assert core.decide(req("batch")).kind == ACCEPT


def test_a_request_over_the_share_that_never_ran_does_not_rest_its_class(clock):
    # Its admission revoked (the shared store gave no global slot within its wait): nothing ran, nothing was held
    # of the replicas, so nothing is owed. It rested the class 1.5x the time it waited for the store.
    core = AdmissionController(pool_policy(batch={"min_share": 0.1}), clock=clock)
    d = over_share(core)
    assert d.ticket.rest > 0
    clock.advance(5)
    core.revoke(d, "queue_timeout", "no global slot")
    assert core.decide(req("interactive")).kind == QUEUE
    assert core.decide(req("batch")).kind == ACCEPT  # its guarantee holds at once


@pytest.mark.parametrize("taken_back", ["withdraw", "revoke"])
def test_a_request_admitted_after_a_latency_cut_that_never_ran_is_not_waited_for(pcore, clock, taken_back):
    # After a latency cut the limit may not rise until most of the first interval's admissions are served
    # (PoolLimit._blind); one given back unused (a store's revoke, a grant whose client left in the same instant,
    # the stream's withdrawal) is never served, and held the window blind up to target x SLO.
    limit = pcore.gates["pool_a"].controller
    limit._fresh(clock(), "cut_latency")
    ran = [pcore.decide(req("interactive")).ticket for _ in range(2)]
    given_back = pcore.decide(req("interactive"))
    if taken_back == "withdraw":
        pcore.withdraw(given_back.ticket)
    else:
        pcore.revoke(given_back, "client_disconnected", "gone")
    clock.advance(0.6)  # past the interval: the cohort is the three admitted in it
    for t in ran:
        pcore.finish(t, Outcome.OK)
        pcore.report(t.id, Completion(Outcome.OK, 200, 0.1, 0.6))
    assert not limit._blind(clock())  # both that ran are served


def test_the_core_asks_to_be_ticked_at_half_its_quickest_limit_interval_within_bounds(clock):
    core = AdmissionController(pool_policy(knobs={"interval_s": 0.1}), clock=clock)
    assert core.tick_s == 0.05  # a move is at most half an interval late
    core.apply(pool_policy(knobs={"interval_s": 0.05}))
    assert core.tick_s == 0.025  # the floor: finer ticks cost more than they buy
    core.apply(pool_policy(knobs={"interval_s": 5.0}))
    assert core.tick_s == 0.1    # the ceiling: queue grants and the limit's in-flight samples still need it
    core.apply(pool_policy(knobs={"enabled": False}))
    assert core.tick_s == 0.1    # nothing moves by itself


def test_a_refusal_after_waiting_for_the_pool_names_the_pool_and_what_held_it(clock):
    # An on-call reading "class 'batch' had no free slot" tuned batch's cap, which had room: the pool-wide limit
    # (and the higher class waiting for it) held the request. The message says so; one held by its own cap does not.
    core = AdmissionController(pool_policy(batch={"max_concurrency": 2}), clock=clock)
    batch = [core.decide(req("batch")) for _ in range(3)]
    assert [d.kind for d in batch] == [ACCEPT, ACCEPT, QUEUE]  # the third: batch's own cap of 2
    capped = core.abandon(batch[2].waiter, timed_out=True)
    assert "pool" not in capped.message
    core.finish(batch[1].ticket, Outcome.OK)
    for _ in range(3):
        assert core.decide(req("interactive")).kind == ACCEPT
    assert core.decide(req("interactive")).kind == QUEUE
    waiting = core.decide(req("batch"))
    assert waiting.kind == QUEUE  # batch has room under its cap of 2: the pool holds it
    clock.advance(5.1)
    refused = core.abandon(waiting.waiter, timed_out=True)
    assert refused.reason == "queue_timeout"
    assert "pool 'pool_a'" in refused.message and "'interactive' waits" in refused.message, refused.message


def test_a_refusal_names_the_rest_that_held_its_class(clock):
    core = AdmissionController(pool_policy(batch={"min_share": 0.1}), clock=clock)
    ran_over_share(core, clock)  # interactive's waiter takes the room; the class rests 15 s
    waiting = core.decide(req("batch"))
    assert waiting.kind == QUEUE
    clock.advance(5.1)
    refused = core.abandon(waiting.waiter, timed_out=True)
    assert "resting" in refused.message and "min_share" in refused.message, refused.message


def test_a_full_queue_of_requests_waiting_for_the_pool_says_so_not_that_the_class_is_at_capacity(clock):
    core = AdmissionController(pool_policy(batch={"max_queue": 1}), clock=clock)
    for _ in range(4):
        core.decide(req("interactive"))
    assert core.decide(req("interactive")).kind == QUEUE
    assert [core.decide(req("batch")).kind for _ in range(2)] == [ACCEPT, QUEUE]  # its guarantee, then the pool
    full = core.decide(req("batch"))
    assert full.reason == "queue_full"
    assert "pool 'pool_a'" in full.message and "'interactive' waits" in full.message, full.message
    assert "its queue waits for pool" in full.message  # 1 of its 100 slots taken: not its cap


def test_a_degrade_for_a_full_queue_waiting_for_the_pool_says_so(clock):
    core = AdmissionController(pool_policy(interactive={"max_queue": 1}), clock=clock)
    for _ in range(4):
        core.decide(req("interactive"))
    assert core.decide(req("interactive")).kind == QUEUE
    degraded = core.decide(req("interactive"))
    assert (degraded.kind, degraded.reason) == (DEGRADE, "queue_full")
    assert "its queue waits for pool 'pool_a': the limit is full: 4.0 of 4.0 requests held" in degraded.message, \
        degraded.message


def test_a_waiter_whose_room_came_back_without_a_release_is_not_told_the_pool_was_full(clock):
    # Waiters are granted at releases: a rest that runs out gives the class its guarantee back with no release to
    # grant it, and the waiter times out with room there. Its refusal said "no free slot" (its cap: it had room),
    # or "the limit is full" with room under it (seen on the real stack: 4 of 61 batch timeouts).
    core = AdmissionController(pool_policy(batch={"min_share": 0.1, "max_wait_ms": 20000}), clock=clock)
    ran_over_share(core, clock)  # rests until +15 s
    waiting = core.decide(req("batch"))
    assert waiting.kind == QUEUE
    clock.advance(16)
    refused = core.abandon(waiting.waiter, timed_out=True)
    assert "pool 'pool_a'" in refused.message and "without a release" in refused.message, refused.message
    assert "full" not in refused.message


def test_a_request_for_another_pool_does_not_wait_behind_its_class_waiting_for_this_one(pcore):
    # scenarios/moe-rag.yaml: interactive RAG waited for the Mixtral pool's limit while the same class's chat product
    # on the idle 8B pool was refused (deadline_unmeetable) or queued behind it: the class's queue is one FIFO.
    for _ in range(4):
        assert pcore.decide(req("interactive")).kind == ACCEPT
    waiting = pcore.decide(req("interactive"))
    assert waiting.kind == QUEUE  # for pool_a
    assert pcore.decide(req("interactive", model="small")).kind == ACCEPT  # its pool has room, its class too
    assert pcore.decide(req("interactive")).kind == QUEUE  # behind the first waiter for pool_a, as before
    assert held(pcore) == (4, [4, 0, 0], [2, 0, 0])


def test_a_limit_turned_on_counts_a_shadow_request_enforce_would_degrade_where_enforce_runs_it(clock):
    # Found by the shadow model test (test_admission_model_shadow.py): a request enforce would degrade to `small`
    # runs in shadow on its own pool, holding the degraded slot. A reload turning a limit on for its own pool
    # counted it there (enforce runs it on the fallback's pool), so the limit looked full one request early: the
    # waiter enforce grants stayed in its virtual place, and shadow counted what enforce would not do.
    def loaded(mode, cap=3, pools=None):
        return make_policy(mode=mode, tenants=[], shed={}, pools=pools or {}, classes={"interactive": {
            "max_concurrency": cap, "max_queue": 2, "max_wait_ms": 1000, "on_overflow": "fallback",
            "fallback": {"action": "degrade", "model": "small", "max_concurrency": 1}}})

    held_by = {}
    for mode in ("enforce", "shadow"):
        core = AdmissionController(loaded(mode), clock=clock)
        ds = [core.decide(RequestFacts(header_class="interactive", model="llama", max_tokens=100))
              for _ in range(6)]  # 3 run, 2 wait, 1 degraded
        assert sum(d.kind == DEGRADE for d in ds) == (1 if mode == "enforce" else 0)
        core.apply(loaded(mode, 5, {"pool_a": {"limit": {"enabled": True, "unit": "requests", "initial": 4, "min": 4,
                                                      "max": 4}}}))
        held_by[mode] = (core.gates["pool_a"].inflight, core.limiters["interactive"].inflight,
                         len(core.limiters["interactive"].queue))
    assert held_by["shadow"] == held_by["enforce"]


def down(now: float) -> PoolSaturation:
    """A reading of a pool whose every replica refused the connection (or none is listed)."""
    sat = PoolSaturation()
    sat.saturated, sat.down, sat.updated_at = True, True, now
    return sat


def test_a_pool_with_no_replica_up_keeps_its_limit_for_their_return(clock):
    """Read as load, 30 s with every replica down (a restart, or the ext_proc up before its replicas) cut the
    limit to its floor, 1, and the replicas came back to a pool that took one request at a time, the limit
    climbing back at `max_raise` a move (~2 minutes to 20K tokens). Its requests meanwhile fail fast (Envoy: no
    healthy upstream), and nothing of it says how much the replicas take."""
    core = AdmissionController(pool_policy(limit=20, knobs={"max": 100}), clock=clock)
    gate = core.gates["pool_a"]
    for _ in range(10):  # served before: 12 at a time, 1 s each, the latency well within its target
        held = [core.decide(req("interactive")).ticket for _ in range(12)]
        for _ in range(10):
            core.set_saturation("pool_a", PoolSaturation())
            clock.advance(0.1)
            core.tick()
        for t in held:
            core.report(t.id, Completion(Outcome.OK, 200, 0.1, 1.0))
            core.finish(t, Outcome.OK)
    before = gate.limit
    for _ in range(300):
        core.set_saturation("pool_a", down(clock()))
        t = core.decide(req("interactive")).ticket
        clock.advance(0.05)
        core.tick()  # one in flight at a time: read as the demand, the limit settled towards it (1.5 of them)
        core.report(t.id, Completion(Outcome.UPSTREAM_ERROR, 503, 0.001, 0.001))  # no healthy upstream
        core.finish(t, Outcome.UPSTREAM_ERROR)
        clock.advance(0.05)
    assert gate.limit == before >= 12 and gate.inflight == 0


def test_a_hung_replica_that_dies_with_the_pool_leaves_nothing_stuck(clock):
    """The pool's last replica, stalled, then killed: its requests are gone with it, and the room the stall left out
    of what the pool holds must not outlive it while the limit holds through the outage."""
    core = AdmissionController(pool_policy(limit=4), clock=clock)
    gate = core.gates["pool_a"]
    [core.decide(req("interactive")).ticket for _ in range(2)]
    core.set_saturation("pool_a", hung(2.0, clock()))
    clock.advance(0.1)
    core.tick()
    assert gate.stuck == 2.0 and gate.stall
    core.set_saturation("pool_a", down(clock()))
    clock.advance(0.6)
    core.tick()
    assert gate.stuck == 0.0 and not gate.stall and gate.limit == 4




def test_a_flow_is_owed_its_share_among_the_flows_on_the_pool_not_the_tenants_of_other_pools(clock):
    """The owner's return compares a flow with what its class holds on this pool, so its share is among the flows
    active there. Counted among every tenant active in the class, a weight-3 tenant beside a weight-1 one on a full
    70B pool was owed 3/5 of it while a third tenant ran on the 8B pool, not 3/4: it got 65% of the 70B's
    GPU-seconds (scenarios/audit-three-models-hot.yaml)."""
    tenants = [{**t, "weight": 3} if t["name"] == "a" else t for t in FAIR_TENANTS]
    core = AdmissionController(fair_pool_policy(10, tenants), clock=clock)
    gate = core.gates["pool_a"]
    asks(core, "interactive", "a", 6)
    asks(core, "interactive", "b", 4)   # the limit is full: a holds 6 of the class's 10 there, under its 3/4
    assert core.decide(RequestFacts(api_key="sk-c", header_class="interactive", model="small",
                                    max_tokens=100)).kind == ACCEPT  # c runs on pool_b
    assert [d.kind for d in asks(core, "interactive", "a", 2)] == [ACCEPT, QUEUE]  # 7 of 11; 8 of 12 is past 3/4
    assert gate.inflight == 11
