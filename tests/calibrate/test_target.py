"""Target identity and the MoE margin: what the simulator says about itself, and model-name heuristics."""

import pytest

from extproc.tools.calibrate.cli import Calibration, StepPlan, Sweep, SweepConfig
from extproc.tools.calibrate.steps import _early_stop
from extproc.tools.calibrate.target import TargetError, moe_hint, probe
from extproc.tools.loadgen import RequestKind, RequestRecord, Workload
from extproc.tools.sim.fleet import SimFleet


@pytest.mark.parametrize("name", ["mistralai/Mixtral-8x7B-Instruct-v0.1", "Qwen/Qwen3-30B-A3B", "h100-mixtral-8x7b",
                                  "deepseek-ai/DeepSeek-V3", "ibm/granite-3.0-3b-a800m-moe", "openai/gpt-oss-20b"])
def test_moe_model_names_are_recognised(name):
    assert moe_hint([name]) == name


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-70B-Instruct-AWQ", "h100-llama8b", "Qwen/Qwen2.5-72B"])
def test_dense_model_names_are_not_moe(name):
    assert moe_hint([name]) is None


def calibration(url, moe=None):
    return Calibration(target=url, model=None, workload=Workload([RequestKind()]),
                       sweep=Sweep(SweepConfig(slo_p95_s=2.0)), plan=StepPlan(), time_scale=None, moe=moe,
                       margin=0.2, moe_margin=0.35)


async def test_the_mixtral_simulator_gets_the_moe_margin_and_its_identity_is_recorded():
    async with SimFleet("h100-mixtral-8x7b", speed=10) as fleet:
        run = calibration(fleet.urls[0])
        run.identity = await probe(run.target, None)
    run.decide_moe()
    assert run.is_moe and run.margin_applied() == 0.35 and "mixtral" in run.moe_note.lower()
    identity = run.identity
    assert identity.model == "mistralai/Mixtral-8x7B-Instruct-v0.1" and identity.version == "0.32.0-sim"
    assert identity.sim_profile == "h100-mixtral-8x7b" and identity.sim_speed == 10
    assert identity.probed_at.endswith("+00:00") and identity.max_model_len == 32768


async def test_the_moe_flag_overrides_the_guess_both_ways():
    async with SimFleet("h100-llama70b-awq", speed=10) as fleet:
        forced, dense = calibration(fleet.urls[0], moe=True), calibration(fleet.urls[0], moe=False)
        forced.identity = dense.identity = await probe(fleet.urls[0], None)
    forced.decide_moe()
    dense.decide_moe()
    assert forced.margin_applied() == 0.35 and dense.margin_applied() == 0.2


async def test_a_model_the_target_does_not_serve_is_refused():
    async with SimFleet("h100-llama8b", speed=10) as fleet:
        with pytest.raises(TargetError, match="'llama-70b' is not served"):
            await probe(fleet.urls[0], "llama-70b")


def record(start, latency, error=None):
    return RequestRecord(start=start, kind="k", url="u", status=500 if error else 200, latency=latency, error=error)


def test_a_step_is_cut_short_once_p95_is_far_over_the_slo_after_the_warmup():
    config = SweepConfig(slo_p95_s=2.0, far_factor=2.0)
    slow = [record(10 + i, 4.5) for i in range(20)]
    assert _early_stop(slow, warmup_s=5.0, config=config) == "latency"
    assert _early_stop(slow[:19], warmup_s=5.0, config=config) is None  # too few samples to judge
    assert _early_stop([record(1, 4.5)] * 20, warmup_s=5.0, config=config) is None  # still in the warmup
    assert _early_stop([record(10, 3.9)] * 20, warmup_s=5.0, config=config) is None  # over, but not far


def test_a_step_is_cut_short_once_errors_pass_the_limit():
    config = SweepConfig(slo_p95_s=2.0, max_error_rate=0.05)
    records = [record(0, 0.1)] * 18 + [record(0, 0.1, error="InternalServerError")] * 2
    assert _early_stop(records, warmup_s=5.0, config=config) == "errors"
    assert _early_stop(records[2:] + [record(0, 0.1)] * 30, warmup_s=5.0, config=config) is None
