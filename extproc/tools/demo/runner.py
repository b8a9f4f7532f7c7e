"""Run one mode: start simulated replicas + Envoy (+ ext_proc), replay the scenario's arrivals, stop everything."""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from extproc.tools.loadgen import LoadClient, RequestRecord, run_open_loop
from extproc.tools.stack import Stack
from extproc.tools.stats import percentile

from .modes import Mode, render_policy
from .results import served_latency
from .scenario import Scenario

PROGRESS_WINDOW_S = 10.0  # simulated seconds of completions behind the "current p99" in progress lines
MAX_IN_FLIGHT = 8000  # client-side bound; far above what the fleet holds even with no admission control


@dataclass
class ModeResult:
    mode: Mode
    records: list[RequestRecord]
    wall_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process during the replay
    # Requests the replicas of the other pools (the small model) finished, by their own count: with the clients
    # all asking for the first pool's model, these were degraded.
    served_elsewhere: int = 0


class Interrupt:
    """Set by `extproc demo`'s signal handler the moment a Ctrl-C, SIGTERM or SIGHUP arrives. Its cancel of the
    demo's task lands at the next await only, and starting or stopping a stack is synchronous: a signal during the
    previous mode's stop, or during a start, let the next mode's whole stack (or the rest of this one) start before
    it was stopped. Nothing starts once it is set (check())."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def check(self, what: str) -> None:
        """Raises once a signal came, before `what` (say "mode d started", "envoy ready")."""
        if self.signum is not None:
            raise asyncio.CancelledError(f"{signal.Signals(self.signum).name} came before {what}")


@dataclass
class RunSettings:
    speed: float
    capacity: float  # fleet requests/s the phases' rates multiply
    workdir: Path
    progress_every_s: float = 5.0  # wall seconds between progress lines
    print_fn: object = print
    interrupt: Interrupt = field(default_factory=Interrupt)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + (fields[7] if len(fields) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def start_pool(stack: Stack, name: str, profile: str, replicas: int, model_names: list[str], speed: float,
               seed: int, timeout_s: float = 30.0, scheduling_policy: str | None = None,
               lora_modules: list[str] = (), max_loras: int = 1) -> list[tuple[str, int]]:
    """`extproc sim` for one pool as a process of `stack` (so stack.stop() ends it); returns its endpoints.
    `lora_modules`: adapter names served as `--lora-modules NAME=/adapters/NAME`, with `--max-loras`."""
    argv = [sys.executable, "-m", "extproc.cli", "sim", "--profile", profile, "--replicas", str(replicas),
            "--port", "0", "--speed", str(speed), "--seed", str(seed)]
    if scheduling_policy:
        argv += ["--scheduling-policy", scheduling_policy]
    for model in model_names:
        argv += ["--model-name", model]
    if lora_modules:
        argv += ["--lora-modules", *(f"{a}=/adapters/{a}" for a in lora_modules), "--max-loras", str(max_loras)]
    log = stack.workdir / f"sim-{name}.log"
    seen = log.stat().st_size if log.exists() else 0  # logs are appended to: skip an earlier run's ready line
    proc = stack.spawn(f"sim-{name}", argv)
    deadline, check = time.monotonic() + timeout_s, stack.checker(f"{proc.name} ready")
    while time.monotonic() < deadline:
        if check is not None:
            check()
        with open(proc.log_path, "rb") as f:
            f.seek(seen)
            lines = f.read().decode(errors="replace").splitlines()
        for line in lines:
            if line.startswith("sim ready:"):
                urls = [u for u in line.split()[2:] if u.startswith("http://")]
                return [(u[7:].rpartition(":")[0], int(u.rpartition(":")[2])) for u in urls]
        if not proc.alive():
            break
        time.sleep(0.05)
    raise RuntimeError(f"simulator for pool {name} did not start:\n{proc.tail()}")


def build_stack(mode: Mode, scenario: Scenario, settings: RunSettings) -> Stack:
    """A started stack for `mode`: the scenario's simulated pools, Envoy, and the ext_proc if the mode has one."""
    workdir = settings.workdir / f"mode-{mode.key}"
    adaptive = mode.adaptive if mode.stack_mode == "adaptive" else None  # simulated seconds: Envoy's divided by speed
    stack = Stack(workdir, {}, mode=mode.stack_mode, lb_policy=mode.lb_policy, adaptive=adaptive,
                  speed=settings.speed, check=settings.interrupt.check)
    try:
        for i, pool in enumerate(scenario.pools):
            stack.pools[pool.name] = start_pool(stack, pool.name, pool.profile, pool.replicas, pool.model_names,
                                                settings.speed, scenario.seed + 100 * i,
                                                scheduling_policy=pool.scheduling_policy,
                                                lora_modules=pool.lora_modules, max_loras=pool.max_loras)
        if mode.policy:  # rendered once the replicas are up: its `pools` scrape them
            stack.policy_path = render_policy(mode.policy, settings.speed, workdir / "policy.yaml", stack.pools)
        stack.start()
    except BaseException:
        stack.stop()
        raise
    return stack


