"""Issue 19's targets for the pool-wide limit (mode d) over several seeds of several scenarios, in the what-if.

One seed is one path through a controller that reacts to its own past: a change that helps the demo's seed can
hurt the next one (kv-agents has 8-14 full-model interactive completions per 5 s, so its worst 10 s window is
nearly its slowest request). Judge a change of the controller or of a default here, not on one run.

`python bench/seeds.py [--limit KEY=VALUE ...] [--scenario NAME:SEED,SEED ...] [--instances N]` runs d and Envoy's
adaptive_concurrency model (b) on every scenario and seed (default: spike 7-9, kv-agents 19-22, ramp 23-26),
with the scenario's own d policy; `--limit` overrides a field of every enabled `pools.<name>.limit` in it (e.g.
`--limit target=0.75`). It prints per seed the worst-window p99 and full-model goodput (d against b) of each
overload window, and the requests refused or degraded in the phases at or under 60% load, then a summary line:
the mean and largest worst-window p99, d's goodput over b's, and how many of the two spike targets were missed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Iterator

import yaml

from extproc.tools.demo import what_if_stats
from extproc.tools.demo.results import calm_windows, spike_windows
from extproc.tools.demo.scenario import Scenario

DEFAULT = {"spike": (7, 8, 9), "kv-agents": (19, 20, 21, 22), "ramp": (23, 24, 25, 26)}


def with_seed(name: str, seed: int, folder: Path, limit: dict) -> Scenario:
    """The scenario with its seed set, and its d policy with the limit overrides, written into `folder`."""
    doc = yaml.safe_load(Path(f"scenarios/{name}.yaml").read_text(encoding="utf-8"))
    doc["seed"] = seed
    if limit:
        base = (doc.get("policies") or {}).get("d", "policies/demo-full.yaml")
        policy = yaml.safe_load(Path(base).read_text(encoding="utf-8"))
        for pool in policy.get("pools", {}).values():
            if pool.get("limit", {}).get("enabled"):
                pool["limit"].update(limit)
        out = folder / f"{name}-d.yaml"
        out.write_text(yaml.safe_dump(policy, sort_keys=False), encoding="utf-8")  # class order is priority
        doc["policies"] = {**(doc.get("policies") or {}), "d": str(out)}
    path = folder / f"{name}-{seed}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return Scenario.load(str(path))


def seeded(scenarios: list[str], default: dict[str, tuple[int, ...]],
           limit: dict) -> Iterator[tuple[str, int, Scenario]]:
    """(name, seed, scenario) for each `NAME:SEED,SEED` of `scenarios` (else `default`), written to a folder that
    lasts while the caller iterates."""
    sets = {name: tuple(int(s) for s in seeds.split(",")) for name, seeds in
            (item.split(":", 1) for item in scenarios)} or default
    with tempfile.TemporaryDirectory() as tmp:
        for name, seeds in sets.items():
            for seed in seeds:
                yield name, seed, with_seed(name, seed, Path(tmp), limit)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                   help="override a pools.<name>.limit field of d's policy (repeat)")
    p.add_argument("--instances", type=int, default=1, metavar="N",
                   help="d's policy run by N ext_proc instances, each its own core (what-if InstancesAdmitter)")
    p.add_argument("--scenario", action="append", default=[], metavar="NAME:SEED,SEED",
                   help="scenario (scenarios/NAME.yaml) and seeds (repeat; default: spike, kv-agents, ramp)")
    args = p.parse_args()
    limit = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.limit)}
    worst, ratio, calm, missed, checks = [], [], 0, 0, 0
    print("| scenario | seed | window: d worst-window p99 s, d / b full-model goodput req/s | refused or degraded "
          "at <= 60% load |")
    print("|---|---:|---|---:|")
    for name, seed, sc in seeded(args.scenario, DEFAULT, limit):
        st = what_if_stats(sc, "b,d", args.instances)
        parts = []
        for w in spike_windows(sc):
            d, b = st["d"][w], st["b"][w]
            worst.append(d.p99_worst_window)
            ratio.append(d.goodput / b.goodput if b.goodput else float("inf"))
            # As results.targets judges them: a NaN worst window (d served nothing there) is no reached target.
            missed += (not d.p99_worst_window <= sc.slo_p95_s) + (d.goodput < b.goodput)
            checks += 2
            parts.append(f"{w}: {d.p99_worst_window:.2f}, {d.goodput:.2f} / {b.goodput:.2f}")
        n = sum(st["d"][w].refused + st["d"][w].degraded for w in calm_windows(sc))
        calm += n
        print(f"| {name} | {seed} | {'; '.join(parts)} | {n} |", flush=True)
    print(f"\nworst-window p99: mean {statistics.mean(worst):.2f} s, largest {max(worst):.2f} s; d / b full-model "
          f"goodput: mean {statistics.mean(ratio):.2f}, lowest {min(ratio):.2f}; refused or degraded at <= 60% "
          f"load: {calm}; spike targets missed: {missed} of {checks}" + (f" (limit: {limit})" if limit else ""))


if __name__ == "__main__":
    main()
