"""What `extproc_class_fairness_index` reads through a scenario: the what-if's own admission core, the SLO class's
live index sampled every second, its mean and least over each report window, per mode.

`python bench/fairness_index.py [--modes cde] scenarios/noisy-neighbour.yaml scenarios/tenants-backlogged.yaml`
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.tools.demo.scenario import Scenario  # noqa: E402
from extproc.tools.demo.whatif import PolicyAdmitter, what_if  # noqa: E402


class IndexSampler(PolicyAdmitter):
    """The what-if's admission core, one class's live fairness index read every second."""

    def __init__(self, path: str, cls: str = "interactive"):
        super().__init__(path)
        self.cls = cls
        self.index: list[tuple[float, float]] = []

    def start(self, clock, pools):
        timers = super().start(clock, pools)
        q = self.core.limiters[self.cls].queue
        timers.append((1.0, lambda: self.index.append((clock(), q.fairness_index()))))
        return timers

    def read(self, t0: float, t1: float) -> list[float]:
        """The index as sampled from t0 to t1."""
        return [x for t, x in self.index if t0 <= t < t1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="+")
    ap.add_argument("--modes", default="cde", help="the scenario's policy modes to run")
    args = ap.parse_args()
    print("| scenario | mode | window | index, mean | index, least |")
    print("|---|---|---|---:|---:|")
    for path in args.scenarios:
        sc = Scenario.load(path)
        for key in args.modes:
            if key not in sc.policies:
                continue
            sampler = IndexSampler(sc.policies[key], sc.slo_class)
            what_if(sc, sampler, sc.fleet_capacity())
            for window, (t0, t1) in sc.report_windows().items():
                live = sampler.read(t0, t1)
                print(f"| {sc.name} | {key} | {window} | {sum(live) / len(live):.3f} | {min(live):.3f} |", flush=True)


if __name__ == "__main__":
    main()
