"""What each mode achieved, from the load generator's own records (simulated seconds), and the issue's targets."""

from __future__ import annotations

from dataclasses import dataclass, field

from extproc.tools.loadgen import RequestRecord
from extproc.tools.stats import percentile

REFUSED = (429, 503)


@dataclass
class WindowStats:
    """One mode over one time window (requests grouped by start time; tokens by end time)."""

    p50: float
    p95: float
    p99: float
    ttft_p99: float
    goodput: float  # SLO-class completions within the SLO per second
    tokens_per_s: float  # output tokens of completed requests (every class) that ended in the window, per second
    requests: int
    # class -> outcome -> percent of that class's requests: rejected, shed, timeout, error
    outcomes: dict[str, dict[str, float]] = field(default_factory=dict)


def served_latency(r: RequestRecord, timeout_s: float) -> float | None:
    """End-to-end latency of a request the fleet took on: completed, or timed out (counted at the timeout)."""
    if r.status in REFUSED:
        return None
    if r.error == "timeout":
        return timeout_s
    return r.latency


def first_token(r: RequestRecord, timeout_s: float) -> float | None:
    if r.status in REFUSED:
        return None
    if r.ttft is not None:
        return r.ttft
    return timeout_s if r.error == "timeout" else None


def outcome(r: RequestRecord, has_extproc: bool) -> str:
    """ok | rejected | shed | timeout | error. The ext_proc sheds with 503; Envoy's own limiter rejects with 503."""
    if r.ok:
        return "ok"
    if r.status == 429 or (r.status == 503 and not has_extproc):
        return "rejected"
    if r.status == 503:
        return "shed"
    return "timeout" if r.error == "timeout" else "error"


def window_stats(records: list[RequestRecord], window: tuple[float, float], slo_class: str, slo_s: float,
                 timeout_s: float, has_extproc: bool) -> WindowStats:
    t0, t1 = window
    span = t1 - t0
    started = [r for r in records if t0 <= r.start < t1]
    slo = [r for r in started if r.kind == slo_class]
    latencies = sorted(x for x in (served_latency(r, timeout_s) for r in slo) if x is not None)
    ttfts = sorted(x for x in (first_token(r, timeout_s) for r in slo) if x is not None)
    good = sum(1 for r in slo if r.ok and r.latency <= slo_s)
    tokens = sum(r.output_tokens for r in records if r.ok and t0 <= r.start + r.latency < t1)
    outcomes: dict[str, dict[str, float]] = {}
    for cls in sorted({r.kind for r in started}):
        mine = [outcome(r, has_extproc) for r in started if r.kind == cls]
        outcomes[cls] = {k: 100.0 * mine.count(k) / len(mine) for k in ("rejected", "shed", "timeout", "error")}
    return WindowStats(percentile(latencies, 50), percentile(latencies, 95), percentile(latencies, 99),
                       percentile(ttfts, 99), good / span, tokens / span, len(started), outcomes)


def rolling_p99(records: list[RequestRecord], slo_class: str, timeout_s: float, end: float, width: float = 10.0,
                step: float = 2.0) -> tuple[list[float], list[float]]:
    """(window end times, p99 of the SLO class's served latency for requests started in each window)."""
    times, values = [], []
    t = width
    while t <= end + 1e-9:
        lat = sorted(x for r in records if r.kind == slo_class and t - width <= r.start < t
                     for x in [served_latency(r, timeout_s)] if x is not None)
        times.append(t)
        values.append(percentile(lat, 99))
        t += step
    return times, values


def rolling_rate(values: list[tuple[float, float]], end: float, width: float = 10.0,
                 step: float = 2.0) -> tuple[list[float], list[float]]:
    """(window end times, sum of weights per second) for (time, weight) points, e.g. arrivals or tokens."""
    times, rates = [], []
    t = width
    while t <= end + 1e-9:
        times.append(t)
        rates.append(sum(w for at, w in values if t - width <= at < t) / width)
        t += step
    return times, rates


@dataclass
class Target:
    name: str
    value: float
    bound: float
    reached: bool

    def line(self) -> str:
        return f"{'reached' if self.reached else 'MISSED '}  {self.name}: {self.value:.2f} (target {self.bound:.2f})"


def targets(spike: dict[str, WindowStats], slo_s: float) -> list[Target]:
    """The issue's targets for mode d during the spike, against a and b (those missing from the run are skipped)."""
    d = spike.get("d")
    if d is None:
        return []
    out = [Target("d: interactive p99 during the spike, s (<= SLO)", d.p99, slo_s, d.p99 <= slo_s)]
    a, b = spike.get("a"), spike.get("b")
    if a is not None:
        ratio = d.tokens_per_s / a.tokens_per_s if a.tokens_per_s else float("inf")
        out.append(Target("d/a: total output tokens/s (>= 0.96)", ratio, 0.96, ratio >= 0.96))
        ratio = d.goodput / a.goodput if a.goodput else float("inf")
        out.append(Target("d/a: interactive goodput (>= 1.5)", ratio, 1.5, ratio >= 1.5))
    if b is not None:
        out.append(Target("d vs b: interactive goodput, req/s (>= b's)", d.goodput, b.goodput,
                          d.goodput >= b.goodput))
    return out


def adaptive_targets(stats: dict[str, dict[str, WindowStats]], windows: list[str], slo_s: float,
                     static: tuple[str, ...] = ("c", "d")) -> list[Target]:
    """Issue 12's targets for mode e in every report window: p99 within the SLO, goodput >= the best static
    setting run (c, d) and >= Envoy's adaptive_concurrency (b)."""
    e = stats.get("e")
    if e is None:
        return []
    out = []
    for w in windows:
        out.append(Target(f"e: interactive p99 ({w}), s (<= SLO)", e[w].p99, slo_s, e[w].p99 <= slo_s))
        best = max((stats[k][w].goodput for k in static if k in stats), default=None)
        if best is not None:
            out.append(Target(f"e vs best static ({'/'.join(k for k in static if k in stats)}): interactive "
                              f"goodput ({w}), req/s", e[w].goodput, best, e[w].goodput >= best))
        if "b" in stats:
            out.append(Target(f"e vs b: interactive goodput ({w}), req/s", e[w].goodput, stats["b"][w].goodput,
                              e[w].goodput >= stats["b"][w].goodput))
    return out
