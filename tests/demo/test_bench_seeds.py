"""bench/seeds.py's summary counts the spike targets as results.targets judges them."""

import importlib.util
import math
import sys
from pathlib import Path

from extproc.tools.demo.results import WindowStats
from extproc.tools.demo.scenario import Scenario

ROOT = Path(__file__).resolve().parents[2]


def ws(**fields) -> WindowStats:
    base = dict(p50=1, p95=1, p99=1, ttft_p99=1, goodput=5, goodput_degraded=0, tokens_per_s=0,
                useful_tokens_per_s=0, degraded_tokens_per_s=0, requests=1, p99_worst_window=1.0)
    return WindowStats(**{**base, **fields})


def test_a_spike_where_d_served_nothing_counts_its_p99_target_as_missed(monkeypatch, capsys):
    # d refused every interactive request of a spike (its worst-window p99 NaN, as --limit overrides can make it):
    # the report's targets print "MISSED ... nan", but the seeds table counted the p99 target as reached.
    spec = importlib.util.spec_from_file_location("bench_seeds", ROOT / "bench" / "seeds.py")
    seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seeds)
    sc = Scenario.load(str(ROOT / "scenarios" / "spike.yaml"))
    monkeypatch.setattr(seeds, "seeded", lambda *a: iter([("spike", 7, sc)]))
    calm = {"phase normal": ws(), "phase after": ws()}
    monkeypatch.setattr(seeds, "what_if_stats", lambda *a: {
        "d": {"spike": ws(p99_worst_window=math.nan, p99=math.nan), **calm}, "b": {"spike": ws(goodput=4), **calm}})
    monkeypatch.setattr(sys, "argv", ["seeds.py"])
    seeds.main()
    assert "spike targets missed: 1 of 2" in capsys.readouterr().out
