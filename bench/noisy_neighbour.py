"""Noisy neighbour (issue 20) in the engine-model what-if: per-tenant p99 and full-model goodput during the flood.

`python bench/noisy_neighbour.py [--plot PNG]` runs scenarios/noisy-neighbour.yaml and its no-flood baseline under
the three policies the scenario names (c = fifo, d = round_robin, e = fair; they differ only in `fairness.mode`)
and prints the table of docs/demo.md's "Noisy neighbour" section. Both scenarios run at the flood scenario's
measured capacity. With --plot it also draws each tenant's full-model goodput over time, fifo against fair, in the
flood scenario (docs/img/noisy-neighbour.png). With --tradeoff it runs the fair policy on the flood scenario with
tenant A held to a few request rates (`requests_per_minute`) and prints B's and C's p99 against the pool's output:
how far A must be held back before B's and C's p99 return to their no-flood level. With --seeds it prints B's and
C's flood-window p99 over seeds 20-25, flood against no flood, and pooled over the seeds. With --backlogged it runs
scenarios/tenants-backlogged.yaml instead: each tenant's share of the GPU-seconds when every tenant waits (with
--scenario, another scenario of backlogged tenants: scenarios/tenants-output-mix.yaml).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

import yaml

from extproc.policy.fairness import jain_index
from extproc.tools.demo.results import engine_time, rolling_rate, served_work, window_stats
from extproc.tools.plotting import SKIPPED, pyplot
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import PolicyAdmitter, what_if
from extproc.tools.stats import percentile

SCENARIOS = ("scenarios/noisy-neighbour.yaml", "scenarios/noisy-neighbour-baseline.yaml")
MODES = {"c": "fifo", "d": "round_robin", "e": "fair"}
WINDOW = "flood"


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
            total = window_stats(res.records, span, kinds, sc.slo_p95_s, sc.client_timeout_s, True)
            index = total.fairness_index
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


def over_seeds(seeds=range(20, 26), mode: str = "e") -> None:
    """B's and C's flood-window latency over several seeds, flood against no flood (`mode`'s policy): each seed's
    p99 (about 100 answers a tenant: its second slowest) and the p95 / p99 of all seeds' answers pooled."""
    flood, base = (Scenario.load(p) for p in SCENARIOS)
    capacity = flood.fleet_capacity()
    span = flood.report_windows()[WINDOW]
    kinds = ("tenant-b", "tenant-c")
    pooled: dict[tuple[str, str], list[float]] = {}
    print("| seed | " + " | ".join(f"{k} p99 s, flood / no flood" for k in kinds) + " |")
    print("|---:|" + "---|" * len(kinds))
    for seed in seeds:
        cells = {k: [] for k in kinds}
        for sc in (flood, base):
            run = dataclasses.replace(sc, seed=seed)
            records = what_if(run, run.policies[mode], capacity).records
            for k in kinds:
                cells[k].append(window_stats(records, span, k, sc.slo_p95_s, sc.client_timeout_s, True).p99)
                pooled.setdefault((sc.name, k), []).extend(
                    r.latency for r in records if r.kind == k and span[0] <= r.start < span[1] and r.ok
                    and not r.degraded)
        print(f"| {seed} | " + " | ".join(f"{cells[k][0]:.2f} / {cells[k][1]:.2f}" for k in kinds) + " |", flush=True)
    for k in kinds:
        f, b = (sorted(pooled[(sc.name, k)]) for sc in (flood, base))
        print(f"{k}, all seeds pooled ({len(f)} / {len(b)} answers): p95 {percentile(f, 95):.2f} / "
              f"{percentile(b, 95):.2f} s, p99 {percentile(f, 99):.2f} / {percentile(b, 99):.2f} s (flood / no flood)")


BACKLOGGED = "scenarios/tenants-backlogged.yaml"


def with_pool_limit(doc: dict) -> dict:
    """A tenants' policy with the 70B pool under a pool-wide limit instead of batch's cap of 16 (the cap stays as
    the playbook's bound, 128). The tenants' policies have batch alone (e358f62): a platform tier above it that none
    of them reaches gives the limit the SLO it steers on. tests/demo/test_fairness_whatif.py runs the same policies
    (two copies of this drifted once, and this bench stopped at its fourth row)."""
    doc["classes"] = {"interactive": {"max_concurrency": 48, "max_queue": 20, "max_wait_ms": 200,
                                      "slo_p95_ms": 2000}, **doc["classes"]}
    doc["classes"]["batch"]["max_concurrency"] = 128
    doc["pools"] = {"vllm_llama70b": {"limit": {"enabled": True}}}
    return doc


def pool_limited(path: str) -> str:
    """with_pool_limit of the policy file at `path`, in a temporary file."""
    with open(path, encoding="utf-8") as f:
        doc = with_pool_limit(yaml.safe_load(f))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return f.name


def backlogged(path: str = BACKLOGGED) -> None:
    """scenarios/tenants-backlogged.yaml: each tenant's share of the GPU-seconds served in the backlog window
    (full-model answers, at the cost coefficients the run's core learned: the units `fair` shares) and of their
    tokens (prompt + output), under batch's cap and under a pool-wide limit. Fairness index: Jain's over
    GPU-seconds per weight (every tenant is backlogged, so its weighted share is its due)."""
    sc = Scenario.load(path)
    capacity = sc.fleet_capacity()
    kinds = [k.name for k in sc.workload.kinds]
    t0, t1 = sc.report_windows()["backlog"]
    with open(sc.policies["e"], encoding="utf-8") as f:
        weights = {t["name"]: t.get("weight", 1.0) for t in yaml.safe_load(f)["tenants"]}
    due = {k: 100 * weights[k] / sum(weights[n] for n in kinds) for k in kinds}
    print(f"capacity {capacity:.2f} req/s; window: backlog ({t0:g}-{t1:g} s); weights "
          + ", ".join(f"{k} {weights[k]:g}" for k in kinds))
    print("| limit | mode | GPU-seconds share, % (" + " / ".join(f"{due[k]:.0f}" for k in kinds) + " due) | "
          "engine time share, % | tokens share, % | answers | p50 s | output tok/s | fairness index, GPU-s / engine |")
    print("|---|---|---|---|---|---|---|---:|---:|")
    for family, policy_of in (("batch cap 16", lambda p: p), ("pool-wide limit", pool_limited)):
        for key in "cde":
            admitter = PolicyAdmitter(policy_of(sc.policies[key]))
            res = what_if(sc, admitter, capacity)
            model = admitter.core.cost_models["llama-70b"]  # as the run left it: learned from its answers
            work = served_work(res.records, (t0, t1), kinds, model)
            gpu = {k: w[0] for k, w in work.items()}
            tokens = {k: w[1] for k, w in work.items()}
            engine = engine_time(res.records, (t0, t1), kinds, res.engine_work)
            total = sum(gpu.values()) or 1.0
            index = jain_index(gpu[k] / weights[k] for k in kinds)
            engine_index = jain_index(engine[k] / weights[k] for k in kinds)
            per = {k: window_stats(res.records, (t0, t1), k, sc.client_timeout_s, sc.client_timeout_s, True)
                   for k in kinds}
            output = per[kinds[0]].tokens_per_s
            print(f"| {family} | {key} ({MODES[key]}) | " + " / ".join(f"{100 * gpu[k] / total:.0f}" for k in kinds)
                  + " | " + " / ".join(f"{100 * engine[k] / (sum(engine.values()) or 1):.0f}" for k in kinds)
                  + " | " + " / ".join(f"{100 * tokens[k] / (sum(tokens.values()) or 1):.0f}" for k in kinds)
                  + " | " + " / ".join(str(work[k][2]) for k in kinds) + " | "
                  + " / ".join(f"{per[k].p50:.1f}" for k in kinds) + f" | {output:.0f} | {index:.3f} / {engine_index:.3f} |",
                  flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modes", nargs="?", default="cde", help="mode keys to run (c fifo, d round_robin, e fair)")
    ap.add_argument("--plot", metavar="PNG", help="also draw each tenant's goodput over time into PNG")
    ap.add_argument("--tradeoff", action="store_true", help="the fair policy with tenant A's rate capped instead")
    ap.add_argument("--backlogged", action="store_true",
                    help="scenarios/tenants-backlogged.yaml instead: each tenant's share of the GPU-seconds")
    ap.add_argument("--scenario", default=BACKLOGGED, metavar="YAML",
                    help="with --backlogged: another scenario of backlogged tenants (scenarios/tenants-output-mix.yaml)")
    ap.add_argument("--seeds", action="store_true",
                    help="B's and C's p99 over seeds 20-25, flood against no flood, each seed and pooled (fair)")
    args = ap.parse_args()
    if args.seeds:
        over_seeds()
    elif args.backlogged:
        backlogged(args.scenario)
    elif args.tradeoff:
        tradeoff()
    else:
        main(args.modes, plot_path=args.plot)
