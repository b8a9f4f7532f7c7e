"""The demo scenario YAML: fleet, request mix, load phases (as multiples of fleet capacity), SLO."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.loadgen import Workload
from extproc.sim.profile import load_profile

from .capacity import closed_loop_mix


@dataclass(frozen=True)
class Pool:
    """Simulated replicas behind one Envoy cluster."""

    name: str
    profile: str
    replicas: int
    model_names: list[str]


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float  # simulated seconds
    rate: float  # multiple of the fleet capacity


@dataclass
class Scenario:
    name: str
    description: str
    seed: int
    pools: list[Pool]
    phases: list[Phase]
    workload: Workload
    slo_class: str
    slo_p95_s: float
    client_timeout_s: float
    capacity: float | str = "auto"  # requests/s of the first pool, or "auto"
    capacity_concurrency: int = 32

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        return cls.from_dict(yaml.safe_load(Path(path).read_text(encoding="utf-8")))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scenario:
        pools = [Pool(name, p["profile"], int(p.get("replicas", 1)), list(p.get("model_names", [])))
                 for name, p in d["pools"].items()]
        phases = [Phase(p["name"], float(p["duration_s"]), float(p["rate"])) for p in d["phases"]]
        if not pools or not phases:
            raise ValueError("a scenario needs at least one pool and one phase")
        return cls(name=d.get("name", "scenario"), description=d.get("description", ""), seed=int(d.get("seed", 0)),
                   pools=pools, phases=phases, workload=Workload.from_dict(d["workload"]),
                   slo_class=d.get("slo", {}).get("class", "interactive"),
                   slo_p95_s=float(d.get("slo", {}).get("p95_s", 2.0)),
                   client_timeout_s=float(d.get("client_timeout_s", 60.0)),
                   capacity=d.get("capacity", "auto"), capacity_concurrency=int(d.get("capacity_concurrency", 32)))

    def shortened(self, phase_s: float) -> Scenario:
        """The same scenario with every phase cut to `phase_s` simulated seconds (tests, quick looks)."""
        phases = [Phase(p.name, phase_s, p.rate) for p in self.phases]
        return Scenario(**{**self.__dict__, "phases": phases})

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def fleet_capacity(self) -> float:
        """Requests/s the first pool sustains with this mix (measured in the engine model unless given)."""
        if self.capacity != "auto":
            return float(self.capacity)
        main = self.pools[0]
        point = closed_loop_mix(load_profile(main.profile), self.workload, self.capacity_concurrency,
                                requests=2000, seed=self.seed)
        return point.requests_per_s * main.replicas

    def schedule(self, capacity: float) -> list[tuple[float, float]]:
        """(duration_s, requests/s) per phase, for extproc.loadgen.run_open_loop."""
        return [(p.duration_s, p.rate * capacity) for p in self.phases]

    def phase_at(self, t: float) -> Phase:
        start = 0.0
        for p in self.phases:
            if t < start + p.duration_s:
                return p
            start += p.duration_s
        return self.phases[-1]

    def window(self, phase_name: str) -> tuple[float, float]:
        """Start and end (simulated s) of the named phase."""
        start = 0.0
        for p in self.phases:
            if p.name == phase_name:
                return start, start + p.duration_s
            start += p.duration_s
        raise KeyError(f"no phase {phase_name!r} (phases: {', '.join(p.name for p in self.phases)})")
