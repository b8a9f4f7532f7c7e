"""A pool that mixes GPU generations (scenarios/mixed-pool.yaml: two 70B replicas, one 2x slower from the start,
calm, a 2x spike, calm), in the engine-only what-if. The slow-replica rule finds the slow one within seconds and
keeps the class with an SLO off it for good, however much of the pool-wide limit that class holds: the limit's
latency is then the fast replica's, and bounds what goes there. Spread past the fast replica's share of the limit
(the rule before 2026-12-05), interactive ran on the slow replica at a p99 of 2.4-4.3 s, the limit cut for it
from 22K to 6K tokens, which no lower limit fixes, and stayed low after the spike."""

from pathlib import Path

import yaml

from extproc.tools.demo.results import window_stats
from extproc.tools.demo.scenario import Scenario
from extproc.tools.demo.whatif import what_if
from extproc.tools.sim.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def test_a_permanently_slow_replica_takes_no_slo_class_and_does_not_drag_the_limit_down(monkeypatch, tmp_path):
    on_slow = []  # when interactive-sized requests (prompts under 1,000 tokens) reached the slow 70B engine
    add_request = Engine.add_request

    def recording(self, prompt_tokens, max_tokens, now, **kw):
        if self.slowdown > 1 and prompt_tokens < 1000:
            on_slow.append(now)
        return add_request(self, prompt_tokens, max_tokens, now, **kw)

    monkeypatch.setattr(Engine, "add_request", recording)
    worst = []
    for seed in (41, 42, 43):
        doc = yaml.safe_load((ROOT / "scenarios" / "mixed-pool.yaml").read_text())
        doc["seed"] = seed
        (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        scenario = Scenario.load(tmp_path / "scenario.yaml")
        on_slow.clear()
        res = what_if(scenario, str(ROOT / "policies" / "demo-full.yaml"), scenario.fleet_capacity())
        assert not [t for t in on_slow if t >= 20.0]  # found slow by then (one 20 s pace window)
        stats = {w: window_stats(res.records, scenario.window(w), scenario.slo_class, scenario.slo_p95_s,
                                 scenario.client_timeout_s, True) for w in ("spike", "after")}
        worst.append(stats["spike"].p99_worst_window)
        # Seed 41, spread / kept off (2026-12-05): spike p99 3.40 / 2.36 s (worst 10 s window 4.26 / 2.49),
        # full-model goodput 8.7 / 10.6 req/s; after it, at 53% load: 37 / 0 degraded or refused, p99 2.02 / 1.60 s.
        # Since the lower classes' request over their share rests them, 10 after it (8 batch queue_timeout: batch
        # rests while interactive waits now and then; seeds 41-43: 10 / 4 / 9 against 0 / 5 / 10).
        assert stats["after"].degraded + stats["after"].refused <= 12
        assert stats["after"].p99 < scenario.slo_p95_s
    # The spike's worst 10 s window is its first, all on the fast replica, and moves with the limit the calm left
    # (spread: 4.26 / 3.62 / 4.42 s). Seeds 41-43: 2.49 / 2.68 / 2.71 s with the slow replica found at 0.6 s, and
    # 3.20 / 2.55 / 2.71 s once paces were compared at like context too (found at 5.4 / 7.4 / 0.6 s; seed 41
    # entered the spike with a limit of 26.3K tokens against 24.6K, and read 3.16 s in its first 10 s; seeds 44-49
    # within 0.14 s of before). One seed's is its path; three seeds' mean is the rule's.
    assert sum(worst) / len(worst) < 3.0 and max(worst) < 3.5
