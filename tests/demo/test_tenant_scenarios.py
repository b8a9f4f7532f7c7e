"""Scenarios whose SLO class is several tenants, each its own kind (noisy-neighbour, tenants-backlogged): `slo.kinds`
judges the SLO on them together, a phase's `weights` count in its load, the report names the modes as the scenario
does and prints the tenants' fairness index. Before, these scenarios printed NaN for every latency and goodput, a
flood phase at rate 0.6 counted as calm, and the modes kept the default labels (fifo read as "static caps")."""

import math
from pathlib import Path

import pytest

from extproc.tools.demo.modes import parse_modes, with_policies
from extproc.tools.demo.report import class_goodput_table
from extproc.tools.demo.results import calm_windows, fairness_index, spike_windows, window_stats
from extproc.tools.demo.scenario import Scenario
from extproc.tools.loadgen import RequestRecord

ROOT = Path(__file__).resolve().parents[2]


def scenario(**extra) -> Scenario:
    kinds = [{"name": f"tenant-{t}", "endpoint": "chat", "prompt_tokens": 500, "max_tokens": 64} for t in "abc"]
    return Scenario.from_dict({"pools": {"p": {"profile": "h100-llama8b"}}, "capacity": 10.0,
                               "phases": [{"name": "calm", "duration_s": 10, "rate": 0.6},
                                          {"name": "flood", "duration_s": 10, "rate": 0.6,
                                           "weights": {"tenant-a": 5}}],
                               "workload": {"kinds": kinds}, **extra})


def rec(kind: str, start: float, latency: float = 1.0, status: int = 200, prompt: int = 500) -> RequestRecord:
    ok = status == 200
    return RequestRecord(start, kind, "", status, latency=latency if ok else None, prompt_tokens=prompt,
                         output_tokens=100 if ok else 0)


def test_a_phase_counts_its_weights_in_its_load():
    s = scenario()
    assert [round(s.phase_load(p), 3) for p in s.phases] == [0.6, 1.4]  # 0.6 x (5 + 1 + 1) / 3
    assert list(calm_windows(s)) == ["phase calm"]  # the flood is not held to the calm phases' zero
    assert list(spike_windows(scenario(windows={"flood": ["flood"]}))) == ["flood"]


def test_without_windows_the_report_compares_the_phase_of_the_highest_load_not_of_the_highest_rate():
    # Both phases at rate 0.6: the default window was the first (the calm one), and the flood had no spike targets.
    s = scenario()
    assert s.report_windows() == {"spike": (10.0, 20.0)} and list(spike_windows(s)) == ["spike"]


def test_slo_kinds_judge_several_tenant_kinds_together_and_name_only_known_kinds():
    s = scenario(slo={"class": "interactive", "kinds": ["tenant-a", "tenant-b", "tenant-c"]})
    assert s.slo_kinds == ("tenant-a", "tenant-b", "tenant-c") and not s.warnings
    records = [rec("tenant-a", 1.0, 3.0), rec("tenant-b", 1.0, 1.0), rec("tenant-c", 2.0, 1.5)]
    st = window_stats(records, (0.0, 10.0), s.slo_kinds, 2.0, 60.0, True)
    assert st.p99 == pytest.approx(3.0, abs=0.05) and st.goodput == pytest.approx(0.2)  # 2 of 3 within 2 s
    assert scenario().warnings and "slo.kinds" in scenario().warnings[0]  # interactive names no kind here
    with pytest.raises(ValueError, match="slo.kinds: tenant-x name no kind"):
        scenario(slo={"kinds": ["tenant-a", "tenant-x"]})
    with pytest.raises(ValueError, match="slo.kinds: a list"):
        scenario(slo={"kinds": "tenant-a"})  # not read as the kinds t, e, n, ...


def test_labels_name_the_modes_and_only_modes():
    s = scenario(labels={"c": "fifo between tenants"})
    (c,) = with_policies(parse_modes("c"), {}, labels=s.labels)
    assert c.label == "fifo between tenants"
    with pytest.raises(ValueError, match="labels: z are not modes"):
        scenario(labels={"z": "?"})
    with pytest.raises(ValueError, match="labels: mode key -> text"):
        scenario(labels=["fifo"])


TENANTS = ("tenant-a", "tenant-b", "tenant-c")


def test_the_fairness_index_is_against_each_tenants_max_min_share_of_the_tokens_served():
    # A asks 5x; B and C get all they ask (4 each) and A the rest: every one its max-min share.
    served_all = [rec("tenant-a", t / 2) for t in range(20)] + [rec(k, t) for k in TENANTS[1:] for t in range(4)]
    flooded = [rec("tenant-a", t / 2, status=429) for t in range(20, 40)]
    assert fairness_index(served_all + flooded, TENANTS, 2.0) == pytest.approx(1.0)
    # The same demand, but B refused half of what it asked while A got more: under its share.
    starved = [rec("tenant-a", t / 4) for t in range(40)] + [rec("tenant-b", t, status=(200 if t < 2 else 429))
                                                             for t in range(4)] + [rec("tenant-c", t) for t in range(4)]
    assert fairness_index(starved, TENANTS, 2.0) < 0.95
    assert math.isnan(fairness_index(starved, ("tenant-a",), 2.0))  # one SLO kind: no index


def test_the_fairness_index_counts_tokens_not_answers():
    # Every tenant backlogged, one answer each a second: equal in answers, but A's prompts are 8x B's and C's.
    records = [rec(k, t, prompt=4000 if k == "tenant-a" else 500) for k in TENANTS for t in range(10)]
    records += [rec(k, t / 3, status=429, prompt=4000 if k == "tenant-a" else 500) for k in TENANTS
                for t in range(30)]  # each asked four times what it got: more than an equal share
    assert fairness_index(records, TENANTS, 2.0) == pytest.approx(0.535, abs=0.01)  # A got 77% of the tokens


def test_the_noisy_neighbour_report_judges_the_tenants_and_prints_their_fairness_index():
    s = Scenario.load(ROOT / "scenarios" / "noisy-neighbour.yaml")
    assert not s.warnings and list(spike_windows(s)) == ["flood"] and "phase flood" not in calm_windows(s)
    records = [rec("tenant-a", 70.0, 1.0), rec("tenant-b", 71.0, 1.0), rec("tenant-c", 72.0, 3.0)]
    stats = {"e": {"flood": window_stats(records, (60.0, 120.0), s.slo_kinds, s.slo_p95_s, 60.0, True)}}
    table = class_goodput_table(stats, {"e": s.labels["e"]}, s.slo_kinds, s.slo_p95_s, "flood")
    assert "fairness index" in table.splitlines()[0] and "| e: fair (GPU-seconds per weight) |" in table
