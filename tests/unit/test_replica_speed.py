"""A slow replica (policy.replica_speed, server.saturation, policy.steering): its inter-token latency, from vLLM's
histogram counters over a window, well over the pool's fastest replica's; requests of classes with an SLO go to
the other replicas, however much of the pool-wide limit they hold, while the classes below still use it."""

import logging

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import AdmissionController
from extproc.policy.decision import Admit, RequestFacts
from extproc.policy.replica_speed import MIN_SPAN, MIN_TOKENS, TokenPace, judge_slow
from extproc.policy.schema import PoolSpec
from extproc.policy.steering import ReplicaSteering
from extproc.server.saturation import PACE_SCRAPES, PoolScraper
from tests.conftest import FakeClock, make_policy
from tests.unit.test_saturation_scraper import RecordingCore


def paced(seconds_per_token: float, tokens: int = 200, window_s: float = 20.0, at: float = 10.0,
          running: float = 4.0, kv: float = float("nan")) -> TokenPace:
    pace = TokenPace(window_s)
    pace.add(min(at - window_s, 0.0), 0.0, 0.0)  # read for a whole window: long enough to be judged (MIN_SPAN)
    pace.add(at, seconds_per_token * tokens, tokens, running, kv)
    return pace


def test_a_pace_is_the_mean_inter_token_latency_over_its_window():
    pace = TokenPace(10.0)
    assert pace.seconds_per_token(0.0) is None
    pace.add(0.0, 5.0, 100.0)  # counters since the replica started: only what they add counts
    pace.add(5.0, 6.0, 200.0)
    assert pace.seconds_per_token(5.0) == 1.0 / 100
    pace.add(12.0, 10.0, 300.0)
    assert pace.seconds_per_token(12.0) == 5.0 / 200
    assert pace.seconds_per_token(16.0) == 4.0 / 100  # the step at 5 s is out of the window
    assert pace.seconds_per_token(30.0) is None


def test_too_few_tokens_a_restart_or_no_histogram_give_no_pace():
    assert paced(0.01, tokens=MIN_TOKENS - 1).seconds_per_token(10.0) is None
    pace = paced(0.01)
    pace.add(11.0, 0.5, 20.0)  # counters went back: a restarted replica
    assert pace.seconds_per_token(11.0) is None
    pace = paced(0.01)
    pace.add(11.0, float("nan"), float("nan"))  # a scrape without the histogram: what follows starts over
    pace.add(12.0, 3.0, 300.0)
    assert pace.seconds_per_token(12.0) is None
    for t in range(13, 23):
        pace.add(float(t), 3.0 + (t - 12) * 0.5, 300.0 + (t - 12) * 50)
        if t < 12 + MIN_SPAN * 20.0:  # read since 12 s: not for half its window yet
            assert pace.seconds_per_token(float(t)) is None
    assert pace.seconds_per_token(22.0) == 0.01


def test_a_replica_read_for_less_than_half_its_window_is_not_judged():
    # Judged on its first 0.4 s (74 tokens), an 8B replica prefilling a 24K-token prompt read 1.51x its twin and
    # stayed slow for the whole 180 s: its SLO classes sent away, the twin always ran the heavier batch, and a
    # slow replica is let back only against one that ran no heavier (scenarios/audit-long-context.yaml, seed 901).
    young, twin = TokenPace(20.0), TokenPace(20.0)
    for p in (young, twin):
        p.add(0.0, 0.0, 0.0, 0.0, 0.0)
    young.add(0.4, 0.00262 * 74, 74, 1.0, 0.4)
    twin.add(0.4, 0.00173 * 74, 74, 1.0, 0.4)
    assert young.seconds_per_token(0.4) is None and judge_slow([young, twin], 0.4, 1.5) == []
    young.add(10.0, 0.00262 * 74 + 0.00262 * 1000, 1074, 1.0, 0.4)
    twin.add(10.0, 0.00173 * 74 + 0.00173 * 1000, 1074, 1.0, 0.4)
    assert judge_slow([young, twin], 10.0, 1.5) == [young]  # a gap that lasts half the window is judged


