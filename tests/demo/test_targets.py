"""Issue 19's reporting: full-model goodput apart from degraded answers, and the targets for our policy (d)."""

import math

import pytest
import yaml

from extproc.tools.demo.results import (ClassOrder, WindowStats, adaptive_targets, calm_windows, spike_windows,
                                       targets, window_stats)
from extproc.tools.demo.scenario import Scenario
from extproc.tools.loadgen import RequestRecord

BIG, SMALL = "llama-70b", "llama-8b"


def rec(start, kind="interactive", latency=0.5, status=200, model=BIG, tokens=10, queued=False, error=None,
        wait=0.0):
    return RequestRecord(start, kind, "", status, latency=latency, ttft=0.1 if status == 200 else None,
                         output_tokens=tokens, error=error, asked_model=BIG,
                         model=model if status == 200 else None, queued=queued or wait > 0, queue_wait=wait)


def stats(records, window=(0.0, 10.0), onsets=None):
    return window_stats(records, window, "interactive", 2.0, 60.0, True, onsets)


def ws(**fields) -> WindowStats:
    base = dict(p50=1, p95=1, p99=1, ttft_p99=1, goodput=0, goodput_degraded=0, tokens_per_s=0,
                useful_tokens_per_s=0, degraded_tokens_per_s=0, requests=1, p99_worst_window=1.0,
                others=1)  # some request of a lower class
    return WindowStats(**{**base, **fields})


def test_a_degraded_answer_is_not_full_model_goodput():
    w = stats([rec(1), rec(2, model=SMALL), rec(3, kind="batch", model=SMALL, tokens=40)])
    assert w.goodput == pytest.approx(0.1) and w.goodput_degraded == pytest.approx(0.1)
    assert w.goodput_by_class["interactive"] == pytest.approx({"full": 0.1, "degraded": 0.1})
    assert w.goodput_by_class["batch"] == pytest.approx({"full": 0.0, "degraded": 0.1})
    assert w.outcomes["interactive"]["degraded"] == 50.0 and w.degraded == 2
    assert w.useful_tokens_per_s == pytest.approx(1.0) and w.degraded_tokens_per_s == pytest.approx(5.0)


def test_a_degrade_on_the_same_model_is_not_full_model_goodput_either():
    # `fallback: {action: degrade, max_tokens: 128}`: the same model answers, fewer tokens; the ext_proc says so
    # in x-extproc-decision, and the record keeps it (a user's report showed such a run as 0% degraded).
    clamped = rec(2)
    clamped.degraded_by_policy = True
    w = stats([rec(1), clamped])
    assert w.goodput == pytest.approx(0.1) and w.goodput_degraded == pytest.approx(0.1) and w.degraded == 1


def test_other_http_errors_are_counted_and_are_no_latency():
    # Every request a 404 (a model name typo in a scenario) printed p99 0.00 s and every target reached.
    w = stats([rec(1, status=404, error="invalid_request_error", latency=0.002), rec(2, status=401, latency=0.002)])
    assert math.isnan(w.p99) and w.failed == 2 and w.refused == 0 and w.goodput == 0
    found = by_name(targets(spike_and_calm(ws(), ws(failed=3)), ["spike"], ["phase normal"], 2.0))
    assert not found["d: requests refused, degraded or failed (== 0)"].reached


def test_an_interactive_answer_past_the_slo_is_neither_goodput_nor_useful_tokens():
    w = stats([rec(1, latency=3.0), rec(2, kind="batch", latency=3.0)])
    assert w.goodput == 0 and w.tokens_per_s == pytest.approx(2.0) and w.useful_tokens_per_s == pytest.approx(1.0)
    assert w.goodput_by_class["batch"]["full"] == pytest.approx(0.1)


def test_a_record_that_does_not_say_which_model_answered_counts_as_the_one_asked():
    assert not RequestRecord(0, "interactive", "", 200, asked_model=BIG).degraded
    assert RequestRecord(0, "interactive", "", 200, asked_model=BIG, model=SMALL).degraded


