"""Flow control inside a class, through the admission core: the class's fairness mode picks which tenant's waiter a
freed slot goes to; FIFO stays the default; deadlines, reloads and learned usage reach the fair queue."""

import pytest

from extproc.policy.admission import ACCEPT, QUEUE, REJECT, AdmissionController, RequestFacts
from extproc.policy.fairness import nested
from extproc.policy.limits import Completion, Outcome
from extproc.policy.schema import PolicyError
from tests.conftest import make_policy

TENANTS = [{"name": n, "api_keys": [f"sk-{n}"]} for n in ("a", "b", "c")]


def policy(mode: str = "fifo", key: str = "tenant", tenants=TENANTS, **overrides):
    return make_policy(classes={"interactive": {"max_concurrency": 2, "max_queue": 10, "max_wait_ms": 1000,
                                                "fairness": {"mode": mode, "key": key}}},
                       tenants=tenants, **overrides)


def core_with(clock, mode: str = "fifo", **kw) -> AdmissionController:
    core = AdmissionController(policy(mode, **kw), clock=clock)
    cores.append(core)
    return core


def ask(core, tenant: str, prompt_chars: int = 400, **facts):
    return core.decide(RequestFacts(api_key=f"sk-{tenant}", model="llama", max_tokens=100,
                                    doc={"prompt": "x" * prompt_chars}, **facts))


def grants(core, running, n: int) -> list[str]:
    """Finish `n` running requests one by one; the tenants granted, in order."""
    order = []
    for _ in range(n):
        t = running.pop(0)
        before = {id(w) for w in core.limiters["interactive"].queue}
        core.finish(t, Outcome.OK)
        after = {id(w) for w in core.limiters["interactive"].queue}
        granted = [d for d in pending if id(d.waiter) in before - after and d.waiter.result.kind == ACCEPT]
        for d in granted:
            order.append(d.tenant)
            running.append(d.waiter.result.ticket)
            pending.remove(d)
    return order


pending: list = []
cores: list[AdmissionController] = []  # the cores core_with made in this test


@pytest.fixture(autouse=True)
def _fresh():
    pending.clear()
    cores.clear()


def flood(core, clock):
    """A holds both slots and queues 4 more; then B and C queue one each."""
    running = [ask(core, "a").ticket, ask(core, "a").ticket]
    for t in ["a", "a", "a", "a", "b", "c"]:
        d = ask(core, t)
        assert d.kind == QUEUE
        pending.append(d)
        clock.advance(0.001)
    return running


def test_fifo_is_the_default_and_serves_in_arrival_order(clock):
    core = core_with(clock)
    assert core.limiters["interactive"].queue.mode == "fifo"
    assert grants(core, flood(core, clock), 6) == ["a", "a", "a", "a", "b", "c"]


def test_round_robin_gives_each_waiting_tenant_a_turn(clock):
    core = core_with(clock, "round_robin")
    assert grants(core, flood(core, clock), 6) == ["a", "b", "c", "a", "a", "a"]


def test_fair_serves_the_tenants_that_were_served_least_first(clock):
    core = core_with(clock, "fair")
    order = grants(core, flood(core, clock), 6)
    # B and C join at A's virtual time (no credit for having been idle) and each gets a share of the next grants
    assert order[0] in ("b", "c") and sorted(order[:3]) == ["a", "b", "c"]
    assert order[3:] == ["a"] * 3  # work-conserving: A gets every slot nobody else waits for


@pytest.mark.parametrize("mode, order", [("fair", ["a", "b", "b", "b"]), ("round_robin", ["a", "b", "a", "b"])])
def test_fair_counts_gpu_seconds_where_round_robin_counts_turns(clock, mode, order):
    core = core_with(clock, mode)
    running = [ask(core, "c").ticket, ask(core, "c").ticket]
    for t in ["a", "a", "b", "b", "b"]:
        pending.append(ask(core, t, prompt_chars=40_000 if t == "a" else 400))  # A's requests cost ~10x B's
        clock.advance(0.001)
    assert grants(core, running, 4) == order


def test_a_tenant_weight_buys_a_larger_share(clock):
    tenants = [{**TENANTS[0], "weight": 4}, *TENANTS[1:]]
    core = core_with(clock, "fair", tenants=tenants)
    running = [ask(core, "a").ticket, ask(core, "b").ticket]
    for t in ["a", "a", "a", "b", "b", "b"]:
        pending.append(ask(core, t))
        clock.advance(0.001)
    assert grants(core, running, 4).count("a") >= 3