def test_slow_past_the_ratio_and_back_within_half_the_margin():
    fast, slow = paced(0.010), paced(0.016)
    assert judge_slow([fast, slow], 10.0, 1.5) == [slow] and slow.slow and not fast.slow
    assert slow.relative == 1.6 and slow.factor == 1.6 and fast.factor == 1.0
    slow.add(15.0, 0.016 * 200 + 0.013 * 2000, 2200)  # 1.32x over the window: still past 1.25
    assert judge_slow([fast, slow], 15.0, 1.5) == [] and slow.slow
    slow.add(20.0, 0.016 * 200 + 0.013 * 2000 + 0.011 * 4000, 6200)  # 1.19x
    assert judge_slow([fast, slow], 20.0, 1.5) == [slow] and not slow.slow
    assert judge_slow([paced(0.010), paced(0.014)], 10.0, 1.5) == []  # 1.4x: not slow


def test_paces_are_compared_only_where_the_context_held_does_not_explain_the_gap():
    # One request each, one of 5.9K tokens (7% of the KV cache), one of 470 (0.5%): 4.7 against 2.8 ms a token on
    # identical replicas (scenarios/noisy-neighbour.yaml). The batch is the same; the context read per step is not.
    long, short = paced(0.0047, running=1.0, kv=0.07), paced(0.0028, running=1.0, kv=0.005)
    assert judge_slow([long, short], 10.0, 1.5) == [] and not long.slow
    # Against a lighter one the gap is divided by the larger of the two loads' ratios: 12x the context here.
    assert long.relative < 1.0
    # As much context and as many requests: the gap is the replica's.
    assert judge_slow([paced(0.0028, running=1.0, kv=0.07), long], 10.0, 1.5) == [long] and long.slow
    # More context on the slow one, but less than its gap: 2x slower at 1.2x the context and batch stays slow.
    fast, slow = paced(0.005, running=10.0, kv=0.5), paced(0.010, running=12.0, kv=0.6)
    assert judge_slow([fast, slow], 10.0, 1.5) == [slow] and slow.relative == 2.0
    # Let back only beside one that held no more context either: one as fast but holding 3x the KV proves nothing.
    slow.add(40.0, 0.010 * 200 + 0.006 * 2000, 2200, 4.0, 0.1)
    fast.add(40.0, 0.005 * 200 + 0.006 * 2000, 2200, 4.0, 0.3)
    assert judge_slow([fast, slow], 41.0, 1.5) == [] and slow.slow

def test_tokens_made_between_two_readings_that_saw_no_request_do_not_count():
    # An 8B answers a 7K-token prompt's 150 tokens in 0.2 s: the request can come and go between two scrapes, and
    # then nothing says what load its tokens were made at. Read as an idle replica's, they were compared directly
    # with a busier replica's and read 1.58x (scenarios/moe-rag.yaml, seed 74).
    pace = TokenPace(20.0)
    pace.add(-20.0, 0.0, 0.0, 0.0, 0.0)  # read, idle, for a window before
    pace.add(0.0, 0.0, 0.0, 0.0, 0.0)
    pace.add(0.2, 0.0012 * 150, 150, 0.0, 0.0)
    assert pace.seconds_per_token(0.2) is None
    # Ended since the last reading, which saw them: they count at the load it saw.
    pace.add(0.4, 0.18, 150, 1.0, 0.015)
    pace.add(0.6, 0.18 + 0.0012 * 100, 250, 0.0, 0.0)
    assert pace.seconds_per_token(0.6) == 0.0012 and pace.batch() == 1.0 and pace.context() == 0.015
    fast = paced(0.0008, at=0.6, running=0.4, kv=0.002)
    assert judge_slow([fast, pace], 0.6, 1.5) == [] and not pace.slow