def test_the_p99_target_holds_in_every_10_s_window_not_only_over_the_whole_spike():
    records = [rec(i / 10) for i in range(600)]  # 10/s for 60 s, 0.5 s each
    for r in records[300:305]:  # five slow ones in 30-30.5 s: under 1% of the spike, 5% of its 10 s windows
        r.latency = 5.0
    w = stats(records, (0.0, 60.0))
    assert w.p99 == 0.5
    assert w.p99_worst_window == 5.0 and 21.0 <= w.p99_worst_window_at <= 30.0


def test_the_first_5_s_of_an_overload_count_on_their_own():
    records = [rec(i / 20) for i in range(1200)]  # 20/s for 60 s
    for r in records[40:42]:  # at 2 s: 2 of 200 in any 10 s window (within the p99), 2 of 100 in the first 5 s
        r.latency = 5.0
    assert stats(records, (0.0, 60.0), onsets=()).p99_worst_window == 0.5
    w = stats(records, (0.0, 60.0), onsets=(0.0,))
    assert w.p99_worst_window == 5.0 and w.p99_worst_window_at == 0.0


def test_refusals_and_degrades_are_counted_for_the_calm_phase_target():
    w = stats([rec(1), rec(2, status=429, error="rate_limit"), rec(3, model=SMALL), rec(4, kind="batch", status=503)])
    assert w.refused == 2 and w.degraded == 1


def test_first_degrade_and_first_batch_held_back_come_from_the_records():
    w = stats([rec(1), rec(2, model=SMALL), rec(3, kind="batch", queued=True), rec(4, kind="batch", status=503),
               rec(5, model=SMALL)])
    assert w.first_degraded_at == 2 and w.first_other_held_at == 3
    assert w.first_degraded_by_kind == {"interactive": 2} and w.first_held_by_kind == {"batch": 3}


def test_a_degrade_after_a_wait_is_timed_when_it_was_decided_not_when_the_request_arrived():
    # The interactive request arrived at 2.0, waited 0.2 s for the pool and was then degraded: the batch request
    # held back at 2.1 was held before that degrade (at arrival it was waiting, not degraded).
    w = stats([rec(1), rec(2.0, model=SMALL, wait=0.2), rec(2.1, kind="batch", queued=True)])
    assert w.first_degraded_at == pytest.approx(2.2) and w.first_other_held_at == 2.1


def spike_and_calm(d: WindowStats, calm: WindowStats | None = None):
    a = ws(p99=60, p99_worst_window=60, goodput=0.3, useful_tokens_per_s=1000)
    b = ws(p99=2.6, p99_worst_window=3.0, goodput=7.5, useful_tokens_per_s=1800)
    calm = calm or ws()
    return {k: {"spike": v, "phase normal": calm} for k, v in (("a", a), ("b", b), ("d", d))}


def by_name(found):
    return {t.name.split(": ", 2)[0] + ": " + t.name.split(": ", 2)[2]: t for t in found}


def test_targets_are_on_the_full_model_against_a_and_b():
    d = ws(p99=1.5, p99_worst_window=1.9, goodput=8.0, goodput_degraded=20.0, useful_tokens_per_s=980)
    found = by_name(targets(spike_and_calm(d), ["spike"], ["phase normal"], 2.0))
    assert found["d: interactive p99, worst 10 s window and first 5 s (<= SLO)"].reached
    assert found["d vs b: full-model interactive goodput, req/s (>= b's)"].reached
    assert found["d vs a: full-model interactive goodput, req/s (>= a's)"].reached
    tokens = found["d vs a: full-model useful output tokens/s (>= 0.96 x a's)"]
    assert tokens.reached and tokens.bound == pytest.approx(960)
    assert found["d: requests refused, degraded or failed (== 0)"].reached
    assert found["d: first batch refused/queued before the first interactive degrade, s"].reached is None

    # Degraded answers do not make up for the full model: b's 7.5 req/s is not reached with 7 + 20 degraded.
    d = ws(p99_worst_window=2.5, goodput=7.0, goodput_degraded=20.0, useful_tokens_per_s=900)
    found = by_name(targets(spike_and_calm(d), ["spike"], ["phase normal"], 2.0))
    assert not found["d vs b: full-model interactive goodput, req/s (>= b's)"].reached
    assert not found["d: interactive p99, worst 10 s window and first 5 s (<= SLO)"].reached
    assert not found["d vs a: full-model useful output tokens/s (>= 0.96 x a's)"].reached


