"""What a user's own scenario and policy get from the demo tools: a misspelt key or an impossible number is named,
not ignored, and the what-if reads requests as the ext_proc does (found by writing them from the docs)."""

import re
from pathlib import Path

import pytest
import yaml

from extproc.tools.demo import run
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if

ROOT = Path(__file__).resolve().parents[2]


def spike_doc() -> dict:
    return yaml.safe_load((ROOT / "scenarios" / "spike.yaml").read_text())


def write(tmp_path: Path, doc: dict, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(polices=d.pop("policies", {"d": "x.yaml"})), "polices: unknown key"),
    (lambda d: d.update(capacity=0), "capacity: 'auto' or requests/s > 0"),
    (lambda d: d["phases"][0].update(duration_s=-5), "duration_s must be > 0"),
    (lambda d: d["phases"][0].update(rat=1), "phases[0].rat: unknown key"),
    (lambda d: d.update(envoy_adaptive={"min_rtt_s": 4}), "envoy_adaptive.min_rtt_s: unknown key"),
    (lambda d: d.update(envoy_adaptive={"min_rtt_fixed_s": 0}), "envoy_adaptive.min_rtt_fixed_s: a number > 0"),
    (lambda d: d.update(windows={"w": ["nope"]}), "windows.w: nope name no phase"),
    (lambda d: d.update(events=[{"at_s": 30, "pool": "vllm_llama70b", "fault": {"slow_down": 2}}]),
     "events[0].fault.slow_down: unknown key"),
    (lambda d: d.update(events=[{"at_s": 30, "pool": "vllm_llama70b", "fault": {"slowdown": -1}}]),
     "events[0].fault.slowdown: must be a finite number >= 0, got -1"),
    # The what-if crashed mid-replay (KeyError, IndexError: a traceback); the real run's fault task died unseen
    # and the report said the replica had been slowed down.
    (lambda d: d.update(events=[{"at_s": 30, "pool": "vllm_llama70", "fault": {"slowdown": 2}}]),
     "events[0].pool: vllm_llama70 names no pool (pools: vllm_llama70b, vllm_llama8b)"),
    (lambda d: d.update(events=[{"at_s": 30, "pool": "vllm_llama70b", "replica": 2, "fault": {"slowdown": 2}}]),
     "events[0].replica: pool vllm_llama70b has 2 replicas (0-1), got 2"),
    # Phases are found by name: the second `normal` (after the spike) was never held to the calm-phase target,
    # and a second `spike` was in no report window and no overload onset.
    (lambda d: d["phases"].append({"name": "normal", "duration_s": 30, "rate": 0.6}),
     "phases[3]: name 'normal' is given to phases[0] already"),
    # No replica: capacity 0 (every phase empty), or with `capacity:` given the what-if's "min() arg is an empty
    # sequence"; no request in the capacity loop: a TypeError traceback.
    (lambda d: d["pools"]["vllm_llama70b"].update(replicas=0), "pools.vllm_llama70b.replicas: at least 1, got 0"),
    (lambda d: d.update(capacity_concurrency=0), "capacity_concurrency: at least 1, got 0"),
    # A window spans its first phase's start to its last phase's end: [normal, after] compared the whole run,
    # the spike between them included, under the name the user gave; [] crashed the report (min() of nothing).
    (lambda d: d.update(windows={"calm": ["normal", "after"]}),
     "windows.calm: the phases of a window follow each other (spike lies between normal and after)"),
    (lambda d: d.update(windows={"w": []}), "windows.w: a list of one or more phases, got []"),
])
def test_a_scenario_mistake_is_named(tmp_path, edit, message):
    doc = spike_doc()
    edit(doc)
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.load(write(tmp_path, doc))


def test_a_prompt_longer_than_the_pools_context_is_named(tmp_path):
    # The simulator answers 400 to it; the what-if ran it as a near-empty answer and printed sub-second latencies.
    doc = spike_doc()
    doc["workload"]["kinds"][1]["prompt_tokens"] = {"min": 6000, "max": 12000}
    with pytest.raises(ValueError, match="workload kind 'batch': prompts of up to 12000 tokens, but pool "
                                         "'vllm_llama70b' \\(profile h100-llama70b-awq\\) has max_model_len 8192"):
        Scenario.load(write(tmp_path, doc))
    doc["workload"]["kinds"][1]["prompt_tokens"] = {"min": 6000, "max": 8000}
    Scenario.load(write(tmp_path, doc))