def test_paces_are_compared_only_where_the_batch_does_not_explain_the_gap():
    # A replica an autoscaler just added runs 3 requests at 5 ms a token; the busy ones run 10 at 7.5 ms: 1.5x, the
    # load's doing, not theirs (scenarios/scale-out.yaml). Against one as busy, the same 7.5 ms is slow.
    new, busy = paced(0.005, running=3.0), paced(0.0075, running=10.0)
    assert judge_slow([new, busy], 10.0, 1.4) == [] and not busy.slow
    assert judge_slow([paced(0.005, running=9.0), busy], 10.0, 1.4) == [busy] and busy.slow
    # A replica 2x slower by design, its SLO class sent away: it runs 1-2 requests to the fast one's 13, and reads
    # 1.07x its pace (scenarios/mixed-pool.yaml). It stays slow until judged beside one that ran no heavier.
    fast, slow = paced(0.005, running=4.0), paced(0.010, running=2.0)
    assert judge_slow([fast, slow], 10.0, 1.5) == [slow] and slow.relative == 2.0
    fast.add(20.0, 0.005 * 200 + 0.0074 * 2000, 2200, 13.0)
    slow.add(20.0, 0.010 * 200 + 0.0079 * 200, 400, 1.0)
    assert judge_slow([fast, slow], 20.0, 1.5) == [] and slow.slow
    fast.add(40.0, 0.005 * 200 + 0.0074 * 2000 + 0.005 * 2000, 4200, 4.0)  # the spike's tokens out of the window
    slow.add(40.0, 0.010 * 200 + 0.0079 * 200 + 0.0055 * 2000, 2400, 4.0)  # back to speed, as busy: let back
    assert judge_slow([fast, slow], 41.0, 1.5) == [slow] and not slow.slow


def test_a_slow_replica_is_not_let_back_for_reading_as_fast_as_another_slow_one():
    # Two replicas of an older GPU generation, 2x slower, beside a fast one that runs the heavier batch (the classes
    # with an SLO are sent to it): each slow one was let back for matching the other's pace, judged slow again
    # against the fast one the round after, and so on every scrape, with a log line and a steering change each.
    fast, old1, old2 = paced(0.005, running=8.0), paced(0.010, running=2.0), paced(0.010, running=2.0)
    assert judge_slow([fast, old1, old2], 10.0, 1.5) == [old1, old2]
    for _ in range(3):
        assert judge_slow([fast, old1, old2], 10.0, 1.5) == [] and old1.slow and old2.slow


def test_a_slow_replica_is_not_let_back_by_another_slow_one_judged_for_the_first_time():
    # old1 already slow; old2, just restarted (or added), has its first window's tokens this round, at old1's pace
    # on a lighter batch: old1 was let back against it before old2 itself was found slow, for one round (a log
    # line each way, and the classes with an SLO sent to a replica 2x slower for a scrape).
    fast, old1 = paced(0.005, running=8.0), paced(0.010, running=4.0)
    assert judge_slow([fast, old1], 10.0, 1.5) == [old1]
    old2 = paced(0.010, running=3.0)
    assert judge_slow([old1, old2, fast], 10.0, 1.5) == [old2] and old1.slow and old2.slow


def test_the_pools_fastest_replica_is_never_left_slow_for_want_of_another_not_slow():
    # A replica judged slow got faster while the others turned slow and were judged so against it: with no
    # replica left that was not slow it was never let back, the pool's fastest read slow (3 of 3 slow) for good.
    fastest, old1, old2 = paced(0.010), paced(0.025), paced(0.025)
    for pace in (fastest, old1, old2):
        pace.slow = True
    assert judge_slow([old1, fastest, old2], 10.0, 1.5) == [fastest] and not fastest.slow
    assert fastest.relative == 1.0 and old1.slow and old2.slow


def test_a_slow_replica_holding_the_heavier_batch_is_still_judged():
    # Least request at low concurrency leaves the slow replica, whose requests last longer, the heavier batch: 1.8
    # to the fast one's 1.2 with three clients. 3x the pace is more than a batch 1.5x heavier can cost (1.5x at
    # most), so it is slow; compared only with heavier replicas it went unjudged (a flaky integration test).
    fast, slow = paced(0.005, running=1.2), paced(0.015, running=1.8)
    assert judge_slow([fast, slow], 10.0, 1.5) == [slow] and abs(slow.relative - 2.0) < 1e-9
    # A gap the batch explains is not slow: 1.4x the pace at a batch 1.5x heavier.
    fast, busy = paced(0.005, running=1.2), paced(0.007, running=1.8)
    assert judge_slow([fast, busy], 10.0, 1.5) == [] and not busy.slow


