"""ReplicaSteering for LoRA adapters: a request for one of a pool's adapters names the least loaded replica already
running it (or sent it since the last scrape) while that one's load is within one adapter's share of the least
loaded candidate's; else the least loaded one with a free adapter slot; else (every slot taken) its home, the
replica last named for it, within the same bound; else none (Envoy balances). Nothing changes for a model that is not an
adapter, or where the replicas do not export their LoRA state. A stalled or slow replica is kept out first."""

from extproc.policy.adaptive import PoolSaturation
from extproc.policy.admission import AdmissionController
from extproc.policy.steering import ReplicaSteering
from tests.conftest import FakeClock, make_policy
from tests.unit.test_model_names import card, listed_core


def lora_steering(*replicas, adapters=("a1", "a2", "a3", "a4", "a5", "a6")) -> ReplicaSteering:
    """Steering for pool `p` whose replicas are (address, load, max_lora, adapters running)."""
    s = ReplicaSteering()
    s.set_adapters("p", frozenset(adapters))
    s.update_loras("p", tuple((a, float(load), m, frozenset(run)) for a, load, m, run in replicas))
    return s


def test_an_adapter_goes_to_the_replica_running_it():
    s = lora_steering(("a:1", 6, 2, {"a1", "a2"}), ("b:1", 4, 2, {"a3", "a4"}))
    assert s.active
    assert s.pick("p", 0.0, model="a1") == "a:1"  # load 6 <= 4 + one adapter's share (10 / 4 = 2.5)
    assert s.pick("p", 0.0, model="a3") == "b:1"


def test_the_herding_is_bounded_by_one_adapters_share_of_the_load():
    # Share: 12 requests over 4 adapters running = 3 a slot in use. a:1 at 8 > 2 + 3: a1 is not sent there, nor to
    # b:1, whose slots are full (it would wait for one there), and it has no home: Envoy balances.
    s = lora_steering(("a:1", 8, 2, {"a1", "a2"}), ("b:1", 2, 2, {"a3", "a4"}))
    assert s.pick("p", 0.0, model="a1") is None
    # With a free slot on b:1 it goes there, and counts as running there from then on.
    s = lora_steering(("a:1", 8, 2, {"a1", "a2"}), ("b:1", 2, 3, {"a3", "a4"}))
    assert s.pick("p", 0.0, model="a1") == "b:1"
    assert s.pick("p", 0.0, model="a1") == "b:1"  # now affine there (b's load 3)


def test_what_was_sent_since_the_scrape_counts_as_load_and_as_running():
    s = lora_steering(("a:1", 0, 2, ()), ("b:1", 0, 2, ()))
    # Nothing runs: the least loaded with a free slot; from then on a1 runs there (sent since the scrape), and
    # stays while a:1's load is within the share (its load over the one adapter in use) of b's.
    assert [s.pick("p", 0.0, model="a1") for _ in range(3)] == ["a:1"] * 3
    # a2 runs nowhere: the least loaded with a free slot, b:1; a3 too (b at 1 is under a's 3, a slot left).
    assert [s.pick("p", 0.0, model=m) for m in ("a2", "a3")] == ["b:1", "b:1"]
    assert s.pick("p", 0.0, model="a4") == "a:1"  # b's slots are full: a's last free one
    assert s.pick("p", 0.0, model="a5") is None  # every slot taken, and no home: Envoy balances
    # a1 on a:1 at 4 is over b's 2 + the share (6 sent over 4 adapters: 1.5), and a:1 is its home: none.
    assert s.pick("p", 0.0, model="a1") is None
    # A new scrape replaces the counts and the adapters.
    s.update_loras("p", (("a:1", 1.0, 2, frozenset({"a1"})), ("b:1", 0.0, 2, frozenset())))
    assert s.pick("p", 0.0, model="a1") == "a:1"
    s.update_loras("p", ())
    assert not s.active and s.pick("p", 0.0, model="a1") is None


