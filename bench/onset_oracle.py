"""How far the pool-wide limit (mode d) is from a clairvoyant one at each overload's onset, in the what-if.

`python bench/onset_oracle.py [--scenario NAME:SEED,SEED ...] [--hold S] [--caps L,L,...]` runs d on each seed as
shipped, then once per cap L with the limit held at or under L (the pool's unit) for `--hold` seconds from the
exact second each overload starts, and otherwise left to its own controller. It prints the worst-window p99 and
full-model goodput of each overload window, and the requests refused or degraded at <= 60% load.

What it tells apart: an onset miss that a limit set in time would have avoided (the controller is short of knowing
when the overload starts: for its first seconds a spike reads as a calm phase's bursts) from one the pool cannot
serve within the SLO at any limit (the work already running when it starts). No causal controller reaches the
clairvoyant row; it bounds what a better onset detector could give (docs/overload.md).
"""

from __future__ import annotations

import argparse

from seeds import seeded

from extproc.policy import pool
from extproc.tools.demo import what_if_stats
from extproc.tools.demo.results import calm_windows, overload_onsets, spike_windows

DEFAULT = {"spike": (8, 9), "kv-agents": (19,)}


class HeldAtOnsets:
    """Holds every pool's limit at or under `cap` for the spans given (cap None: as shipped), by wrapping
    PoolLimit.update."""

    def __init__(self):
        self.spans: list[tuple[float, float]] = []
        self.cap: float | None = None
        shipped = pool.PoolLimit.update

        def update(limit: pool.PoolLimit, now: float, *args, **kwargs) -> float:
            value = shipped(limit, now, *args, **kwargs)
            if self.cap is not None and value > self.cap and any(t0 <= now < t1 for t0, t1 in self.spans):
                limit.limit = value = self.cap
            return value

        pool.PoolLimit.update = update


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", action="append", default=[], metavar="NAME:SEED,SEED",
                   help="scenario (scenarios/NAME.yaml) and seeds (repeat; default: spike 8,9 and kv-agents 19)")
    p.add_argument("--hold", type=float, default=10.0, metavar="S", help="seconds held from each onset (10)")
    p.add_argument("--caps", default="16000,20000,22000", metavar="L,L",
                   help="the caps to hold, in the pool's unit (default 16000,20000,22000 tokens)")
    args = p.parse_args()
    held = HeldAtOnsets()
    print("| scenario | seed | limit from each onset | window: worst-window p99 s, full-model goodput req/s | "
          "refused or degraded at <= 60% load |")
    print("|---|---:|---|---|---:|")
    for name, seed, sc in seeded(args.scenario, DEFAULT, {}):
        held.spans = [(t, t + args.hold) for t in overload_onsets(sc)]
        for cap in [None] + [float(c) for c in args.caps.split(",")]:
            held.cap = cap
            st = what_if_stats(sc, "d")["d"]
            parts = "; ".join(f"{w}: {st[w].p99_worst_window:.2f}, {st[w].goodput:.2f}" for w in spike_windows(sc))
            calm = sum(st[w].refused + st[w].degraded for w in calm_windows(sc))
            how = "its own" if cap is None else f"<= {cap:g} for {args.hold:g} s"
            print(f"| {name} | {seed} | {how} | {parts} | {calm} |", flush=True)


if __name__ == "__main__":
    main()
