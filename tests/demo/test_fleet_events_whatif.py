"""Fleet events in the engine-only what-if that change which replicas the load balancer has: a replica drained
(`{"draining": 1}`) takes no new request, and one put back (`{"draining": 0}`, as the simulator's /health answers 200
again and Envoy's health checks add it: a replica an autoscaler adds) takes its share again."""

from dataclasses import replace
from pathlib import Path

from extproc.tools.demo.baselines import admitter_for
from extproc.tools.demo.modes import MODES
from extproc.tools.demo.scenario import FleetEvent, Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.sim.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def test_a_drained_replica_put_back_takes_requests_again(monkeypatch):
    scenario = Scenario.load(ROOT / "scenarios" / "spike.yaml")
    capacity = scenario.fleet_capacity()
    sent = []  # (when, the engine) of every request the 70B replicas took
    add_request = Engine.add_request

    def recording(self, prompt_tokens, max_tokens, now, **kw):
        if self.profile.name == scenario.pools[0].profile:
            sent.append((now, self))
        return add_request(self, prompt_tokens, max_tokens, now, **kw)

    monkeypatch.setattr(Engine, "add_request", recording)
    out, back = FleetEvent(0.0, "vllm_llama70b", 1, {"draining": 1.0}), FleetEvent(90.0, "vllm_llama70b", 1,
                                                                                    {"draining": 0.0})
    scenario = replace(scenario, events=(out, back))
    what_if(scenario, admitter_for(MODES["a"]), capacity)
    engines = {e for _, e in sent}
    assert len(engines) == 2
    first = sent[0][1]  # replica 0 took the first request: replica 1 was out
    assert all(e is first for t, e in sent if t < 90.0)
    assert sum(1 for t, e in sent if t >= 90.0 and e is not first) > 0.3 * sum(1 for t, _ in sent if t >= 90.0)