def test_admissions_and_releases_reach_the_fair_queue_per_tenant(clock):
    core = core_with(clock, "fair")
    d = ask(core, "a")
    q = core.limiters["interactive"].queue
    assert (q.stats["a"].inflight, q.stats["a"].admitted) == (1, 1)
    assert q.stats["a"].served_gpu_s == pytest.approx(d.ticket.cost)
    core.finish(d.ticket, Outcome.OK)
    assert q.stats["a"].inflight == 0


@pytest.mark.parametrize("refused_by", ["queue_full", "queue_timeout", "fallback"])
def test_the_fairness_index_weighs_requests_the_class_could_not_take(clock, refused_by):
    # The index counted service only: a tenant refused every request while another held the class read as fair as
    # one that asked for nothing. Now what a flow was refused, or sent elsewhere, counts as its demand.
    overflow = {"on_overflow": "fallback", "fallback": {"action": "canned", "status": 200, "message": "busy"}} \
        if refused_by == "fallback" else {}
    core = AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 1, "max_queue": 0 if refused_by != "queue_timeout" else 1,
                                 "max_wait_ms": 100, "fairness": {"mode": "fair"}, **overflow}},
        tenants=TENANTS), clock=clock)
    q = core.limiters["interactive"].queue
    first = ask(core, "a")
    assert first.kind == ACCEPT and q.fairness_index() == 1.0
    d = ask(core, "b")
    if refused_by == "queue_timeout":
        assert d.kind == QUEUE and q.fairness_index() == 0.5  # waiting: asked, not served yet
        clock.advance(0.2)
        assert core.abandon(d.waiter, timed_out=True) is not None  # the adapter's timer, at its deadline
        d = d.waiter.result
    assert d.kind != ACCEPT and d.reason in ("queue_full", "queue_timeout")
    assert q.fairness_index() == pytest.approx(0.5)  # a got the class, b asked as much and got nothing
    core.finish(first.ticket, Outcome.OK)
    assert ask(core, "b").kind == ACCEPT
    assert q.fairness_index() == pytest.approx(1.0)  # each got its due: half of what was served


def test_learned_usage_settles_the_flow_with_what_the_request_really_cost(clock):
    core = core_with(clock, "fair")
    d = ask(core, "a")
    q = core.limiters["interactive"].queue
    estimated = q.stats["a"].served_gpu_s
    core.usage(d.ticket, 100, 1)  # it answered in one token where 100 were expected
    core.finish(d.ticket, Outcome.OK)
    core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.1, 0.2))
    assert q.stats["a"].served_gpu_s < estimated


@pytest.mark.parametrize("taken_back", ["withdraw", "revoke"])
def test_a_request_that_never_ran_is_not_charged_to_its_flow(clock, taken_back):
    # A slot given back unused (revoke: no global slot from the shared store, or a queue's grant in the instant its
    # client left; withdraw: the stream refused the request before forwarding it) left its flow charged the
    # estimate for good: served GPU-seconds for work that never ran, and a virtual time that put the tenant behind
    # the others in a fair queue for it.
    core = core_with(clock, "fair")
    q = core.limiters["interactive"].queue
    ask(core, "a")  # runs: the flow stays kept, with what it was served
    vtime, served = q.flow_of("a").vtime, q.stats["a"].served_gpu_s
    d = ask(core, "a")
    assert q.flow_of("a").vtime > vtime and q.stats["a"].served_gpu_s > served
    if taken_back == "withdraw":
        core.withdraw(d.ticket)
    else:
        core.revoke(d, "client_disconnected", "gone")
    assert q.flow_of("a").vtime == pytest.approx(vtime) and q.stats["a"].served_gpu_s == pytest.approx(served)
    assert q.stats["a"].inflight == 1


@pytest.mark.parametrize("report, refunded", [
    (Completion(Outcome.OK, 400, 0.01, 0.01), True),               # vLLM: max_tokens past its context
    (Completion(Outcome.NOT_ROUTED, 404, 0.001, 0.001), True),     # Envoy answered without a replica
    (Completion(Outcome.UPSTREAM_ERROR, 500, 0.5, 0.5), False),    # the engine may have run it
    # The client left before any answer (Envoy: flag DC, status 0). Kept on purpose, not a refund: it reads the
    # same whether the replica was about to answer a 400 or had run the request for minutes (a non-streamed
    # answer's first byte is its last), and a refund made every abort free: a client that drops its
    # non-streamed requests before they end got GPU time its flow was never charged for.
    (Completion(Outcome.CLIENT_ABORT, 0, None, 0.005), False),
    (Completion(Outcome.CLIENT_ABORT, 400, 0.01, 0.01), True),     # left after the replica's 400 was on its way
    (Completion(Outcome.OK, 200, 0.1, 0.2), False)])               # served, its usage not read