def test_a_fault_the_what_if_does_not_model_is_said_before_it_runs(tmp_path):
    doc = spike_doc()
    doc["events"] = [{"at_s": 30, "pool": "vllm_llama70b", "fault": {"error_rate": 0.5}},
                     {"at_s": 40, "pool": "vllm_llama70b", "fault": {"hang": 1}}]
    warnings = Scenario.load(write(tmp_path, doc)).warnings
    assert warnings == ["events[0].fault.error_rate: applied on the real stack only (the what-if models draining, "
                        "hang, slowdown)"]


def test_a_key_given_twice_is_refused_as_in_a_policy(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text((ROOT / "scenarios" / "spike.yaml").read_text() + "\nseed: 3\nseed: 4\n")
    with pytest.raises(ValueError, match="duplicate key 'seed'"):
        Scenario.load(path)


def test_the_demo_answers_a_bad_scenario_with_one_line(tmp_path, capsys):
    doc = spike_doc()
    doc["capacity"] = -1
    args = type("A", (), {"what_if": True, "scenario": str(write(tmp_path, doc)), "phase_s": None, "modes": "d",
                          "show_limits": False})()
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("extproc demo: ") and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_what_if_reads_the_policys_headers_and_refuses_unknown_callers(tmp_path):
    # `anonymous.allow: false`, and the class claimed in a header the policy names: the what-if admitted every
    # request and read only `x-priority`.
    policy = yaml.safe_load((ROOT / "policies" / "demo-full.yaml").read_text())
    policy["anonymous"] = {"allow": False}
    policy["classify"] = {**policy.get("classify", {}), "header": "x-tier"}
    pol = write(tmp_path, policy, "p.yaml")
    doc = spike_doc()
    doc["phases"] = [{"name": "normal", "duration_s": 20, "rate": 0.5}]
    chat, batch = doc["workload"]["kinds"]
    chat["headers"] = {"Authorization": "Bearer sk-chat-1", "x-tier": "interactive"}
    batch["headers"] = {"x-tier": "batch"}  # no key: refused with 401
    scenario = Scenario.from_dict(doc)
    res = what_if(scenario, str(pol), 6.0)
    statuses = {}
    for r in res.records:
        statuses.setdefault(r.kind, set()).add(r.status)
    assert statuses["batch"] == {401} and 401 not in statuses["interactive"], statuses


def test_the_shipped_names_work_from_any_directory(tmp_path, monkeypatch):
    from extproc.tools.demo.modes import parse_modes, repo_path, with_policies
    monkeypatch.chdir(tmp_path)
    (d,) = with_policies(parse_modes("d"), {})
    assert Path(d.policy).is_file() and Path(repo_path("scenarios/spike.yaml")).is_file()
    assert repo_path("mine.yaml") == "mine.yaml"  # not shipped: as given, for the error to name it


def test_a_scenario_retunes_envoys_filter_for_its_traffic(tmp_path):
    from extproc.tools.adaptive_concurrency import TUNED
    from extproc.tools.demo.modes import parse_modes, with_policies
    doc = spike_doc()
    doc["envoy_adaptive"] = {"min_rtt_fixed_s": 4.0}
    sc = Scenario.load(str(write(tmp_path, doc)))
    a, b, d = with_policies(parse_modes("a,b,d"), sc.policies, sc.envoy_adaptive)
    assert b.adaptive == {**TUNED, "min_rtt_fixed_s": 4.0}
    assert not a.adaptive and not d.adaptive


def test_a_canned_answer_is_a_degraded_answer_in_the_what_if_as_on_the_real_stack(tmp_path):
    # The ext_proc answers a `canned` fallback with 200 and `x-extproc-decision: degrade`, which the load generator
    # records as a degraded answer; the what-if recorded an error (status 200, error "refused: queue_full"): its
    # outcome table said "error", and the calm-phase target (refused, degraded or failed) did not see it.
    from extproc.tools.demo.results import window_stats
    policy = {"classes": {"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0,
                                          "on_overflow": "fallback", "fallback": {"action": "canned"}}},
              "default_class": "interactive", "models": {"llama-70b": {"cluster": "big"}}}
    doc = {"pools": {"big": {"profile": "h100-llama70b-awq", "replicas": 1, "model_names": ["llama-70b"]}},
           "capacity": 4.0, "phases": [{"name": "p", "duration_s": 20, "rate": 1.0}],
           "workload": {"kinds": [{"name": "interactive", "model": "llama-70b", "prompt_tokens": 300,
                                   "max_tokens": 32}]}}
    records = what_if(Scenario.from_dict(doc), str(write(tmp_path, policy, "p.yaml")), 4.0).records
    canned = [r for r in records if r.degraded]
    assert canned and all(r.ok and r.status == 200 and r.model == "llama-70b" for r in canned)
    w = window_stats(records, (0.0, 20.0), "interactive", 2.0, 60.0, True)
    assert w.degraded == len(canned) and w.outcomes["interactive"]["error"] == 0.0


