"""A kind's `body` as the simulator reads it, in the what-if and the capacity measurement: `ignore_eos: true` runs its
answers to max_tokens (clamped to the context) instead of drawing their length from the profile; `n: N` (several
samples of one prompt) runs N sequences, each a request of its own in the engine, their usage summed, and the
ext_proc's core counts N (both ran one sequence whatever `n` said: an n=4 mix was modelled at a quarter of its
load); a cap (chat's `max_completion_tokens`, which the OpenAI SDKs send, or `max_tokens`) is the one its requests
run with (both ran the kind's `max_tokens`, 256 when not given)."""

import statistics

import aiohttp
import pytest

from extproc.tools.demo.baselines import NoAdmission
from extproc.tools.demo.capacity import closed_loop_mix
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import _Ask, _facts, what_if
from extproc.tools.loadgen import LoadClient, PlannedRequest, RequestKind, Workload
from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.profile import load_profile

PROFILE = "h100-llama70b-awq"  # max_model_len 8192, outputs drawn with median 154
MODEL = "meta-llama/Llama-3.1-70B-Instruct-AWQ"
SMALL, SMALL_MODEL = "h100-llama8b", "meta-llama/Llama-3.1-8B-Instruct"


def kind(name, max_tokens, ignore_eos, prompt_tokens=500, endpoint="chat"):
    body = {"ignore_eos": ignore_eos} if ignore_eos is not None else {}
    return {"name": name, "endpoint": endpoint, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "body": body}


def samples(name, n=None, max_tokens=100, **body):
    """A completions kind of fixed-length answers, `n` samples each (unset: the body has no `n`)."""
    if n is not None:
        body["n"] = n
    return {"name": name, "endpoint": "completions", "prompt_tokens": 300, "max_tokens": max_tokens,
            "body": {"ignore_eos": True, "temperature": 0.8, **body}}


# Capped by the body, over the kind's max_tokens (256 here, and the RequestKind default when not given).
CAPPED = {"name": "capped", "endpoint": "chat", "prompt_tokens": 300, "max_tokens": 256,
          "body": {"max_completion_tokens": 32, "ignore_eos": True}}
BODY_MAX = {"name": "body-max", "endpoint": "completions", "prompt_tokens": 300,
            "body": {"max_tokens": 24, "ignore_eos": True}}


def scenario(*kinds, profile=PROFILE) -> Scenario:
    return Scenario.from_dict({"seed": 3, "pools": {"big": {"profile": profile, "replicas": 2}},
                               "phases": [{"name": "only", "duration_s": 20, "rate": 1.0}],
                               "workload": {"kinds": list(kinds)}, "capacity": 1.0, "client_timeout_s": 600})


def outputs(result, name):
    done = [r for r in result.records if r.kind == name]
    assert done and all(r.ok for r in done)
    return [r.output_tokens for r in done]


def test_what_if_runs_an_ignore_eos_kind_to_max_tokens():
    s = scenario(kind("eos", 1500, True), kind("drawn", 1500, None))
    res = what_if(s, NoAdmission("least_request"), s.fleet_capacity())
    assert set(outputs(res, "eos")) == {1500}  # before the fix: the profile's draw, median ~40-150
    assert statistics.median(outputs(res, "drawn")) < 1000


async def test_what_if_clamps_an_ignore_eos_answer_to_the_context_like_the_simulator():
    # 8,000 prompt tokens + max_tokens 1,500 > 8,192: the simulator clamps max_tokens to the 192 left.
    request = {"model": MODEL, "prompt": [1] * 8000, "max_tokens": 1500, "ignore_eos": True}
    async with SimFleet(PROFILE, replicas=1, port=0, speed=50) as fleet, aiohttp.ClientSession() as http:
        async with http.post(fleet.urls[0] + "/v1/completions", json=request) as resp:
            simulated = (await resp.json())["usage"]["completion_tokens"]
    s = scenario(kind("long", 1500, True, prompt_tokens=8000, endpoint="completions"))
    res = what_if(s, NoAdmission("least_request"), s.fleet_capacity())
    assert simulated == 192 and set(outputs(res, "long")) == {simulated}


def test_a_degrade_lowers_max_tokens_as_the_ext_proc_rewrites_the_body():
    assert _Ask(100, 1500, True).degraded(128) == _Ask(100, 128, True)  # ignore_eos stays in the body
    assert _Ask(100, None, True).degraded(128) == _Ask(100, 128, True)  # no max_tokens: the ceiling is written
    assert _Ask(100, 64, True).degraded(128) == _Ask(100, 64, True)
    assert _Ask(100, 64, True).degraded(None) == _Ask(100, 64, True)