def test_a_request_the_replica_refused_is_not_charged_to_its_flow(clock, report, refunded):
    # One request of max_tokens 2**31 (about 2e6 GPU-seconds at the estimate without max_context_tokens), refused
    # by vLLM with a 400 before anything ran, kept its flow behind every other tenant of the class for as long as
    # they had requests waiting: weights 2:1 were granted a a b a a b... before, b b b b b b a a a... after it
    # (a hostile-client audit).
    core = core_with(clock, "fair")
    q = core.limiters["interactive"].queue
    ask(core, "a")  # runs: the flow stays kept, with what it was served
    vtime, served = q.flow_of("a").vtime, q.stats["a"].served_gpu_s
    d = core.decide(RequestFacts(api_key="sk-a", model="llama", max_tokens=2**31 - 1, doc={"prompt": "x"}))
    assert q.flow_of("a").vtime > vtime + 1000
    core.finish(d.ticket, report.outcome, report.status)
    core.report(d.ticket.id, report)
    if refunded:
        assert q.flow_of("a").vtime == pytest.approx(vtime) and q.stats["a"].served_gpu_s == pytest.approx(served)
    else:
        assert q.flow_of("a").vtime > vtime + 1000


def test_a_request_that_never_ran_is_refunded_under_the_label_it_was_served_under(clock):
    # A reload removed its tenant while it ran: its key's label is now "other", which never served it.
    core = core_with(clock, "fair")
    d = ask(core, "c")
    core.apply(policy("fair", tenants=TENANTS[:2]))
    core.withdraw(d.ticket)
    q = core.limiters["interactive"].queue
    assert q.stats["other"].served_gpu_s == 0.0 and q.stats["other"].inflight == 0


def test_learned_usage_is_settled_under_the_label_it_was_served_under(clock):
    # A reload removed its tenant while it ran: its key now counts under "other", which never served it; the
    # correction of its charge by the usage it reported belongs to the label it was charged to.
    core = core_with(clock, "fair")
    d = ask(core, "c")
    q = core.limiters["interactive"].queue
    estimated = q.stats["c"].served_gpu_s
    core.apply(policy("fair", tenants=TENANTS[:2]))
    core.usage(d.ticket, 100, 1)  # it answered in one token where 100 were expected
    core.finish(d.ticket, Outcome.OK)
    core.report(d.ticket.id, Completion(Outcome.OK, 200, 0.1, 0.2))
    assert q.stats["other"].served_gpu_s == 0.0 and q.stats["other"].refunded_gpu_s == 0.0
    assert 0.0 < d.ticket.fair_stats.served_gpu_s < estimated  # corrected where it was charged


def test_a_request_deadline_shortens_its_wait_never_lengthens_it(clock):
    core = core_with(clock, "fair", classify={"deadline_header": "x-deadline-ms"})
    ask(core, "a"), ask(core, "a")
    short = ask(core, "b", deadline_ms=50)
    long = ask(core, "b", deadline_ms=60_000)
    assert short.waiter.deadline == pytest.approx(clock() + 0.05)
    assert long.waiter.deadline == pytest.approx(clock() + 1.0)  # the class's max_wait_ms
    clock.advance(0.06)
    core.reap()
    assert short.waiter.result.kind == REJECT and long.waiter.pending


def test_inside_a_flow_the_earliest_deadline_is_granted_first(clock):
    core = core_with(clock, "fair")
    running = [ask(core, "a").ticket, ask(core, "a").ticket]
    late = ask(core, "b", deadline_ms=900)
    early = ask(core, "b", deadline_ms=300)
    core.finish(running[0], Outcome.OK)
    assert early.waiter.result.kind == ACCEPT and late.waiter.pending


def test_the_fairness_header_keys_flows_where_the_class_asks_for_it(clock):
    core = core_with(clock, "fair", key="header", classify={"fairness_header": "x-gateway-inference-fairness-id"})
    d = ask(core, "a", fairness_id="team-7")
    assert d.ticket.flow == nested("a", "team-7")  # inside the tenant whose API key it came with
    q = core.limiters["interactive"].queue
    assert q.stats["a"].inflight == 1  # labelled by that tenant
    d = core.decide(RequestFacts(model="llama", max_tokens=100, fairness_id="team-7"))
    assert d.ticket.flow == nested("anonymous", "team-7")
    assert q.stats["other"].inflight == 1  # no API key, not a configured tenant: its metric label is folded


