"""The sustained-load signal for autoscalers: per-class queue depth and in-flight/cap, averaged over minutes.

Admission control absorbs bursts; only load that lasts should add replicas (cold starts take minutes, and scaling
on instantaneous queue length or GPU utilisation oscillates). Sampled once a second by the server's housekeeping.
"""

from __future__ import annotations

from collections import deque


class SustainedLoad:
    """Exact sliding-window means of per-class samples taken at a steady interval."""

    def __init__(self, window_s: float = 300.0, interval_s: float = 1.0):
        self.window_s = window_s
        self.interval_s = interval_s
        self._samples: dict[str, deque[tuple[float, float, float]]] = {}
        self._sums: dict[str, list[float]] = {}

    def sample(self, now: float, snapshot: dict[str, dict[str, float]]) -> None:
        """Record each class's queue depth and in-flight/cap now; drop samples older than the window."""
        for cls, s in snapshot.items():
            limit = s["limit"] or 1.0
            q, ratio = float(s["queue"]), s["inflight"] / limit
            dq = self._samples.setdefault(cls, deque())
            sums = self._sums.setdefault(cls, [0.0, 0.0])
            dq.append((now, q, ratio))
            sums[0] += q
            sums[1] += ratio
            while dq and dq[0][0] <= now - self.window_s:
                _, oq, oratio = dq.popleft()
                sums[0] -= oq
                sums[1] -= oratio
        for cls in list(self._samples):
            if cls not in snapshot:
                del self._samples[cls], self._sums[cls]

    def averages(self) -> dict[str, tuple[float, float]]:
        """class -> (mean queue depth, mean in-flight / cap) over the window so far."""
        return {cls: (max(s[0], 0.0) / len(self._samples[cls]), max(s[1], 0.0) / len(self._samples[cls]))
                for cls, s in self._sums.items() if self._samples[cls]}
