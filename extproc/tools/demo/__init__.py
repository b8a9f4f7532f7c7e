"""`extproc demo`: the traffic spike served five ways (no control, Envoy adaptive, static caps, our policy, AIMD)."""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import signal
import sys
import time
from pathlib import Path

from .baselines import admitter_for
from extproc.policy.schema import PolicyError, load_policy_file

from .modes import DEFAULT_MODES, DEFAULT_SPEED, MODES, Mode, parse_modes, repo_path, with_policies
from .report import COMPUTE, Comparison, comparison_for, comparison_note, tables, write_report
from .results import (ClassOrder, WindowStats, adaptive_targets, calm_windows, scenario_stats, spike_windows,
                      targets)
from .runner import Interrupt, ModeResult, RunSettings, run_mode
from .scenario import Scenario
from .whatif import check_routes, kind_classes, unserved_kinds, what_if


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default="scenarios/spike.yaml", help="scenario YAML (see docs/demo.md)")
    p.add_argument("--speed", type=float, default=DEFAULT_SPEED,
                   help="simulated seconds per wall second (the whole stack's time-based settings are scaled)")
    p.add_argument("--out", help="results folder (default: results/YYYYmmdd-HHMMSS; with --what-if: none unless "
                   "given)")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"which modes, in order: {','.join(MODES)}")
    p.add_argument("--phase-s", type=float, help="cut every phase to this many simulated seconds (quick looks)")
    p.add_argument("--progress-every", type=float, default=5.0, help="wall seconds between progress lines")
    p.add_argument("--what-if", action="store_true",
                   help="no processes: every mode against engine models in simulated time (policies through the "
                        "real core, the Envoy-only modes modelled; seconds; for tuning a policy, see docs/demo.md)")
    p.add_argument("--instances", type=int, default=1, metavar="N",
                   help="with --what-if: the ext_proc modes' policy run by N instances (or workers), each its own "
                        "core, requests spread round robin (what stays per instance: docs/envoy-integration.md)")
    p.add_argument("--show-limits", action="store_true",
                   help="with --what-if: print every move of the class caps and of each pool-wide limit (pool:NAME, "
                        "in its unit)")


def mode_stats(res: ModeResult, scenario: Scenario) -> dict[str, WindowStats]:
    """The mode's numbers in each of the scenario's report windows (default: the spike) and over the whole run."""
    return scenario_stats(res.records, scenario, res.mode.stack_mode == "extproc")


def scenario_modes(scenario: Scenario, modes: str) -> list[Mode]:
    """The modes named in `modes` (e.g. "b,d") as the scenario runs them: its policies, mode b's knobs, its labels."""
    return with_policies(parse_modes(modes), scenario.policies, scenario.envoy_adaptive, scenario.labels)


def check_policies(scenario: Scenario, modes: list[Mode]) -> None:
    """Every mode's policy, read and checked against the scenario's fleet before the first mode runs: a mistake in
    mode d's file was found once modes a-c had run (minutes of the real demo, each stack started and stopped).
    PolicyError or ValueError names it. A policy that does not name the model of some of the workload's kinds is
    warned about (their requests get 404 in that mode)."""
    for m in modes:
        if m.policy:
            policy = load_policy_file(m.policy)
            check_routes(scenario, policy, m.policy)
            unserved = unserved_kinds(scenario, policy)
            if unserved:
                models = sorted({k.model for k in scenario.workload.kinds if k.name in unserved})
                print(f"warning: mode {m.key}'s policy {m.policy} names no model {', '.join(models)}: the requests "
                      f"of {', '.join(dict.fromkeys(unserved))} get 404 unknown_model in that mode (give the mode "
                      "a policy of yours in the scenario's `policies:`, docs/demo.md)", file=sys.stderr, flush=True)
    _warn_modelless(scenario, [m.key for m in modes if m.policy])


def _warn_modelless(scenario: Scenario, ext_proc_modes: list[str]) -> None:
    """A kind without `model` is served by the first pool where no ext_proc stands (vLLM takes a body without one
    as its first served name), and refused by the ext_proc, which needs it to route and count: the report's rows
    for the ext_proc modes read "error 100.0" and a p99 of nan, with no word on why."""
    kinds = list(dict.fromkeys(k.name for k in scenario.workload.kinds if k.model is None))
    if not kinds or not ext_proc_modes:
        return
    what = f"kind {kinds[0]} names" if len(kinds) == 1 else f"kinds {', '.join(kinds)} name"
    print(f"warning: workload {what} no `model`: the ext_proc refuses each of its requests in modes "
          f"{', '.join(ext_proc_modes)} (400 on the real stack: a body without `model`; the what-if's 404), where "
          "modes without it have the first pool serve them (give each kind the model its clients ask for, "
          "docs/demo.md)", file=sys.stderr, flush=True)