class _Waiter:
    def __init__(self):
        self.result, self.on_result = None, None

    @property
    def pending(self):
        return self.result is None

    def notify(self, callback):
        self.on_result = callback


class _NeverFrees:
    """An admitter that queues every request and grants none (a pool that never has room), up to a 20 s wait."""

    lb_policy, limits = "least_request", []

    def __init__(self):
        self.left = []

    def start(self, clock, pools):
        return []

    def decide(self, facts):
        from extproc.policy.decision import Queued
        return Queued("queued", "interactive", "", _Waiter())

    def abandon(self, waiter):
        from extproc.policy.decision import REJECT, Refusal
        self.left.append(waiter)
        waiter.result = Refusal(REJECT, "client_gone", "interactive", "", 499, "gone")
        waiter.on_result(waiter.result)

    def ended(self, ticket, record):
        pass

    def reap(self):
        pass


def test_a_queued_request_whose_client_gives_up_leaves_the_queue_at_its_timeout_in_the_what_if():
    # The real client closes its connection at client_timeout_s, and Envoy the ext_proc's stream: the request
    # leaves the queue. The what-if gave a queued request no timeout: it waited on (up to the class's
    # max_wait_ms, 29 s, past a shorter client timeout), and requests still queued when the arrivals ran out
    # were never resolved (status 0, no latency, no error).
    doc = {"pools": {"big": {"profile": "h100-llama70b-awq", "replicas": 1, "model_names": ["llama-70b"]}},
           "capacity": 2.0, "client_timeout_s": 5, "phases": [{"name": "p", "duration_s": 10, "rate": 1.0}],
           "workload": {"kinds": [{"name": "interactive", "model": "llama-70b", "prompt_tokens": 300,
                                   "max_tokens": 32}]}}
    admitter = _NeverFrees()
    records = what_if(Scenario.from_dict(doc), admitter, 2.0).records
    assert records and len(admitter.left) == len(records)
    assert all(r.status == 0 and r.error == "timeout" and r.latency == 5.0 and r.queued for r in records)


def test_a_non_streamed_answers_first_byte_is_its_whole_answer_in_the_what_if_as_in_the_load_generator():
    # The load generator's TTFT of an answer not streamed is when the response arrives (the whole answer); the
    # what-if took the engine's first token: code-completion's and classify-burst's interactive TTFT p99 read as
    # a prefill time in the what-if and as the whole latency on the real stack.
    kinds = [{"name": "interactive", "model": "llama-70b", "prompt_tokens": 300, "max_tokens": 64, "stream": s}
             for s in (True, False)]
    kinds[1]["name"] = "plain"
    doc = {"pools": {"big": {"profile": "h100-llama70b-awq", "replicas": 1, "model_names": ["llama-70b"]}},
           "capacity": 2.0, "phases": [{"name": "p", "duration_s": 10, "rate": 1.0}], "workload": {"kinds": kinds}}
    from extproc.tools.demo.baselines import NoAdmission
    records = [r for r in what_if(Scenario.from_dict(doc), NoAdmission(), 2.0).records if r.ok]
    plain = [r for r in records if r.kind == "plain"]
    streamed = [r for r in records if r.kind == "interactive"]
    assert plain and all(r.ttft == r.latency for r in plain)
    assert streamed and all(r.ttft < r.latency for r in streamed if r.output_tokens > 1)