def test_nothing_is_slow_with_the_rule_off_or_one_replica_to_compare():
    fast, slow = paced(0.010), paced(0.030)
    judge_slow([fast, slow], 10.0, 1.5)
    assert judge_slow([fast, slow], 10.0, 0) == [slow] and not slow.slow
    alone = paced(0.030)
    assert judge_slow([alone, TokenPace(20.0)], 10.0, 1.5) == [] and not alone.slow  # the other is idle


def reading(itl_sum: float, itl_count: float, running: float = 4.0) -> dict:
    return {"running": running, "waiting": 0.0, "kv": 0.2, "preemptions": 0.0, "tokens": itl_count,
            "itl_sum": itl_sum, "itl_count": itl_count}


def test_the_scraper_names_a_slow_replica_last_with_its_pace(caplog):
    caplog.set_level(logging.INFO, logger="extproc.saturation")
    clock = FakeClock()
    spec = PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"], scrape_interval_ms=200)
    scraper = PoolScraper(RecordingCore(), "pool_a", spec, None, clock=clock)
    paces = {"10.0.0.1:8000": 0.01, "10.0.0.2:8000": 0.025, "10.0.0.3:8000": 0.011}
    for step in range(60):  # 100 tokens a scrape each, for more than half the window (MIN_SPAN)
        for address, r in scraper.replicas.items():
            scraper.record(r, reading(paces[address] * 100 * step, 100.0 * step))
        sat = scraper.aggregate(clock())
        clock.advance(0.2)
    assert sat.slow == 1 and sat.stalled == 0 and not sat.saturated
    assert [(a, p) for a, _, p in sat.working] == [("10.0.0.1:8000", 1.0), ("10.0.0.2:8000", 2.5),
                                                    ("10.0.0.3:8000", 1.0)]
    assert PACE_SCRAPES * spec.scrape_interval_ms / 1000 == scraper.replicas["10.0.0.2:8000"].pace.window_s
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "10.0.0.2:8000 is slow" in warnings[0] and "2.5x" in warnings[0]
    paces["10.0.0.2:8000"] = 0.01  # back to speed: its window forgets the slow tokens
    for step in range(60, 60 + PACE_SCRAPES + 1):
        for address, r in scraper.replicas.items():
            before = r.metrics
            scraper.record(r, reading(before["itl_sum"] + paces[address] * 100, 100.0 * step))
        sat = scraper.aggregate(clock())
        clock.advance(0.2)
    assert sat.slow == 0 and sat.working == ()
    assert any("no longer slow" in r.getMessage() for r in caplog.records)


