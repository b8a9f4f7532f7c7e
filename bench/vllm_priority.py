"""Does vLLM's own priority scheduling let the policy admit more batch at the same interactive p99? (issue 20)

    .venv/bin/python bench/vllm_priority.py [--scenario scenarios/spike.yaml --policy policies/demo-full.yaml ...]
        [--seeds 7,8 | --n-seeds 3] [--phase-s 20]

The engine-only what-if (extproc.tools.demo.whatif) for each scenario with its mode-d policy, admitting three
ways: the policy as shipped (`d`), with batch's `min_share` at 0.5 (`d, batch share 0.5`: more batch admitted
under the pool limit), and without the pool limit (`d, no pool limit`: per-class caps only, so the engines get a
waiting queue and KV pressure, which is where vLLM's priority scheduling acts). Each with the policy's classes
without `vllm_priority` or with it (interactive 0, agent 5, batch and internal 10), and every pool's replicas
under vLLM's `--scheduling-policy` fcfs (the default) or priority: all four combinations for `d`, the two that
differ for the others (without `vllm_priority` every request has vLLM's default 0, and fcfs ignores priorities:
both give fcfs's numbers exactly, as the `d` rows show).

Prints a markdown table per scenario: per report window, interactive p99 (the worst seed's; its worst 10 s window
beside it), full-model interactive goodput within the SLO, batch completed req/s (started in the window), batch
and all output tokens/s (ended in it), batch refused %, and the first pool's preemptions over the whole run.
Means over seeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.tools.demo.results import window_stats  # noqa: E402
from extproc.tools.demo.scenario import Scenario  # noqa: E402
from extproc.tools.demo.whatif import what_if  # noqa: E402

PAIRS = (("scenarios/spike.yaml", "policies/demo-full.yaml"), ("scenarios/kv-agents.yaml", "policies/agents-full.yaml"))
PRIORITIES = {"interactive": 0, "agent": 5, "batch": 10, "internal": 10}


ADMISSION = {  # name -> edit of the policy document; the first is the policy as shipped
    "d": lambda doc: None,
    "d, batch share 0.5": lambda doc: doc["classes"]["batch"].update(min_share=0.5),
    "d, no pool limit": lambda doc: [p["limit"].update(enabled=False) for p in doc.get("pools", {}).values()
                                     if "limit" in p],
}


def variant(policy: str, admission: str, tagged: bool, folder: Path) -> str:
    """The policy edited for `admission`, with `vllm_priority` on each class named in PRIORITIES if `tagged`
    (class order kept: it is the pool limit's priority order)."""
    doc = yaml.safe_load(Path(policy).read_text(encoding="utf-8"))
    ADMISSION[admission](doc)
    if tagged:
        for name, spec in doc["classes"].items():
            if name in PRIORITIES:
                spec["vllm_priority"] = PRIORITIES[name]
    path = folder / f"{Path(policy).stem}-{len(list(folder.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return str(path)


def batch_stats(records, span: tuple[float, float]) -> tuple[float, float, float]:
    """Batch: completions started in the window per s, output tokens of completions ended in it per s, % refused."""
    t0, t1 = span
    batch = [r for r in records if r.kind == "batch"]
    started = [r for r in batch if t0 <= r.start < t1]
    done = sum(1 for r in started if r.ok) / (t1 - t0)
    tokens = sum(r.output_tokens for r in batch if r.ok and t0 <= r.start + r.latency < t1) / (t1 - t0)
    refused = 100.0 * sum(1 for r in started if r.status in (429, 503)) / max(len(started), 1)
    return done, tokens, refused


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", help="scenario (repeatable, with --policy in the same order)")
    p.add_argument("--policy", action="append", help="its mode-d policy")
    p.add_argument("--seeds", default="", help="comma-separated; default: each scenario's seed and the next ones")
    p.add_argument("--n-seeds", type=int, default=3, help="how many seeds from each scenario's own (default 3)")
    p.add_argument("--phase-s", type=float, help="cut every phase to this many simulated seconds (quick look)")
    args = p.parse_args()
    pairs = list(zip(args.scenario, args.policy)) if args.scenario else list(PAIRS)
    with tempfile.TemporaryDirectory() as tmp:
        for scenario_path, policy in pairs:
            base = Scenario.load(scenario_path)
            if args.phase_s:
                base = base.shortened(args.phase_s)
            capacity = base.fleet_capacity()
            seeds = [int(s) for s in args.seeds.split(",") if s] or [base.seed + k for k in range(args.n_seeds)]
            windows = {**base.report_windows(), "overall": (0.0, base.duration_s)}
            print(f"\n{base.name} ({scenario_path}), capacity {capacity:.1f} req/s, policy {policy}, seeds {seeds}")
            print("| window | admission | vllm_priority | scheduling | interactive p99 s (worst 10 s) "
                  "| goodput ≤ SLO req/s | batch done req/s | batch tokens/s | all tokens/s | batch refused % "
                  "| preemptions (run) |")
            print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
            full = [(False, "fcfs"), (False, "priority"), (True, "fcfs"), (True, "priority")]
            variants = [(adm, tagged, sched) for adm in ADMISSION
                        for tagged, sched in (full if adm == "d" else [full[0], full[3]])]
            rows: dict[str, list[str]] = {w: [] for w in windows}
            for admission, tagged, sched in variants:
                pol = variant(policy, admission, tagged, Path(tmp))
                per = {w: [] for w in windows}
                for seed in seeds:
                    scenario = replace(base, seed=seed).with_scheduling_policy(sched)
                    res = what_if(scenario, pol, capacity)
                    for w, span in windows.items():
                        st = window_stats(res.records, span, scenario.slo_class, scenario.slo_p95_s,
                                          scenario.client_timeout_s, True)
                        per[w].append((st, batch_stats(res.records, span), res.preemptions[base.pools[0].name]))
                for w, got in per.items():
                    stats = [g[0] for g in got]
                    b = [g[1] for g in got]
                    rows[w].append(
                        f"| {w} | {admission} | {'set' if tagged else 'unset'} | {sched} "
                        f"| {max(s.p99 for s in stats):.2f} ({max(s.p99_worst_window for s in stats):.2f}) "
                        f"| {statistics.mean(s.goodput for s in stats):.2f} "
                        f"| {statistics.mean(x[0] for x in b):.2f} | {statistics.mean(x[1] for x in b):.0f} "
                        f"| {statistics.mean(s.tokens_per_s for s in stats):.0f} "
                        f"| {statistics.mean(x[2] for x in b):.1f} "
                        f"| {statistics.mean(g[2] for g in got):.0f} |")
            for w in windows:
                print("\n".join(rows[w]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