def test_the_header_key_needs_the_policy_to_read_the_header():
    with pytest.raises(PolicyError) as e:
        policy("fair", key="header")
    assert any(line.startswith("classes.interactive.fairness.key:") for line in e.value.errors)


def test_guaranteed_shares_cannot_add_up_to_more_than_the_class():
    tenants = [{**t, "guaranteed_share": 0.6} for t in TENANTS[:2]]
    with pytest.raises(PolicyError) as e:
        policy("fair", tenants=tenants)
    assert "tenants: the guaranteed_share of every tenant add up to more than 1" in e.value.errors


def test_a_reload_to_another_mode_keeps_the_waiters_and_reorders_them(clock):
    core = core_with(clock)
    running = flood(core, clock)
    core.apply(policy("round_robin"))
    q = core.limiters["interactive"].queue
    assert (q.mode, len(q)) == ("round_robin", 6)
    assert grants(core, running, 3) == ["a", "b", "c"]


def test_a_reload_that_removes_a_tenant_under_load_leaves_every_tenant_gauge_at_zero_after_it(clock):
    core = core_with(clock, "fair")
    admitted = [ask(core, "c"), ask(core, "a")]
    queued = ask(core, "c")
    assert queued.kind == QUEUE
    core.apply(policy("fair", tenants=TENANTS[:2]))
    for d in admitted:
        core.finish(d.ticket, Outcome.OK)
    core.finish(queued.waiter.result.ticket, Outcome.OK)
    q = core.limiters["interactive"].queue
    assert {label: (st.inflight, st.waiting) for label, st in q.stats.items() if st.inflight or st.waiting} == {}


@pytest.mark.parametrize("allow_anonymous", [False, True])
def test_a_tenant_removed_while_its_requests_wait_is_not_served_from_the_queue_when_keys_are_required(
        clock, allow_anonymous):
    core = AdmissionController(policy(anonymous={"allow": allow_anonymous}), clock=clock)
    running = [ask(core, "a"), ask(core, "b")]
    revoked, kept = ask(core, "c"), ask(core, "a")
    assert revoked.kind == kept.kind == QUEUE
    core.apply(policy(tenants=TENANTS[:2], anonymous={"allow": allow_anonymous}))
    if allow_anonymous:  # the key's requests are anonymous ones now: nothing to refuse
        assert revoked.waiter.pending
        return
    assert (revoked.waiter.result.status, revoked.waiter.result.reason) == (401, "invalid_api_key")
    assert kept.waiter.pending
    core.finish(running[0].ticket, Outcome.OK)
    assert kept.waiter.result.kind == ACCEPT  # the freed slot goes to a tenant that still exists
    gone = core.limiters["interactive"].queue.stats.get("c")
    assert gone is None or gone.waiting == 0  # its flow waits no more (and is forgotten once idle)


def test_a_full_queue_gives_the_flooding_tenants_last_place_to_a_tenant_with_fewer_waiting(clock):
    core = AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 1000,
                                 "fairness": {"mode": "fair"}}}, tenants=TENANTS), clock=clock)
    ask(core, "a")
    first, last = ask(core, "a"), ask(core, "a")
    b = ask(core, "b")
    assert b.kind == QUEUE and first.waiter.pending
    assert (last.waiter.result.kind, last.waiter.result.reason) == (REJECT, "queue_full")


def test_fifo_keeps_a_full_queue_full(clock):
    core = AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 1000}}, tenants=TENANTS),
        clock=clock)
    ask(core, "a"), ask(core, "a"), ask(core, "a")
    assert (ask(core, "b").kind, ask(core, "b").reason) == (REJECT, "queue_full")