def test_twins_read_at_their_start_while_one_prefills_are_not_judged_apart(caplog):
    # The pool's first scrapes, through the scraper (200 ms, a 20 s window): for 0.4 s one twin prefills a long
    # prompt and decodes its 74 tokens at 2.62 ms, the other at 1.73 ms (1.51x); from then on both decode at 1.73 ms.
    # Judged on those 0.4 s, the first was slow for good: steered away from, it ran the lighter batch, and a slow
    # replica is let back only against one that ran no heavier (audit-long-context seed 901, through the what-if).
    caplog.set_level(logging.INFO, logger="extproc.saturation")
    clock = FakeClock()
    spec = PoolSpec(replicas=["10.0.0.1:8000", "10.0.0.2:8000"], scrape_interval_ms=200)
    scraper = PoolScraper(RecordingCore(), "pool_a", spec, None, clock=clock)
    young, twin = scraper.replicas.values()
    for r in (young, twin):
        scraper.record(r, reading(0.0, 0.0, running=1.0))
    scraper.aggregate(clock())
    for step in range(1, PACE_SCRAPES * 3):  # a minute
        clock.advance(0.2)
        for r, pace in ((young, 0.00262 if step <= 2 else 0.00173), (twin, 0.00173)):
            before = r.metrics
            scraper.record(r, reading(before["itl_sum"] + pace * 37, before["itl_count"] + 37, running=1.0))
        sat = scraper.aggregate(clock())
        assert sat.slow == 0 and sat.working == (), step
        if step == 2:  # enough tokens to judge (MIN_TOKENS), read for less than half the window (MIN_SPAN)
            assert young.pace.seconds_per_token(clock()) is None and twin.pace.seconds_per_token(clock()) is None
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_class_with_an_slo_goes_to_the_fast_replicas_first_the_others_to_envoy():
    s = ReplicaSteering()
    s.update("pool", (("a:1", 4.0, 1.0), ("b:1", 0.0, 2.0), ("c:1", 5.0, 1.0)), stalled=False)
    assert s.pick("pool", 0.0) is None  # no SLO: Envoy's least request (which now finds b the least loaded)
    # The fast replicas, least loaded first (each pick counted), the slow one last however idle it is.
    picks = [s.pick("pool", 0.0, tight_slo=True) for _ in range(4)]
    assert picks == ["a:1,c:1,b:1", "a:1,c:1,b:1", "c:1,a:1,b:1", "a:1,c:1,b:1"]
    s.update("pool", (("a:1", 3.0, 2.0), ("b:1", 1.0, 2.5)), stalled=False)  # only slow ones: the least loaded
    assert s.pick("pool", 0.0, tight_slo=True) == "b:1,a:1"


def core_with_a_slow_replica() -> AdmissionController:
    """pool_a: a pool-wide limit of 10 requests, two replicas, the second slow (2x); interactive has an SLO."""
    classes = {"interactive": {"max_concurrency": 20, "max_queue": 2, "max_wait_ms": 200, "slo_p95_ms": 2000},
               "batch": {"max_concurrency": 20, "max_queue": 5, "max_wait_ms": 5000}}
    policy = make_policy(classes=classes, pools={"pool_a": {"limit": {"enabled": True, "unit": "requests",
                                                                      "initial": 10, "min": 1}}})
    core = AdmissionController(policy, clock=FakeClock())
    sat = PoolSaturation()
    sat.slow, sat.working = 1, (("10.0.0.1:8000", 0.0, 1.0), ("10.0.0.2:8000", 0.0, 2.0))
    core.set_saturation("pool_a", sat)
    return core


def test_the_core_keeps_a_class_with_an_slo_off_a_slow_replica_however_much_of_the_limit_it_holds():
    core = core_with_a_slow_replica()
    assert core.replicas_for("pool_a", "batch") is None  # no SLO: Envoy picks
    assert core.replicas_for("pool_a", "interactive") == "10.0.0.1:8000,10.0.0.2:8000"
    assert core.replicas_for("pool_a", "interactive") == "10.0.0.1:8000,10.0.0.2:8000"  # however busy
    d = core.decide(RequestFacts(header_class="interactive", model="llama"))
    assert isinstance(d, Admit) and d.cluster == "pool_a"
    assert core.replicas_for(d.cluster, d.cls).startswith("10.0.0.1:8000")
    gate = core.gates["pool_a"]
    gate.held[core.limiters["interactive"].rank] = 9.0  # most of the limit: still the fast one first
    assert core.replicas_for("pool_a", "interactive").startswith("10.0.0.1:8000")
    core.set_saturation("pool_a", PoolSaturation())  # no longer slow
    gate.held[core.limiters["interactive"].rank] = 0.0
    assert core.replicas_for("pool_a", "interactive") is None


def test_a_replica_whose_histogram_sum_stands_still_is_not_a_zero_pace():
    # Its count grows, its sum does not (an exporter that fills only the count): 0 s a token is no measurement,
    # and as the fastest replica it divided every other's pace by zero (ZeroDivisionError in judge_slow).
    still, other = paced(0.0), paced(0.010)
    assert still.seconds_per_token(10.0) is None
    assert judge_slow([still, other], 10.0, 1.5) == [] and not other.slow and not still.slow
