"""The what-if's models of the modes without the ext_proc (a: no control, b: Envoy's adaptive_concurrency),
every mode through `--what-if`, and the what-if ranking the modes as the recorded real runs did."""

import argparse
import math
import re
from pathlib import Path

import pytest

from extproc.policy.admission import Admit, RequestFacts
from extproc.tools.demo import mode_stats, what_if_stats, what_if_tables
from extproc.tools.demo.baselines import EnvoyAdaptive, GradientController, NoAdmission, admitter_for
from extproc.tools.adaptive_concurrency import TUNED
from extproc.tools.demo.modes import MODES, with_policies
from extproc.tools.demo.ordering import (RECORDED_REAL_KV_AGENTS, RECORDED_REAL_RUNS, disagreements, from_summary, ranking, settled_pairs,
                                         window_values)
from extproc.tools.demo.runner import ModeResult
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.loadgen import RequestRecord


def controller(limit, min_rtt=1.0, buffer=100.0, **kw):
    c = GradientController(min_rtt, buffer, 90.0, **kw)
    c.limit = limit
    return c


def test_the_limit_falls_when_sampled_latency_rises_over_min_rtt_plus_buffer():
    c = controller(40)
    for latency in [3.0] * 10:  # target 2 s (1 s + 100%): gradient 2/3
        c.record(latency)
    assert c.update() == int(40 * 2 / 3 + math.sqrt(40 * 2 / 3)) == 31
    for latency in [10.0] * 10:  # far over: the gradient is clamped at 0.5
        c.record(latency)
    assert c.update() == int(15.5 + math.sqrt(15.5)) == 19 and c.last_gradient == 0.5


def test_the_limit_rises_by_its_square_root_headroom_at_or_under_the_target():
    c = controller(16)
    assert c.gradient(2.0) == 1.0 and c.next_limit(1.0) == 20  # a sample RTT of min RTT + buffer: the headroom
    c.record(2.0)  # ... but one 2.0 s latency reads as 2.05 s in Envoy's histogram: just over the target
    assert c.update() == int(16 * 2 / 2.05 + math.sqrt(16 * 2 / 2.05)) == 19
    c.record(0.5)  # well under: gradient clamped at 2
    assert c.update() == int(38 + math.sqrt(38)) and c.last_gradient == 2.0


def test_the_sample_rtt_is_read_from_envoys_log_linear_histogram():
    # What real Envoy 1.40 reported as sample_rtt_msecs for intervals with these latencies (wall seconds), in
    # tests/integration/test_envoy_adaptive_model.py's runs: the bin's share, not the latencies themselves.
    p90 = GradientController(0.2, 100.0, 90.0, speed=1.0)
    assert p90.sample_rtt([1.0123] * 24) == pytest.approx(1.088)  # the 22nd of 24 in [1.0, 1.1) s: 22/25 of it
    assert p90.sample_rtt([0.112]) == pytest.approx(0.115)  # one sample: the middle of its bin
    assert p90.sample_rtt([0.1226, 0.1256, 0.1281]) == pytest.approx(0.1275)  # Envoy: 127 (whole ms)
    median = GradientController(0.5, 100.0, 50.0, speed=1.0)
    assert median.sample_rtt([1.0123] * 9) == pytest.approx(1.05) and median.gradient(1.05) < 0.96
    assert median.sample_rtt([1.09] * 9) == pytest.approx(1.05)  # and under the latencies at a bin's top
    assert median.sample_rtt([0.09, 1.32, 1.33]) == pytest.approx(1.3333, abs=1e-4)  # the 1st of its bin's 2: 1/3
    # The what-if's seconds at the demo's speed: Envoy bins the wall-clock fifth of them.
    b = EnvoyAdaptive(TUNED).controller
    assert b.sample_rtt([5.06] * 24) == pytest.approx(5 * 1.088)


def test_an_interval_without_samples_leaves_the_limit_and_bounds_hold():
    c = controller(10, max_concurrency_limit=24)
    assert c.update() == 10
    c.record(0.1)
    assert c.update() == 24
    c = controller(4, min_concurrency=3)
    c.record(100.0)
    assert c.update() == 3


def facts():
    return RequestFacts(api_key="k", header_class=None, model="llama-70b", max_tokens=16, stream=False)


def test_requests_over_the_limit_get_a_503_at_once_and_a_sample_frees_a_slot():
    b = EnvoyAdaptive(TUNED)
    assert b.controller.limit == TUNED["min_concurrency"] == 3  # Envoy starts at min_concurrency
    admitted = [b.decide(facts()) for _ in range(3)]
    assert all(isinstance(d, Admit) for d in admitted)
    refused = b.decide(facts())
    assert refused.status == 503 and refused.kind != "queue"
    done = RequestRecord(0, "interactive", "", 200, latency=1.2)
    b.ended(admitted[0].ticket, done)
    assert b.controller.samples == [1.2] and isinstance(b.decide(facts()), Admit)
    b.ended(admitted[1].ticket, RequestRecord(0, "interactive", "", 0, latency=60.0, error="timeout"))
    assert b.controller.samples == [1.2] and b.controller.outstanding == 2  # a timeout gives no sample