class Progress:
    """Plain-text progress lines: phase, simulated time, requests sent / completed, current interactive p99."""

    def __init__(self, mode: Mode, scenario: Scenario, arrivals: list[float], client: LoadClient,
                 settings: RunSettings):
        self.mode, self.scenario, self.arrivals, self.client, self.settings = mode, scenario, arrivals, client, settings

    def line(self) -> str:
        s = self.settings
        now = (time.monotonic() - self.client.t0) * s.speed
        total = self.scenario.duration_s
        phase = self.scenario.phase_at(now).name if now < total else "drain"
        sent = bisect.bisect_right(self.arrivals, now)
        records = self.client.records
        recent = sorted(self.recent_latencies(now))
        refused = sum(1 for r in records if r.status in (429, 503))
        p99 = percentile(recent, 99)
        p99_text = f"{p99:5.1f}s" if recent else "   - "
        return (f"[{self.mode.key}] {phase:<7} t={min(now, total):5.0f}/{total:.0f}s  sent {sent:5d}  "
                f"done {len(records):5d}  refused {refused:5d}  {self.scenario.slo_class} p99 "
                f"(last {PROGRESS_WINDOW_S:.0f}s) {p99_text}")

    def recent_latencies(self, now: float) -> list[float]:
        """The SLO kinds' latencies of the requests that ended in the last PROGRESS_WINDOW_S, as the report counts
        them (a timeout at the timeout: until 2026-12-06 only answers counted, and no control's collapse read as a
        few seconds). Records are appended as requests end, so the walk back stops at the first older one."""
        out = []
        for r in reversed(self.client.records):
            if r.latency is None:  # refused by the load generator itself, at its arrival
                continue
            if r.start + r.latency < now - PROGRESS_WINDOW_S:
                break
            latency = served_latency(r, self.scenario.client_timeout_s) if r.kind in self.scenario.slo_kinds else None
            if latency is not None:
                out.append(latency)
        return out

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.progress_every_s)
            self.settings.print_fn(self.line(), flush=True)


async def replay(mode: Mode, scenario: Scenario, stack: Stack, settings: RunSettings) -> ModeResult:
    """Send the scenario's arrivals (same seed for every mode) through `stack`; wait for every request to end."""
    schedule = scenario.schedule(settings.capacity)
    arrivals = [p.at for p in scenario.arrivals(settings.capacity)]  # a session counts once: its start
    pids = {p.name: p.popen.pid for p in stack.processes}
    pids["loadgen"] = os.getpid()
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    machine0 = machine_cpu_seconds()
    wall0 = time.monotonic()
    async with LoadClient([stack.url], timeout_s=scenario.client_timeout_s / settings.speed,
                          time_scale=settings.speed, pool=MAX_IN_FLIGHT) as client:
        progress = asyncio.create_task(Progress(mode, scenario, arrivals, client, settings).run())
        faults = asyncio.create_task(apply_events(scenario, stack, client, settings))
        try:
            await run_open_loop(client, scenario.workload, schedule, seed=scenario.seed, max_in_flight=MAX_IN_FLIGHT,
                                phase_weights=scenario.phase_weights())
        finally:
            progress.cancel()
            faults.cancel()
    wall = time.monotonic() - wall0
    cpu = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
    # Everything else on the machine in the same time (other jobs steal CPU from the simulated GPUs).
    cpu["other processes"] = max(0.0, machine_cpu_seconds() - machine0 - sum(cpu.values()))
    others = [ep for pool in scenario.pools[1:] for ep in stack.pools[pool.name]]
    return ModeResult(mode, client.records, wall, cpu, served_elsewhere=sum(map(finished_requests, others)))


async def apply_events(scenario: Scenario, stack: Stack, client: LoadClient, settings: RunSettings) -> None:
    """The scenario's fleet events, each at its simulated time: POST its fault to the replica's /sim/fault."""
    for e in sorted(scenario.events, key=lambda e: e.at_s):
        await asyncio.sleep(max(0.0, client.t0 + e.at_s / settings.speed - time.monotonic()))
        host, port = stack.pools[e.pool][e.replica]
        body = json.dumps(e.fault).encode()
        req = urllib.request.Request(f"http://{host}:{port}/sim/fault", data=body, method="POST",
                                     headers={"content-type": "application/json"})
        await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=5).read())
        settings.print_fn(f"[{e.at_s:g}s] fault on {e.pool}[{e.replica}]: {e.fault}", flush=True)


def finished_requests(endpoint: tuple[str, int]) -> int:
    """Requests a simulated replica finished (any reason), from its /sim/state."""
    with urllib.request.urlopen(f"http://{endpoint[0]}:{endpoint[1]}/sim/state", timeout=5) as resp:
        return sum(json.load(resp)["finished"].values())


async def run_mode(mode: Mode, scenario: Scenario, settings: RunSettings) -> ModeResult:
    stack = build_stack(mode, scenario, settings)
    try:
        return await replay(mode, scenario, stack, settings)
    finally:
        stack.stop()

