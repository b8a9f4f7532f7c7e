"""vLLM priority scheduling in the what-if: a pool's `scheduling_policy` and the class's `vllm_priority` reach the
engine model as they reach a real replica (the ext_proc sets the body's `priority`; the sim orders by it)."""

import pytest
import yaml

from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.sim.engine import Engine

SCENARIO = "scenarios/spike.yaml"


def prioritised(tmp_path, name: str = "policies/demo-full.yaml") -> str:
    """The policy with interactive 0, batch 10."""
    doc = yaml.safe_load(open(name, encoding="utf-8"))
    doc["classes"]["interactive"]["vllm_priority"] = 0
    doc["classes"]["batch"]["vllm_priority"] = 10
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))  # class order is priority order
    return str(path)


def engine_priorities(monkeypatch) -> list[tuple[str, int]]:
    """(scheduling policy, priority) of every request the what-if's engines take."""
    seen = []
    add = Engine.add_request

    def spy(self, *args, priority: int = 0, **kwargs):
        seen.append((self.profile.scheduling_policy, priority))
        return add(self, *args, priority=priority, **kwargs)

    monkeypatch.setattr(Engine, "add_request", spy)
    return seen


def test_a_pool_takes_vllms_scheduling_policy_from_the_scenario():
    doc = yaml.safe_load(open(SCENARIO, encoding="utf-8"))
    assert [p.scheduling_policy for p in Scenario.from_dict(doc).pools] == [None, None]
    doc["pools"]["vllm_llama70b"]["scheduling_policy"] = "priority"
    assert [p.scheduling_policy for p in Scenario.from_dict(doc).pools] == ["priority", None]
    doc["pools"]["vllm_llama70b"]["scheduling_policy"] = "lifo"
    with pytest.raises(ValueError, match="pools.vllm_llama70b.scheduling_policy"):
        Scenario.from_dict(doc)
    s = Scenario.load(SCENARIO).with_scheduling_policy("priority")
    assert {p.scheduling_policy for p in s.pools} == {"priority"}


def test_admitted_requests_reach_the_engine_with_their_class_priority(tmp_path, monkeypatch):
    s = Scenario.load(SCENARIO).shortened(8).with_scheduling_policy("priority")
    capacity = s.fleet_capacity()
    seen = engine_priorities(monkeypatch)
    res = what_if(s, prioritised(tmp_path), capacity)
    assert {pol for pol, _ in seen} == {"priority"}
    # Each class's priority: batch requests carry 10, interactive 0 (a degrade keeps its class's).
    assert sorted({p for _, p in seen}) == [0, 10]
    started = [r for r in res.records if r.status != 429 and r.status != 503]
    assert sum(1 for _, p in seen if p == 10) <= sum(1 for r in started if r.kind == "batch")


def test_without_vllm_priority_every_request_goes_with_vllms_default(monkeypatch):
    s = Scenario.load(SCENARIO).shortened(5)
    capacity = s.fleet_capacity()
    seen = engine_priorities(monkeypatch)
    what_if(s, "policies/demo-full.yaml", capacity)
    assert seen and {pol for pol, _ in seen} == {"fcfs"} and {p for _, p in seen} == {0}


def test_fcfs_ignores_the_priorities_so_the_numbers_do_not_move(tmp_path):
    s = Scenario.load(SCENARIO).shortened(8)
    capacity = s.fleet_capacity()
    plain = what_if(s, "policies/demo-full.yaml", capacity).records
    with_priority = what_if(s, prioritised(tmp_path), capacity).records
    assert [(r.start, r.status, r.latency) for r in plain] == [(r.start, r.status, r.latency)
                                                               for r in with_priority]


def test_the_demo_starts_a_priority_pool_with_the_flag(pool_argv):
    for policy, flag in (("priority", ["--scheduling-policy", "priority"]), (None, [])):
        argv = pool_argv("p", "h100-llama8b", 1, [], 1.0, 0, scheduling_policy=policy)
        assert (argv[-2:] == flag) if flag else "--scheduling-policy" not in argv