def test_with_every_slot_taken_an_adapter_keeps_to_its_home_within_the_bound():
    """A request for an adapter that runs nowhere waits for a slot wherever it goes (vLLM 0.32 does not list it
    while it waits): where its earlier ones wait, it takes one slot when one frees, not one on every replica."""
    s = lora_steering(("a:1", 10, 3, {"a1", "a2"}), ("b:1", 12, 2, {"a3", "a4"}))
    assert s.pick("p", 0.0, model="a5") == "a:1"  # a free slot: a5's home from now on
    # A new scrape: a:1's slots are full and a5 waits there, not listed.
    s.update_loras("p", (("a:1", 14.0, 3, frozenset({"a1", "a2", "a6"})), ("b:1", 11.0, 2, frozenset({"a3", "a4"}))))
    assert s.pick("p", 0.0, model="a5") == "a:1"  # its home: 14 <= 11 + 25 / 5
    assert s.pick("p", 0.0, model="a7") is None  # no home, no slot: Envoy balances
    s.update_loras("p", (("a:1", 30.0, 3, frozenset({"a1", "a2", "a6"})), ("b:1", 11.0, 2, frozenset({"a3", "a4"}))))
    assert s.pick("p", 0.0, model="a5") is None  # its home past the bound (30 > 11 + 41 / 5)


def test_nothing_changes_for_a_model_that_is_not_an_adapter_or_without_lora_state():
    s = lora_steering(("a:1", 0, 2, {"a1"}), ("b:1", 5, 2, ()))
    assert s.pick("p", 0.0, model="llama") is None  # the base model
    assert s.pick("p", 0.0) is None
    assert s.pick("other", 0.0, model="a1") is None  # another pool
    # An adapter no listing names but a replica reports running is one too.
    s = lora_steering(("a:1", 0, 2, {"x9"}), ("b:1", 5, 2, ()), adapters=())
    assert s.pick("p", 0.0, model="x9") == "a:1"
    assert s.pick("p", 0.0, model="a1") is None
    # Replicas without vllm:lora_requests_info: nothing to go by.
    s = ReplicaSteering()
    s.set_adapters("p", frozenset({"a1"}))
    assert not s.active and s.pick("p", 0.0, model="a1") is None


def test_a_stalled_replica_is_left_out_first_and_the_rest_named_after():
    s = lora_steering(("b:1", 5, 2, {"a1"}), ("c:1", 0, 2, ()))  # a:1 is stalled: not in either reading
    s.update("p", (("b:1", 5.0, 1.0), ("c:1", 0.0, 1.0)), stalled=True)
    assert s.pick("p", 0.0, model="a1") == "b:1,c:1"  # b runs a1: 5 <= 0 + 5 / 1
    assert s.pick("p", 0.0, model="llama") == "c:1,b:1"  # the base model: least loaded first, as before
    assert s.pick("p", 0.0, model="a2") == "c:1,b:1"  # c: least loaded with a free slot


def test_a_class_with_an_slo_is_kept_off_a_slow_replica_running_its_adapter():
    s = lora_steering(("a:1", 1, 2, {"a1"}), ("b:1", 1, 2, ()))
    s.update("p", (("a:1", 1.0, 2.5), ("b:1", 1.0, 1.0)), stalled=False)  # a:1 slow
    assert s.pick("p", 0.0, tight_slo=True, model="a1") == "b:1,a:1"
    assert s.pick("p", 0.0, model="a1") == "a:1"  # other classes: only its adapter's replica, as Envoy would


def test_the_core_takes_adapters_from_listings_and_lora_state_from_saturation(clock):
    core = listed_core(clock)
    core.set_listings("pool_a", [[card("llama"), card("sql-lora", "llama")]])
    sat = PoolSaturation()
    sat.loras = (("10.0.0.1:8000", 9.0, 4, frozenset({"sql-lora"})), ("10.0.0.2:8000", 8.0, 4, frozenset()))
    core.set_saturation("pool_a", sat)
    assert core.replicas_for("pool_a", "batch", "sql-lora") == "10.0.0.1:8000"
    assert core.replicas_for("pool_a", "batch", "llama") is None
    assert core.replicas_for("pool_a", "batch") is None
    core.set_saturation("pool_a", None)
    assert core.replicas_for("pool_a", "batch", "sql-lora") is None


def test_without_lora_state_the_core_names_nothing():
    core = AdmissionController(make_policy(), clock=FakeClock())
    core.set_saturation("vllm_llama70b", PoolSaturation())
    assert core.replicas_for("vllm_llama70b", None, "llama-70b") is None
    assert not core.steering.active
