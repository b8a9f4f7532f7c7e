"""`extproc calibrate` against the simulated H100 / Llama 3.1 70B AWQ: the knee, the margin, the policy edit,
a target that fails mid-sweep, and Ctrl-C.

The reference table puts p99 at 2.18 s at concurrency 16 (512-token prompts, max_tokens 256); with max_tokens
capping a quarter of the generations, p95 sits close to p99, so a 2 s p95 SLO is crossed just below 16 (the
simulator: p95 2.1 s at 16, knee 14-15) and a 2.5 s one between 16 and 32 (knee 18-22).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from extproc.cli import main
from extproc.policy.schema import load_policy_file
from extproc.tools.calibrate import cli as calibrate
from extproc.tools.calibrate.sweep import Status
from extproc.tools.sim.fleet import SimFleet

ROOT = Path(__file__).resolve().parents[2]
# Short steps: 30 simulated seconds after a 4 s warmup, 1.7 s of wall time each at --speed 20 (the simulator's
# clock amplifies CPU jitter by the speed; 20 keeps the knee steady on a busy 2-core machine).
FAST = ["--no-stream", "--prompt-tokens", "512", "--max-tokens", "256", "--step-duration", "30s",
        "--step-warmup", "4s", "--max-concurrency", "64"]


def sweep(url, slo, tmp_path, *extra):
    out = tmp_path / f"out-{slo}"
    rc = main(["calibrate", "--target", url, "--slo-p95", slo, "--out", str(out), *FAST, *extra])
    return rc, json.loads((out / "results.json").read_text()), out


def test_a_2s_slo_puts_the_knee_just_below_16_and_writes_the_cap_into_the_policy(sim_url, tmp_path, capsys):
    policy = tmp_path / "policy.yaml"
    shutil.copy(ROOT / "policies" / "default.yaml", policy)
    rc, results, out = sweep(sim_url, "2s", tmp_path, "--policy", str(policy), "--class", "interactive")
    printed = capsys.readouterr().out
    outcome = results["outcome"]
    assert rc == 0 and outcome["status"] == "cap", printed
    assert 10 <= outcome["knee"] <= 16, printed  # 14-15 on a quiet machine; CPU contention reads as latency
    assert outcome["cap"] == int(outcome["knee"] * 0.8)
    assert [s["concurrency"] for s in results["steps"]][:5] == [1, 2, 4, 8, 16]
    assert results["steps"][4]["verdict"] == "over"
    assert load_policy_file(str(policy)).classes["interactive"].max_concurrency == outcome["cap"]
    assert f"+  interactive: {{max_concurrency: {outcome['cap']}," in printed
    assert f"last good {outcome['knee']}" in printed and "cap = floor(" in printed
    assert results["target"]["version"] == "0.32.0-sim" and results["target"]["sim_profile"] == "h100-llama70b-awq"
    assert results["target"]["model"] == "meta-llama/Llama-3.1-70B-Instruct-AWQ"
    assert (out / "calibration.png").stat().st_size > 10_000


def test_a_2_5s_slo_puts_the_knee_between_16_and_32_and_applies_the_margin(sim_url, tmp_path, capsys,
                                                                          monkeypatch):
    # Also without matplotlib (the optional `plot` extra): results and exit status as with it, no traceback.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, results, out = sweep(sim_url, "2.5s", tmp_path, "--margin", "0.25")
    printed = capsys.readouterr().out
    assert "plot skipped: matplotlib is not installed" in printed
    assert not (out / "calibration.png").exists()
    outcome = results["outcome"]
    assert rc == 0 and 16 <= outcome["knee"] < 32, printed  # 18-22 measured
    assert outcome["cap"] == int(outcome["knee"] * 0.75)
    assert f"interactive: {{max_concurrency: {outcome['cap']}}}" in printed  # the snippet


async def test_a_target_that_fails_mid_sweep_is_reported_and_gets_no_cap(tmp_path, capsys, monkeypatch):
    policy = tmp_path / "policy.yaml"
    shutil.copy(ROOT / "policies" / "default.yaml", policy)
    before = policy.read_text()
    parser = calibrate.argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    # The SLO is far above any latency steps 1 and 2 see, so only the injected errors end the sweep: at 2 s, a busy
    # machine (CPU contention reads as latency, times the simulator's speed) put step 2 over the SLO, and the sweep
    # ended with a cap (knee 1) before the fault was injected (exit 0).
    slo = 60.0
    async with SimFleet("h100-llama70b-awq", speed=30, seed=2) as fleet:
        args = parser.parse_args(["--target", fleet.urls[0], "--slo-p95", f"{slo:g}s", "--policy", str(policy),
                                  "--out", str(tmp_path / "out"), *FAST])
        measure_step, steps_started = calibrate.measure_step, []

        async def fault_from_step_3(*a, **kw):  # before step 3's first request, not racing it
            steps_started.append(len(steps_started) + 1)
            if len(steps_started) == 3:  # from step 3 on, half the requests get a 500
                async with aiohttp.ClientSession() as session:
                    async with session.post(fleet.urls[0] + "/sim/fault", json={"error_rate": 0.5}) as resp:
                        assert resp.status == 200
            return await measure_step(*a, **kw)
        monkeypatch.setattr(calibrate, "measure_step", fault_from_step_3)
        # The CLI runs asyncio.run(execute()) then report(); here execute() shares the test's loop with the fleet.
        run = calibrate.Calibration(target=args.target, model=None, workload=calibrate.workload_from_args(args),
                                    sweep=calibrate.Sweep(calibrate.SweepConfig(slo_p95_s=slo)),
                                    plan=calibrate.StepPlan(duration_s=40, warmup_s=5),
                                    time_scale=None, moe=None, margin=0.2, moe_margin=0.35)
        await run.execute(progress=False)
    rc = calibrate.report(run, args)
    printed = capsys.readouterr().out
    assert rc == 1 and run.sweep.status is Status.TARGET_FAILED
    assert "no cap: target_failed" in printed
    assert "target failed at step 3 (concurrency 4)" in printed and "InternalServerError" in printed
    assert "not changed (no cap)" in printed and policy.read_text() == before
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["outcome"]["cap"] is None and results["steps"][2]["errors"]["InternalServerError"] > 0


def test_an_unreachable_target_exits_non_zero_without_a_sweep(tmp_path, capsys):
    rc = main(["calibrate", "--target", "http://127.0.0.1:9", "--slo-p95", "2s", "--out", str(tmp_path)])
    assert rc == 1 and "not reachable" in capsys.readouterr().err


def test_a_policy_without_the_class_is_refused_before_the_sweep(tmp_path, capsys):
    rc = main(["calibrate", "--target", "http://127.0.0.1:9", "--slo-p95", "2s",
               "--policy", str(ROOT / "policies" / "default.yaml"), "--class", "nope"])
    assert rc == 2 and "classes.nope: not found" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, said", [
    ("--time-scale", "0", "--time-scale must be positive"),      # every step divided by it: ZeroDivisionError
    ("--time-scale", "-2", "--time-scale must be positive"),     # steps that end before they start
    ("--step-requests", "0", "--step-requests must be at least 1"),
    ("--step-duration", "0s", "--step-duration must be positive"),
])
def test_a_step_budget_or_time_scale_that_measures_nothing_is_refused_before_the_sweep(tmp_path, capsys, flag, value,
                                                                                       said):
    # Each crashed mid-sweep (a traceback, no results.json) or measured no request at all, which the sweep read as
    # "target failed at step 1: 0 of 0 requests failed", blaming the target for the arguments.
    rc = main(["calibrate", "--target", "http://127.0.0.1:9", "--slo-p95", "2s", "--out", str(tmp_path), flag, value])
    assert rc == 2 and said in capsys.readouterr().err


def test_ctrl_c_prints_the_partial_table_and_exits_130(sim_url, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "calibrate", "--target", sim_url, "--slo-p95",
                             "2s", "--out", str(tmp_path / "out"), *FAST], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stderr:
        if line.startswith("step 2"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "no cap: interrupted" in out and "interrupted after 1 step(s)" in out
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["outcome"]["status"] == "interrupted" and len(results["steps"]) == 1


@pytest.mark.skipif(not os.environ.get("VLLM_URL"), reason="set VLLM_URL to a real vLLM (the e2e target)")
def test_against_the_real_vllm(tmp_path):
    # The e2e target is a tiny model on the CPU: short requests and a suitably small SLO (a 32-token answer takes
    # ~0.1 s alone), so the sweep finds a knee (or holds to its ceiling) in a couple of minutes.
    slo = os.environ.get("VLLM_SLO_P95", "500ms")
    rc = main(["calibrate", "--target", os.environ["VLLM_URL"], "--slo-p95", slo, "--out", str(tmp_path),
               "--prompt-tokens", "64", "--max-tokens", "32", "--no-stream", "--step-duration", "8s",
               "--step-warmup", "2s", "--max-concurrency", "32", "--bisect-steps", "2"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["outcome"]["reason"]
    assert results["target"]["version"] and results["outcome"]["cap"] >= 1