def test_nothing_refused_or_degraded_at_low_load():
    found = by_name(targets(spike_and_calm(ws(), ws(refused=0, degraded=1)), ["spike"], ["phase normal"], 2.0))
    t = found["d: requests refused, degraded or failed (== 0)"]
    assert not t.reached and t.value == 1


def test_a_calm_phase_miss_says_what_no_control_gave_there():
    # The zero target and the SLO pull against each other where the pool cannot serve a phase's bursts within the
    # SLO even at 60% load: the report's reader needs a's numbers beside the miss to tell that from a bad policy.
    stats = spike_and_calm(ws(), ws(degraded=2))
    stats["a"]["phase normal"] = ws(p99=2.81, p99_worst_window=3.98)
    t = by_name(targets(stats, ["spike"], ["phase normal"], 2.0))["d: requests refused, degraded or failed (== 0)"]
    assert t.line().endswith("; no control there: p99 2.81 s, worst 10 s window 3.98 s (over the SLO)")
    stats["a"]["phase normal"] = ws(p99=1.2, p99_worst_window=1.6)
    t = by_name(targets(stats, ["spike"], ["phase normal"], 2.0))["d: requests refused, degraded or failed (== 0)"]
    assert t.note.endswith("(within the SLO)")
    del stats["a"]  # without a there is nothing to say; a target reached needs nothing said
    t = by_name(targets(stats, ["spike"], ["phase normal"], 2.0))["d: requests refused, degraded or failed (== 0)"]
    assert t.note == ""
    found = {t.name: t for t in adaptive_targets({"a": {"phase normal": ws(p99_worst_window=3.0)},
                                                  "e": {"spike": ws(), "phase normal": ws()}}, ["spike"], 2.0,
                                                 calm=("phase normal",))}
    assert found["e: phase normal: requests refused, degraded or failed (== 0)"].note == ""


def test_mode_e_is_held_to_the_calm_phase_target_too():
    # Issue 20 (3): the adaptive caps must not refuse at normal load, before or after a spike.
    stats = {"e": {"spike": ws(), "phase normal": ws(), "phase after": ws(refused=2, degraded=3)}}
    found = {t.name: t for t in adaptive_targets(stats, ["spike"], 2.0, calm=("phase normal", "phase after"))}
    assert found["e: phase normal: requests refused, degraded or failed (== 0)"].reached
    after = found["e: phase after: requests refused, degraded or failed (== 0)"]
    assert not after.reached and after.value == 5


@pytest.mark.parametrize("held, degraded, reached", [(60.2, 60.5, True), (61.0, 60.5, False),
                                                     (None, 60.5, False), (None, None, None)])
def test_batch_is_held_back_before_the_first_interactive_degrade(held, degraded, reached):
    d = ws(first_other_held_at=held, first_degraded_at=degraded)
    found = by_name(targets(spike_and_calm(d), ["spike"], [], 2.0))
    t = found["d: first batch refused/queued before the first interactive degrade, s"]
    assert t.reached is reached
    assert (math.isnan(t.value) if held is None else t.value == held)


def test_an_slo_class_never_degraded_is_not_applicable_rather_than_reached():
    # A four-class run whose SLO class (critical) was never degraded printed "reached ... 10.06 (target nan)":
    # a verdict on an order nothing had to keep.
    found = by_name(targets(spike_and_calm(ws(first_other_held_at=10.06)), ["spike"], [], 1.5, slo_class="critical"))
    t = found["d: first batch refused/queued before the first critical degrade, s"]
    assert t.reached is None
    assert t.line() == ("n/a      d: spike: first batch refused/queued before the first critical degrade, s: "
                        "not applicable: critical was never degraded")


