"""The demo's outputs: Markdown tables (printed and in report.md), the PNG plot, per-request records as JSONL."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path

from extproc.tools.plotting import SKIPPED, pyplot

from .results import (Comparison, Target, WindowStats, compared_on, rolling_p99, rolling_rate, scenario_stats,
                      slo_kinds)
from .runner import ModeResult
from .scenario import Scenario


def _s(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.2f}"


def _ratio(x: float, base: float) -> str:
    if math.isnan(x) or math.isnan(base):
        return "–"
    if base == 0:  # nothing against nothing is no ratio (kv-agents' 2nd spike: a and c both 0 req/s printed ∞)
        return "–" if x == 0 else "∞"
    return f"{x / base:.2f}×"


def latency_table(stats: dict[str, dict[str, WindowStats]], labels: dict[str, str], slo_class: str,
                  window: str = "spike", comparison: Comparison | None = None) -> str:
    """`comparison`: the "vs a" column on the requests a can serve only (comparison_for)."""
    vs, scope = compared_on(stats, comparison)
    rows = [f"| mode | {slo_class} p50 / p95 / p99 s ({window}) | TTFT p99 s ({window}) | p99 vs a ({window}{scope}) "
            "| p50 / p95 / p99 s (overall) | TTFT p99 s (overall) |",
            "|---|---|---:|---:|---|---:|"]
    base = vs.get("a", {}).get(window)
    for key, w in stats.items():
        s, o, c = w[window], w["overall"], vs[key][window]
        rows.append(f"| {key}: {labels[key]} | {_s(s.p50)} / {_s(s.p95)} / {_s(s.p99)} | {_s(s.ttft_p99)} "
                    f"| {_ratio(c.p99, base.p99) if base else '–'} | {_s(o.p50)} / {_s(o.p95)} / {_s(o.p99)} "
                    f"| {_s(o.ttft_p99)} |")
    return "\n".join(rows)


def throughput_table(stats: dict[str, dict[str, WindowStats]], labels: dict[str, str], slo_class: str,
                     slo_s: float, window: str = "spike", comparison: Comparison | None = None) -> str:
    """Goodput and output tokens, the full model (the one asked for) apart from degraded answers (another);
    `comparison`: the "vs a" columns on the requests a can serve only."""
    vs, scope = compared_on(stats, comparison)
    rows = [f"| mode | {slo_class} goodput ≤ {slo_s:g} s, full model, req/s ({window}) | vs a{scope} | + degraded "
            f"| full model (overall) | + degraded | useful tokens/s, full model ({window}) | vs a{scope} | + degraded "
            f"| all output tokens/s ({window}) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = vs.get("a", {}).get(window)
    for key, w in stats.items():
        s, o, c = w[window], w["overall"], vs[key][window]
        rows.append(f"| {key}: {labels[key]} | {s.goodput:.2f} | {_ratio(c.goodput, base.goodput) if base else '–'} "
                    f"| {s.goodput_degraded:.2f} | {o.goodput:.2f} | {o.goodput_degraded:.2f} "
                    f"| {s.useful_tokens_per_s:.0f} "
                    f"| {_ratio(c.useful_tokens_per_s, base.useful_tokens_per_s) if base else '–'} "
                    f"| {s.degraded_tokens_per_s:.0f} | {s.tokens_per_s:.0f} |")
    return "\n".join(rows)


COMPUTE = object()  # a `comparison` argument not given: comparison_for's is computed (None is "no comparison")


def comparison_for(results: list[ModeResult], scenario: Scenario) -> Comparison | None:
    """Every mode's stats on the first pool's models' requests, where a mode without the ext_proc (a, b) ran and
    some kind asks for another model: a and b route every request to the first pool, whose replicas answer the
    others 404, so "vs a" on every request set d's answers from all pools against a's from one (a three-model
    audit printed d at 71x a's goodput, most of it the 8B's own customers). None where that is not so."""
    kinds = {k.name for k in scenario.first_pool_kinds()}
    if kinds == {k.name for k in scenario.workload.kinds} or all(r.mode.policy for r in results):
        return None
    stats = {r.mode.key: scenario_stats([x for x in r.records if x.kind in kinds], scenario,
                                        r.mode.stack_mode == "extproc") for r in results}
    return Comparison(stats, ", ".join(scenario.pools[0].served))


def comparison_note(comparison: Comparison | None, scenario: Scenario) -> str:
    """What the comparisons with a and b cover, in words ("" when they cover every request)."""
    if comparison is None:
        return ""
    others = sorted({k.model for k in scenario.workload.kinds if not scenario.pools[0].serves(k.model)},
                    key=str)
    return (f"Modes a and b route every request to the first pool ({scenario.pools[0].name}), whose replicas answer "
            f"the requests for {', '.join(map(str, others))} 404: every comparison with a or b (\"vs a\" columns, "
            f"\"vs a\" and \"vs b\" targets) counts the requests for {comparison.models} only, in every mode. The "
            "other numbers cover every request each mode took.")


def class_goodput_table(stats: dict[str, dict[str, WindowStats]], labels: dict[str, str],
                        slo_class: str | Collection[str], slo_s: float, window: str = "spike") -> str:
    """Completions per second per class (or tenant kind), full model / degraded (the SLO kinds: within the SLO);
    with several SLO kinds, their fairness index (WindowStats.fairness_index) in a last column."""
    group = slo_kinds(slo_class)
    classes = sorted({c for w in stats.values() for c in w[window].goodput_by_class})
    fairness = len(group) > 1
    # Cells, not joined text: a window no request started in has no class, and its header then had a cell more
    # than its separator (no table in Markdown).
    head = [f"{c}{f' ≤ {slo_s:g} s' if c in group else ''} full / degraded req/s" for c in classes]
    rows = [_row([f"mode ({window})", *head, *(["fairness index"] if fairness else [])]),
            "|---|" + "---:|" * (len(classes) + fairness)]
    for key, w in stats.items():
        by = w[window].goodput_by_class
        rows.append(_row([f"{key}: {labels[key]}",
                          *(f"{by.get(c, {}).get('full', 0.0):.2f} / {by.get(c, {}).get('degraded', 0.0):.2f}"
                            for c in classes), *([_s(w[window].fairness_index)] if fairness else [])]))
    return "\n".join(rows)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def outcome_table(stats: dict[str, dict[str, WindowStats]], labels: dict[str, str],
                  degraded: dict[str, float]) -> str:
    classes = sorted({c for w in stats.values() for c in w["overall"].outcomes})
    head = [f"{c} rejected / shed / timeout / error / degraded %" for c in classes]
    rows = [_row(["mode", *head, "degraded % (all)"]), "|---|" + "---|" * len(classes) + "---:|"]
    for key, w in stats.items():
        cells = []
        for c in classes:
            o = w["overall"].outcomes.get(c, {})
            cells.append(f"{o.get('rejected', 0):.1f} / {o.get('shed', 0):.1f} / {o.get('timeout', 0):.1f} "
                         f"/ {o.get('error', 0):.1f} / {o.get('degraded', 0):.1f}")
        rows.append(_row([f"{key}: {labels[key]}", *cells, f"{degraded.get(key, 0.0):.1f}"]))
    return "\n".join(rows)


def offered_load(scenario: Scenario, capacity: float) -> tuple[list[float], list[float]]:
    """(window end times, requests/s offered) from the arrivals the load generator sends: its phase weights
    counted, a session's start counted as its mean calls. (Until 2026-12-06 the plot drew Poisson arrivals at
    `rate` x capacity: noisy-neighbour's flood, 1.4x, showed as 0.6x.)"""
    return rolling_rate([(p.at, p.kind.mean_calls) for p in scenario.arrivals(capacity)], scenario.duration_s)