@pytest.mark.parametrize("edit, message", [
    # The requested model's own cluster: a KeyError mid-replay.
    (lambda p: p["models"].update({"llama-70b": {"cluster": "vllm_big"}}) or p["pools"].update(
        {"vllm_big": p["pools"].pop("vllm_llama70b")}),
     "policy {pol} sends workload kind 'interactive' (model 'llama-70b') to cluster 'vllm_big', which is no pool "
     "of the scenario (pools: vllm_llama70b, vllm_llama8b)"),
    # Its class's degrade model's: sent to the first pool without a word.
    (lambda p: p["models"].update({"llama-8b": {"cluster": "vllm_small"}}),
     "policy {pol} sends workload kind 'interactive' (class interactive's degrade model 'llama-8b') to cluster "
     "'vllm_small'"),
])
def test_a_policy_route_to_a_cluster_the_fleet_lacks_is_named_before_the_run(tmp_path, capsys, edit, message):
    policy = yaml.safe_load((ROOT / "policies" / "demo-full.yaml").read_text())
    edit(policy)
    pol = write(tmp_path, policy, "p.yaml")
    doc = spike_doc()
    doc.update(capacity=6.0, policies={"d": str(pol)}, phases=[{"name": "normal", "duration_s": 5, "rate": 0.5}])
    scenario = Scenario.from_dict(doc)
    with pytest.raises(ValueError, match=re.escape(f"scenario spike: {message.format(pol=pol)}")):
        what_if(scenario, str(pol), 6.0)
    args = type("A", (), {"what_if": True, "scenario": str(write(tmp_path, doc)), "phase_s": None, "modes": "a,d",
                          "show_limits": False})()
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "vllm_" in err and len(err.strip().splitlines()) == 1


def test_a_mode_policy_naming_models_the_workload_never_asks_for_runs():
    # The route check follows the workload's models: the shipped mode policies name models (and clusters) many
    # scenarios' fleets lack.
    from extproc.policy.schema import load_policy_file
    from extproc.tools.demo import scenario_modes
    from extproc.tools.demo.whatif import check_routes
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        scenario = Scenario.load(path)
        for m in scenario_modes(scenario, "c,d,e"):
            check_routes(scenario, load_policy_file(m.policy), m.policy)


