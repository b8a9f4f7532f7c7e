"""A replica whose engine hangs (fault `hang`: it takes requests, answers /health and /metrics, generates nothing)
in the engine-only what-if: the ext_proc's scraper reports it stalled once its token counters stood still for the
pool's `stall_ms`, leaves its queue out of the pool's saturation, the pool-wide limit keeps serving the full
model from the replica that works instead of cutting itself to its floor on the hung one's queue, and new
requests are sent to the working replica only."""

from dataclasses import replace
from pathlib import Path

from extproc.policy.admission import AdmissionController
from extproc.tools.demo.results import window_stats
from extproc.tools.demo.scenario import FleetEvent, Scenario
from extproc.tools.demo.whatif import what_if

ROOT = Path(__file__).resolve().parents[2]
HANG_AT, STALL_S = 30.0, 10.0  # the shipped default stall_ms: 10 s
HANG = FleetEvent(HANG_AT, "vllm_llama70b", 0, {"hang": 1.0})


def run(monkeypatch, tmp_path, events, stall_ms=None):
    seen = []
    set_saturation = AdmissionController.set_saturation

    def recording(self, pool, sat):
        if sat is not None:
            seen.append((self.clock(), pool, sat.stalled, sat.saturated))
        return set_saturation(self, pool, sat)

    monkeypatch.setattr(AdmissionController, "set_saturation", recording)
    policy = (ROOT / "policies" / "demo-full.yaml").read_text()  # mode d: the pool-wide limit
    if stall_ms is not None:
        policy = policy.replace("  vllm_llama70b:\n", f"  vllm_llama70b:\n    stall_ms: {stall_ms}\n", 1)
    (tmp_path / "policy.yaml").write_text(policy)
    scenario = replace(Scenario.load(ROOT / "scenarios" / "spike.yaml"), events=tuple(events))
    res = what_if(scenario, str(tmp_path / "policy.yaml"), scenario.fleet_capacity())
    spike = window_stats(res.records, scenario.window("spike"), scenario.slo_class, scenario.slo_p95_s,
                         scenario.client_timeout_s, True)
    return seen, res, spike


def test_a_hung_replica_is_seen_stalled_after_stall_ms_and_its_queue_does_not_shut_the_pool(monkeypatch, tmp_path):
    seen, res, spike = run(monkeypatch, tmp_path, [HANG])
    stalled = [t for t, pool, n, _ in seen if pool == "vllm_llama70b" and n == 1]
    assert stalled, "the hung replica was never seen stalled"
    assert HANG_AT + STALL_S <= stalled[0] <= HANG_AT + STALL_S + 1.0  # stall_ms after its last token
    assert not all(sat for t, pool, n, sat in seen if n)  # its queue is not the pool's saturation
    # The requests it took before it was seen are held until their clients give up (60 s), as on the real stack;
    # from then on none is sent to it (x-extproc-replica names the working one), so none started after times out
    # and the spike's p99 is the working replica's, not the timeout.
    seen_at = stalled[0]
    assert any(r.error == "timeout" and r.start < seen_at for r in res.records)
    assert not any(r.error == "timeout" and r.start > seen_at for r in res.records)
    assert spike.p99_worst_window < 3.0
    # The working replica still serves the full model through the spike: half the fleet's 70B capacity is left,
    # and a healthy fleet serves ~19 req/s here. Read as saturation, the hung replica's queue took the limit to its
    # floor and everything to the 8B (0.1 req/s full-model).
    _, _, blind = run(monkeypatch, tmp_path, [HANG], stall_ms=0)
    assert spike.goodput >= 5.0 > 1.0 >= blind.goodput


def test_without_a_hang_no_replica_is_ever_stalled(monkeypatch, tmp_path):
    seen, _, _ = run(monkeypatch, tmp_path, [])
    assert not any(n for _, _, n, _ in seen)