def backlogged_shares(clock, send_c, rounds: int = 600) -> dict[str, float]:
    """Tenants gold (weight 3), b and c keep 4 requests each waiting or running in a fair class keyed by the
    fairness header; `send_c(i)` is c's header value. Each GPU-second admitted, by tenant, over `rounds` releases."""
    tenants = [{"name": "gold", "api_keys": ["sk-gold"], "weight": 3}, *TENANTS[1:]]
    core = core_with(clock, "fair", key="header", tenants=tenants,
                     classify={"fairness_header": "x-gateway-inference-fairness-id"})
    running, served, out, seq = [], dict.fromkeys(("gold", "b", "c"), 0.0), dict.fromkeys(("gold", "b", "c"), 0), [0]

    def granted(d, tenant):
        if d.kind != ACCEPT:  # refused, or its place taken
            out[tenant] -= 1
            return
        running.append((d.ticket, tenant))
        served[tenant] += d.ticket.cost

    for _ in range(rounds):
        for t in served:
            while out[t] < 4:
                seq[0] += 1
                d = ask(core, t, fairness_id=send_c(seq[0]) if t == "c" else t)
                out[t] += 1
                if d.kind == QUEUE:
                    d.waiter.notify(lambda r, t=t: granted(r, t))
                else:
                    granted(d, t)
        ticket, t = running.pop(0)
        out[t] -= 1
        clock.advance(0.01)
        core.finish(ticket, Outcome.OK)
    total = sum(served.values())
    return {t: round(s / total, 2) for t, s in served.items()}


def test_weights_are_honoured_between_backlogged_tenants_keyed_by_header(clock):
    assert backlogged_shares(clock, lambda i: "c") == {"gold": 0.6, "b": 0.2, "c": 0.2}


def test_a_tenant_rotating_its_fairness_key_gets_its_own_share_not_the_class(clock):
    # Before header keys were nested in their tenant, each new key was a flow of its own starting level with the
    # waiting ones: c took 99.8% of the class
    assert backlogged_shares(clock, lambda i: f"c-{i}") == {"gold": 0.6, "b": 0.2, "c": 0.2}


def test_a_fairness_key_naming_another_tenant_does_not_spend_its_share(clock):
    # Before: c's requests keyed "gold" joined gold's flow and shared its weight: gold 0.375, c 0.375
    assert backlogged_shares(clock, lambda i: "gold") == {"gold": 0.6, "b": 0.2, "c": 0.2}


def test_the_fairness_index_reads_a_tenant_not_its_header_keys(clock):
    # The index counted each header key apart: c rotating keys while every tenant got exactly its weighted share
    # read 0.04 (an alert on it would fire). It reads the tenants, as the queue shares between them.
    backlogged_shares(clock, lambda i: f"c-{i}")
    assert cores[-1].limiters["interactive"].queue.fairness_index() == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("mode", ["round_robin", "fair"])
def test_a_release_into_a_full_class_looks_for_one_grant_not_two(mode, monkeypatch):
    # Found by bench/scale.py: after its one grant a release picked the next waiter too (a pass over every waiting
    # flow in fair mode) only to find the class full again.
    from tests.conftest import FakeClock
    from extproc.policy.fairness import FairQueue

    core = AdmissionController(policy(mode), clock=FakeClock())
    running = [ask(core, t).ticket for t in ("a", "b")]
    for t in ("a", "b", "c", "a", "b", "c"):
        assert ask(core, t).kind == QUEUE
    picks = []
    pick = FairQueue._pick
    monkeypatch.setattr(FairQueue, "_pick", lambda q, pool: picks.append(pool) or pick(q, pool))
    core.finish(running[0], Outcome.OK)
    assert len(core.limiters["interactive"].queue) == 5  # one granted
    assert len(picks) == 1


@pytest.mark.parametrize("mode", ["round_robin", "fair"])
def test_early_rejection_counts_a_flows_queue_ahead_only_when_the_whole_queue_would_miss(mode, monkeypatch):
    # Found by bench/scale.py: every queued arrival counted its own queue ahead, a pass over every waiting flow in
    # fair mode, though the whole queue ahead (no flow has more) was well within the wait.
    from tests.conftest import FakeClock
    from extproc.policy.fairness import FairQueue

    clock = FakeClock()
    core = AdmissionController(policy(mode), clock=clock)
    running = [ask(core, t).ticket for t in ("a", "b")]
    for t in ("a", "b"):
        assert ask(core, t).kind == QUEUE
    lim = core.limiters["interactive"]
    for i in range(100):  # the class has drained 100 requests a second: 2 waiting are 20 ms of a 1 s wait
        lim.drain.record(clock() - 1.0 + i * 0.01)
    counted = []
    ahead = FairQueue.ahead
    monkeypatch.setattr(FairQueue, "ahead", lambda q, key: counted.append(key) or ahead(q, key))
    assert ask(core, "c").kind == QUEUE
    assert counted == []
    for i in range(1000):  # ...and now 1 a second: the whole queue (3) would miss, c's own queue ahead is counted
        lim.drain.record(clock() + 1000.0 + i)
    clock.advance(2000.0)
    d = ask(core, "c")
    assert counted and set(counted) == {"c"}  # the check, and the refusal's message
    assert d.kind == REJECT and d.reason == "deadline_unmeetable"
    assert running