def plot(results: list[ModeResult], scenario: Scenario, capacity: float, path: Path) -> Path | None:
    """Rolling p99 of the SLO class per mode with the SLO line and the offered load; output tokens/s below.
    None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None

    end = scenario.duration_s
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True, height_ratios=[3, 2])
    for res in results:
        t, p99 = rolling_p99(res.records, scenario.slo_kinds, scenario.client_timeout_s, end)
        top.plot(t, p99, label=f"{res.mode.key}: {res.mode.label}", linewidth=1.8)
        tokens = [(r.start + r.latency, r.output_tokens) for r in res.records if r.ok]
        t, rate = rolling_rate(tokens, end)
        bottom.plot(t, rate, label=f"{res.mode.key}", linewidth=1.5)
    top.axhline(scenario.slo_p95_s, color="black", linestyle="--", linewidth=1, label=f"SLO {scenario.slo_p95_s:g} s")
    top.set_yscale("log")
    top.set_ylabel(f"{scenario.slo_class} p99 latency, s (10 s windows)")
    top.set_title(f"{scenario.name}: {scenario.description}")
    load = top.twinx()
    t, rate = offered_load(scenario, capacity)
    load.fill_between(t, rate, color="grey", alpha=0.15, step="mid")
    load.set_ylabel("offered load, requests/s (grey)")
    load.set_ylim(0, max(rate or [1]) * 1.6)
    top.legend(loc="upper left", fontsize=8)
    top.set_zorder(load.get_zorder() + 1)
    top.patch.set_visible(False)
    bottom.set_ylabel("output tokens/s (completed)")
    bottom.set_xlabel("simulated seconds")
    bottom.legend(loc="upper left", fontsize=8, ncol=4)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        start = 0.0
        for phase in scenario.phases[:-1]:
            start += phase.duration_s
            ax.axvline(start, color="grey", linewidth=0.8)
        for e in scenario.events:
            ax.axvline(e.at_s, color="red", linewidth=1.0, linestyle=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tables(stats, labels, scenario: Scenario, degraded: dict[str, float], comparison: Comparison | None = None) -> str:
    parts = []
    for window in scenario.report_windows():
        parts += [latency_table(stats, labels, scenario.slo_class, window, comparison),
                  throughput_table(stats, labels, scenario.slo_class, scenario.slo_p95_s, window, comparison),
                  class_goodput_table(stats, labels, scenario.slo_kinds, scenario.slo_p95_s, window)]
    return "\n\n".join(parts + [outcome_table(stats, labels, degraded)])


def _window_sections(stats, labels, scenario: Scenario, comparison: Comparison | None) -> str:
    out = []
    for window, (start, end) in scenario.report_windows().items():
        out.append(f"""## {window} (requests started in {start:g}–{end:g} s)

