"""Noisy neighbour (issue 20) in the engine-model what-if: per-tenant p99 and full-model goodput during the flood.

`python bench/noisy_neighbour.py [--plot PNG]` runs scenarios/noisy-neighbour.yaml and its no-flood baseline under
the three policies the scenario names (c = fifo, d = round_robin, e = fair; they differ only in `fairness.mode`)
and prints the table of docs/demo.md's "Noisy neighbour" section. Both scenarios run at the flood scenario's
measured capacity. With --plot it also draws each tenant's full-model goodput over time, fifo against fair, in the
flood scenario (docs/img/noisy-neighbour.png). With --tradeoff it runs the fair policy on the flood scenario with
tenant A held to a few request rates (`requests_per_minute`) and prints B's and C's p99 against the pool's output:
how far A must be held back before B's and C's p99 return to their no-flood level.
"""

from __future__ import annotations

import argparse
import tempfile

import yaml

from extproc.policy.fairness import jain_index
from extproc.tools.demo.results import rolling_rate, window_stats
from extproc.tools.plotting import SKIPPED, pyplot
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if

SCENARIOS = ("scenarios/noisy-neighbour.yaml", "scenarios/noisy-neighbour-baseline.yaml")
MODES = {"c": "fifo", "d": "round_robin", "e": "fair"}
WINDOW = "flood"


def max_min_shares(demands: dict[str, float], total: float) -> dict[str, float]:
    """Water-filling: what each tenant gets of `total` when none gets more than it asks and the rest is equal."""
    shares, left, open_ = {}, total, dict(demands)
    while open_:
        level = left / len(open_)
        small = {k: d for k, d in open_.items() if d <= level}
        if not small:
            shares.update({k: level for k in open_})
            break
        for k, d in small.items():
            shares[k] = d
            left -= d
            del open_[k]
    return shares


def plot(runs: dict[str, list], kinds: list[str], sc: Scenario, path: str) -> None:
    """Each tenant's full-model goodput (answers within the SLO, 10 s windows) over time, one panel per mode."""
    plt = pyplot()
    if plt is None:
        print(SKIPPED)
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(11, 3.8), sharey=True)
    for ax, (label, records) in zip(axes, runs.items()):
        for k in kinds:
            good = [(r.start, 1.0) for r in records
                    if r.kind == k and r.ok and not r.degraded and r.latency <= sc.slo_p95_s]
            t, rate = rolling_rate(good, sc.duration_s)
            ax.plot(t, rate, label=k, linewidth=1.6)
        start, end = sc.report_windows()[WINDOW]
        ax.axvspan(start, end, color="grey", alpha=0.12)
        ax.set_title(f"{label}: full-model goodput per tenant")
        ax.set_xlabel("simulated seconds (grey: A floods)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(f"answers within {sc.slo_p95_s:g} s, req/s")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


def main(modes: str = "cde", plot_path: str | None = None) -> None:
    flood = Scenario.load(SCENARIOS[0])
    capacity = flood.fleet_capacity()
    kinds = [k.name for k in flood.workload.kinds]
    print(f"capacity {capacity:.2f} req/s; window: {WINDOW}; goodput: full-model answers within "
          f"{flood.slo_p95_s:g} s, req/s")
    print("| scenario | mode | " + " | ".join(f"{k} p99 s | {k} goodput" for k in kinds)
          + " | pool output tok/s | fairness index |")
    print("|---|---|" + "---:|---:|" * len(kinds) + "---:|---:|")
    drawn: dict[str, list] = {}
    for path in SCENARIOS:
        sc = Scenario.load(path)
        span = sc.report_windows()[WINDOW]
        for key in modes:
            res = what_if(sc, sc.policies[key], capacity)
            if path == SCENARIOS[0] and MODES[key] in ("fifo", "fair"):
                drawn[MODES[key]] = res.records
            per = {k: window_stats(res.records, span, k, sc.slo_p95_s, sc.client_timeout_s, True) for k in kinds}
            total = window_stats(res.records, span, kinds[0], sc.slo_p95_s, sc.client_timeout_s, True)
            offered = {k: per[k].requests / (span[1] - span[0]) for k in kinds}
            served = {k: per[k].goodput for k in kinds}
            fair = max_min_shares(offered, sum(served.values()))
            index = jain_index(served[k] / fair[k] for k in kinds if fair[k] > 0)
            cells = " | ".join(f"{per[k].p99:.2f} | {per[k].goodput:.2f}" for k in kinds)
            print(f"| {sc.name} | {key} ({MODES[key]}) | {cells} | {total.tokens_per_s:.0f} | {index:.3f} |",
                  flush=True)
    if plot_path and drawn:
        plot(drawn, kinds, flood, plot_path)


def tradeoff(rates=(None, 300, 200, 120)) -> None:
    """The fair policy with tenant A's requests per minute capped (burst 2 s): per-tenant p99 / goodput and the pool's
    output tokens/s in the flood window."""
    sc = Scenario.load(SCENARIOS[0])
    capacity = sc.fleet_capacity()
    kinds = [k.name for k in sc.workload.kinds]
    span = sc.report_windows()[WINDOW]
    with open(sc.policies["e"], encoding="utf-8") as f:
        base = yaml.safe_load(f)
    print("| tenant-a requests/min | " + " | ".join(f"{k} p99 s / goodput" for k in kinds) + " | pool output tok/s |")
    print("|---|" + "---:|" * (len(kinds) + 1))
    for rpm in rates:
        doc = yaml.safe_load(yaml.safe_dump(base, sort_keys=False))
        for tenant in doc["tenants"]:
            if tenant["name"] == "tenant-a" and rpm:
                tenant.update(requests_per_minute=rpm, burst_s=2)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        res = what_if(sc, f.name, capacity)
        per = {k: window_stats(res.records, span, k, sc.slo_p95_s, sc.client_timeout_s, True) for k in kinds}
        cells = " | ".join(f"{per[k].p99:.2f} / {per[k].goodput:.2f}" for k in kinds)
        print(f"| {rpm or 'none'} | {cells} | {per[kinds[0]].tokens_per_s:.0f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modes", nargs="?", default="cde", help="mode keys to run (c fifo, d round_robin, e fair)")
    ap.add_argument("--plot", metavar="PNG", help="also draw each tenant's goodput over time into PNG")
    ap.add_argument("--tradeoff", action="store_true", help="the fair policy with tenant A's rate capped instead")
    args = ap.parse_args()
    if args.tradeoff:
        tradeoff()
    else:
        main(args.modes, plot_path=args.plot)
