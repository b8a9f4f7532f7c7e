"""The calibration's outputs as text and JSON: header with the target's identity, step table, knee and cap."""

from __future__ import annotations

import math
from dataclasses import asdict

from .sweep import Outcome, StepResult, SweepConfig
from .target import TargetIdentity
from extproc.tools.loadgen import Workload

COLUMNS = ("step", "phase", "conc", "reqs", "p50 s", "p95 s", "p99 s", "TTFT p95 s", "tokens/s", "verdict",
           "errors")


def describe_workload(workload: Workload) -> str:
    parts = []
    for k in workload.kinds:
        stream = "stream" if k.stream else "no stream"
        parts.append(f"{k.name} (weight {k.weight:g}): {k.endpoint}, prompt {k.prompt_tokens} tokens, "
                     f"max_tokens {k.max_tokens}, {stream}")
    return "; ".join(parts)


def _seconds(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def _errors(step: StepResult) -> str:
    if not step.errors:
        return "0"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(step.errors.items(), key=lambda kv: -kv[1]))
    return f"{step.error_count} ({kinds})"


def step_rows(steps: list[StepResult], config: SweepConfig, streaming: bool) -> list[tuple[str, ...]]:
    rows = []
    for i, s in enumerate(steps, 1):
        verdict = config.verdict(s).value + (" (cut short)" if s.stopped_early else "")
        rows.append((str(i), s.phase, str(s.concurrency), str(s.requests), _seconds(s.latency_p50),
                     _seconds(s.latency_p95), _seconds(s.latency_p99),
                     _seconds(s.ttft_p95) if streaming else "-", f"{s.tokens_per_s:,.0f}", verdict, _errors(s)))
    return rows


def render_table(identity: TargetIdentity | None, workload: Workload, config: SweepConfig,
                 steps: list[StepResult], outcome: Outcome, moe_note: str) -> str:
    """The printed report: who was measured under what, one row per step, the knee and the cap."""
    lines = ["extproc calibrate: " + (identity.describe() if identity else "target not probed"),
             f"workload: {describe_workload(workload)}",
             f"SLO p95 {config.slo_p95_s:.2f} s; margin {outcome.margin if outcome.margin is not None else config.margin:.0%}"
             f" ({moe_note})", ""]
    streaming = any(k.stream for k in workload.kinds)
    rows = [COLUMNS, *step_rows(steps, config, streaming)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    for row in rows:
        cells = [cell.rjust(w) if i not in (1, 9, 10) else cell.ljust(w) for i, (cell, w) in
                 enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    if not streaming:
        lines.append("(TTFT needs a streaming workload: '-')")
    lines.append("")
    if outcome.has_cap:
        lines.append(f"knee: {outcome.knee}; cap: {outcome.cap}")
    else:
        lines.append(f"no cap: {outcome.status.value}")
    lines.append(f"reason: {outcome.reason}")
    return "\n".join(lines)


def results_document(identity: TargetIdentity | None, workload: Workload, config: SweepConfig,
                     steps: list[StepResult], outcome: Outcome, moe: dict, started_at: str, finished_at: str,
                     step_plan: dict, policy: dict | None) -> dict:
    """Everything needed to judge later whether this calibration is stale (results.json)."""
    return {
        "target": asdict(identity) if identity else None,
        "started_at": started_at,
        "finished_at": finished_at,
        "workload": [asdict(k) for k in workload.kinds],
        "slo_p95_s": config.slo_p95_s,
        "config": asdict(config),
        "step_plan": step_plan,
        "moe": moe,
        "steps": [{**asdict(s), "verdict": config.verdict(s).value, "error_rate": s.error_rate} for s in steps],
        "outcome": {"status": outcome.status.value, "knee": outcome.knee, "cap": outcome.cap,
                    "margin": outcome.margin, "reason": outcome.reason},
        "policy": policy,
    }
