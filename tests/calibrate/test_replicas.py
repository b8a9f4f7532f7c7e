"""The cap `extproc calibrate` writes is the fleet's: the per-replica cap it measured x --replicas."""

import argparse
import json
import shutil
from pathlib import Path

from extproc.policy.schema import load_policy_file
from extproc.tools.calibrate import cli as calibrate
from extproc.tools.calibrate.steps import StepPlan
from extproc.tools.calibrate.sweep import Sweep, SweepConfig
from extproc.tools.loadgen import RequestKind, Workload
from tests.calibrate.test_sweep import drive

ROOT = Path(__file__).resolve().parents[2]


def calibrated(tmp_path, replicas, policy=None):
    sweep = Sweep(SweepConfig(slo_p95_s=2.0, bisect_steps=4))
    drive(sweep, lambda c: 0.5 + c * 0.08)  # knee 18, cap 14 per replica
    run = calibrate.Calibration(target="http://127.0.0.1:1", model="m", workload=Workload([RequestKind(name="k")]),
                                sweep=sweep, plan=StepPlan(duration_s=60.0), time_scale=1.0, moe=False, margin=0.2,
                                moe_margin=0.35)
    args = argparse.Namespace(policy=policy, class_name="interactive", replicas=replicas, out=str(tmp_path / "out"),
                              no_plot=True)
    assert calibrate.report(run, args) == calibrate.EXIT_CAP
    return json.loads((tmp_path / "out" / "results.json").read_text())["policy"]


def test_the_cap_written_into_the_policy_is_per_replica_times_replicas(tmp_path, capsys):
    # A user calibrated one of three Mixtral replicas and let calibrate write the policy: the fleet's interactive cap
    # became the one replica's (2 where 6 was meant; what-if of scenarios/moe-rag.yaml: 93 requests refused or
    # degraded at 55% load).
    policy = tmp_path / "policy.yaml"
    shutil.copy(ROOT / "policies" / "default.yaml", policy)
    written = calibrated(tmp_path, 3, str(policy))
    assert load_policy_file(str(policy)).classes["interactive"].max_concurrency == 42
    assert written["per_replica"] == 14 and written["replicas"] == 3 and written["max_concurrency"] == 42
    assert "cap 14 per replica x 3 replicas = 42" in capsys.readouterr().out


def test_without_replicas_the_snippet_says_the_cap_is_one_replica_s(tmp_path, capsys):
    assert calibrated(tmp_path, 1)["max_concurrency"] == 14
    out = capsys.readouterr().out
    assert "cap 14 per replica x 1 replica = 14 (the policy's caps are the fleet's: give --replicas N" in out
    assert "interactive: {max_concurrency: 14}" in out