{latency_table(stats, labels, scenario.slo_class, window, comparison)}

{throughput_table(stats, labels, scenario.slo_class, scenario.slo_p95_s, window, comparison)}

{class_goodput_table(stats, labels, scenario.slo_kinds, scenario.slo_p95_s, window)}
""")
    return "\n".join(out)


def _measured_by(what_if: bool, speed: float) -> str:
    if what_if:
        return ("Every number comes from the what-if: the scenario's arrivals against engine models in simulated "
                "time, the policies through the real admission core, the Envoy-only modes through their models "
                "(docs/demo.md).")
    return (f"Every number is measured by the load generator (client side) and given in simulated seconds (wall "
            f"time × {speed:g}).")


def _finite(value):
    """`value` with every NaN or infinity as None: JSON has no NaN (a bare `NaN` in summary.json, for a window
    with nothing served, made jq and JavaScript refuse the file); ordering.from_summary reads null as NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_report(out: Path, results: list[ModeResult], stats, scenario: Scenario, capacity: float, speed: float,
                 found: list[Target], degraded: dict[str, float], command: str, what_if: bool = False,
                 comparison: Comparison | None | object = COMPUTE) -> Path:
    """The run's records, summary, plot and report.md in `out`; `what_if`: engine models in simulated time (no
    processes, so no speed and no machine load to report); `comparison`: comparison_for's, when the caller has it
    (computed here if not given)."""
    labels = {r.mode.key: r.mode.label for r in results}
    if comparison is COMPUTE:
        comparison = comparison_for(results, scenario)
    for res in results:  # the data first: a plot that cannot be drawn must not lose the run
        with open(out / f"records-{res.mode.key}.jsonl", "w", encoding="utf-8") as f:
            for r in res.records:
                f.write(json.dumps(asdict(r)) + "\n")
    (out / "summary.json").write_text(json.dumps(_finite({
        "command": command, "speed": speed, "capacity_rps": capacity,
        "modes": {k: {w: asdict(v) for w, v in s.items()} for k, s in stats.items()},
        "targets": [asdict(t) for t in found], "degraded_percent": degraded,
        "cpu_s": {r.mode.key: r.cpu_s for r in results}, "wall_s": {r.mode.key: r.wall_s for r in results},
    }), indent=2, default=str, allow_nan=False), encoding="utf-8")
    png = plot(results, scenario, capacity, out / "spike.png")
    picture = f"![{scenario.slo_class} p99 over time]({png.name})" if png is not None else f"({SKIPPED})"
    phases = ", ".join(f"{p.name} {p.duration_s:g} s at {scenario.phase_load(p):.3g}× "
                       f"({scenario.phase_load(p) * capacity:.1f} req/s"
                       f"{f'; rate {p.rate:g}× with its weights' if p.weights else ''})" for p in scenario.phases)
    cpu_lines = "\n".join(f"| {r.mode.key} | {r.wall_s:.0f} | " + ", ".join(
        f"{name} {sec / r.wall_s:.0%}" for name, sec in sorted(r.cpu_s.items())) + " |" for r in results)
    events = "".join(f" At {e.at_s:g} s, replica {e.replica} of `{e.pool}` gets fault "
                     + ", ".join(f"{k} {v:g}" for k, v in e.fault.items()) + "." for e in scenario.events)
    text = f"""# {scenario.name}: {len(results)} ways

`{command}`

Scenario `{scenario.name}`: {phases}. Fleet capacity {capacity:.1f} requests/s. SLO of the {scenario.slo_class}
class: p95 ≤ {scenario.slo_p95_s:g} s end to end. {_measured_by(what_if, speed)} Latency percentiles cover requests the fleet took on (completed, or
timed out after {scenario.client_timeout_s:g} s, counted at the timeout); refused requests are counted separately.
Each window counts the requests started in it. "Full model": answered by the model the client asked for (the
response's `model`); "degraded": by another (the small model's pool). Goodput and the targets count the full
model; degraded answers are shown beside them. Useful tokens: output tokens of completed requests, the
{scenario.slo_class} class's only within the SLO.{events} {comparison_note(comparison, scenario)}

{picture}

{_window_sections(stats, labels, scenario, comparison)}
## Refusals per class (whole run)

{outcome_table(stats, labels, degraded)}

## Targets

""" + ("\n".join(f"- {t.line()}" for t in found) or "- (modes d / e not run)") + f"""

""" + ("" if what_if else f"""## Machine load

CPU per process as a share of one core during each replay, and what every other process on the machine used
meanwhile. This machine has {os.cpu_count()} cores; near that in total, the load generator, Envoy or the simulator
lag and latencies are inflated: compare runs only when "other processes" stayed small.

| mode | wall s | CPU |
|---|---:|---|
{cpu_lines}
""")
    path = out / "report.md"
    path.write_text(text, encoding="utf-8")
    return path
