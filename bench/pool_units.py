"""The pool-wide limit's unit (tokens vs requests) on every public scenario, in the engine-model what-if.

`python bench/pool_units.py` prints the table of docs/overload.md: interactive p99 and full-model vs degraded
goodput per compared window, for the scenario's own `d` policy with `unit: tokens` and with `unit: requests`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from extproc.tools.demo.results import scenario_stats
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if

SCENARIOS = ("spike", "kv-agents", "ramp", "shifted-fleet", "replica-removed")


def with_unit(policy: str, unit: str, folder: Path) -> str:
    doc = yaml.safe_load(Path(policy).read_text(encoding="utf-8"))
    for pool in doc.get("pools", {}).values():
        if pool.get("limit", {}).get("enabled"):
            pool["limit"]["unit"] = unit
    path = folder / f"{Path(policy).stem}-{unit}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")  # class order is priority
    return str(path)


def main() -> None:
    print("| scenario | window | unit | p99 s | worst 10 s window p99 s | full-model goodput req/s | "
          "degraded answers req/s |")
    print("|---|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in SCENARIOS:
            sc = Scenario.load(f"scenarios/{name}.yaml")
            policy = (sc.policies or {}).get("d", "policies/demo-full.yaml")
            capacity = sc.fleet_capacity()
            for unit in ("tokens", "requests"):
                res = what_if(sc, with_unit(policy, unit, Path(tmp)), capacity)
                stats = scenario_stats(res.records, sc, True)
                for window in sc.report_windows():
                    s = stats[window]
                    print(f"| {name} | {window} | {unit} | {s.p99:.2f} | {s.p99_worst_window:.2f} | "
                          f"{s.goodput:.2f} | {s.goodput_degraded:.2f} |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    main()