def what_if_stats(scenario: Scenario, modes: str, instances: int = 1) -> dict[str, dict[str, WindowStats]]:
    """mode key -> mode_stats, for `modes` (e.g. "b,d") run in the what-if with the scenario's policies."""
    capacity = scenario.fleet_capacity()
    out = {}
    for m in scenario_modes(scenario, modes):
        res = what_if(scenario, admitter_for(m, instances), capacity)
        out[m.key] = mode_stats(ModeResult(m, res.records, 0.0, served_elsewhere=res.served_elsewhere), scenario)
    return out


def load_scenario(args: argparse.Namespace) -> Scenario:
    scenario = Scenario.load(repo_path(args.scenario))
    for w in scenario.warnings:
        print(f"warning: {args.scenario}: {w}", file=sys.stderr)
    return scenario.shortened(args.phase_s) if args.phase_s else scenario


def policy_lines(modes: list[Mode]) -> str:
    """Which policy file each ext_proc mode runs (a scenario's `policies:` may name its own)."""
    return "\n".join(f"   mode {m.key}: policy {m.policy}" for m in modes if m.policy)


def class_order(scenario: Scenario, modes: list[Mode], ours: str = "d") -> ClassOrder | None:
    """Which workload kinds rank below which under our mode's policy (None without that mode): the order targets
    hold each degraded class to the classes below it, not to every other kind."""
    mode = next((m for m in modes if m.key == ours and m.policy), None)
    if mode is None:
        return None
    policy = load_policy_file(mode.policy)
    rank = {name: i for i, name in enumerate(policy.class_names())}
    classes = kind_classes(scenario, policy)
    return ClassOrder({kind: rank[cls] for kind, cls in classes.items()}, tuple(scenario.slo_kinds))


def print_tables(results: list[ModeResult], scenario: Scenario, order: ClassOrder | None = None,
                 comparison: Comparison | None | object = COMPUTE) -> tuple[dict, dict, list]:
    """`order`: class_order's, for the order targets (None: every kind outside the SLO's counts as lower);
    `comparison`: comparison_for's, when the caller has it for its report too (computed here if not given)."""
    stats = {r.mode.key: mode_stats(r, scenario) for r in results}
    degraded = {r.mode.key: 100.0 * sum(1 for x in r.records if x.ok and x.degraded) / max(1, len(r.records))
                for r in results}
    capacity = scenario.fleet_capacity()
    if comparison is COMPUTE:
        comparison = comparison_for(results, scenario)
    found = targets(stats, list(spike_windows(scenario)), list(calm_windows(scenario)), scenario.slo_p95_s,
                    capacity=capacity, slo_class=scenario.slo_class, order=order, comparison=comparison)
    found += adaptive_targets(stats, list(scenario.report_windows()), scenario.slo_p95_s,
                              calm=tuple(calm_windows(scenario)), capacity=capacity, slo_class=scenario.slo_class,
                              comparison=comparison)
    print()
    note = comparison_note(comparison, scenario)
    if note:
        print(note + "\n")
    print(tables(stats, {r.mode.key: r.mode.label for r in results}, scenario, degraded, comparison))
    if found:
        print("\nTargets:")
        for t in found:
            print(f"  {t.line()}")
    return stats, degraded, found


def what_if_tables(args: argparse.Namespace, command: str = "extproc demo --what-if") -> int:
    """Every mode against engine models only (extproc.tools.demo.whatif): the ext_proc modes' policies through the
    real core, the Envoy-only modes through their models (extproc.tools.demo.baselines)."""
    scenario = load_scenario(args)
    capacity = scenario.fleet_capacity()
    results = []
    modes = scenario_modes(scenario, args.modes)
    check_policies(scenario, modes)
    if any(m.policy for m in modes):
        print(f"scenario {scenario.name}, what-if:\n{policy_lines(modes)}")
    for m in modes:
        res = what_if(scenario, admitter_for(m, getattr(args, "instances", 1)), capacity)
        results.append(ModeResult(m, res.records, 0.0, served_elsewhere=res.served_elsewhere))
        if args.show_limits:
            moves = " ".join(f"{t:.0f}s:" + ",".join(f"{c}={v}" for c, v in lim.items()) for t, lim in res.limits)
            print(f"{m.key} limits: {moves or '(static)'}")
    comparison = comparison_for(results, scenario)  # once: the tables and the report both show it
    stats, degraded, found = print_tables(results, scenario, class_order(scenario, modes), comparison)
    if getattr(args, "out", None):  # the records (simulated seconds) and report of a real run's shape, for a look per request
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = write_report(out, results, stats, scenario, capacity, 1.0, found, degraded, command, what_if=True,
                              comparison=comparison)
        print(f"\nreport: {report}", flush=True)
    return 0