def test_a_mode_whose_policy_names_none_of_the_workloads_models_is_warned_about(tmp_path, capsys):
    # A platform engineer's own fleet (chat-70b on vllm_chat) through `extproc demo --what-if --modes c,d`: mode c ran
    # the demo's policy, which names llama-70b only, and its rows said "error 100.0" for every kind without a word
    # on why. The demo now says so before it runs; a mode whose policy names the models says nothing.
    from extproc.tools.demo import check_policies, scenario_modes

    doc = spike_doc()
    doc["pools"] = {"vllm_chat": {"profile": "h100-llama70b-awq", "replicas": 2, "model_names": ["chat-70b"]}}
    for kind in doc["workload"]["kinds"]:
        kind["model"] = "chat-70b"
    own = {"classes": {"interactive": {"max_concurrency": 8}, "batch": {"max_concurrency": 2}},
           "models": {"chat-70b": {"cluster": "vllm_chat"}}}
    doc["policies"] = {"d": str(write(tmp_path, own, "own.yaml"))}
    scenario = Scenario.load(write(tmp_path, doc))
    check_policies(scenario, scenario_modes(scenario, "c,d"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: mode c's policy ")
    assert "names no model chat-70b: the requests of interactive, batch get 404 unknown_model" in err[0]
    check_policies(scenario, scenario_modes(scenario, "d"))
    assert capsys.readouterr().err == ""


def _kind(d: dict) -> dict:
    return d["workload"]["kinds"][0]


@pytest.mark.parametrize("edit, message", [
    # Each crashed the what-if mid-run (after the real demo had started its stack): ZeroDivisionError, KeyError,
    # TypeError, or a ValueError that named no key ("empty range for randrange()").
    (lambda d: _kind(d).update(session={"calls": 0}),
     "workload kind 'interactive': session.calls: an int or {min, max}"),
    (lambda d: _kind(d).update(session={"calls": {"median": 3, "sigma": 0.5, "max": 6}}),
     "workload kind 'interactive': session.calls: an int or {min, max}"),
    (lambda d: _kind(d).update(session={"calls": {"min": 3}}), "session.calls: an int or {min, max}"),
    (lambda d: _kind(d).update(prompt_tokens={"min": 800, "max": 300}),
     "workload kind 'interactive': prompt_tokens: an int, {min, max} or {median, sigma, max} of at least 1"),
    (lambda d: _kind(d).update(prompt_tokens=300.5), "workload kind 'interactive': prompt_tokens:"),
    (lambda d: _kind(d).update(endpoint="responses"),
     "workload kind 'interactive': endpoint: one of chat, completions, got 'responses'"),
    (lambda d: _kind(d).update(headers=["x-priority: interactive"]),
     "workload kind 'interactive': headers: a mapping is expected"),
    (lambda d: _kind(d).update(body=[1]), "workload kind 'interactive': body: a mapping is expected"),
    (lambda d: _kind(d).update(weight=-1), "workload kind 'interactive': weight: a number >= 0, got -1"),
    (lambda d: [k.update(weight=0) for k in d["workload"]["kinds"]], "workload.kinds: every weight is 0"),
    (lambda d: d["workload"].update(kinds=[]), "workload.kinds: at least one kind"),
])
def test_a_workload_kind_the_load_generator_cannot_draw_is_named_at_load(tmp_path, capsys, edit, message):
    doc = spike_doc()
    doc.update(capacity=6.0, phases=[{"name": "normal", "duration_s": 5, "rate": 0.5}])
    edit(doc)
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.load(write(tmp_path, doc))
    args = type("A", (), {"what_if": True, "scenario": str(write(tmp_path, doc)), "phase_s": None, "modes": "a,d",
                          "show_limits": False})()
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "workload" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("edit, message", [
    # The what-if drew arrivals for ever: it hung before its first request.
    (lambda p: p.update(rate=float("inf")), "phase 'normal': duration_s must be > 0 and rate >= 0"),
    (lambda p: p.update(duration_s=float("inf")), "phase 'normal': duration_s must be > 0 and rate >= 0"),
    (lambda p: p.update(weights={"interactive": float("inf")}), "phase 'normal': weights: factors >= 0"),
    # The phase sent nothing, without a word.
    (lambda p: p.update(weights={"interactive": -1}),
     "phase 'normal': weights: factors >= 0, got {'interactive': -1.0}"),
])
def test_a_phase_number_that_cannot_be_replayed_is_named(edit, message):
    doc = spike_doc()
    edit(doc["phases"][0])
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.from_dict(doc)


@pytest.mark.parametrize("edit, message", [
    # Timeouts are served latencies counted at the timeout: the report printed a p99 of -1 s.
    (lambda d: d.update(client_timeout_s=-1), "client_timeout_s: seconds > 0, got -1"),
    (lambda d: d.update(client_timeout_s=0), "client_timeout_s: seconds > 0, got 0"),
    (lambda d: d["slo"].update(p95_s=0), "slo.p95_s: seconds > 0, got 0"),
])
def test_a_timeout_or_slo_of_no_time_is_named(edit, message):
    doc = spike_doc()
    edit(doc)
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.from_dict(doc)


def test_a_pools_model_names_not_a_list_is_named():
    # Read as its letters, the pool served no model the clients asked for: every request a 404, the report a NaN.
    doc = spike_doc()
    doc["pools"]["vllm_llama70b"]["model_names"] = "llama-70b"
    with pytest.raises(ValueError, match=re.escape("pools.vllm_llama70b.model_names: a list of model names, got "
                                                   "'llama-70b'")):
        Scenario.from_dict(doc)


@pytest.mark.parametrize("key, value, message", [
    ("pools", [{"profile": "h100-llama8b"}], "pools: a mapping is expected, got list"),
    ("windows", ["spike"], "windows: a mapping is expected, got list"),
    ("workload", [{"name": "interactive"}], "workload: a mapping is expected, got list"),
    ("phases", {"name": "spike"}, "phases: a list is expected, got dict"),
])
def test_a_section_of_the_wrong_shape_is_named_not_a_traceback(tmp_path, key, value, message):
    # pools and windows as lists raised AttributeError out of Scenario.load (the demo printed a traceback).
    doc = spike_doc()
    doc[key] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.load(write(tmp_path, doc))


def test_a_degrade_with_streaming_off_is_read_whole_in_the_what_if_as_on_the_real_stack(tmp_path):
    # `fallback: {stream: false}` has the ext_proc ask the replica for one answer and send it to the streaming
    # client as one chunk once complete (server/stream.py): its TTFT is the whole answer. The what-if took the
    # engine's first token, so a degrade that turned streaming off read as a prefill time.
    policy = {"classes": {"interactive": {"max_concurrency": 2, "max_queue": 0, "on_overflow": "fallback",
                                          "fallback": {"action": "degrade", "stream": False, "max_tokens": 32}}},
              "models": {"llama-70b": {"cluster": "big"}}}
    pol = write(tmp_path, policy, "p.yaml")
    kinds = [{"name": "interactive", "model": "llama-70b", "prompt_tokens": 300, "max_tokens": 64, "stream": True}]
    doc = {"pools": {"big": {"profile": "h100-llama70b-awq", "replicas": 1, "model_names": ["llama-70b"]}},
           "capacity": 4.0, "phases": [{"name": "p", "duration_s": 10, "rate": 2.0}], "workload": {"kinds": kinds}}
    records = [r for r in what_if(Scenario.from_dict(doc), str(pol), 4.0).records if r.ok]
    degraded = [r for r in records if r.degraded]
    assert degraded and all(r.ttft == r.latency for r in degraded)
    assert all(r.ttft < r.latency for r in records if not r.degraded and r.output_tokens > 1)


def test_a_kinds_abort_prob_the_what_if_does_not_model_is_said_before_it_runs(tmp_path):
    # The what-if's clients never give up early: their aborts were answers in its report, without a word.
    doc = spike_doc()
    doc["workload"]["kinds"][1]["abort_prob"] = 0.3
    assert Scenario.load(write(tmp_path, doc)).warnings == [
        "abort_prob of batch: applied on the real stack only (the what-if's clients wait for every answer or their "
        "timeout)"]


@pytest.mark.parametrize("max_tokens", [0, 9000])
def test_a_max_tokens_the_pool_answers_400_to_is_named(tmp_path, max_tokens):
    # vLLM (and the simulator) refuse max_tokens below 1 or beyond the context with a 400; the what-if served
    # every such request, clamped, and reported sub-second latencies for requests the real stack refuses.
    doc = spike_doc()
    doc["workload"]["kinds"][0]["max_tokens"] = max_tokens
    with pytest.raises(ValueError, match=re.escape(
            f"workload kind 'interactive': max_tokens {max_tokens}, but pool 'vllm_llama70b' (profile "
            "h100-llama70b-awq) takes 1 to its max_model_len 8192")):
        Scenario.load(write(tmp_path, doc))


@pytest.mark.parametrize("edit, message", [
    # Each raised a TypeError (or AttributeError) once requests flowed: mid-run, after the real demo's stack started.
    (lambda k: k.update(model=70), "workload kind 'interactive': model: a model name, got 70"),
    (lambda k: k.update(max_tokens=float("inf")), "workload kind 'interactive': max_tokens: a whole number of tokens"),
    (lambda k: k.update(session={"calls": 3, "think_s": "1s"}),
     "workload kind 'interactive': session.think_s: seconds >= 0, got '1s'"),
    (lambda k: k.update(session={"calls": 3, "retries": "2"}), "workload kind 'interactive': session.retries:"),
    (lambda k: k.update(session={"calls": 3, "max_context_tokens": {}}),
     "workload kind 'interactive': session.max_context_tokens: tokens >= 1, got {}"),
    (lambda k: k.update(session=True), "workload kind 'interactive': session: a mapping is expected, got True"),
    (lambda k: k.update(abort_prob="often"), "workload kind 'interactive': abort_prob: a probability (0 to 1)"),
])
def test_a_workload_value_of_the_wrong_type_is_named_at_load(tmp_path, edit, message):
    doc = spike_doc()
    doc.update(capacity=6.0, phases=[{"name": "normal", "duration_s": 10, "rate": 1.0}])
    edit(doc["workload"]["kinds"][0])
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.load(write(tmp_path, doc))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["phases"][0].update(weights="batch"), "phases[0].weights: kind name -> factor, got 'batch'"),
    (lambda d: d["pools"]["vllm_llama8b"].update(profile=8), "pools.vllm_llama8b.profile: a profile name or file"),
    (lambda d: d.update(seed=float("inf")), "cannot convert float infinity to integer"),
])
def test_a_scenario_value_that_raised_past_load_or_mid_run_is_an_error_of_the_file(tmp_path, edit, message):
    # weights as a string: AttributeError out of Scenario.load (a traceback); seed .inf: OverflowError likewise;
    # a profile that is no name: a TypeError mid-run where the what-if builds the pool's engines.
    doc = spike_doc()
    edit(doc)
    path = write(tmp_path, doc)
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.load(path)