def test_targets_name_the_class_the_scenario_judges():
    stats = {**spike_and_calm(ws()), "e": {"spike": ws(), "phase normal": ws()}}
    found = targets(stats, ["spike"], [], 1.5, slo_class="critical")
    found += adaptive_targets(stats, ["spike"], 1.5, slo_class="critical")
    assert not [t.name for t in found if "interactive" in t.name]
    assert "d: spike: critical p99, worst 10 s window and first 5 s (<= SLO)" in {t.name for t in found}
    assert "e vs b: full-model critical goodput (spike), req/s" in {t.name for t in found}


FOUR = ClassOrder({"critical": 0, "interactive": 1, "standard": 2, "batch": 3}, ("critical",))


@pytest.mark.parametrize("held, reached", [({"standard": 10.1}, True), ({"batch": 10.6}, False),
                                           ({"critical": 9.0}, False), ({}, False)])
def test_every_degraded_class_is_held_to_the_classes_below_it(held, reached):
    # interactive degraded at 10.5 while the SLO class (critical) never was: a lower class (standard, batch) must
    # have been refused or queued first; a higher class (critical) queued holds nothing back for it.
    d = ws(first_degraded_by_kind={"interactive": 10.5}, first_held_by_kind=held)
    found = by_name(targets(spike_and_calm(d), ["spike"], [], 1.5, slo_class="critical", order=FOUR))
    assert found["d: first interactive/standard/batch refused/queued before the first critical degrade, s"] \
        .reached is None
    t = found["d: first standard/batch refused/queued before the first interactive degrade, s"]
    assert t.reached is reached and t.bound == 10.5


def test_with_the_class_order_the_slo_class_is_held_to_the_lower_classes_only():
    # kv-agents: interactive over agent over batch; an agent request queued first counts, as before.
    order = ClassOrder({"interactive": 0, "agent": 1, "batch": 2}, ("interactive",))
    d = ws(first_degraded_at=60.5, first_degraded_by_kind={"interactive": 60.5}, first_held_by_kind={"agent": 60.2})
    (t,) = [t for t in targets(spike_and_calm(d), ["spike"], [], 2.0, order=order) if "refused/queued" in t.name]
    assert t.name == "d: spike: first agent/batch refused/queued before the first interactive degrade, s"
    assert t.reached and t.value == 60.2


def test_the_lowest_class_degraded_has_no_class_below_to_hold_back():
    d = ws(first_degraded_by_kind={"batch": 10.0})
    found = targets(spike_and_calm(d), ["spike"], [], 1.5, slo_class="critical", order=FOUR)
    assert not [t for t in found if t.name.endswith("before the first batch degrade, s")]


def test_a_scenario_of_one_class_has_no_lower_class_to_hold_back():
    # It printed "MISSED ... nan" for every degrade, as if batch had been served first.
    d = ws(first_other_held_at=None, first_degraded_at=60.5, outcomes={"interactive": {}}, others=0)
    found = by_name(targets(spike_and_calm(d), ["spike"], [], 2.0))
    assert "d: first batch refused/queued before the first interactive degrade, s" not in found


def test_spike_windows_hold_an_overload_and_calm_windows_are_the_phases_at_or_below_60_percent():
    spike = Scenario.load("scenarios/spike.yaml")
    assert spike_windows(spike) == {"spike": (60.0, 120.0)}
    assert calm_windows(spike) == {"phase normal": (0.0, 60.0), "phase after": (120.0, 180.0)}
    shifted = Scenario.load("scenarios/shifted-fleet.yaml")
    assert list(spike_windows(shifted)) == ["first-half", "second-half"]
    assert list(calm_windows(shifted)) == ["phase normal-1", "phase normal-2"]