async def demo(args: argparse.Namespace, command: str, interrupt: Interrupt | None = None) -> int:
    scenario = load_scenario(args)
    modes = scenario_modes(scenario, args.modes)
    check_policies(scenario, modes)
    out = Path(args.out or f"results/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    capacity = scenario.fleet_capacity()
    settings = RunSettings(speed=args.speed, capacity=capacity, workdir=out / "logs",
                           progress_every_s=args.progress_every, interrupt=interrupt or Interrupt())
    phases = ", ".join(f"{p.name} {p.duration_s:g}s x{scenario.phase_load(p):.3g}" for p in scenario.phases)
    print(f"scenario {scenario.name}: {phases}; fleet capacity {capacity:.1f} req/s "
          f"({', '.join(f'{p.replicas}x {p.profile}' for p in scenario.pools)}); speed {args.speed:g}; "
          f"about {len(modes) * (scenario.duration_s / args.speed + 8):.0f}s of wall time; results in {out}",
          flush=True)
    if any(m.policy for m in modes):
        print(policy_lines(modes), flush=True)
    results: list[ModeResult] = []
    for mode in modes:
        settings.interrupt.check(f"mode {mode.key} started")  # a signal while the previous mode's stack stopped
        print(f"== mode {mode.key}: {mode.label}", flush=True)
        res = await run_mode(mode, scenario, settings)
        results.append(res)
        windows = scenario.report_windows()
        parts = [f"{w}: {scenario.slo_class} p99 {s.p99:.2f}s, goodput {s.goodput:.2f}/s full model "
                 f"+ {s.goodput_degraded:.2f}/s degraded, {s.tokens_per_s:.0f} tokens/s"
                 for w, s in mode_stats(res, scenario).items() if w in windows]
        print(f"== mode {mode.key} done in {res.wall_s:.0f}s: {len(res.records)} requests; " + "; ".join(parts),
              flush=True)
    comparison = comparison_for(results, scenario)  # once: the tables and the report both show it
    stats, degraded, found = print_tables(results, scenario, class_order(scenario, modes), comparison)
    report = write_report(out, results, stats, scenario, capacity, args.speed, found, degraded, command,
                          comparison=comparison)
    print(f"\nreport: {report}" + (f"\nplot:   {out / 'spike.png'}" if (out / "spike.png").exists() else ""),
          flush=True)
    return 0


async def _main(args: argparse.Namespace, command: str) -> int:
    # Ctrl-C, SIGTERM and SIGHUP end the demo: the running mode's finally stops every process it started. SIGINT
    # is handled here, not left to asyncio's default: a shell without job control starts a background command with
    # SIGINT ignored, Python then keeps it ignored, and the demo ran to its end through a Ctrl-C (`extproc serve`,
    # `sim` and `calibrate` set their own handlers too). A Python handler, not loop.add_signal_handler's callback:
    # that ran at the loop's next turn only, after a stack's start or stop (synchronous) had returned, and the next
    # mode's whole stack started before the cancel stopped it. This one runs as the signal comes, in synchronous
    # code too: it marks the interrupt (nothing more starts, runner.Interrupt), and cancels the task at its next
    # await, as asyncio.Runner does for SIGINT.
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    interrupt = Interrupt()

    def on_signal(signum, frame) -> None:
        interrupt.signum = signum
        task.cancel()
        loop.call_soon_threadsafe(lambda: None)  # wakes a loop waiting in its poll

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return await demo(args, command, interrupt)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    import uvloop

    command = "extproc demo " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["demo"] else "extproc demo"
    instances = getattr(args, "instances", 1)
    if instances < 1 or (instances > 1 and not args.what_if):
        print("extproc demo: --instances takes N >= 1 and goes with --what-if", file=sys.stderr)
        return 2
    # Simulated seconds: --speed 0 raised ZeroDivisionError, --phase-s 0 ran the whole scenario unsaid and a
    # negative one a run of no request, its report all -0.00.
    speed = None if args.what_if else args.speed  # the what-if runs in simulated time
    for flag, value in (("--speed", speed), ("--phase-s", getattr(args, "phase_s", None))):
        if value is not None and not 0 < value < math.inf:
            print(f"extproc demo: {flag} takes seconds > 0, got {value:g}", file=sys.stderr)
            return 2
    try:
        return what_if_tables(args, command) if args.what_if else uvloop.run(_main(args, command))
    except (ValueError, PolicyError, OSError) as e:  # a scenario, policy or mode the run cannot start from
        return _bad_input(e)
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\ninterrupted: every process the demo started has been stopped", file=sys.stderr)
        return 130


def _bad_input(e: Exception) -> int:
    """One line that names what is wrong, not a traceback (a scenario, policy or mode given on the command line)."""
    text = "; ".join(e.errors) if isinstance(e, PolicyError) else str(e)
    print(f"extproc demo: {text}", file=sys.stderr)
    return 2