@pytest.mark.parametrize("edit, message", [
    # Read only where the what-if builds the pool's engines (no kind asks for its model): an error mid-run.
    (lambda d: d["pools"]["vllm_llama8b"].update(profile="h100-llama8"),
     "pools.vllm_llama8b.profile: unknown profile 'h100-llama8'"),
    # `pools:` with nothing under it: AttributeError out of Scenario.load.
    (lambda d: d.update(pools=None), "a scenario needs at least one pool and one phase"),
])
def test_a_pool_the_workload_does_not_ask_for_is_checked_at_load_too(tmp_path, edit, message):
    doc = spike_doc()
    edit(doc)
    with pytest.raises(ValueError, match=re.escape(message)):
        Scenario.load(write(tmp_path, doc))


@pytest.mark.parametrize("what_if_run", [True, False])
def test_a_bad_mode_policy_is_named_before_the_first_mode_runs(tmp_path, monkeypatch, capsys, what_if_run):
    # The real demo read mode d's policy when it started d's stack, after a, b and c had run (minutes each); the
    # what-if when it came to d.
    import extproc.tools.demo as demo
    policy = yaml.safe_load((ROOT / "policies" / "demo-full.yaml").read_text())
    policy["classes"]["interactive"]["max_concurency"] = 4
    doc = spike_doc()
    doc["policies"] = {"d": str(write(tmp_path, policy, "p.yaml"))}
    def ran(*a):
        raise AssertionError("a mode ran before the policies were read")
    monkeypatch.setattr(demo, "run_mode", ran)
    monkeypatch.setattr(demo, "what_if", ran)
    args = type("A", (), {"what_if": what_if_run, "scenario": str(write(tmp_path, doc)), "phase_s": None,
                          "modes": "a,d", "show_limits": False, "out": str(tmp_path / "out"), "speed": 5.0,
                          "progress_every": 5.0})()
    assert run(args) == 2
    assert "classes.interactive.max_concurency" in capsys.readouterr().err


