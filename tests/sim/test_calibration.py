"""A shortened calibration check: closed-loop p50 over real HTTP at high speed, loose tolerance."""

import pytest

from extproc.tools.loadgen import LoadClient, RequestKind, Workload, run_closed_loop, summarize
from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.offline import closed_loop
from extproc.tools.sim.profile import load_profile

SPEED = 20.0
REFERENCE_P50 = {8: 0.78, 32: 1.89}
REFERENCE_TOKENS_PER_S = {8: 1540, 32: 2680}


# timing: `make test` runs it alone after its parallel part. The simulator's clock is wall time x SPEED, in this
# process: with three other workers on the two cores a make test run measured no request at all in the window
# (p50 NaN at 8), while beside two busy-looping processes alone it read 0.96-1.06 of the table's p50.
@pytest.mark.timing
@pytest.mark.parametrize("concurrency", [8, 32])
async def test_closed_loop_p50_matches_the_reference_table(concurrency):
    workload = Workload([RequestKind(endpoint="chat", prompt_tokens=512, max_tokens=256)])
    warmup, measured = 5.0, 250 * 155 / REFERENCE_TOKENS_PER_S[concurrency]  # simulated seconds
    async with SimFleet("h100-llama70b-awq", speed=SPEED, seed=3) as fleet:
        async with LoadClient(fleet.urls, time_scale=SPEED, pool=concurrency) as client:
            await run_closed_loop(client, workload, concurrency, duration_s=(warmup + measured) / SPEED, seed=3)
    summary = summarize(client.records, (warmup, warmup + measured))
    assert summary["errors"] == {}
    assert summary["latency_p50"] == pytest.approx(REFERENCE_P50[concurrency], rel=0.35)
    assert summary["output_tokens_per_s"] == pytest.approx(REFERENCE_TOKENS_PER_S[concurrency], rel=0.35)


def test_engine_only_sweep_is_within_the_issue_tolerance_below_the_kv_cliff():
    profile = load_profile("h100-llama70b-awq")
    for concurrency, (tokens, p50) in {8: (1540, 0.78), 32: (2680, 1.89)}.items():
        point = closed_loop(profile, concurrency, 512, 256, requests=800, seed=1)
        assert point.tokens_per_s == pytest.approx(tokens, rel=0.15)
        assert point.p50_s == pytest.approx(p50, rel=0.15)


def test_kv_cliff_preemption_costs_its_victims_little_under_fcfs():
    """At 64 the cache is full and sequences are preempted, but a victim is the newest sequence and goes back to the
    head of the queue, so it loses little: the reason the simulator's p99 at 64 cannot reach the table's
    (docs/simulator.md, bench/sim_tail.py)."""
    point = closed_loop(load_profile("h100-llama70b-awq"), 64, 512, 256, requests=1500, seed=1)
    assert len(point.sequences) == 1500 and all(s.finished is not None for s in point.sequences)
    hit, clean = (point.latencies_s(generated=256, preempted=p) for p in (True, False))
    assert len(hit) > 20 and len(clean) > 20
    assert hit[len(hit) // 2] - clean[len(clean) // 2] < 0.05 * clean[len(clean) // 2]