def test_each_mode_gets_its_what_if_model():
    assert isinstance(admitter_for(MODES["a"]), NoAdmission) and admitter_for(MODES["a"]).lb_policy == "round_robin"
    b = admitter_for(MODES["b"])
    assert isinstance(b, EnvoyAdaptive) and b.interval_s == TUNED["concurrency_update_interval_s"]
    assert all(admitter_for(MODES[k]).policy for k in "cde")


def test_what_if_runs_all_five_modes(capsys):
    args = argparse.Namespace(scenario="scenarios/spike.yaml", phase_s=6.0, modes="a,b,c,d,e", show_limits=True)
    assert what_if_tables(args) == 0
    out = capsys.readouterr().out
    for key, mode in MODES.items():
        assert f"| {key}: {mode.label} |" in out
    assert "b limits: 0s:adaptive_concurrency=3 " in out and "Targets:" in out


@pytest.fixture(scope="module")
def spike_what_if():
    """Every mode on scenarios/spike.yaml in the what-if: the spike window's values per mode (~6 s)."""
    return what_if_stats(Scenario.load("scenarios/spike.yaml"), ",".join(MODES))


def test_mode_a_collapses_and_b_refuses_with_503_in_the_what_if(spike_what_if):
    a, b = spike_what_if["a"]["spike"], spike_what_if["b"]["spike"]
    assert a.outcomes["interactive"]["timeout"] > 20 and a.p99 == 60.0  # clients give up at 60 s, as for real
    assert b.outcomes["interactive"]["rejected"] > 20 and b.p99 < 5


# The real runs at speed 5 ranked b above c on goodput (c's latencies sit at the 2 s line there and the shared
# CPU's delays, counted five times, push them over); at speed 2 c came above b, as in the what-if: that pair is
# not settled, and the what-if agrees with every pair the real runs agree on.
# d and e serve every interactive request of the what-if's spike within the SLO, one model or the other (34.45
# req/s each): a tie, where the real runs had e ahead by 0.06-2.6 req/s. It read as e ahead until 2026-12-07 only
# because d's sum came out 34.449999999999996 (ordering.better now calls float rounding a tie).
KNOWN_DISAGREEMENTS = {"goodput": set(), "goodput_total": {("e", "d")}, "p99": set()}


@pytest.mark.parametrize("metric", ["goodput", "goodput_total", "p99"])
def test_the_what_if_ranks_the_modes_as_the_recorded_real_runs_did(spike_what_if, metric):
    settled = settled_pairs(list(RECORDED_REAL_RUNS.values()), metric)
    assert ("a", "d") in settled or ("d", "a") in settled
    values = window_values(spike_what_if)
    assert disagreements(settled, values, metric) == KNOWN_DISAGREEMENTS[metric], ranking(values, metric)


def test_settled_pairs_leave_out_pairs_the_runs_rank_differently():
    runs = [{"d": {"p99": 1.8}, "e": {"p99": 1.5}, "b": {"p99": 2.6}},
            {"d": {"p99": 2.6}, "e": {"p99": 3.4}, "b": {"p99": 2.7}}]
    assert settled_pairs(runs, "p99") == {("d", "b")}
    assert disagreements({("d", "b")}, {"d": {"p99": 3.0}, "b": {"p99": 2.0}}, "p99") == {("d", "b")}


def test_the_ordering_is_read_from_a_summary_json_old_or_split(tmp_path):
    new = tmp_path / "new.json"
    new.write_text('{"modes": {"b": {"spike": {"p99": 2.6, "goodput": 7.5, "goodput_degraded": 0.0}},'
                   ' "d": {"spike": {"p99": 1.9, "goodput": 5.0, "goodput_degraded": 25.0}}}}')
    values = from_summary(new)
    assert ranking(values, "goodput") == ["b", "d"] and ranking(values, "goodput_total") == ["d", "b"]
    assert ranking(values, "p99") == ["d", "b"]
    old = tmp_path / "old.json"  # before the split its goodput counted degraded answers
    old.write_text('{"modes": {"d": {"spike": {"p99": 2.65, "goodput": 26.6}}}}')
    assert from_summary(old) == {"d": {"p99": 2.65, "goodput_total": 26.6}}


