"""How the modes rank in one report window, from a run's summary.json (or the demo's own stats), and whether the
what-if ranks them as the real stack did.

A pair of modes counts as ranked by the real stack only when every recorded real run that has both ranks them
the same way ("settled"): a shared 2-core machine moves close pairs from run to run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

# metric -> True when higher is better
METRICS = {"goodput": True, "goodput_total": True, "p99": False}

# The real runs of scenarios/spike.yaml that docs/demo.md records ("Results"), spike phase, client side.
# Their goodput counted degraded answers too: it is `goodput_total` here; the full-model goodput of d and e was
# not recorded (a, b and c degrade nothing, so theirs is the same). The caps-only run's d was another policy.
RECORDED_REAL_RUNS: dict[str, dict[str, dict[str, float]]] = {
    # d is the pool-wide limit of issue 19 (policies/demo-full.yaml); runs of the earlier per-class d are left
    # out: that d was another policy. `extproc demo` at the speed each run names (5 when it names none).
    "2026-12-03 speed 2, five modes (/tmp/runs2/spike-s2 b,d at 16:56; /tmp/runs2/spike-s2b a,c,e at 17:46)": {
        "a": {"p99": 60.0, "goodput": 0.20, "goodput_total": 0.20},
        "b": {"p99": 2.54, "goodput": 7.53, "goodput_total": 7.53},
        "c": {"p99": 5.59, "goodput": 8.13, "goodput_total": 8.13},
        "d": {"p99": 1.95, "goodput": 19.13, "goodput_total": 34.36},
        "e": {"p99": 1.48, "goodput": 9.92, "goodput_total": 34.42}},
    "2026-12-03 16:45, five modes (/tmp/runs2/spike)": {
        "a": {"p99": 60.0, "goodput": 0.37, "goodput_total": 0.37},
        "b": {"p99": 2.69, "goodput": 7.37, "goodput_total": 7.37},
        "c": {"p99": 5.64, "goodput": 7.33, "goodput_total": 7.33},
        "d": {"p99": 2.27, "goodput": 16.43, "goodput_total": 31.17},
        "e": {"p99": 1.69, "goodput": 8.57, "goodput_total": 33.77}},
    "2026-12-03 16:05, five modes (/tmp/runs/spike)": {
        "a": {"p99": 60.0, "goodput": 0.27, "goodput_total": 0.27},
        "b": {"p99": 2.71, "goodput": 7.57, "goodput_total": 7.57},
        "c": {"p99": 6.13, "goodput": 6.40, "goodput_total": 6.40},
        "d": {"p99": 2.47, "goodput": 17.28, "goodput_total": 32.72},
        "e": {"p99": 1.42, "goodput": 9.67, "goodput_total": 34.33}},
    "earlier, a/b/c": {
        "a": {"p99": 60.0, "goodput_total": 0.18}, "b": {"p99": 2.65, "goodput_total": 8.20},
        "c": {"p99": 5.22, "goodput_total": 7.92}},
}

# scenarios/kv-agents.yaml on the real stack (`extproc demo --scenario scenarios/kv-agents.yaml`, speed 5,
# 2026-12-03 16:52, /tmp/runs2/kv; mode e again at 19:25 after issue 20's changes to the per-class caps), per spike
# window.
RECORDED_REAL_KV_AGENTS: dict[str, dict[str, dict[str, float]]] = {
    "spike-1": {
        "a": {"p99": 47.8, "goodput": 0.22}, "b": {"p99": 8.17, "goodput": 1.22},
        "c": {"p99": 32.98, "goodput": 0.11}, "d": {"p99": 2.96, "goodput": 1.91},
        "e": {"p99": 5.03, "goodput": 1.40}},
    "spike-2": {
        "a": {"p99": 60.0, "goodput": 0.0}, "b": {"p99": 6.78, "goodput": 1.13},
        "c": {"p99": 31.32, "goodput": 0.0}, "d": {"p99": 2.47, "goodput": 1.84},
        "e": {"p99": 2.71, "goodput": 2.04}},
}


def window_values(modes: dict[str, dict[str, Any]], window: str = "spike") -> dict[str, dict[str, float]]:
    """mode -> {p99, goodput_total, goodput (full model; absent when the source did not split it)} from
    summary.json's "modes" (or {mode: {window: WindowStats}})."""
    out = {}
    for key, windows in modes.items():
        w = windows[window]
        w = w if isinstance(w, dict) else asdict(w)
        values = {"p99": _number(w["p99"])}
        if "goodput_degraded" in w:  # split: `goodput` is the full model's
            values["goodput"] = _number(w["goodput"])
            values["goodput_total"] = _number(w["goodput"]) + _number(w["goodput_degraded"])
        else:  # an older summary: its goodput counted degraded answers
            values["goodput_total"] = _number(w["goodput"])
        out[key] = values
    return out


def _number(value: Any) -> float:
    """A summary's number: null is what summary.json writes for NaN (nothing served in the window)."""
    return math.nan if value is None else float(value)


def from_summary(path: str | Path, window: str = "spike") -> dict[str, dict[str, float]]:
    """window_values() of a demo run's summary.json (`extproc demo --out DIR` writes DIR/summary.json)."""
    return window_values(json.loads(Path(path).read_text(encoding="utf-8"))["modes"], window)


def ranking(values: dict[str, dict[str, float]], metric: str) -> list[str]:
    """Mode keys, best first, of those that have the metric."""
    have = [k for k in values if metric in values[k]]
    return sorted(have, key=lambda k: values[k][metric], reverse=METRICS[metric])


def better(x: float, y: float, metric: str) -> bool:
    """Whether x ranks above y; sums that differ only in float rounding are a tie (34.449999999999996 against
    34.45: the same requests added in another order)."""
    if math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12):
        return False
    return x > y if METRICS[metric] else x < y


def settled_pairs(runs: list[dict[str, dict[str, float]]], metric: str) -> set[tuple[str, str]]:
    """(better, worse) pairs that every run holding both ranks the same way (and at least one run holds), ties
    settling nothing."""
    verdicts: dict[tuple[str, str], set[bool]] = {}
    for run in runs:
        keys = sorted(k for k in run if metric in run[k])
        for i, x in enumerate(keys):
            for y in keys[i + 1:]:
                seen = verdicts.setdefault((x, y), set())
                if run[x][metric] == run[y][metric]:
                    seen.update((True, False))  # a tie settles nothing
                else:
                    seen.add(better(run[x][metric], run[y][metric], metric))
    return {(x, y) if v == {True} else (y, x) for (x, y), v in verdicts.items() if len(v) == 1}


def disagreements(settled: set[tuple[str, str]], values: dict[str, dict[str, float]],
                  metric: str) -> set[tuple[str, str]]:
    """The settled (better, worse) pairs that `values` ranks the other way (or as a tie)."""
    return {(x, y) for x, y in settled if x in values and y in values and metric in values[x]
            and metric in values[y] and not better(values[x][metric], values[y][metric], metric)}
