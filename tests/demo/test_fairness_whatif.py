"""Work-based fairness when every tenant waits (scenarios/tenants-backlogged.yaml, engine-model what-if): three
batch tenants of weights 1, 1, 2, each sending about the pool's capacity, tenant A with prompts ~8x the others'.
Round-robin grants by turns, so A's long prompts take most of the GPU (llm-d's open issue about it); `fair` grants
by GPU-seconds served per weight (the policies' coefficients, in the engine profile's proportions, corrected per
flow by the usage read), so each tenant gets its weighted share of what the engine spends."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from extproc.policy.fairness import jain_index
from extproc.tools.demo.results import engine_time, served_work
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import PolicyAdmitter, what_if

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["tenant-a", "tenant-b", "tenant-c"]
DUE = {"tenant-a": 0.25, "tenant-b": 0.25, "tenant-c": 0.5}  # weights 1, 1, 2


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return Scenario.load(ROOT / "scenarios" / "tenants-backlogged.yaml")


def shares(scenario: Scenario, policy: str) -> tuple[dict[str, float], float]:
    """Each tenant's share of the GPU-seconds served in the backlog window, and the output tokens/s of all."""
    admitter = PolicyAdmitter(policy)
    res = what_if(scenario, admitter, scenario.fleet_capacity())
    window = scenario.report_windows()["backlog"]
    work = served_work(res.records, window, KINDS, admitter.core.cost_models["llama-70b"])
    total = sum(w[0] for w in work.values())
    output = sum(r.output_tokens for r in res.records if r.ok and window[0] <= r.start < window[1])
    return {k: work[k][0] / total for k in KINDS}, output / (window[1] - window[0])


