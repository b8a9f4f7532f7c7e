"""The calibration chart: latency percentiles and throughput vs concurrency, the SLO line, the knee and the cap."""

from __future__ import annotations

from .sweep import Outcome, StepResult
from extproc.tools.plotting import pyplot


def plot_sweep(steps: list[StepResult], slo_p95_s: float, outcome: Outcome, path: str, title: str,
               streaming: bool) -> bool:
    """Write a PNG (False when matplotlib is missing); a concurrency measured twice is drawn from its last
    measurement."""
    plt = pyplot()
    if plt is None:
        return False
    import matplotlib.ticker

    by_concurrency = {s.concurrency: s for s in steps}
    points = [by_concurrency[c] for c in sorted(by_concurrency)]
    xs = [s.concurrency for s in points]
    fig, (lat, tput) = plt.subplots(2, 1, sharex=True, figsize=(8, 7), height_ratios=(3, 2))
    lat.plot(xs, [s.latency_p50 for s in points], "o-", label="p50")
    lat.plot(xs, [s.latency_p95 for s in points], "o-", label="p95")
    lat.plot(xs, [s.latency_p99 for s in points], "o-", label="p99")
    if streaming:
        lat.plot(xs, [s.ttft_p95 for s in points], "s--", label="TTFT p95")
    lat.axhline(slo_p95_s, color="red", linestyle="--", label=f"SLO p95 {slo_p95_s:g} s")
    tput.plot(xs, [s.tokens_per_s for s in points], "o-", color="tab:purple", label="output tokens/s")
    for ax in (lat, tput):
        if outcome.knee is not None:
            ax.axvline(outcome.knee, color="grey", linestyle=":", label=f"knee {outcome.knee}")
        if outcome.cap is not None:
            ax.axvline(outcome.cap, color="green", linestyle="-", label=f"cap {outcome.cap}")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    lat.set_ylabel("latency (s)")
    tput.set_ylabel("tokens/s")
    tput.set_xlabel("concurrency")
    tput.set_xscale("log", base=2)
    tput.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    lat.set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