def test_a_calm_phase_has_no_onset_its_worst_window_is_a_10_s_one():
    # A calm phase's first 5 s were counted as an overload's onset: at 30 requests/s, 2 slow answers in them are
    # 1.3% of the 5 s (its p99) but 0.7% of every 10 s window, and the calm target's note printed 5.00 s as the
    # phase's "worst 10 s window".
    from extproc.tools.demo.results import scenario_stats
    doc = yaml.safe_load(open("scenarios/spike.yaml"))
    doc.update(capacity=50.0, phases=[{"name": "calm", "duration_s": 20, "rate": 0.6}])
    records = [rec(i / 30) for i in range(600)]
    for r in records[40:42]:
        r.latency = 5.0
    calm = scenario_stats(records, Scenario.from_dict(doc), True)["phase calm"]
    assert calm.p99_worst_window == 0.5


def test_overall_is_the_whole_run_with_the_calls_sessions_make_after_the_last_phase():
    # An agent session begun near the end goes on calling (and retrying) after the last phase: kv-agents' mode d
    # made 39 of its 1,240 requests then, and "overall" (the outcome table, "whole run") left them out while the
    # row's "degraded % (all)" counted them.
    from extproc.tools.demo.results import scenario_stats
    doc = yaml.safe_load(open("scenarios/spike.yaml"))
    doc.update(capacity=10.0, phases=[{"name": "only", "duration_s": 10, "rate": 0.5}])
    late = [rec(10.0, status=429), rec(12.5, kind="batch", status=503)]
    overall = scenario_stats([rec(1), rec(9.5), *late], Scenario.from_dict(doc), True)["overall"]
    assert overall.requests == 4 and overall.refused == 2
    assert overall.outcomes["batch"]["shed"] == 100.0 and overall.outcomes["interactive"]["rejected"] == 100 / 3


def test_a_missed_target_never_prints_the_same_number_as_its_bound():
    # A worst-window p99 of 2.004 s against a 2 s SLO printed "MISSED ... 2.00 (target 2.00)".
    from extproc.tools.demo.results import Target
    assert Target("p99", 2.004, 2.0, False).line() == "MISSED   p99: 2.004 (target 2.000)"
    assert Target("p99", 1.5, 2.0, True).line() == "reached  p99: 1.50 (target 2.00)"
    assert Target("zero", 0.0, 0.0, True).line() == "reached  zero: 0.00 (target 0.00)"
    # Closer than four decimals (a simulated latency of 2.00003 s): the digits went no further than 4.
    assert Target("p99", 2.00003, 2.0, False).line() == "MISSED   p99: 2.00003 (target 2.00000)"


def test_a_mode_as_empty_as_no_control_is_not_infinitely_better_than_it():
    # kv-agents' second spike: a and c both 0.00 req/s full-model goodput; both rows printed "∞" against a.
    from extproc.tools.demo.report import throughput_table
    stats = {k: {"spike": ws(goodput=g), "overall": ws()} for k, g in (("a", 0.0), ("c", 0.0), ("d", 1.84))}
    rows = throughput_table(stats, {"a": "a", "c": "c", "d": "d"}, "interactive", 2.0).splitlines()[2:]
    vs_a = {row.split(":")[0].strip("| "): row.split("|")[3].strip() for row in rows}
    assert vs_a == {"a": "–", "c": "–", "d": "∞"}


def test_percentiles_are_nearest_rank_whatever_the_parity_of_the_rank():
    # round() halves to even: the p99 of 100 answers was the slowest (rank 100, not 99), the p50 of 10 the 6th, the
    # p95 of 20 the slowest, while the p99 of 200 was rank 198 as nearest-rank says.
    from extproc.tools.stats import percentile
    ranks = {(n, q): percentile(list(range(1, n + 1)), q) for n in (1, 2, 10, 20, 100, 101, 200, 300)
             for q in (50, 95, 99)}
    assert ranks == {(n, q): max(1, math.ceil(q * n / 100)) for n, q in ranks}
    w = stats([rec((i - 1) / 10, latency=float(i)) for i in range(1, 101)])  # 100 answers in the window
    assert w.p99 == 99.0 and w.p50 == 50.0