def test_an_event_whose_fault_is_left_empty_is_named(tmp_path):
    # `fault:` with nothing under it raised AttributeError out of Scenario.load (a traceback).
    doc = spike_doc()
    doc["events"] = [{"at_s": 30, "pool": "vllm_llama70b", "fault": None}]
    with pytest.raises(ValueError, match=re.escape("events[0].fault: a mapping is expected, got NoneType")):
        Scenario.load(write(tmp_path, doc))


@pytest.mark.parametrize("what_if_run, speed, phase_s, message", [
    (False, 0.0, None, "--speed takes seconds > 0, got 0"),  # ZeroDivisionError, a traceback
    (True, 5.0, 0.0, "--phase-s takes seconds > 0, got 0"),  # the whole scenario, unsaid
    (True, 5.0, -2.0, "--phase-s takes seconds > 0, got -2"),  # no request at all, a report of -0.00
])
def test_a_speed_or_phase_length_of_no_time_is_refused(monkeypatch, capsys, what_if_run, speed, phase_s, message):
    import extproc.tools.demo as demo

    def ran(*a):
        raise AssertionError("a mode ran")
    monkeypatch.setattr(demo, "run_mode", ran)
    monkeypatch.setattr(demo, "what_if", ran)
    args = type("A", (), {"what_if": what_if_run, "scenario": "scenarios/spike.yaml", "phase_s": phase_s,
                          "modes": "a", "show_limits": False, "out": None, "speed": speed, "progress_every": 5.0})()
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err == f"extproc demo: {message}\n"


