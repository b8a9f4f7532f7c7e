"""ReplicaSteering: while a pool's replica is stalled, each request names the working replicas, least loaded
first by the last scrape plus what was sent since; with none stalled it names nothing (Envoy picks). A replica
Envoy has ejected for errors in a row is not named (Envoy would take it anyway)."""

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import AdmissionController
from extproc.policy.steering import EJECT_S, FAILURES, ReplicaSteering
from tests.conftest import FakeClock, make_policy


def test_nothing_is_named_without_a_stalled_replica():
    s = ReplicaSteering()
    assert s.pick("pool", 0.0) is None
    s.update("pool", ())
    assert s.pick("pool", 0.0) is None


def test_the_least_loaded_goes_first_counting_what_was_sent_since_the_reading():
    s = ReplicaSteering()
    s.update("pool", (("a:1", 3.0, 1.0), ("b:1", 1.0, 1.0), ("c:1", float("inf"), 1.0)))
    picks = [s.pick("pool", 0.0) for _ in range(4)]
    assert picks == ["b:1,a:1,c:1", "b:1,a:1,c:1", "a:1,b:1,c:1", "b:1,a:1,c:1"]  # b: 1, 2, 3 = a's 3, then a
    s.update("pool", (("a:1", 0.0, 1.0), ("b:1", 5.0, 1.0)))  # a new reading replaces the counts
    assert s.pick("pool", 0.0) == "a:1,b:1"
    s.update("pool", (("b:1", 0.0, 1.0),))
    assert s.pick("pool", 0.0) == "b:1"
    assert s.pick("other", 0.0) is None
    s.update("pool", ())  # none stalled any more
    assert s.pick("pool", 0.0) is None


def test_the_core_takes_it_from_each_saturation_reading():
    core = AdmissionController(make_policy(), clock=FakeClock())
    sat = PoolSaturation()
    sat.stalled, sat.working = 1, (("10.0.0.2:8000", 0.0, 1.0),)
    core.set_saturation("vllm_llama70b", sat)
    assert core.replicas_for("vllm_llama70b") == "10.0.0.2:8000"
    core.set_saturation("vllm_llama70b", PoolSaturation())
    assert core.replicas_for("vllm_llama70b") is None
    core.set_saturation("vllm_llama70b", sat)
    core.set_saturation("vllm_llama70b", None)  # no longer scraped
    assert core.replicas_for("vllm_llama70b") is None


def test_a_replica_failing_in_a_row_is_left_out_until_its_ejection_would_be_over():
    s = ReplicaSteering()
    s.update("pool", (("a:1", 0.0, 1.0), ("b:1", 5.0, 1.0)))
    assert s.active
    for _ in range(FAILURES - 1):
        s.answered("a:1", True, 10.0)
    assert s.pick("pool", 10.0).startswith("a:1")  # not yet FAILURES in a row
    s.answered("a:1", True, 10.0)
    assert s.pick("pool", 11.0) == "b:1"
    assert s.pick("pool", 10.0 + EJECT_S + 1).startswith("a:1")  # Envoy would have taken it back by now
    for _ in range(FAILURES):
        s.answered("a:1", True, 50.0)
    s.answered("a:1", False, 51.0)  # an answer in between: not in a row
    assert s.pick("pool", 52.0).startswith("a:1")
    for _ in range(FAILURES):
        s.answered("a:1", True, 60.0)
        s.answered("b:1", True, 60.0)
    assert s.pick("pool", 61.0) is None  # every one failing: Envoy's own balancing knows best


def test_a_replica_that_failed_and_left_the_pool_is_forgotten_once_its_ejection_would_be_over():
    # A replica that fails and then leaves (a dying pod) is never looked up again: its errors were kept for good,
    # one entry more for every replica that ever failed while a pool was steered.
    clock = FakeClock()
    core = AdmissionController(make_policy(), clock=clock)
    sat = PoolSaturation()
    sat.stalled, sat.working = 1, (("10.0.0.2:8000", 0.0, 1.0), ("10.0.0.3:8000", 0.0, 1.0))
    core.set_saturation("vllm_llama70b", sat)
    for _ in range(FAILURES):
        core.replica_answered("10.0.0.3:8000", True)
    clock.advance(EJECT_S / 2)
    core.set_saturation("vllm_llama70b", sat)
    assert core.replicas_for("vllm_llama70b") == "10.0.0.2:8000"  # still ejected
    sat.working = (("10.0.0.2:8000", 0.0, 1.0),)  # it left the pool
    clock.advance(EJECT_S)
    core.set_saturation("vllm_llama70b", sat)
    assert core.steering._failing == {}


def test_an_error_after_an_ejection_is_over_counts_from_one_whether_or_not_a_lookup_dropped_it_in_between():
    # The errors of an ejection that is over were only dropped when a request to the pool looked the replica up (or
    # a scrape came): one more error before that ejected it again for EJECT_S, after it, not.
    s = ReplicaSteering()
    s.update("pool", (("a:1", 0.0, 1.0), ("b:1", 5.0, 1.0)))
    for _ in range(FAILURES):
        s.answered("a:1", True, 10.0)
    later = 10.0 + EJECT_S + 1
    s.answered("a:1", True, later)  # no request to the pool since its ejection ended
    assert s.pick("pool", later).startswith("a:1")


def test_a_request_names_at_most_named_replicas_the_same_first_ones_as_before():
    from extproc.policy.steering import NAMED
    s = ReplicaSteering()
    working = [(f"10.0.{i // 250}.{i % 250}:8000", float(i % 7), 2.0 if i % 5 == 0 else 1.0) for i in range(300)]
    s.update("p", working, stalled=True)
    names = s.pick("p", 0.0).split(",")
    assert len(names) == NAMED and names[0] == working[0][0]  # the least loaded (load 0, first read)
    assert names[1:] == [a for a, _, _ in working[1:NAMED]]  # then as read
    tight = s.pick("p", 0.0, tight_slo=True).split(",")
    fast = [(load, a) for a, load, pace in working if pace <= 1.0]
    least = min(fast, key=lambda r: r[0])[1]  # the least loaded fast one, the first read among equals
    assert len(tight) == NAMED and tight[0] == least and all(a in dict(map(reversed, fast)) for a in tight)
