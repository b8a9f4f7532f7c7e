"""Which replicas of a pool run markedly slower than the fastest: a throttled GPU, a noisy neighbour on the host.

Envoy balances by requests in flight, not by speed, so a replica at half speed keeps its share of the pool's
requests and every one of them takes twice as long: the class with the tightest SLO misses it on that replica
alone, and the pool-wide limit, which sees one latency for the pool, cuts the healthy replicas' admissions for
it. vLLM counts its own inter-token latency (the `vllm:inter_token_latency_seconds` histogram); its sum and count
over the last few seconds give each replica's pace, and the replicas of one pool, balanced to about the same
load, should show about the same. One whose pace is `ratio` times the fastest's is slow: the classes with an SLO
are sent to the others while it is (policy.steering), the rest still go to it. It stops being slow once back
within half that margin, or after a window without tokens (it gets nothing to be judged on otherwise).

The window is long (server.saturation: 100 scrapes, 20 s by default) because a replica's inter-token latency
also depends on its mix: a replica prefilling long prompts decodes slower for a few seconds. Over 5 s, healthy
replicas of the long-prompt scenario (scenarios/kv-agents.yaml) read 1.5x apart; over 20 s none did, on any seed.

It also depends on the batch: every token of a step waits for the whole batch. Replicas are judged against each
other only where the load cannot explain the gap: a replica is slow against one that ran at least as heavy a
batch (the tokens' mean running requests over the window), or against a lighter one by more than the batches'
ratio, and back only against one that ran no heavier. Once the SLO classes were sent away from a replica 2x slower by design (a
pool mixing GPU generations, scenarios/mixed-pool.yaml), it ran 2 requests to the fast one's 13 and read only 1.2x
its pace: it was let back, took interactive again at a p99 of 2.5-4 s, and went slow again, back and forth through
the spike. And a replica an autoscaler had just added, still lightly loaded, made the busy ones read 1.5x slower
than it (scenarios/scale-out.yaml).

The batch is counted in requests, and a step's time grows with their context too: each token reads the KV entries
of every request in the step. Two identical 70B replicas holding one request each, one of 5.9K tokens and one of
470, read 4.7 and 2.8 ms a token, 1.7x (scenarios/noisy-neighbour.yaml; an 8B held one 7K-token degraded RAG
context against 1-1.4K, 1.6x: scenarios/moe-rag.yaml). So the load is two measures, the running requests and the
KV cache in use (vllm:kv_cache_usage_perc, the context held): "as heavy" holds in both, and a lighter replica's
gap is divided by the larger of the two ratios.
"""

from __future__ import annotations

import math
from collections import deque

MIN_TOKENS = 50  # inter-token observations in the window before a replica's pace is judged
# ... and the share of the window it must have been read for since it started (or restarted): judged on its first
# 0.4 s, an 8B replica prefilling a 24K-token prompt read 1.51x its twin and stayed "slow" for the whole run, its
# SLO classes steered away so that the twin always ran the heavier batch (scenarios/audit-long-context.yaml).
MIN_SPAN = 0.5
# Batches within this factor of each other count as the same load: least-request balancing keeps healthy
# replicas' running requests about equal, not equal.
LOAD_SLACK = 1.25


class TokenPace:
    """One replica's mean inter-token latency over a window, from the histogram's cumulative sum and count."""

    __slots__ = ("window_s", "_last", "_steps", "_since", "slow", "relative")

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._last: tuple[float, float, float, float] | None = None  # (sum, count, running, kv) as last read
        # (when, sum added, count added, and count added times the running requests and the KV cache used)
        self._steps: deque[tuple[float, float, float, float, float]] = deque()
        self._since = math.inf  # when its counters were first read, since it (re)started
        self.slow = False
        self.relative = 1.0  # its inter-token latency over the pool's fastest, as last judged (1: unknown)

    def add(self, now: float, total_s: float, count: float, running: float = math.nan, kv: float = math.nan) -> None:
        """A reading of the cumulative counters (NaN: the replica does not export them), and the requests it runs
        now and the share of its KV cache they hold (the batch those tokens were made in; NaN: unknown)."""
        last, self._last = self._last, (total_s, count, running, kv)
        if math.isnan(total_s) or math.isnan(count):
            self._last = None
        elif last is not None and count >= last[1] and total_s >= last[0]:
            added = count - last[1]
            if added and running == 0:  # the requests that made them ended since the last reading, which saw them
                running, kv = last[2], last[3]
            if added and running == 0:
                # Nor did that one: they came and went between two readings (an 8B answers a 7K-token prompt's 150
                # tokens in 0.2 s), and what they held is unknown. Read as an idle replica's, a 7K-token request's
                # 1.2 ms a token was 1.58x the other 8B's busier 0.8 ms (scenarios/moe-rag.yaml, seed 74).
                self._trim(now)
                return
            self._steps.append((now, total_s - last[0], added, added * running, added * kv))
        else:  # first reading, or the counters went back (a restarted replica): start over
            self._steps.clear()
            self._since = now
        self._trim(now)

    @property
    def factor(self) -> float:
        """How much longer a request should take here than on the fastest replica, for steering: 1 unless slow."""
        return self.relative if self.slow else 1.0

    def seconds_per_token(self, now: float) -> float | None:
        """The mean inter-token latency over the window; None with fewer than MIN_TOKENS observations, or read for
        less than MIN_SPAN of the window."""
        self._trim(now)
        if now - self._since < MIN_SPAN * self.window_s:
            return None
        count = sum(step[2] for step in self._steps)
        if count < MIN_TOKENS:
            return None
        total = sum(step[1] for step in self._steps)
        # A sum that stood still while the count grew measured nothing (and a 0 pace divides the others' by zero).
        return total / count if total > 0 else None

    def batch(self) -> float:
        """The mean requests running alongside each token of the window (call after seconds_per_token); NaN when
        a reading did not say: then it is compared with every replica, whatever their batches."""
        return self._mean(3)

    def context(self) -> float:
        """The mean share of the KV cache in use alongside each token of the window (the context its steps read),
        as batch()."""
        return self._mean(4)

    def _mean(self, field: int) -> float:
        count = sum(step[2] for step in self._steps)
        return sum(step[field] for step in self._steps) / count if count else math.nan

    def _trim(self, now: float) -> None:
        steps = self._steps
        while steps and now - steps[0][0] > self.window_s:
            steps.popleft()


