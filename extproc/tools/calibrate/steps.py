"""Measure one closed-loop step against the target with the load generator, with progress and an early stop."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

from .sweep import StepResult, SweepConfig
from extproc.tools.loadgen import LoadClient, Workload, run_closed_loop, summarize
from extproc.tools.stats import percentile

POLL_S = 0.1  # real seconds between progress updates and early-stop checks
EARLY_STOP_MIN_SAMPLES = 20  # measured requests needed before a step may be judged early


@dataclass(frozen=True)
class StepPlan:
    """How long each step runs; times in seconds of the target's time (real seconds x time_scale)."""

    duration_s: float | None = 60.0  # measured time per step (after the warmup) ...
    requests: int | None = None  # ... or this many requests per step (warmup included)
    warmup_s: float = 5.0  # left out of the measurement: the first wave starts in lockstep
    time_scale: float = 1.0  # the simulator's --speed: target seconds per real second
    request_timeout_s: float = 60.0
    seed: int = 0


class StepProgress:
    """A one-line progress bar on stderr: redrawn in place on a terminal, a line per quarter otherwise."""

    WIDTH = 24

    def __init__(self, label: str, stream: TextIO | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._quarter = 0  # without a terminal: a line at 25%, 50%, 75% and 100%

    def update(self, fraction: float, done: int, errors: int) -> None:
        fraction = min(max(fraction, 0.0), 1.0)
        filled = round(fraction * self.WIDTH)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {fraction:4.0%}  "
                f"{done} done, {errors} errors")
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        elif int(fraction * 4) > self._quarter:
            self._quarter = int(fraction * 4)
            print(line, file=self.stream, flush=True)

    def finish(self, note: str) -> None:
        if self.tty:
            self.stream.write("\n")
        print(f"{self.label} {note}", file=self.stream, flush=True)


def _early_stop(records: list, warmup_s: float, config: SweepConfig) -> str | None:
    """Why to cut the step short now, or None: errors over the limit, or p95 already far over the SLO."""
    if len(records) >= EARLY_STOP_MIN_SAMPLES:
        errors = sum(1 for r in records if not r.ok)
        if errors / len(records) > config.max_error_rate:
            return "errors"
    measured = sorted(r.latency for r in records if r.ok and r.start >= warmup_s)
    if len(measured) >= EARLY_STOP_MIN_SAMPLES and config.far_over(percentile(measured, 95)):
        return "latency"
    return None


def step_summary(records: list, window: tuple[float, float], workload: Workload) -> dict:
    """The load generator's summary, with TTFT from the streamed kinds alone: a non-streamed answer's first token
    is its whole body, so a half-streamed workload's TTFT p95 read as its end-to-end p95 (2.66 s against 2.79 s,
    where the streamed half's first tokens came at ~0.1-0.5 s)."""
    summary = summarize(records, window)
    streamed = {k.name for k in workload.kinds if k.stream}
    summary["ttft_p95"] = summarize([r for r in records if r.kind in streamed], window)["ttft_p95"]
    return summary


async def measure_step(urls: list[str], model: str, workload: Workload, concurrency: int, plan: StepPlan,
                       config: SweepConfig, phase: str, progress: StepProgress | None = None,
                       stop: Callable[[], bool] = lambda: False) -> StepResult:
    """One closed-loop step at `concurrency`; latencies in the target's seconds. `stop()` true ends it early (the
    caller drops such a step)."""
    scale = plan.time_scale
    real_total = None if plan.duration_s is None else (plan.warmup_s + plan.duration_s) / scale
    async with LoadClient(urls, timeout_s=plan.request_timeout_s / scale, time_scale=scale, pool=concurrency,
                          default_model=model) as client:
        run = asyncio.create_task(run_closed_loop(client, workload, concurrency,
                                                  duration_s=real_total, requests=plan.requests,
                                                  seed=plan.seed + concurrency))
        started = time.monotonic()
        stopped = None
        try:
            while not run.done() and not stop():
                await asyncio.wait([run], timeout=POLL_S)
                records = client.records
                if progress is not None:
                    elapsed = time.monotonic() - started
                    fraction = elapsed / real_total if real_total else len(records) / plan.requests
                    progress.update(fraction, len(records), sum(1 for r in records if not r.ok))
                if not run.done() and (stopped := _early_stop(records, plan.warmup_s, config)):
                    break
        finally:
            if not run.done():
                run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        end_s = (time.monotonic() - started) * scale
    # A failing target is judged on every request; latencies only on those after the warmup.
    # A full timed step is measured over its nominal window, not the drain after it (concurrency falls there).
    window_start = 0.0 if stopped == "errors" else min(plan.warmup_s, end_s)
    if stopped is None and plan.duration_s is not None:
        end_s = plan.warmup_s + plan.duration_s
    summary = step_summary(client.records, (window_start, max(end_s, window_start + 1e-6)), workload)
    result = StepResult.from_summary(concurrency, summary, phase=phase, stopped_early=stopped is not None)
    if progress is not None:
        note = {None: "", "errors": " (stopped early: errors)", "latency": " (stopped early: p95 far over SLO)"}
        progress.finish(f"done: p95 {result.latency_p95:.2f} s, {result.ok}/{result.requests} ok{note[stopped]}")
    return result