# kv-agents: the what-if ranks the five modes as the real run did in both spikes on p99, and on full-model goodput
# for every pair but mode e's: since issue 20's changes to the per-class caps (lower classes yield once per ask)
# the real run put e above b in both spikes (1.40 / 2.04 against 1.22 / 1.13 req/s) and above d in the second
# (2.04 against 1.84), and the what-if puts e below d in the second. The engine model gives interactive less when
# batch and agent yield than the simulator does; docs/adaptive.md. (While extproc.tools.stats.percentile halved
# ranks to even, b's p90 of 10 samples was the slowest, and the what-if put e below b in the second spike too: 1.38
# against 1.42. Until a breaker's state moved on by time alone (2026-12-06), an idle class's open latency breaker
# kept the classes below it yielding, and the what-if put e below b in the first spike: 1.09 against 1.13; now
# 1.29.)
KV_KNOWN = {("spike-1", "goodput"): set(), ("spike-1", "p99"): set(),
            ("spike-2", "goodput"): {("e", "d")}, ("spike-2", "p99"): set()}


@pytest.fixture(scope="module")
def kv_what_if():
    scenario = Scenario.load("scenarios/kv-agents.yaml")
    capacity = scenario.fleet_capacity()
    stats = {}
    for mode in with_policies(list(MODES.values()), scenario.policies):
        res = what_if(scenario, admitter_for(mode), capacity)
        stats[mode.key] = mode_stats(ModeResult(mode, res.records, 0.0), scenario)
    return stats


@pytest.mark.parametrize("window,metric", sorted(KV_KNOWN))
def test_the_what_if_ranks_the_modes_on_kv_agents_as_the_real_run_did(kv_what_if, window, metric):
    settled = settled_pairs([RECORDED_REAL_KV_AGENTS[window]], metric)
    values = window_values(kv_what_if, window)
    assert disagreements(settled, values, metric) == KV_KNOWN[window, metric], ranking(values, metric)



def test_without_the_ext_proc_a_model_the_first_pool_does_not_serve_is_answered_404_as_the_replicas_do():
    # The real a and b route everything to the first pool, whose replicas answer 404 to a model they do not serve
    # (shared-small's lite-chat, 30% of the requests, asks for the 8B): the what-if ran it on the 70B's engines.
    doc = {"pools": {"big": {"profile": "h100-llama70b-awq", "replicas": 1, "model_names": ["llama-70b"]},
                     "small": {"profile": "h100-llama8b", "replicas": 1, "model_names": ["llama-8b"]}},
           "capacity": 4.0, "phases": [{"name": "p", "duration_s": 20, "rate": 1.0}],
           "workload": {"kinds": [{"name": "interactive", "model": "llama-70b", "prompt_tokens": 300, "max_tokens": 32},
                                  {"name": "lite", "model": "llama-8b", "prompt_tokens": 300, "max_tokens": 32}]}}
    scenario = Scenario.from_dict(doc)
    for key in "ab":
        admitter = admitter_for(MODES[key])
        records = what_if(scenario, admitter, 4.0).records
        lite = [r for r in records if r.kind == "lite"]
        assert lite and {r.status for r in lite} == {404}, key
        assert {r.status for r in records if r.kind == "interactive"} == {200}, key
    assert admitter.controller.outstanding == 0  # b: each 404 came back through the filter


def _readme_spike_rows() -> dict[str, list[float]]:
    """The README's spike table ("Spike phase, `extproc demo --what-if`"): mode key -> the numbers of its row."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| mode | interactive p99 (worst 10 s window) |"):].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        key = line.split("|")[1].strip()[0]
        rows[key] = [float(n.replace(",", "")) for n in re.findall(r"[\d,]*\d(?:\.\d+)?", line.split(":", 1)[1])]
    return rows


def test_the_readme_spike_table_is_what_the_what_if_prints(spike_what_if):
    """The README's numbers are today's tree's (a docs audit found mode b's row a model change behind): rerun
    `extproc demo --what-if` and copy its spike rows when this fails."""
    rows = _readme_spike_rows()
    assert set(rows) == set(MODES)
    for key, numbers in rows.items():
        s = spike_what_if[key]["spike"]
        tokens = f"{s.useful_tokens_per_s:,.0f}".replace(",", "")
        if key == "a":  # 60 s (31% timed out) | 0.37 req/s | – | 1,031
            want = [round(s.p99), round(s.outcomes["interactive"]["timeout"]), round(s.goodput, 2), float(tokens)]
        else:  # p99 (worst window) | goodput | [+ degraded] | tokens (x a)
            ratio = s.useful_tokens_per_s / spike_what_if["a"]["spike"].useful_tokens_per_s
            want = [round(s.p99, 2), round(s.p99_worst_window, 2), round(s.goodput, 2),
                    *([round(s.goodput_degraded, 2)] if len(numbers) == 6 else []), float(tokens), round(ratio, 2)]
        assert numbers == want, (key, numbers, want)