def test_a_tenant_asking_a_large_max_tokens_is_charged_what_its_answers_cost(clock):
    # Found by a multi-tenant audit (2026-12-05): usage is read for a sample of requests (learn_sample, 5%), and
    # only those were settled; the rest stayed charged at the estimate, max_tokens x the model's output ratio. A
    # tenant whose client asks max_tokens 1,000 and gets 50-token answers, like its neighbour's asking 100, was
    # charged ~5x its neighbour per request and served a sixth of the grants at equal weights.
    core = core_with(clock, "fair")
    running, done = [], 0

    def enter(d):
        (running.append(d.ticket) if d.kind == ACCEPT else pending.append(d))

    for t in ("a", "b", "a", "b", "a", "b"):
        enter(ask_tokens(core, t))
    granted = []
    for _ in range(400):
        ticket = running.pop(0)
        done += 1
        if done % 10 == 0:  # one answer in ten is read, whoever's it is (as the ext_proc's sample)
            core.usage(ticket, 100, 50)
        before = list(pending)
        core.finish(ticket, Outcome.OK)
        core.report(ticket.id, Completion(Outcome.OK, 200, 0.1, 0.2))
        for d in before:
            if d.waiter.result is not None and d.waiter.result.kind == ACCEPT:
                pending.remove(d)
                granted.append(d.tenant)
                running.append(d.waiter.result.ticket)
                enter(ask_tokens(core, d.tenant))  # both stay backlogged
        clock.advance(0.01)
    late = granted[200:]
    assert 0.4 <= late.count("a") / len(late) <= 0.6  # equal weights, equal real cost: about half each


def ask_tokens(core, tenant: str):
    """A request of 100 prompt tokens asking max_tokens 1,000 (tenant a) or 100 (any other)."""
    return core.decide(RequestFacts(api_key=f"sk-{tenant}", model="llama", doc={"prompt": "x" * 400},
                                    max_tokens=1000 if tenant == "a" else 100))


def test_early_rejection_counts_no_queue_ahead_of_a_tenant_under_its_guaranteed_share(clock):
    # A tenant under its guaranteed_share is granted the next free slot whatever its virtual time (a33f2ab: it runs
    # far ahead of the others'), but its queue ahead counted every other tenant's waiters as going first, and at a
    # slow drain the early rejection refused it as unable to make its wait: it was next.
    tenants = [*TENANTS[:2], {**TENANTS[2], "guaranteed_share": 0.5}]
    core = core_with(clock, "fair", tenants=tenants)
    for t in ("a", "b"):
        assert ask(core, t).kind == ACCEPT
    for t in ("a", "b", "a", "b"):
        assert ask(core, t).kind == QUEUE
    lim = core.limiters["interactive"]
    for i in range(1500):  # 1.5 requests a second: the 4 waiting are ~3 s of a 1 s wait, the next grant ~0.7 s
        lim.drain.record(clock() + i / 1.5)
    clock.advance(1000.0)
    d = ask(core, "c")
    assert d.kind == QUEUE, d.message
    assert lim.queue[0] is d.waiter  # it is the next grant


def test_a_slot_the_head_cannot_use_goes_to_the_next_in_the_queues_order_not_the_next_pool_in_arrival_order(clock):
    # Found by a review: with the queue's head held by its pool's limit, the slot went to the first waiter of the
    # first other pool in arrival order (a, with two running, arrived before b), not to the flow the queue puts
    # next among the pools with room (b, served least).
    pol = make_policy(
        classes={"interactive": {"max_concurrency": 3, "max_queue": 10, "max_wait_ms": 1000,
                                 "fairness": {"mode": "fair"}}},
        tenants=TENANTS + [{"name": "d", "api_keys": ["sk-d"]}], shed={},
        models={"m1": {"cluster": "p1"}, "m2": {"cluster": "p2"}, "m3": {"cluster": "p3"}},
        pools={"p1": {"limit": {"enabled": True, "unit": "requests", "initial": 1, "min": 1, "max": 1}}})
    core = AdmissionController(pol, clock=clock)

    def on(tenant, model):
        return core.decide(RequestFacts(api_key=f"sk-{tenant}", model=model, max_tokens=100, doc={"prompt": "x" * 400}))

    assert on("d", "m1").kind == ACCEPT  # p1 full, held by the class itself: c's request is owed nothing there
    running = [on("a", "m2").ticket, on("a", "m2").ticket]
    queued = {}
    for tenant, model in (("c", "m1"), ("a", "m2"), ("b", "m3")):
        queued[tenant] = on(tenant, model)
        assert queued[tenant].kind == QUEUE
        clock.advance(0.001)
    assert core.limiters["interactive"].queue[0] is queued["c"].waiter  # the head waits for p1
    core.finish(running[0], Outcome.OK)
    granted = [t for t, d in queued.items() if d.waiter.result is not None and d.waiter.result.kind == ACCEPT]
    assert granted == ["b"]


