"""The what-if's several ext_proc instances (`extproc demo --what-if --instances N`): each its own core, requests
spread round robin, every completion reported to the instance that admitted it, nothing left held at the end."""

from pathlib import Path

from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import InstancesAdmitter, what_if

ROOT = Path(__file__).resolve().parents[2]


def test_each_instance_admits_its_share_and_gives_every_slot_back():
    scenario = Scenario.load(ROOT / "scenarios" / "spike.yaml").shortened(15)
    admitter = InstancesAdmitter(str(ROOT / "policies" / "demo-full.yaml"), 3)
    res = what_if(scenario, admitter, scenario.fleet_capacity())
    served = [r for r in res.records if r.ok]
    assert len(served) > 300
    for part in admitter.parts:
        gate = part.core.gates["vllm_llama70b"]
        assert part.core.tickets == {} and gate.inflight == 0 and gate.holding == 0
        assert gate.controller.limit < gate.spec.max  # each moved its own limit