def judge_slow(paces: list[TokenPace], now: float, ratio: float) -> list[TokenPace]:
    """Update each pace's `slow` against the others (see the module's note on load); returns those whose verdict
    changed. `ratio` <= 1: nothing is slow. A replica without a pace (idle, or not exporting it) is not slow: it is
    judged again once it has served a window's tokens. One with no other to be compared with is not slow: slower
    than nothing; nor is the fastest of replicas that all read slow (none is left to judge it against)."""
    if ratio <= 1.0:
        return [p for p in paces if _set(p, False)]
    seen = [(p, s, (p.batch(), p.context())) for p in paces if (s := p.seconds_per_token(now)) is not None]
    release = 1.0 + (ratio - 1.0) / 2  # hysteresis: a slow replica must be well back before it is trusted again
    changed = [p for p in paces if p.seconds_per_token(now) is None and _set(p, False)]
    for p in paces:
        if p.seconds_per_token(now) is None:
            p.relative = 1.0
    if len(seen) < 2:
        return changed + [p for p, _, _ in seen if _set(p, False)]
    was_slow = {id(p) for p, _, _ in seen if p.slow}  # as judged before this round (verdicts change below)
    # The others first: a slow one is let back only against one not slow by this round's verdict too (a restarted
    # slow replica, judged for the first time, let another back for a round before either was found slow).
    for pace, s, load in sorted(seen, key=lambda entry: entry[0].slow):
        others = [(s2, _outweighs(load, load2), _outweighs(load2, load), p2.slow or id(p2) in was_slow)
                  for p2, s2, load2 in seen if p2 is not pace]
        if not pace.slow:
            # Against one that ran at least as heavy a load, the gap itself: slower than that is not the load's
            # doing. Against a lighter one, the gap over what the extra load could cost if every token waited for
            # all of it (pace in proportion to the load, the most it costs): a slow replica holds its requests
            # longer, so least request leaves it the heavier batch at low concurrency (2 to the fast one's 1 with
            # three clients), and compared only with heavier ones it went unjudged.
            pace.relative = max((s / s2 / (heavier if heavier > LOAD_SLACK else 1.0)
                                 for s2, heavier, _, _ in others if math.isfinite(heavier)), default=1.0)
            if pace.relative > ratio and _set(pace, True):
                changed.append(pace)
            continue
        # Slow: back within half the margin of one that ran no heavier a load. Reading as fast as a far busier
        # one proves nothing (a 2x slower replica running 1 request read 1.07x one running 13); least request
        # gives it a share of the classes without an SLO until its batch is the others' size, and then it is judged.
        # Nor does reading as fast as another slow one (two of an older GPU generation let each other back).
        lighter = [s2 for s2, _, theirs_over, slow in others if theirs_over <= LOAD_SLACK and not slow]
        if lighter:
            pace.relative = s / min(lighter)
            if pace.relative <= release and _set(pace, False):
                changed.append(pace)
    if all(p.slow for p, _, _ in seen):
        # Every replica is slow, each against one that was not when it was judged: none is left to let the others
        # back against, and the pool's fastest read slow for good. Slow against none now, it is let back, and the
        # others are judged against it.
        fastest = min(seen, key=lambda entry: entry[1])[0]
        fastest.relative = 1.0
        if _set(fastest, False):
            changed.append(fastest)
    return changed


def _outweighs(load: tuple[float, ...], other: tuple[float, ...]) -> float:
    """How many times `load` is `other` in the measure where it is most over it (a step's time is a sum of terms,
    each growing at most in proportion to one measure): inf where `other` is 0 and `load` is not; a measure not
    known on both sides (NaN) or 0 on both is left out; 0 when none is left."""
    ratios = [a / b if b > 0 else math.inf for a, b in zip(load, other)
              if not (math.isnan(a) or math.isnan(b)) and (a > 0 or b > 0)]
    return max(ratios, default=0.0)


def _set(pace: TokenPace, slow: bool) -> bool:
    changed, pace.slow = pace.slow != slow, slow
    return changed