def _bench():
    spec = importlib.util.spec_from_file_location("bench_noisy_neighbour", ROOT / "bench" / "noisy_neighbour.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def pool_limited(path: str, tmp_path: Path) -> str:
    """The policy under a pool-wide limit, as bench/noisy_neighbour.py --backlogged runs it (one definition: two
    copies drifted once)."""
    doc = _bench().with_pool_limit(yaml.safe_load(Path(path).read_text()))
    out = tmp_path / Path(path).name
    out.write_text(yaml.safe_dump(doc))
    return str(out)


def test_every_tenant_is_backlogged_and_turns_give_the_long_prompts_most_of_the_gpu(scenario):
    rr, _ = shares(scenario, str(ROOT / scenario.policies["d"]))
    assert rr["tenant-a"] > 0.55  # measured 0.67: a turn each, and A's turns are ~4x the GPU-seconds
    assert rr["tenant-c"] < 0.25  # weight 2, and it gets less than a third


def test_fair_gives_each_backlogged_tenant_its_weighted_share_of_gpu_seconds(scenario):
    fair, fair_out = shares(scenario, str(ROOT / scenario.policies["e"]))
    for k in KINDS:
        # Measured 0.29 / 0.26 / 0.46 (seeds 31-34: Jain 0.983-0.999). Each flow's scale rests on its few read
        # answers, and with output-dominated costs (lognormal answers) it is noisier than the prompt-dominated
        # fit to service times was (0.25 / 0.26 / 0.49): the engine's time below is what the shares are for.
        assert fair[k] == pytest.approx(DUE[k], abs=0.05), fair
    assert jain_index(fair[k] / DUE[k] for k in KINDS) > 0.98
    _, rr_out = shares(scenario, str(ROOT / scenario.policies["d"]))
    assert fair_out >= rr_out  # work-conserving: the same slots, none idle while someone waits


def engine_shares(scenario: Scenario, policy: str) -> dict[str, float]:
    """Each tenant's share of the engine time its full-model answers in the backlog window took of the replicas
    (the engine model's own attribution of each step: no cost model involved)."""
    res = what_if(scenario, PolicyAdmitter(policy), scenario.fleet_capacity())
    time = engine_time(res.records, scenario.report_windows()["backlog"], KINDS, res.engine_work)
    return {k: time[k] / sum(time.values()) for k in KINDS}


def test_the_weighted_shares_hold_in_the_engine_time_the_replicas_really_spent(scenario):
    # The shares above are in the units the fair queue charges (its cost model). Read from what each request took
    # of the engine's steps instead, fair gives each its weighted share and turns give A's long prompts most of
    # it: the GPU-seconds, with their context term, weigh requests as the engine does.
    fair = engine_shares(scenario, str(ROOT / scenario.policies["e"]))
    for k in KINDS:
        assert fair[k] == pytest.approx(DUE[k], abs=0.04), fair  # measured 0.25 / 0.27 / 0.48
    rr = engine_shares(scenario, str(ROOT / scenario.policies["d"]))
    assert rr["tenant-a"] > 0.55, rr  # measured 0.65


def test_under_a_pool_wide_limit_the_owners_return_shares_by_weight_in_either_mode(scenario, tmp_path):
    # A flow under its weighted share of what the class holds on the pool goes in over the full limit, so both
    # round_robin and fair end near the weighted shares (in the limit's tokens, where A's prompts weigh more).
    for key in "de":
        got, _ = shares(scenario, pool_limited(str(ROOT / scenario.policies[key]), tmp_path))
        for k in KINDS:
            assert got[k] == pytest.approx(DUE[k], abs=0.05), (key, got)  # measured 0.23 / 0.28 / 0.49-0.50


def test_a_guaranteed_share_holds_under_a_pool_wide_limit_as_under_the_cap(scenario, tmp_path):
    # C of weight 1 with guaranteed_share 0.6: under the cap it gets 61% of the answers; under the pool-wide limit
    # the owner's return held it to its weighted third (51% of the answers, 44% of the GPU-seconds) until share()
    # counted guarantees (61%, 51%).
    doc = yaml.safe_load(Path(ROOT / scenario.policies["e"]).read_text())
    for t in doc["tenants"]:
        if t["name"] == "tenant-c":
            t.update(weight=1, guaranteed_share=0.6)
    path = tmp_path / "guaranteed.yaml"
    path.write_text(yaml.safe_dump(doc))
    admitter = PolicyAdmitter(pool_limited(str(path), tmp_path))
    res = what_if(scenario, admitter, scenario.fleet_capacity())
    work = served_work(res.records, scenario.report_windows()["backlog"], KINDS,
                       admitter.core.cost_models["llama-70b"])
    answers = {k: work[k][2] for k in KINDS}
    assert answers["tenant-c"] / sum(answers.values()) > 0.57, answers


@pytest.fixture(scope="module")
def mix() -> Scenario:
    return Scenario.load(ROOT / "scenarios" / "tenants-output-mix.yaml")


def test_tenants_that_differ_in_answer_length_get_their_weighted_engine_time_under_the_cap(mix):
    # scenarios/tenants-output-mix.yaml: A's answers short (max_tokens 20), B's long (600). Charged at coefficients
    # fitted to service times, whose prompt term ran to its bound, A got 12% of the engine's time under the cap
    # where 25% was due, and B 35% (Jain 0.863; seeds 31-34: 0.83-0.89).
    got = engine_shares(mix, str(ROOT / mix.policies["e"]))
    assert got["tenant-a"] > 0.2, got  # measured 0.23
    for k in KINDS:
        assert got[k] == pytest.approx(DUE[k], abs=0.06), got  # measured 0.23 / 0.21 / 0.55
    assert jain_index(got[k] / DUE[k] for k in KINDS) > 0.98, got  # 0.988 (seeds 31-34: 0.979-0.998)


def test_tenants_that_differ_in_answer_length_get_their_weighted_engine_time_under_a_pool_wide_limit(mix, tmp_path):
    # The owner's return under a pool-wide limit shares the limit's tokens, and there too each tenant gets its
    # weighted share of what the replicas really spent.
    got = engine_shares(mix, pool_limited(str(ROOT / mix.policies["e"]), tmp_path))
    assert jain_index(got[k] / DUE[k] for k in KINDS) > 0.98, got  # measured 0.27 / 0.28 / 0.45: 0.992


def test_the_live_fairness_index_tells_turns_from_work_based_fairness(scenario):
    """What `extproc_class_fairness_index` reads through the backlog, sampled every second from the what-if's own
    core (bench/fairness_index.py): until stop 57 it counted service per weight only, and could not tell the
    noisy-neighbour modes apart (0.63 / 0.65 / 0.64); now each tenant is weighed against its weighted share of what
    it asked."""
    spec = importlib.util.spec_from_file_location("bench_fairness_index", ROOT / "bench" / "fairness_index.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    t0, t1 = scenario.report_windows()["backlog"]
    read = {}
    for mode in ("d", "e"):
        sampler = bench.IndexSampler(str(ROOT / scenario.policies[mode]), scenario.slo_class)
        what_if(scenario, sampler, scenario.fleet_capacity())
        live = sampler.read(t0, t1)
        read[mode] = sum(live) / len(live)
    assert read["d"] < 0.7 < 0.85 < read["e"]  # measured 0.57 (round-robin) and 0.91 (fair)