def test_usage_learned_after_its_flow_was_forgotten_does_not_move_the_flow_that_came_back(clock):
    # Found by a review: a flow with nothing queued or in flight is forgotten when its request ends, and a request
    # is settled when it is accounted, which waits for Envoy's report (up to 5 s). Meanwhile the tenant's next
    # request started a new flow level with the waiting ones, and the refund of the first request's estimate
    # (charged to the flow forgotten) took the new one far below them: a was then granted ahead of b's waiters
    # for all the GPU-seconds the estimate was over.
    core = core_with(clock, "fair")
    q = core.limiters["interactive"].queue
    first = ask_tokens(core, "a").ticket  # max_tokens 1,000: charged about ten times what its answer costs
    running = [ask_tokens(core, "b").ticket]
    for _ in range(3):
        pending.append(ask_tokens(core, "b"))
    core.usage(first, 100, 5)
    core.finish(first, Outcome.OK)  # its slot goes to b; a keeps no state
    pending.append(ask_tokens(core, "a"))
    assert pending[-1].kind == QUEUE
    level = q.virtual_time("a")
    core.report(first.id, Completion(Outcome.OK, 200, 0.1, 0.2))  # accounted now: its usage is learned
    assert q.virtual_time("a") == pytest.approx(level)


def test_an_arrival_that_cannot_take_a_place_takes_none_from_a_waiter_when_a_reload_shrank_the_queue(clock):
    # Found by a review: a reload that lowers max_queue below what waits leaves the queue over its bound, and each
    # arrival then crowded out one waiter of the longest flow ("its place went to a tenant with fewer waiting")
    # and was refused itself, the queue still full: a request lost its place to nobody.
    core = core_with(clock, "fair")
    for _ in range(2):
        assert ask(core, "a").kind == ACCEPT
    for _ in range(6):
        pending.append(ask(core, "a"))
        assert pending[-1].kind == QUEUE
    core.apply(make_policy(classes={"interactive": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 1000,
                                                    "fairness": {"mode": "fair"}}}, tenants=TENANTS))
    assert ask(core, "b").kind == REJECT
    assert all(d.waiter.pending for d in pending)  # nobody's place was taken
    assert len(core.limiters["interactive"].queue) == 6


def waiters_read_in_arrival_order(monkeypatch) -> list:
    """From now on, every waiter read by an iteration of a class queue (in arrival order), in a list."""
    from extproc.policy.fairness import FairQueue

    read, walk = [], FairQueue.__iter__

    def counted(q):
        waiters = list(walk(q))
        read.extend(waiters)
        return iter(waiters)

    monkeypatch.setattr(FairQueue, "__iter__", counted)
    return read


def test_a_grant_of_a_fifo_class_looks_at_the_waiters_it_grants_not_at_every_waiter(monkeypatch):
    # Found by bench/cardinality.py: each release into a full fifo class copied its whole queue to walk it in
    # arrival order (O(waiters) a grant: 1.3x the cost of a step with 100 waiting, 2x with 1,000).
    from tests.conftest import FakeClock

    core = AdmissionController(make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 500,
                                                                    "max_wait_ms": 1000, "early_reject": False}},
                                           tenants=TENANTS), clock=FakeClock())
    running = ask(core, "a").ticket
    queued = [ask(core, "abc"[i % 3]) for i in range(500)]
    assert {d.kind for d in queued} == {QUEUE}
    read = waiters_read_in_arrival_order(monkeypatch)
    for d in queued[:20]:
        core.finish(running, Outcome.OK)
        assert d.waiter.result.kind == ACCEPT  # arrival order
        running = d.waiter.result.ticket
    assert len(read) <= 20


