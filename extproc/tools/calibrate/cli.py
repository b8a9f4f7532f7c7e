"""`extproc calibrate`: find a class's concurrency cap by a closed-loop doubling + bisection sweep of the target.

    extproc calibrate --target http://127.0.0.1:8000 --slo-p95 2s [--workload FILE] [--policy FILE --class C]
        [--replicas N]

Exit status: 0 a cap was chosen (and written, with --policy); 1 no cap (the target failed, or missed the SLO at the
start concurrency); 2 bad arguments or policy; 130 interrupted (Ctrl-C), after printing the partial table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .policy_edit import policy_snippet, set_class_cap, write_class_cap
from .report import describe_workload, render_table, results_document
from .steps import StepPlan, StepProgress, measure_step
from .sweep import Status, Sweep, SweepConfig
from .target import TargetError, TargetIdentity, moe_hint, probe
from extproc.policy.schema import PolicyError
from extproc.tools.loadgen import ENDPOINTS, RequestKind, Workload

EXIT_CAP, EXIT_NO_CAP, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
STREAMING_SCALE_WARN = 5.0  # above this time scale, streaming's per-token cost distorts client-side latency


def parse_seconds(text: str) -> float:
    """'2s', '1500ms', '2' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 2s, 1500ms)")
    value = float(m.group(1))
    return value / 1000 if m.group(2) == "ms" else value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--target", required=True, help="base URL of the vLLM OpenAI server (or the simulator)")
    parser.add_argument("--model", help="model to send (default: the target's first served model)")
    parser.add_argument("--slo-p95", type=parse_seconds, required=True, help="p95 latency SLO, e.g. 2s or 1500ms")
    wl = parser.add_argument_group("workload (a loadgen workload file, or one kind from flags)")
    wl.add_argument("--workload", help="YAML/JSON: {kinds: [{name, weight, endpoint, prompt_tokens, max_tokens, "
                                       "stream, ...}]} (see docs/simulator.md)")
    wl.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    wl.add_argument("--prompt-tokens", type=int, default=512)
    wl.add_argument("--max-tokens", type=int, default=256)
    wl.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                    help="stream responses (needed for TTFT; default on)")
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--start", type=int, default=1, help="first concurrency (default 1)")
    sweep.add_argument("--max-concurrency", type=int, default=256, help="highest concurrency tried (default 256)")
    budget = sweep.add_mutually_exclusive_group()
    budget.add_argument("--step-duration", type=parse_seconds, default=60.0,
                        help="measured time per step, target seconds (default 60s)")
    budget.add_argument("--step-requests", type=int, help="requests per step instead of a duration")
    sweep.add_argument("--step-warmup", type=parse_seconds, default=5.0,
                       help="left out of each step's measurement (default 5s)")
    sweep.add_argument("--bisect-steps", type=int, default=3, help="refinement steps after the doubling (default 3)")
    sweep.add_argument("--far-factor", type=float, default=2.0,
                       help="cut a step short once its p95 passes this x SLO (default 2)")
    sweep.add_argument("--max-error-rate", type=float, default=0.05,
                       help="a step with more failed requests than this ends the sweep with no cap (default 0.05)")
    sweep.add_argument("--request-timeout", type=parse_seconds,
                       help="per request, target seconds (default max(60s, 10 x SLO)); a timeout is an error")
    sweep.add_argument("--time-scale", type=float,
                       help="target seconds per real second (default: the simulator's --speed, read from "
                            "/sim/state; 1 for a real server)")
    sweep.add_argument("--seed", type=int, default=0)
    cap = parser.add_argument_group("the cap")
    cap.add_argument("--margin", type=float, default=0.2, help="safety margin taken off the knee (default 0.2)")
    cap.add_argument("--moe-margin", type=float, default=0.35,
                     help="margin for mixture-of-experts models, instead of --margin (default 0.35)")
    cap.add_argument("--moe", action=argparse.BooleanOptionalAction, default=None,
                     help="the model is MoE (default: guessed from the model name and the simulator profile)")
    cap.add_argument("--policy", help="policy YAML whose class cap is rewritten (comments and the rest are kept)")
    cap.add_argument("--class", dest="class_name", default="interactive", help="class to calibrate")
    cap.add_argument("--replicas", type=int, default=1,
                     help="replicas like the target that serve the class behind one Envoy: the cap written or "
                          "printed is the per-replica cap x this (a policy's caps are the fleet's; default 1)")
    parser.add_argument("--out", help="folder for results.json and calibration.png "
                                      "(default calibration/<model>-<UTC time>)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.workload:
        return Workload.load(args.workload)
    return Workload([RequestKind(name="default", endpoint=args.endpoint, prompt_tokens=args.prompt_tokens,
                                 max_tokens=args.max_tokens, stream=args.stream)])


@dataclass
class Calibration:
    """One calibration run: what was asked, what was measured so far (kept when interrupted)."""

    target: str
    model: str | None
    workload: Workload
    sweep: Sweep
    plan: StepPlan
    time_scale: float | None  # None: read the simulator's speed, else 1
    moe: bool | None
    margin: float
    moe_margin: float
    identity: TargetIdentity | None = None
    is_moe: bool = False
    moe_note: str = "dense model"
    interrupted: bool = False  # Ctrl-C (SIGINT) stopped the sweep
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def margin_applied(self) -> float:
        return self.moe_margin if self.is_moe else self.margin

    def decide_moe(self) -> None:
        """--moe / --no-moe, else a guess from the model name and the simulator profile."""
        if self.moe is not None:
            self.is_moe = self.moe
            self.moe_note = "MoE margin (--moe)" if self.moe else "dense model (--no-moe)"
            return
        names = [self.identity.model] + ([self.identity.sim_profile] if self.identity.sim_profile else [])
        hint = moe_hint(names)
        self.is_moe = hint is not None
        self.moe_note = f"MoE margin: guessed from {hint!r}, --no-moe to override" if hint else "dense model"

    async def execute(self, progress: bool = True) -> None:
        """Probe the target, then measure steps until the sweep ends or SIGINT (Ctrl-C) stops it."""
        self._stop_on_sigint()
        self.identity = await probe(self.target, self.model)
        self.decide_moe()
        if self.time_scale is None:
            self.time_scale = self.identity.sim_speed or 1.0
        self.plan = StepPlan(**{**asdict(self.plan), "time_scale": self.time_scale})
        print(self.identity.describe(), file=sys.stderr)
        if self.time_scale > STREAMING_SCALE_WARN and any(k.stream for k in self.workload.kinds):
            print(f"warning: streaming at time scale {self.time_scale:g}: one SSE event per token costs this "
                  f"client (and a local simulator) CPU, which shows up as latency; prefer --no-stream or a "
                  f"lower --speed", file=sys.stderr)
        while not self.interrupted and (concurrency := self.sweep.next_concurrency()) is not None:
            n = len(self.sweep.steps) + 1
            bar = StepProgress(f"step {n} ({self.sweep.phase}) c={concurrency}") if progress else None
            step = await measure_step([self.identity.url], self.identity.model, self.workload, concurrency,
                                      self.plan, self.sweep.config, self.sweep.phase, bar,
                                      stop=lambda: self.interrupted)
            if not self.interrupted:  # a step cut short is not a measurement
                self.sweep.record(step)

    def _stop_on_sigint(self) -> None:
        """Ctrl-C sets `interrupted` (the sweep stops at once and keeps what it measured) as well as cancelling
        the run: the flag holds even where a cancellation is absorbed on its way up (one was, under load)."""
        task = asyncio.current_task()

        def interrupt() -> None:
            self.interrupted = True
            task.cancel()
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, interrupt)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (a test's loop): Ctrl-C stays Python's KeyboardInterrupt


def _default_out(identity: TargetIdentity | None) -> Path:
    model = re.sub(r"[^A-Za-z0-9._-]+", "_", identity.model if identity else "unknown")
    return Path("calibration") / f"{model}-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"


def _check_policy(args: argparse.Namespace) -> None:
    """Fail before the sweep, not after it, when the policy cannot take the cap."""
    try:
        text = Path(args.policy).read_text(encoding="utf-8")
    except OSError as e:
        raise PolicyError([f"{args.policy}: {e.strerror}"]) from e
    set_class_cap(text, args.class_name, 1)


def _apply_cap(args: argparse.Namespace, per_replica: int) -> dict:
    """Write the fleet's cap (per replica x --replicas) into the policy (printing the diff) or print the snippet;
    returns what was done. The sweep measures one replica, and a policy's max_concurrency is for every replica
    behind its Envoy (docs/tuning.md): written as measured, a three-replica fleet ran at a third of its cap."""
    cap = per_replica * args.replicas
    print(f"\ncap {per_replica} per replica x {args.replicas} replica{'s' if args.replicas > 1 else ''} = {cap}"
          + (" (the policy's caps are the fleet's: give --replicas N for N replicas like this one)"
             if args.replicas == 1 else ""))
    if not args.policy:
        print(f"\npolicy snippet (no --policy given):\n{policy_snippet(args.class_name, cap)}", end="")
        return {"file": None, "class": args.class_name, "max_concurrency": cap, "per_replica": per_replica,
                "replicas": args.replicas, "written": False}
    diff = write_class_cap(args.policy, args.class_name, cap)
    print(f"\n{args.policy}: classes.{args.class_name}.max_concurrency = {cap}" +
          ("" if diff else " (already set; file unchanged)"))
    if diff:
        print(diff, end="")
    return {"file": args.policy, "class": args.class_name, "max_concurrency": cap, "per_replica": per_replica,
            "replicas": args.replicas, "written": bool(diff)}


def run(args: argparse.Namespace) -> int:
    try:
        config = SweepConfig(slo_p95_s=args.slo_p95, start=args.start, max_concurrency=args.max_concurrency,
                             margin=args.margin, far_factor=args.far_factor, max_error_rate=args.max_error_rate,
                             bisect_steps=args.bisect_steps)
        if not 0 <= args.moe_margin < 1:
            raise ValueError("--moe-margin must be in [0, 1)")
        if args.replicas < 1:
            raise ValueError("--replicas must be at least 1")
        # Steps that measure nothing: 0 divided every step (a traceback), the others sent no request, which the
        # sweep read as the target failing.
        if args.time_scale is not None and not args.time_scale > 0:
            raise ValueError("--time-scale must be positive")
        if args.step_requests is not None and args.step_requests < 1:
            raise ValueError("--step-requests must be at least 1")
        if args.step_requests is None and not args.step_duration > 0:
            raise ValueError("--step-duration must be positive")
        workload = workload_from_args(args)
        if args.policy:
            _check_policy(args)
    except (ValueError, OSError) as e:  # PolicyError is a ValueError
        print(f"extproc calibrate: {e}", file=sys.stderr)
        return EXIT_USAGE
    plan = StepPlan(duration_s=None if args.step_requests else args.step_duration, requests=args.step_requests,
                    warmup_s=args.step_warmup, seed=args.seed,
                    request_timeout_s=args.request_timeout or max(60.0, 10 * args.slo_p95))
    calibration = Calibration(target=args.target, model=args.model, workload=workload, sweep=Sweep(config),
                              plan=plan, time_scale=args.time_scale, moe=args.moe, margin=args.margin,
                              moe_margin=args.moe_margin)
    try:
        asyncio.run(calibration.execute())
    except TargetError as e:
        print(f"extproc calibrate: {e}", file=sys.stderr)
        return EXIT_NO_CAP
    except (KeyboardInterrupt, asyncio.CancelledError):
        calibration.interrupted = True
    if calibration.interrupted:
        calibration.sweep.interrupt()
        print("\ninterrupted: partial results follow", file=sys.stderr)
    return report(calibration, args)


def report(calibration: Calibration, args: argparse.Namespace) -> int:
    """Print the table, write results.json and the PNG, apply the cap; returns the exit status."""
    sweep, identity = calibration.sweep, calibration.identity
    outcome = sweep.outcome(margin=calibration.margin_applied())
    print(render_table(identity, calibration.workload, sweep.config, sweep.steps, outcome, calibration.moe_note))
    policy = None
    if outcome.has_cap:
        try:
            policy = _apply_cap(args, outcome.cap)
        except (PolicyError, OSError) as e:
            print(f"extproc calibrate: policy not written: {e}", file=sys.stderr)
            policy = {"file": args.policy, "error": str(e), "written": False}
    elif args.policy:
        print(f"\n{args.policy}: not changed (no cap)")
    out = Path(args.out) if args.out else _default_out(identity)
    out.mkdir(parents=True, exist_ok=True)
    moe = {"is_moe": calibration.is_moe, "note": calibration.moe_note, "margin": calibration.margin, "moe_margin": calibration.moe_margin}
    document = results_document(identity, calibration.workload, sweep.config, sweep.steps, outcome, moe,
                                calibration.started_at, datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                asdict(calibration.plan), policy)
    (out / "results.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    written = [str(out / "results.json")]
    if sweep.steps and not args.no_plot:
        from .plot import plot_sweep
        from extproc.tools.plotting import SKIPPED

        title = (f"{identity.model if identity else '?'} @ {calibration.target}\n"
                 f"{describe_workload(calibration.workload)[:90]}")
        if plot_sweep(sweep.steps, sweep.config.slo_p95_s, outcome, str(out / "calibration.png"), title,
                      streaming=any(k.stream for k in calibration.workload.kinds)):
            written.append(str(out / "calibration.png"))
        else:
            print(SKIPPED)
    print(f"\nwrote {', '.join(written)}")
    if outcome.status is Status.INTERRUPTED:
        return EXIT_INTERRUPTED
    if policy is not None and policy.get("error"):
        return EXIT_USAGE
    return EXIT_CAP if outcome.has_cap else EXIT_NO_CAP