def test_a_broken_connection_or_an_abort_is_no_latency_and_a_broken_connection_is_a_failure():
    # Envoy down (connection refused), a reset mid-stream: the latencies of requests that failed without an HTTP
    # status went into the percentiles (p99 0.00 s) and nothing counted them, so a calm phase of nothing but
    # refused connections reached its target. A client's own abort (`abort_prob`) is no service either.
    refused_conn = rec(1, status=0, latency=0.001, tokens=0, error="ClientConnectorError")
    cut = rec(2, latency=0.3, error="ClientPayloadError")
    aborted = rec(3, latency=0.2, error="abort")
    w = stats([rec(4, latency=1.0), refused_conn, cut, aborted])
    assert w.p50 == w.p99 == 1.0 and w.failed == 2 and w.refused == 0
    found = by_name(targets(spike_and_calm(ws(), w), ["spike"], ["phase normal"], 2.0))
    assert not found["d: requests refused, degraded or failed (== 0)"].reached


def test_a_calm_phase_miss_says_what_the_phase_really_started_against_capacity():
    # kv-agents' phases are written at 60% of capacity, but agent sessions begun in a spike go on calling after it
    # (and clients retry): its `after` phase started 1.28x capacity in the what-if. A reader of "refused at 60%
    # load" must see that, and the capacity is the fleet's, in requests a second of the scenario's mix.
    stats = spike_and_calm(ws(), ws(degraded=3, started_per_s=20.5))
    t = by_name(targets(stats, ["spike"], ["phase normal"], 2.0, capacity=16.0))[
        "d: requests refused, degraded or failed (== 0)"]
    assert "started 1.28x capacity" in t.note
    stats["a"]["phase normal"] = ws(p99=2.81, p99_worst_window=3.98)
    t = by_name(targets(stats, ["spike"], ["phase normal"], 2.0, capacity=16.0))[
        "d: requests refused, degraded or failed (== 0)"]
    assert t.note == "started 1.28x capacity; no control there: p99 2.81 s, worst 10 s window 3.98 s (over the SLO)"
    stats["d"]["phase normal"] = ws(started_per_s=20.5)  # reached: nothing to explain
    t = by_name(targets(stats, ["spike"], ["phase normal"], 2.0, capacity=16.0))[
        "d: requests refused, degraded or failed (== 0)"]
    assert t.reached and t.note == ""


def test_the_window_counts_what_it_started_per_second():
    s = stats([rec(t) for t in (1.0, 2.0, 3.5, 12.0)] + [rec(4.0, kind="batch", status=429)])
    assert s.started_per_s == pytest.approx(0.4)  # every kind, refused ones too; 12 s is outside the window


FOUR_CLASSES = """
classes:
  critical:    {max_concurrency: 18, slo_p95_ms: 1500}
  interactive: {max_concurrency: 39, on_overflow: fallback, fallback: {action: degrade, model: llama-8b}}
  batch:       {max_concurrency: 48}
default_class: batch
classify: {header: x-priority}
tenants:
  - {name: crit-app, api_keys: ["sk-crit-1"], max_class: critical, default_class: critical}
  - {name: chat-app, api_keys: ["sk-chat-1"], max_class: interactive}
models:
  llama-70b: {cluster: vllm_llama70b}
  llama-8b:  {cluster: vllm_llama8b}
"""


def four_class_scenario(tmp_path) -> Scenario:
    doc = yaml.safe_load(open("scenarios/spike.yaml"))
    kind = doc["workload"]["kinds"][0]
    doc["workload"]["kinds"] = [
        {**kind, "name": "crit", "headers": {"Authorization": "Bearer sk-crit-1"}},
        {**kind, "name": "chat", "headers": {"Authorization": "Bearer sk-chat-1", "x-priority": "interactive"}},
        {**kind, "name": "offline", "headers": {}}]
    doc["slo"], doc["capacity"] = {"class": "crit", "p95_s": 1.5}, 10.0
    (tmp_path / "four.yaml").write_text(FOUR_CLASSES)
    doc["policies"] = {"d": str(tmp_path / "four.yaml")}
    return Scenario.from_dict(doc)


