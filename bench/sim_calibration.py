"""Closed-loop sweep of the simulator against the H100 reference table, measured over real HTTP.

Starts `extproc sim` in its own process (so the load generator's CPU does not slow the simulated GPU), runs the
load generator at each concurrency with ~512-token prompts and max_tokens 256 (non-streaming chat), and prints
measured vs reference with ratios. Times are converted to simulated seconds (x --speed).

    .venv/bin/python bench/sim_calibration.py --speed 10
    .venv/bin/python bench/sim_calibration.py --offline        # engine only, no HTTP: seconds, for fitting
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

from extproc.tools.loadgen import LoadClient, RequestKind, Workload, run_closed_loop, summarize
from extproc.tools.sim.offline import closed_loop
from extproc.tools.sim.profile import load_profile

# concurrency: (aggregate output tokens/s, p50 s, p99 s), from the mission's reference table.
REFERENCE = {4: (890, 0.62, 0.89), 8: (1540, 0.78, 1.34), 16: (2210, 1.12, 2.18), 32: (2680, 1.89, 4.12),
             64: (2910, 3.72, 9.60)}
TOLERANCE = {"tokens/s": 0.15, "p50": 0.15, "p99": 0.30}
PROMPT_TOKENS, MAX_TOKENS = 512, 256


def start_simulator(profile: str, speed: float, seed: int) -> tuple[subprocess.Popen, str]:
    """Run `extproc sim` on a free port and wait for its ready line."""
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "sim", "--profile", profile, "--port", "0",
                             "--speed", str(speed), "--seed", str(seed)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("sim ready:"):
        proc.kill()
        raise RuntimeError(f"simulator did not start: {line!r}")
    return proc, line.split()[2]


async def measure_point(url: str, concurrency: int, speed: float, sim_seconds: float, warmup_s: float,
                        seed: int) -> dict:
    """One closed-loop point; returns the loadgen summary in simulated seconds."""
    workload = Workload([RequestKind(endpoint="chat", prompt_tokens=PROMPT_TOKENS, max_tokens=MAX_TOKENS)])
    async with LoadClient([url], timeout_s=120, time_scale=speed, pool=concurrency) as client:
        await run_closed_loop(client, workload, concurrency, duration_s=(warmup_s + sim_seconds) / speed, seed=seed)
    return summarize(client.records, (warmup_s, warmup_s + sim_seconds))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_table(rows: list[tuple[int, float, float, float]], title: str) -> bool:
    """Measured vs reference per cell with ratios; returns whether every cell is within tolerance."""
    print(title)
    print("| concurrency | tokens/s (ref) | ratio | p50 ms (ref) | ratio | p99 ms (ref) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for c, tps, p50, p99 in rows:
        ref = REFERENCE[c]
        ratios = (tps / ref[0], p50 / ref[1], p99 / ref[2])
        for ratio, tol in zip(ratios, TOLERANCE.values()):
            ok &= abs(ratio - 1) <= tol
        print(f"| {c} | {tps:,.0f} ({ref[0]:,}) | {ratios[0]:.2f} | {p50 * 1000:,.0f} ({ref[1] * 1000:,.0f}) | "
              f"{ratios[1]:.2f} | {p99 * 1000:,.0f} ({ref[2] * 1000:,.0f}) | {ratios[2]:.2f} |")
    print(f"within tolerance (tokens/s and p50 ±15%, p99 ±30%): {'yes' if ok else 'NO'}")
    return ok


def run_offline(args: argparse.Namespace) -> bool:
    profile = load_profile(args.profile)
    rows = []
    for c in args.concurrency:
        point = closed_loop(profile, c, PROMPT_TOKENS, MAX_TOKENS, requests=args.requests, seed=args.seed)
        rows.append((c, point.tokens_per_s, point.p50_s, point.p99_s))
    return print_table(rows, f"engine only (no HTTP), {args.requests} requests per point, profile {profile.name}")


async def run_http(args: argparse.Namespace) -> bool:
    proc, url = start_simulator(args.profile, args.speed, args.seed)
    try:
        rows = []
        started = time.monotonic()
        cpu0 = cpu_seconds(proc.pid)
        for c in args.concurrency:
            # Enough simulated time for ~requests completions at this point's reference rate.
            sim_seconds = args.requests * 155 / REFERENCE[c][0]
            s = await measure_point(url, c, args.speed, sim_seconds, warmup_s=args.warmup, seed=args.seed)
            rows.append((c, s["output_tokens_per_s"], s["latency_p50"], s["latency_p99"]))
            print(f"  c={c}: {s['ok']} ok requests, errors {s['errors'] or 'none'}", file=sys.stderr)
        wall = time.monotonic() - started
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(5)
    ok = print_table(rows, f"HTTP closed loop, --speed {args.speed:g}, ~{args.requests} requests per point, "
                           f"profile {args.profile}")
    print(f"wall {wall:.0f} s; simulator process CPU {cpu:.1f} s ({100 * cpu / wall:.0f}% of one core)")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="h100-llama70b-awq")
    parser.add_argument("--speed", type=float, default=10.0, help="simulator speed (simulated s per real s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=sorted(REFERENCE))
    parser.add_argument("--requests", type=int, default=1500, help="about this many measured requests per point")
    parser.add_argument("--warmup", type=float, default=10.0, help="simulated seconds left out of each point")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--offline", action="store_true", help="drive the engine directly in simulated time")
    args = parser.parse_args()
    ok = run_offline(args) if args.offline else asyncio.run(run_http(args))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
