"""The sustained-load signal for autoscalers: per-class queue depth and in-flight/cap, averaged over minutes.

Admission control absorbs bursts; only load that lasts should add replicas (cold starts take minutes, and scaling
on instantaneous queue length or GPU utilisation oscillates). Sampled once a second by the server's housekeeping.
"""

from __future__ import annotations

from collections import deque
from math import fsum


class SustainedLoad:
    """Exact sliding-window means of per-class samples taken at a steady interval."""

    def __init__(self, window_s: float = 300.0, interval_s: float = 1.0):
        self.window_s = window_s
        self.interval_s = interval_s
        self._samples: dict[str, deque[tuple[float, float, float]]] = {}

    def sample(self, now: float, snapshot: dict[str, dict[str, float]]) -> None:
        """Record each class's queue depth and in-flight/cap now; drop samples older than the window."""
        for cls, s in snapshot.items():
            limit = s["limit"] or 1.0
            dq = self._samples.setdefault(cls, deque())
            dq.append((now, float(s["queue"]), s["inflight"] / limit))
            while dq and dq[0][0] <= now - self.window_s:
                dq.popleft()
        for cls in list(self._samples):
            if cls not in snapshot:
                del self._samples[cls]

    def averages(self) -> dict[str, tuple[float, float]]:
        """class -> (mean queue depth, mean in-flight / cap) over the window so far. Summed afresh at each read (a
        scrape; the window holds window_s / interval_s samples): running sums, added to and taken from for hours,
        drifted, and a class idle for a whole window read 5.6e-18 instead of 0."""
        return {cls: (fsum(q for _, q, _ in dq) / len(dq), fsum(r for _, _, r in dq) / len(dq))
                for cls, dq in self._samples.items() if dq}