@pytest.mark.parametrize("mode", ["fifo", "fair"])
def test_an_arrival_that_fits_beside_a_waiter_its_budget_holds_back_reads_no_queue_in_arrival_order(mode,
                                                                                                     monkeypatch):
    # Found in review for bench/cardinality.py: a class whose GPU-seconds budget holds a large request back has
    # room for small ones, and each small arrival read its queue in arrival order (fair: a sort of every waiter;
    # fifo: a copy) to find the first waiter it may not pass: O(waiters) an arrival.
    from tests.conftest import FakeClock

    def core_with(budget):
        spec = {"max_concurrency": 100, "max_queue": 500, "max_wait_ms": 1000, "early_reject": False,
                "fairness": {"mode": mode}, **({"max_inflight_gpu_seconds": budget} if budget else {})}
        return AdmissionController(make_policy(classes={"interactive": spec}, tenants=TENANTS), clock=FakeClock())

    def large(core):
        return core.decide(RequestFacts(api_key="sk-a", model="llama", max_tokens=4000, doc={"prompt": "x" * 400}))

    probe = core_with(None)
    cost = large(probe).charge.estimate.gpu_seconds
    small = ask(probe, "b").charge.estimate.gpu_seconds
    core = core_with(cost + 2 * small)
    assert large(core).kind == ACCEPT and large(core).kind == QUEUE  # the second waits for the budget
    read = waiters_read_in_arrival_order(monkeypatch)
    for i in range(200):
        assert ask(core, "abc"[i % 3]).kind == QUEUE  # it fits, but passes no waiter
    assert len(core.limiters["interactive"].queue) == 201
    assert read == []  # in arrival order, 20,000 waiters were read




@pytest.mark.parametrize("taken_back", ["withdraw", "revoke"])
def test_a_round_robin_grant_that_never_ran_gives_its_flow_its_turn_back(clock, taken_back):
    # Found by a review: fair mode refunds the charge of a grant given back unused (no global slot from the shared
    # store, the client gone the instant it was granted, the stream refusing it), but round_robin kept the turn the
    # grant took: the flow went behind every other waiting flow for a request that was never served.
    core = core_with(clock, "round_robin")
    running = flood(core, clock)  # a runs two and queues four; then b and c queue one each
    core.finish(running[0], Outcome.OK)
    granted = [d for d in pending if not d.waiter.pending]
    assert [d.tenant for d in granted] == ["a"]
    admit = granted[0].waiter.result
    if taken_back == "withdraw":
        core.withdraw(admit.ticket)  # the slot freed goes to the next in turn
    else:
        core.revoke(admit, "client_disconnected", "gone")
    regranted = [d.tenant for d in pending if d is not granted[0] and not d.waiter.pending]
    assert regranted == ["a"]  # a's turn again (b's before: a lost the turn it was never served in)


@pytest.mark.parametrize("reason", ["queue_timeout", "queue_full"])
def test_the_fairness_index_weighs_a_request_the_shared_store_had_no_slot_for(clock, reason):
    # A gated admission the shared store gave no global slot (none within the class's wait, or none and no queue)
    # is refused for want of room like one its class queue timed out: revoked, its local charge was refunded and
    # its demand vanished, so a tenant refused every request while another held the class read as fair.
    core = AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 2, "max_queue": 0, "max_wait_ms": 100,
                                 "fairness": {"mode": "fair"}}}, tenants=TENANTS), clock=clock)
    core.shared_slots = True
    q = core.limiters["interactive"].queue
    first = ask(core, "a")
    core.confirm(first)
    d = ask(core, "b")
    assert d.kind == ACCEPT and core.gated(d)
    clock.advance(0.1)
    assert core.revoke(d, reason, "no global slot").kind == REJECT
    assert q.fairness_index() == pytest.approx(0.5)  # a got the class, b asked as much and got nothing


def test_a_client_that_left_its_global_wait_is_no_unmet_demand(clock):
    core = AdmissionController(make_policy(
        classes={"interactive": {"max_concurrency": 2, "max_queue": 0, "max_wait_ms": 100,
                                 "fairness": {"mode": "fair"}}}, tenants=TENANTS), clock=clock)
    core.shared_slots = True
    q = core.limiters["interactive"].queue
    core.confirm(ask(core, "a"))
    core.revoke(ask(core, "b"), "client_disconnected", "gone")
    assert q.fairness_index() == 1.0
