"""A replica whose engine hangs (fault `hang`: it takes requests, answers /health and /metrics, generates nothing)
in the engine-only what-if: the ext_proc's scraper reports it stalled once its token counters stood still for the
pool's `stall_ms`, and never a replica that works."""

from dataclasses import replace
from pathlib import Path

from extproc.policy.admission import AdmissionController
from extproc.tools.demo.scenario import FleetEvent, Scenario
from extproc.tools.demo.whatif import what_if

ROOT = Path(__file__).resolve().parents[2]
HANG_AT, STALL_S = 20.0, 30.0  # the shipped default stall_ms: 30 s


def run(monkeypatch, events):
    seen = []
    set_saturation = AdmissionController.set_saturation

    def recording(self, pool, sat):
        if sat is not None:
            seen.append((self.clock(), pool, sat.stalled, sat.saturated))
        return set_saturation(self, pool, sat)

    monkeypatch.setattr(AdmissionController, "set_saturation", recording)
    scenario = Scenario.load(ROOT / "scenarios" / "spike.yaml")
    scenario = replace(scenario.shortened(40.0), events=tuple(events))  # 40 s per phase, normal load first
    res = what_if(scenario, str(ROOT / "policies" / "demo-adaptive.yaml"), scenario.fleet_capacity())
    return seen, res


def test_a_hung_replica_is_seen_stalled_after_stall_ms_and_the_pool_counts_as_saturated(monkeypatch):
    seen, res = run(monkeypatch, [FleetEvent(HANG_AT, "vllm_llama70b", 0, {"hang": 1.0})])
    stalled = [t for t, pool, n, _ in seen if pool == "vllm_llama70b" and n == 1]
    assert stalled, "the hung replica was never seen stalled"
    assert HANG_AT + STALL_S <= stalled[0] <= HANG_AT + STALL_S + 1.0  # stall_ms after its last token
    # Its requests are held until their clients give up (60 s), as on the real stack.
    assert any(r.error == "timeout" for r in res.records)


def test_without_a_hang_no_replica_is_ever_stalled(monkeypatch):
    seen, _ = run(monkeypatch, [])
    assert not any(n for _, _, n, _ in seen)