def test_capacity_of_an_ignore_eos_mix_counts_max_tokens_per_request():
    profile = load_profile(PROFILE)
    eos = closed_loop_mix(profile, Workload.from_dict({"kinds": [kind("eos", 400, True)]}), 8, requests=200)
    drawn = closed_loop_mix(profile, Workload.from_dict({"kinds": [kind("drawn", 400, None)]}), 8, requests=200)
    assert eos.output_tokens_per_s / eos.requests_per_s == pytest.approx(400, rel=0.05)
    assert drawn.output_tokens_per_s / drawn.requests_per_s < 250
    assert eos.requests_per_s < drawn.requests_per_s / 1.5  # longer answers: fewer requests/s


def test_a_scenario_refuses_an_ignore_eos_the_simulator_would_refuse():
    with pytest.raises(ValueError, match="'eos': body.ignore_eos: not a boolean"):
        scenario(kind("eos", 100, "maybe"))


async def test_the_simulator_answers_n_samples_with_their_usage_summed():
    request = {"model": SMALL_MODEL, "prompt": "hello " * 50, "max_tokens": 100, "ignore_eos": True, "n": 4,
               "temperature": 0.8}
    async with SimFleet(SMALL, replicas=1, port=0, speed=50) as fleet, aiohttp.ClientSession() as http:
        async with http.post(fleet.urls[0] + "/v1/completions", json=request) as resp:
            usage = (await resp.json())["usage"]
    assert usage["completion_tokens"] == 400


def test_what_if_runs_n_sequences_per_request_and_sums_their_output():
    s = scenario(samples("four", n=4), samples("one"), profile=SMALL)
    res = what_if(s, NoAdmission("least_request"), s.fleet_capacity())
    assert set(outputs(res, "four")) == {400}  # before the fix: {100}, one sequence
    assert set(outputs(res, "one")) == {100}


def test_the_core_is_told_the_sequences_as_the_ext_proc_reads_them():
    assert _facts(RequestKind(**samples("four", n=4)), 300).sequences == 4  # before the fix: 1
    assert _facts(RequestKind(**samples("one")), 300).sequences == 1
    assert _Ask.of(RequestKind(**samples("four", n="4")), 300).sequences == 4  # a lax integer, as vLLM reads it


def test_capacity_of_an_n_mix_counts_every_sequence():
    profile = load_profile(SMALL)
    four = closed_loop_mix(profile, Workload.from_dict({"kinds": [samples("four", n=4)]}), 8, requests=200)
    one = closed_loop_mix(profile, Workload.from_dict({"kinds": [samples("one")]}), 8, requests=200)
    assert four.output_tokens_per_s / four.requests_per_s == pytest.approx(400, rel=0.05)  # before: 100
    assert one.output_tokens_per_s / one.requests_per_s == pytest.approx(100, rel=0.05)


@pytest.mark.parametrize("body, message", [({"n": 0}, "n must be at least 1"),
                                           ({"n": "many"}, "body.n"),
                                           ({"n": 2, "temperature": 0}, "n must be 1 when using greedy")])
def test_a_scenario_refuses_an_n_the_simulator_would_refuse(body, message):
    with pytest.raises(ValueError, match=message):
        scenario(samples("bad", **body))


async def test_the_simulator_obeys_the_cap_the_body_sets():
    body = LoadClient([], default_model=SMALL_MODEL).body(PlannedRequest(0, RequestKind(**CAPPED), 300, None))
    async with SimFleet(SMALL, replicas=1, port=0, speed=50) as fleet, aiohttp.ClientSession() as http:
        async with http.post(fleet.urls[0] + "/v1/chat/completions", json=body) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 32


def test_what_if_runs_the_cap_the_body_sets():
    res = what_if(scenario(CAPPED, BODY_MAX, profile=SMALL), NoAdmission("least_request"), 2.0)
    outputs = {(r.kind, r.output_tokens) for r in res.records if r.ok}
    assert outputs == {("capped", 32), ("body-max", 24)}  # before the fix: 256 and 256


def test_the_core_reads_the_cap_the_body_sets():
    assert _facts(RequestKind(**CAPPED), 300).max_tokens == 32
    assert _facts(RequestKind(**BODY_MAX), 300).max_tokens == 24
    assert _Ask.of(RequestKind(**CAPPED), 300).max_tokens == 32


def test_capacity_runs_the_cap_the_body_sets():
    cap = closed_loop_mix(load_profile(SMALL), Workload.from_dict({"kinds": [CAPPED]}), 8, requests=200)
    assert cap.output_tokens_per_s / cap.requests_per_s == pytest.approx(32, rel=0.05)  # before: 256