def test_a_class_claimed_in_the_body_is_read_by_the_what_if_as_by_the_ext_proc(tmp_path):
    # The ext_proc reads a class claim in the body's `classify.body_field` (server/openai.py parse_body); the
    # what-if read headers only, so a kind sending `body: {priority: batch}` ran as its tenant's default class.
    policy = {"classes": {"interactive": {"max_concurrency": 64},
                          "batch": {"max_concurrency": 1, "max_queue": 0}},
              "models": {"llama-70b": {"cluster": "big"}}, "default_class": "interactive",
              "anonymous": {"max_class": "interactive"}}
    pol = write(tmp_path, policy, "p.yaml")
    kinds = [{"name": "jobs", "model": "llama-70b", "prompt_tokens": 300, "max_tokens": 64,
              "body": {"priority": "Batch"}}]
    doc = {"pools": {"big": {"profile": "h100-llama70b-awq", "replicas": 1, "model_names": ["llama-70b"]}},
           "capacity": 4.0, "phases": [{"name": "p", "duration_s": 10, "rate": 2.0}], "workload": {"kinds": kinds}}
    records = what_if(Scenario.from_dict(doc), str(pol), 4.0).records
    assert any(r.status == 429 for r in records)  # batch's one slot, no queue: refused as batch


TOOLS = [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("body, message", [
    # The simulator, as a vLLM started without --tool-call-parser, answers 400 to every such request; the what-if
    # served them and printed goodput for a workload the real demo answers with errors only.
    ({"tools": TOOLS, "tool_choice": "auto"}, "--tool-call-parser to be set"),
    ({"tools": TOOLS}, "--tool-call-parser to be set"),
    ({"stream_options": {"include_usage": True}}, "Stream options can only be defined when `stream=True`"),
    ({"temperature": -1}, "temperature"),
])
def test_a_request_body_the_simulator_refuses_is_named_at_load(tmp_path, body, message):
    doc = spike_doc()
    doc["workload"]["kinds"][1]["body"] = body  # batch: not streamed
    with pytest.raises(ValueError, match=r"workload kind 'batch': the simulator \(and vLLM\) answer 400 .*"
                                         + re.escape(message)):
        Scenario.load(write(tmp_path, doc))


def test_a_request_body_the_simulator_serves_loads():
    doc = spike_doc()
    doc["workload"]["kinds"][0]["body"] = {"tools": TOOLS, "tool_choice": "none", "n": 2, "temperature": 0.7}
    Scenario.from_dict(doc)


def test_a_kind_that_names_no_model_is_warned_about_before_an_ext_proc_mode_runs(tmp_path, capsys):
    # A kind without `model` (vLLM and the simulator take a body without one, as their first served name): in modes
    # a and b it was served, in every ext_proc mode each request was the ext_proc's 400 (a body without `model`), and
    # the report said "error 100.0" and a p99 of nan for d without a word on why.
    from extproc.tools.demo import check_policies, scenario_modes

    doc = spike_doc()
    del doc["workload"]["kinds"][0]["model"]
    scenario = Scenario.load(write(tmp_path, doc))
    check_policies(scenario, scenario_modes(scenario, "a,b"))
    assert capsys.readouterr().err == ""
    check_policies(scenario, scenario_modes(scenario, "a,d,e"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: workload kind interactive names no `model`")
    assert "modes d, e" in err[0] and "400" in err[0]
