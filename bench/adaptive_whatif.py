"""Compare policies / adaptive controllers in the engine-only what-if, over seeds and report windows.

    .venv/bin/python bench/adaptive_whatif.py --scenario scenarios/shifted-fleet.yaml \
        --policy policies/demo-full.yaml --policy policies/demo-adaptive.yaml --seeds 11,12,13 \
        [--controller aimd|gradient-minrtt|gradient-slo]

Prints, per policy and window: interactive p99 (per seed), goodput, output tokens/s, and for adaptive classes the
cap's range and how often it moved in the steady (normal) phases. The gradient controllers are an experiment for
docs/adaptive.md, not shipped code: a Limit of this script's own, handed to the what-if's core as its
`limit_factory` (extproc.policy.limits.Limit).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extproc.policy.adaptive import AdaptiveLimit  # noqa: E402
from extproc.policy.limits import default_limit  # noqa: E402
from extproc.tools.demo.results import window_stats  # noqa: E402
from extproc.tools.demo.scenario import Scenario  # noqa: E402
from extproc.tools.demo.whatif import what_if  # noqa: E402


class GradientLimit(AdaptiveLimit):
    """A gradient controller in the style of Envoy's adaptive_concurrency / Netflix's Gradient2:
    new = limit * clamp(target / p95, 0.5, 1.5) + sqrt(limit) headroom, smoothed; cut on saturation like AIMD.
    anchor "minrtt": target = 2x the lowest window p50 seen (Envoy's buffer 100% on a fixed-ish min RTT);
    anchor "slo": target = cut_at x the class SLO."""

    anchor = "slo"

    def update(self, now, inflight, saturation):
        anchor = self.anchor
        spec = self.spec
        if self._last is not None and now - self._last < spec.interval_s:
            return int(self.limit)
        self._last = now
        if saturation is not None and saturation.saturated:
            self.limit = max(spec.min_limit, self.limit * spec.decrease)
            self.last_action = "cut_saturated"
            return int(self.limit)
        if self.window.count(now) < spec.min_samples:
            self.last_action = "hold"
            return int(self.limit)
        p95 = max(self.window.quantile(now, 0.95), 1e-3)
        if anchor == "minrtt":
            p50 = self.window.quantile(now, 0.5)
            self._min_rtt = min(getattr(self, "_min_rtt", math.inf), p50)
            target = 2.0 * self._min_rtt
        else:
            target = spec.cut_at * self.slo_s
        gradient = min(1.5, max(0.5, target / p95))
        new = self.limit * gradient + math.sqrt(self.limit)
        if inflight < spec.binding * self.limit:
            new = min(new, self.limit)  # like AIMD: do not grow an unused limit
        self.limit = min(spec.max_limit, max(spec.min_limit, 0.8 * self.limit + 0.2 * new))
        self.last_action = "gradient"
        return int(self.limit)


def limit_factory(controller: str):
    """The shipped AIMD, or a gradient controller for adaptive classes."""
    if controller == "aimd":
        return default_limit

    class Anchored(GradientLimit):
        anchor = controller.split("-")[1]

    def make(spec):
        if not spec.adaptive.enabled:
            return default_limit(spec)
        return Anchored(spec.adaptive, spec.slo_p95_ms / 1000.0, spec.max_concurrency)

    return make


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="scenarios/shifted-fleet.yaml")
    p.add_argument("--policy", action="append", required=True)
    p.add_argument("--seeds", default="")
    p.add_argument("--controller", default="aimd", choices=["aimd", "gradient-minrtt", "gradient-slo"])
    p.add_argument("--phase-s", type=float)
    args = p.parse_args()
    factory = limit_factory(args.controller)
    base = Scenario.load(args.scenario)
    if args.phase_s:
        base = base.shortened(args.phase_s)
    capacity = base.fleet_capacity()
    seeds = [int(s) for s in args.seeds.split(",") if s] or [base.seed]
    windows = {**base.report_windows(), "overall": (0.0, base.duration_s)}
    steady = [base.window(ph.name) for ph in base.phases if ph.rate < 1.0]
    print(f"scenario {base.name}, capacity {capacity:.1f} req/s, controller {args.controller}, seeds {seeds}")
    print("| policy | window | interactive p99 s per seed | goodput req/s (mean) | tokens/s (mean) |")
    print("|---|---|---|---:|---:|")
    for policy in args.policy:
        per_window: dict[str, list] = {w: [] for w in windows}
        moves = []
        for seed in seeds:
            scenario = replace(base, seed=seed)
            res = what_if(scenario, policy, capacity, limit_factory=factory)
            for w, span in windows.items():
                per_window[w].append(window_stats(res.records, span, scenario.slo_class, scenario.slo_p95_s,
                                                  scenario.client_timeout_s, True))
            # Cap moves of interactive inside steady phases, after their first 10 s (settling).
            for a, b in steady:
                vals = [lim.get("interactive") for t, lim in res.limits if a + 10 <= t < b]
                moves.append(len(vals))
        for w, stats in per_window.items():
            print(f"| {Path(policy).stem} | {w} | {' '.join(f'{s.p99:.2f}' for s in stats)} "
                  f"| {statistics.mean(s.goodput for s in stats):.2f} "
                  f"| {statistics.mean(s.tokens_per_s for s in stats):.0f} |")
        if any(moves):
            print(f"|  | interactive cap moves per steady phase (after 10 s) | {moves} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