def test_the_class_order_is_the_policys_classes_of_the_workloads_kinds(tmp_path):
    from extproc.tools.demo import class_order, scenario_modes

    scenario = four_class_scenario(tmp_path)
    order = class_order(scenario, scenario_modes(scenario, "a,d"))
    assert order == ClassOrder({"crit": 0, "chat": 1, "offline": 2}, ("crit",))
    assert class_order(scenario, scenario_modes(scenario, "a,b")) is None  # no policy of ours to read


def test_the_report_names_the_class_the_scenario_judges(tmp_path):
    # A scenario judging `critical` printed "Interactive SLO: p95 <= 1.5 s" and "interactive p99 over time".
    import contextlib
    import io

    from extproc.tools.demo import print_tables, scenario_modes
    from extproc.tools.demo.report import write_report
    from extproc.tools.demo.runner import ModeResult

    scenario = four_class_scenario(tmp_path)
    (mode,) = scenario_modes(scenario, "d")
    records = [rec(t, kind=k) for t in range(0, 180, 3) for k in ("crit", "chat", "offline")]
    results = [ModeResult(mode, records, 0.0)]
    with contextlib.redirect_stdout(io.StringIO()):
        stats, degraded, found = print_tables(results, scenario)
    text = write_report(tmp_path, results, stats, scenario, 10.0, 1.0, found, degraded, "t", what_if=True).read_text()
    assert "SLO of the crit\nclass: p95 ≤ 1.5 s" in text and "Interactive" not in text
    assert "![crit p99 over time]" in text or "plot skipped" in text


def two_model_scenario() -> Scenario:
    doc = yaml.safe_load(open("scenarios/spike.yaml"))
    kind = doc["workload"]["kinds"][0]
    doc["workload"]["kinds"].append({**kind, "name": "lite", "model": SMALL})
    doc["slo"], doc["capacity"] = {"class": "interactive", "p95_s": 2.0, "kinds": ["interactive", "lite"]}, 10.0
    return Scenario.from_dict(doc)


def test_comparisons_with_a_and_b_count_the_first_pools_requests_only():
    # A three-model audit: a and b send every request to the first pool, whose replicas answer the other models'
    # 404, and "d vs a" set d's answers from every pool against a's from one (d at 71x a's goodput).
    import contextlib
    import io

    from extproc.tools.demo import print_tables, scenario_modes
    from extproc.tools.demo.report import comparison_for
    from extproc.tools.demo.runner import ModeResult

    scenario = two_model_scenario()
    a_mode, d_mode = scenario_modes(scenario, "a,d")
    a = [rec(t) for t in range(60, 120)] + [rec(t, kind="lite", status=404, error="NotFoundError")
                                            for t in range(60, 120)]
    d = [rec(t) for t in range(60, 120, 2)] + [rec(t, kind="lite", model=SMALL) for t in range(60, 120)]
    for r in d[30:]:
        r.asked_model = SMALL  # the 8B's own customers, answered by the model they asked for
    results = [ModeResult(a_mode, a, 0.0), ModeResult(d_mode, d, 0.0)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _, _, found = print_tables(results, scenario)
    t = {t.name: t for t in found}["d vs a: spike: full-model interactive goodput, req/s (>= a's; llama-70b "
                                    "requests only)"]
    assert t.value == pytest.approx(0.5) and t.bound == pytest.approx(1.0) and not t.reached  # all pools: 1.5
    assert "counts the requests for llama-70b only, in every mode" in out.getvalue()
    assert "| p99 vs a (spike; llama-70b requests only) |" in out.getvalue()
    assert comparison_for([results[1]], scenario) is None  # no a or b: every mode routes by model
    assert comparison_for(results, Scenario.load("scenarios/spike.yaml")) is None  # one model
