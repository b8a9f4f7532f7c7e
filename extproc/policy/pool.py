"""One limit per pool, found from the pool's own saturation, shared by the classes in strict priority.

Why one pool limit rather than a cap per class (docs/overload.md): what a pool can take depends on the mix, and
per-class caps that sum to more than the pool holds let the lower classes fill it while the highest one waits.
Here the pool has one limit (in KV tokens or requests) and the classes share it by priority: a lower class is
admitted only while no higher class waits for this pool, so when the pool is short the lower classes yield
first; each class keeps a small guaranteed share (`min_share`, on average when one request is larger than it) so
nothing starves.

The limit (PoolLimit) finds its own operating point:
 - the replicas say they are saturated (requests waiting in vLLM, KV cache nearly full, preemptions): cut at
   once to below what is in flight, and again only once that has drained under the limit;
 - otherwise each class with an SLO compares a quantile of its *service* time on this pool (the replicas', not
   our queueing) with `target` x SLO. Over it, and up from the class's calm baseline (load is what slows it):
   cut in proportion (at most `decrease` a step). Under it, while requests wait for room: raise in proportion
   to the room left (at most `max_raise` a step, and RAISE_PER_DELAY per median service time). While it does
   not bind, the limit settles to the recent peak in flight plus headroom (a limit far above any load would let
   a spike's first seconds overfill the pool before any latency showed it), never below half the last limit
   proven under load (PROVEN_FLOOR).
Latency is counted only for requests admitted after the limit was last cut on latency: a cut shows in latency
seconds later, and one slow period must not cut twice. Raises are small steps for the same reason.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import count
from typing import Callable

from .onset import OnsetGuard, nearest_rank
from .schema import PoolLimitSpec

# Binding: in-flight at this share of the limit (or a request waiting for the pool) means the limit decides.
BINDING = 0.9
# An idle limit settles to the recent peak in flight plus this much: room for a burst without waiting, close
# enough that a spike meets the limit before it overfills the pool (latency then says where to go).
SETTLE_HEADROOM = 0.5
# Classes below the first fill the limit only this far: the rest is the first class's room for a burst, so at
# ordinary load it does not wait behind lower classes' long requests that started a moment earlier.
LOWER_FILL = 0.85
# Latency samples count for this many latency windows when completions are few (then the window is a count).
MAX_AGE_WINDOWS = 6
WINDOW_SAMPLES = 512  # at most this many kept per class (a window of a busy pool)
# KV-cache usage under which the replicas have plenty of room (a limit may rise on their word alone).
ROOMY_KV = 0.6
# Latency over the target is cut for only when it is also this much over the class's calm baseline: requests
# that are slow at any load (long outputs, long prompts) are not made faster by a lower limit, only refused.
LOAD_TOLERANCE = 1.2
# The controller's last_action values that move the limit (extproc_pool_limit_moves_total's `action`).
LIMIT_MOVES = ("cut_saturated", "cut_latency", "raise", "settle", "onset_cap")
BASELINE_DRIFT = 0.01  # per interval: the baseline follows a slower mix within a minute or two
RAISE_GAIN = 4.0  # a raise takes its full `max_raise` step once the latency is 25% under the target
# Raises compound: within one feedback delay (the classes' median service time: what a raise takes to show in
# latency) the limit rises at most this much. Short requests never meet it (a raise shows within a few
# intervals); with 10 s answers a raise every interval had compounded to 3x before the first one showed.
RAISE_PER_DELAY = 0.25
# The settle never goes below this share of the last limit proven under load (binding with the latency in target,
# or just cut): idle, the recent peak decays to nothing and the limit fell to its floor (1) in seconds, so the
# next burst ran one request at a time for most of a minute while it climbed back 5% a step (an operator audit).
PROVEN_FLOOR = 0.5
# While the replicas are roomy (nothing waiting, KV cache under ROOMY_KV) and the latency is under 1 / this of its
# target, raises are not held to RAISE_PER_DELAY: a reasoning model's minute-long answers at a quarter of their
# target, the KV cache 6% full, held the limit to +25% per ~20 s through a 2x spike, and 20% of the first class
# was refused or degraded where no control served it all within the SLO (scenarios/reasoning-spike.yaml). The
# replicas' own word shows a raise within a scrape; past ROOMY_KV or half the target the bound holds again.
ROOMY_RATIO = 2.0
# The share a class below the first holds on average through the request over its `min_share` it may run when it
# holds nothing (PoolGate.guaranteed), when its `min_share` is smaller: no class starves for good.
MIN_SHARE = 0.01
# ...and rests at most this long after one: the share holds on average through contention shorter than that; through
# a longer one a class whose requests dwarf its share still gets one a minute. Unbounded, a long request over a
# limit just cut (units / share of 400) rested its class for hours, past the overload that owed it (an audit).
MAX_REST_S = 60.0
# The owner's return (PoolGate.owed) takes the pool to at most this many times its limit: the owners' share of it
# over what the borrowers took under it.
OWED_BOUND = 2.0


# Why a waiter with room on the pool is still waiting (PoolGate.held_back_by): room that came back without a release
# (a rest or squeeze that ran out, a stalled replica's requests left out) is granted only at the next release.
UNGRANTED = "room came back without a release to grant it: waiters are granted at releases"
_STALLS = count(1)  # numbers a pool's stalls (PoolGate.stall), unique across gates: a reload's new gate keeps its own


class RecentLatencies:
    """Recent service times of one class on the pool, each with when it ended: those of the last window, or when
    it holds too few, the last few older ones (up to `max_age_s`): a class that completes few requests here (long
    prompts, most of it degraded) still gives a latency instead of none. And the class's requests still running
    on the pool (key -> when admitted), whose ages are lower bounds on their service times (censored_quantile)."""

    __slots__ = ("samples", "running")

    def __init__(self, size: int):
        self.samples: deque[tuple[float, float]] = deque(maxlen=size)
        self.running: dict[int, float] = {}

    def add(self, now: float, seconds: float) -> None:
        self.samples.append((now, seconds))

    def clear(self) -> None:
        self.samples.clear()

    def quantile(self, now: float, q: float, window_s: float, max_age_s: float, at_least: int) -> float | None:
        """The q-quantile of the last window's samples, or of the last `at_least` younger than `max_age_s`;
        None with fewer than `at_least`."""
        recent = self._recent(now, window_s, max_age_s, at_least)
        return None if recent is None else nearest_rank(sorted(recent), q)

    def censored_quantile(self, now: float, q: float, window_s: float, max_age_s: float, at_least: int,
                          since: float) -> tuple[float, bool] | None:
        """The q-quantile of the samples quantile() takes together with the requests admitted since `since` and
        still running, each at least as long as its age (Kaplan-Meier); whether it is known: False when more than
        1 - q of them may still end later than every time seen, and the value is only a lower bound. None with
        fewer than `at_least` samples.

        Why: requests end in order of length, so the samples alone read the quickest first. After a cut clears the
        window, or when the slowest answers take several times the median, the quantile of what has ended reads
        room that is not there: with 512-token answers and a 5 s SLO the limit rose on it each time until the long
        ones ended, and cut again (worst 10 s windows 6.2-6.4 s, docs/overload.md)."""
        recent = self._recent(now, window_s, max_age_s, at_least)
        if recent is None:
            return None
        ages = [now - at for at in self.running.values() if at >= since]
        if not ages:
            return nearest_rank(sorted(recent), q), True
        return kaplan_meier_quantile(recent, ages, q)

    def _recent(self, now: float, window_s: float, max_age_s: float, at_least: int) -> list[float] | None:
        """The last window's samples, or the last `at_least` younger than `max_age_s`; None with fewer."""
        recent = [s for t, s in self.samples if now - t <= window_s]
        if len(recent) < at_least:
            recent = [s for t, s in self.samples if now - t <= max_age_s][-at_least:]
            if len(recent) < at_least:
                return None
        return recent


def kaplan_meier_quantile(ended: list[float], running: list[float], q: float) -> tuple[float, bool]:
    """The q-quantile of durations of which `ended` are known and `running` are lower bounds, by the Kaplan-Meier
    estimate of the share still running at each time; (the largest time seen, False) when that share never falls
    to 1 - q. Without `running` it is the plain nearest-rank quantile."""
    times = sorted([(x, 1) for x in ended] + [(x, 0) for x in running])
    at_risk, left, i, n = len(times), 1.0, 0, len(times)
    while i < n:
        x, ends, goes = times[i][0], 0, 0
        while i < n and times[i][0] == x:
            ends += times[i][1]
            goes += 1
            i += 1
        if ends:
            left *= 1.0 - ends / at_risk
            if left <= 1.0 - q + 1e-12:
                return x, True
        at_risk -= goes
    return times[-1][0], False


class PoolLimit:
    """Where the pool's limit should be, from saturation and the served latency of each class with an SLO."""

    def __init__(self, spec: PoolLimitSpec, slos: dict[int, float]):
        self.spec = spec
        self.slos = slos  # class rank -> SLO seconds
        self.limit = float(spec.initial if spec.initial is not None else spec.max)
        self.windows = {rank: self._window() for rank in slos}
        self.inflight_avg = 0.0
        self.inflight_peak = 0.0   # the most held at once lately (decays over the window)
        self.baseline: dict[int, float] = {}  # class rank -> its served quantile when calm
        self.served: dict[int, float] = {}    # class rank -> its served quantile at the last move (for metrics)
        self.counted_since = -math.inf  # requests admitted before this say nothing about the current limit
        # While a replica of the pool is seen stalled, from when it was: requests admitted before then and still
        # running may be the hung replica's, which end only when their clients give up. Their age is no latency of
        # the pool's (PoolGate.update sets it).
        self.stalled_since = -math.inf
        # After a latency cut, the first interval's admissions of classes with an SLO: [start, end, admitted,
        # served]. Until most of them are served the window holds only the quickest, and reads room that is not
        # there: on a big fleet (~150 completions a second) min_samples came within milliseconds of a cut, read
        # the latency at 40% of its target, and the limit saw-toothed 85K -> 99K -> 85K tokens every 2.5 s with
        # the p99 over the SLO through a whole spike (scenarios/big-fleet.yaml).
        self._cohort: list[float] | None = None
        self._blind_until = -math.inf
        self.proven = 0.0               # the last limit proven under load (see PROVEN_FLOOR); 0: none yet
        self.served_peak = 0.0          # the most held with the latency in target, before anything was proven
        self.last_action = "hold"
        # The in-flight the last cut was sized on: the instant's for a saturation cut, the window's average (or
        # the instant's, if higher) for a latency cut. Logged with the cut: the instant's alone read
        # 'cut_latency 478 -> 96.2, inflight 0.0' when the requests the latency was measured on had just ended.
        self.sized_on = 0.0
        self.moved_at: float | None = None  # when the limit last had its interval's chance to move
        self._sampled_at: float | None = None
        self._was_saturated = False
        self._raises: deque[tuple[float, float]] = deque()  # (when, factor) of the recent raises
        self.onset = OnsetGuard() if spec.onset_guard else None  # onset.py

    def _window(self) -> RecentLatencies:
        return RecentLatencies(WINDOW_SAMPLES)

    def reconfigure(self, slos: dict[int, float]) -> None:
        """New SLOs by class rank; the classes that keep one keep their samples."""
        self.slos = slos
        self.served = {r: q for r, q in self.served.items() if r in slos}
        self.windows = {r: self.windows.get(r) or self._window() for r in slos}

    def respec(self, spec: PoolLimitSpec, slos: dict[int, float], ranks: dict[int, int]) -> None:
        """A reload changed the knobs or the classes but not the unit: keep what was learned (the limit, within
        the new bounds; each class's calm baseline and samples under its new rank, `ranks`: old -> new)."""
        self.spec = spec
        self.limit = min(spec.max, max(spec.min, self.limit))
        if not spec.onset_guard:
            self.onset = None
        elif self.onset is None or 0 not in ranks or ranks[0] != 0:
            self.onset = OnsetGuard()  # its arrivals and curve were another first class's
        self.baseline = {ranks[r]: b for r, b in self.baseline.items() if r in ranks}
        self.served = {ranks[r]: q for r, q in self.served.items() if r in ranks}
        self.windows = {ranks[r]: w for r, w in self.windows.items() if r in ranks}
        self.reconfigure(slos)

    def asked(self, rank: int, now: float) -> None:
        """A request of the class at `rank` arrived for this pool (the onset guard's test counts the first's)."""
        if rank == 0 and self.onset is not None:
            self.onset.arrival(now)

    def observe(self, rank: int, admitted_at: float, now: float, service_s: float) -> None:
        if rank == 0 and self.onset is not None:
            self.onset.curve.observe(admitted_at, now, service_s)
        window = self.windows.get(rank)
        if window is not None and admitted_at >= self.counted_since:
            window.add(now, service_s)
            cohort = self._cohort
            if cohort is not None and admitted_at < cohort[1]:
                cohort[3] += 1

    def admitted(self, rank: int, at: float, key: int) -> list[float] | None:
        """A request of the class at `rank` was admitted `at` (ended() takes `key` back): the cohort it counts in
        (withdrawn() takes it), or None."""
        window = self.windows.get(rank)
        if window is not None:
            window.running[key] = at
        cohort = self._cohort
        if cohort is not None and rank in self.windows and cohort[0] <= at < cohort[1]:
            cohort[2] += 1
            return cohort
        return None

    def ended(self, key: int) -> None:
        """The request admitted() under `key` no longer runs (its class's rank may have moved on a reload)."""
        for window in self.windows.values():
            if window.running.pop(key, None) is not None:
                return

    @staticmethod
    def withdrawn(cohort: list[float] | None) -> None:
        """A request admitted() counted in `cohort` never ran (its slot given back unused): it will never be
        served, and counted it held the window blind after a latency cut up to target x SLO."""
        if cohort is not None:
            cohort[2] -= 1

    def _blind(self, now: float) -> bool:
        """Whether the window cannot yet speak for the requests admitted since the last latency cut: the first
        interval's are not mostly served (a quantile of the quickest of them reads room that is not there), up to
        target x SLO, the longest a request can run inside a window that meets its target."""
        cohort = self._cohort
        if cohort is None or now >= self._blind_until:
            return False
        return now < cohort[1] or cohort[3] < self.spec.quantile * cohort[2]

    def latency_ratio(self, now: float, calm: bool = True) -> tuple[float | None, bool]:
        """(target x SLO over the served quantile, for the class furthest from its target (None: too few
        samples); whether that class's latency is up from its calm baseline, i.e. load is what slows it).
        `calm`: the limit does not bind, so the baseline may follow a slower mix. The quantile counts the class's
        requests still running (censored_quantile); while it is only a lower bound under the target, the ratio is
        1: no room is known, so the limit neither rises nor is cut on it."""
        worst, loaded = None, False
        for rank, window in self.windows.items():
            read = window.censored_quantile(now, self.spec.quantile, self.spec.window_s,
                                            MAX_AGE_WINDOWS * self.spec.window_s, self.spec.min_samples,
                                            max(self.counted_since, self.stalled_since))
            if read is None:
                self.served.pop(rank, None)
                continue
            served, known = read
            self.served[rank] = served
            # The calm baseline: the lowest quantile seen, drifting up slowly so a changed mix is followed.
            # Only while the limit does not bind: under a slow ramp or a long overload the latency is the load's,
            # and a baseline drifting after it stopped the cuts within seconds (the limit froze over the SLO).
            # Not from a lower bound: that is no measure of the calm latency.
            base = self.baseline.get(rank, served)
            if known:
                base = self.baseline[rank] = min(served, base * (1 + BASELINE_DRIFT * calm))
            ratio = self.spec.target * self.slos[rank] / max(served, 1e-6)
            if not known:
                ratio = min(ratio, 1.0)
            if worst is None or ratio < worst:
                worst, loaded = ratio, served > base * LOAD_TOLERANCE
        return worst, loaded

    def update(self, now: float, inflight: float, short: bool, saturated: bool | None, roomy: bool = False,
               fleeting: bool = False) -> float:
        """Sample the load; move the limit if an interval has passed. Returns the limit. `short`: a request
        waited for room under the limit since the last move; `saturated`: the replicas' word (None: the pool is
        not scraped); `roomy`: they have plenty of room (nothing waiting, KV cache well below saturation);
        `fleeting`: their word rests on waiting requests a snapshot cannot tell from passing through
        (PoolSaturation.fleeting)."""
        self._sample(now, inflight)
        if self.onset is not None:
            self.onset.curve.sample(now, inflight)
        spec = self.spec
        if self.moved_at is not None and now - self.moved_at < spec.interval_s:
            return self.limit
        self.moved_at = now
        avg = self.inflight_avg
        binding = short or inflight >= BINDING * self.limit
        ratio, loaded = self.latency_ratio(now, calm=not binding)
        if saturated and fleeting and ratio is not None and ratio >= ROOMY_RATIO:
            # A request caught between its arrival and the next engine step, at a rate where one waiting reads as
            # held (server.saturation, PASSING_STEPS), with the latency under half its target: not a full pool.
            # At ~80 completions a second a replica the limit was cut 8 times a minute at 60% load on it, the
            # latency at a quarter of its target (scenarios/code-completion.yaml). Near the target such a reading
            # still counts: there it is how a ramp's onset shows first (scenarios/one-model-ramp.yaml).
            saturated = False
        # Saturation for two moves in a row: a single scrape with a request waiting one engine step behind a
        # long prefill is not a full pool.
        persistent, self._was_saturated = saturated and self._was_saturated, bool(saturated)
        if persistent and inflight > self.limit:
            # The last cut has not drained yet: cutting again would count the same queue twice, and a queue that
            # never drains (a hung replica's, until it is seen stalled) took the limit to its floor in seconds.
            self.last_action = "hold"
        elif persistent:
            self.sized_on = inflight
            self._cut(now, min(self.limit, inflight) * spec.decrease, "cut_saturated", clear=False)
        elif ratio is not None and ratio < 1.0 and loaded:
            self.sized_on = max(avg, inflight)
            self._cut(now, min(self.limit, self.sized_on) * max(ratio, spec.decrease), "cut_latency")
        elif ratio is not None and avg > 0:
            if binding and self._blind(now):
                self.last_action = "hold"  # the window cannot speak yet for what was admitted since the cut
            elif binding:  # requests wait for room and the latency has some to give: raise, by how much it has
                step = spec.max_raise * min(1.0, max(0.0, ratio - 1.0) * RAISE_GAIN)
                if not (roomy and ratio >= ROOMY_RATIO):
                    step = min(step, self._raise_room(now))
                self.proven = self.limit  # it held requests back with the latency in target
                self.limit = min(spec.max, self.limit * (1 + step))
                self.last_action = "raise" if step > 0 else "hold"
                if step > 0:
                    self._raises.append((now, 1 + step))
            else:
                # Not binding: come down towards what the load needs, with room for a burst, so that a limit
                # far above any load cannot let a spike's first seconds overfill the pool.
                if not self.proven and ratio >= 1.0:
                    self.served_peak = max(self.served_peak, min(self.inflight_peak, self.limit))
                # Idle, a limit that never bound (nothing proven) followed the fading peak to its floor (1), and the
                # next burst ran one request at a time: it keeps half the most it served in target instead.
                floor = self.proven or (self.served_peak if inflight == 0 else 0.0)
                level = max(self.inflight_peak * (1 + self._burst_room(ratio, roomy)), PROVEN_FLOOR * floor)
                if level < self.limit:
                    self.limit = max(spec.min, level)
                    self.last_action = "settle"
                else:
                    self.last_action = "hold"
        elif binding and roomy and not self.windows:
            # No class has an SLO: the replicas' word that they have plenty of room.
            self.limit = min(spec.max, self.limit * (1 + spec.max_raise))
            self.last_action = "raise"
        else:
            self.last_action = "hold"
        if self.onset is not None and 0 in self.slos:
            self._onset_cap(now)
        return self.limit

    def _onset_cap(self, now: float) -> None:
        """The onset guard (onset.py): during a surge of the first class's arrivals, at most the load its curve
        says meets the target, until the latency loop cuts."""
        onset, spec = self.onset, self.spec
        cap = onset.cap(now, spec.target * self.slos[0], spec.quantile, spec.min_samples)
        if cap is None:
            return
        if self.last_action == "cut_latency":
            onset.released = True
        elif self.limit > cap:
            self.limit = max(spec.min, cap)
            self.last_action = "onset_cap"

    @staticmethod
    def _burst_room(ratio: float, roomy: bool) -> float:
        """The settle's room over the recent peak: SETTLE_HEADROOM, and more while the replicas are roomy and the
        latency is under half its target, in proportion to the latency's room. A small model's pool beside a
        large one (answers in a fifth of the SLO, one or two requests in flight) kept room for barely one more,
        so a burst of three waited out its wait bound on an idle replica and was refused (scenarios/shared-small:
        8 of 199 at 60% load, 65 in the spike). Near the target the room stays as it was: there the spike's
        first seconds are what it holds back."""
        return SETTLE_HEADROOM * (max(1.0, ratio - 1.0) if roomy else 1.0)

    def _raise_room(self, now: float) -> float:
        """How much the limit may still rise now: RAISE_PER_DELAY within the last feedback delay, less the raises
        already made in it."""
        delay = self._feedback_delay(now)
        raised = 1.0
        for at, factor in self._raises:
            if now - at < delay:
                raised *= factor
        while self._raises and now - self._raises[0][0] >= delay:
            self._raises.popleft()
        return max(0.0, (1 + RAISE_PER_DELAY) / raised - 1)

    def _feedback_delay(self, now: float) -> float:
        """The slowest class's median service time over its window (0 without samples)."""
        delay = 0.0
        for window in self.windows.values():
            median = window.quantile(now, 0.5, self.spec.window_s, MAX_AGE_WINDOWS * self.spec.window_s, 1)
            if median is not None:
                delay = max(delay, median)
        return delay

    def _cut(self, now: float, new: float, action: str, clear: bool = True) -> None:
        self.limit = self.proven = max(self.spec.min, min(self.limit, new))
        if clear:
            self._fresh(now, action)
        else:
            self.last_action = action

    def _fresh(self, now: float, action: str) -> None:
        """Cut on latency: the latency that asked for it must not ask again; only requests admitted from now on
        count."""
        self.last_action = action
        self.counted_since = now
        self._cohort = [now, now + self.spec.interval_s, 0, 0]
        self._blind_until = now + max((self.spec.target * slo for slo in self.slos.values()), default=0.0)
        for w in self.windows.values():
            w.clear()

    def _sample(self, now: float, inflight: float) -> None:
        """In-flight averaged over about the latency window (the load the window's latencies were served at)."""
        if self._sampled_at is None:
            self.inflight_avg = self.inflight_peak = inflight
        else:
            k = math.exp(-max(now - self._sampled_at, 0.0) / self.spec.window_s)
            self.inflight_avg = k * self.inflight_avg + (1 - k) * inflight
            self.inflight_peak = max(inflight, k * self.inflight_peak + (1 - k) * inflight)
        self._sampled_at = now


class PoolGate:
    """One pool's limit and what each class holds of it; classes are ranked (0 = highest priority)."""

    def __init__(self, name: str, spec: PoolLimitSpec, slos: dict[int, float], min_shares: list[float],
                 class_names: list[str], previous: PoolGate | None = None):
        self.name = name
        self.class_names = class_names         # by rank: a reload keeps this gate only for the same classes
        self.spec = spec
        self.tokens = spec.unit == "tokens"
        self.controller = self._controller(spec, slos, previous)
        self.limit = self.controller.limit
        self.inflight = 0.0                    # units held, every class (and classes a reload removed)
        self.holding = 0                       # requests held, every class (and classes a reload removed)
        self.held = [0.0] * len(min_shares)    # units held per class rank
        self.count = [0] * len(min_shares)     # requests held per class rank
        self.waiting = [0] * len(min_shares)   # requests queued for this pool per class rank
        # per class rank: flow -> [units, requests] it holds (a flow under its share may over-commit, see owed)
        self.flows: list[dict[str, list[float]]] = [{} for _ in min_shares]
        self.short = False                     # a request waited for room under the limit since the last move
        self.stuck = 0.0                       # units held by requests a stalled replica holds (not the pool's)
        # While a replica of the pool is seen stalled: that stall's number (0: none seen), and the units held by the
        # requests taken since, sent to the working replicas (policy.steering): only those taken before may be
        # the hung replica's.
        self.stall = 0
        self.steered = 0.0
        self.min_shares = min_shares
        self.rest_until = [-math.inf] * len(min_shares)  # per class rank: no request over its share before then
        # Per class rank whose latency breaker asked: (its breaker opened at, until when the classes below it get
        # only their guarantee). One (rank, until) for every breaker let a second breaker's squeeze free the classes
        # between the two at once, and the two renew each other's as new openings.
        self._squeezes: dict[int, tuple[float, float]] = {}
        if previous is not None:  # a reload that replaced the gate: a resting class rests on, under its new rank,
            # and a squeeze holds on: dropped, the classes below went beyond their guarantee at once with the
            # breaker still open, and its next request squeezed them a whole cooldown more in the same opening.
            self.stall = previous.stall  # the requests it holds move here with the stall they were taken in
            for rank, cls in enumerate(previous.class_names):
                if cls in class_names:
                    self.rest_until[class_names.index(cls)] = previous.rest_until[rank]
                    if rank in previous._squeezes:
                        self._squeezes[class_names.index(cls)] = previous._squeezes[rank]

    def _controller(self, spec: PoolLimitSpec, slos: dict[int, float], previous: PoolGate | None) -> PoolLimit:
        """The limit this gate starts from: what the gate it replaces (a reload) learned, unless the unit changed
        (a limit in requests says nothing in tokens) or a new `initial` asks to start again."""
        if previous is None or previous.spec.unit != spec.unit or previous.spec.initial != spec.initial:
            return PoolLimit(spec, slos)
        controller = previous.controller
        controller.limit = previous.limit
        ranks = {r: self.class_names.index(c) for r, c in enumerate(previous.class_names) if c in self.class_names}
        controller.respec(spec, slos, ranks)
        return controller

    def reconfigure(self, slos: dict[int, float], min_shares: list[float]) -> None:
        """A reload kept the limit spec and the classes: keep the learned limit and what is held."""
        self.controller.reconfigure(slos)
        self.min_shares = min_shares

    def rank_of(self, cls: str) -> int | None:
        """A class's rank here; None for one the policy no longer has (what it holds counts, as no class's)."""
        return self.class_names.index(cls) if cls in self.class_names else None

    def units(self, prompt_tokens: int, output_tokens: float, sequences: int = 1) -> float:
        """What one request weighs against the limit. In tokens, its prompt and the output it asked for (its
        `max_tokens`, all sequences: what it may come to hold in KV), not the output expected at the learned
        ratio: that ratio is learned as the ext_proc runs, and a unit that shrank under the limit would let the
        same limit admit more (engine-model what-if, learned from 5% of answers: 310 refused or degraded at 60%
        load against 278 over bench/seeds.py's seeds, and worse p99 on three held-out fleets). In requests, the
        sequences it makes a replica run: vLLM runs each of `n` outputs (and each prompt of a completions list) as
        a request of its own, and its running and waiting gauges, which the limit is cut against, count them so
        (an n=8 request showed 8 running)."""
        return float(prompt_tokens + output_tokens) if self.tokens else float(sequences)

    def guaranteed(self, rank: int, units: float, now: float) -> bool:
        """Within the class's own share: admitted whatever waits above it. A class holding nothing may also run one
        request larger than its share, once it has rested after the last (rest_after): a share smaller than one
        request must not starve the class, nor give it a request's worth of the pool for good. Held back-to-back,
        one batch request took ~15% of the demo pool at a 5% share, and with several ext_proc instances (each its
        own gate) one per instance: the first class's full-model goodput fell by 13% with two, 44% with four."""
        if self.held[rank] + units <= self.min_shares[rank] * self.limit:
            return True
        return self.count[rank] == 0 and now >= self.rest_until[rank]

    def rest_after(self, rank: int, units: float) -> float:
        """For a request of a class below the first taken over its share while the pool is contended: how long
        the class then rests per second it ran, so that on average it holds its share (at least MIN_SHARE)."""
        if rank == 0 or self.held[rank] + units <= self.min_shares[rank] * self.limit:
            return 0.0
        return max(0.0, units / (max(self.min_shares[rank], MIN_SHARE) * self.limit) - 1.0)

    def rest(self, rank: int | None, until: float, now: float) -> None:
        """No request over the share for the class before `until`, at most MAX_REST_S after `now` (rank None: a
        class a reload removed rests no more)."""
        if rank is not None:
            self.rest_until[rank] = max(self.rest_until[rank], min(until, now + MAX_REST_S))

    def fits(self, rank: int, units: float, now: float) -> bool:
        """Room for this request now, before looking at who waits (see admits)."""
        if self.guaranteed(rank, units, now):
            return True
        if self._squeezed(rank, now):
            return False
        # A pool that holds nothing takes the request whatever its size: a resting lower class on a limit its fill
        # leaves no room in (a limit cut to 1 request) waited out max_wait on the idle pool, taking nothing.
        if self.room(rank, units) or not self.holding:
            return True
        if rank == 0 and self.spec.borrow_lower and self.inflight - self.lower_excess() + units <= self.limit:
            return True
        self.short = True
        return False

    def snapshot(self, now: float, waiting: list[int]) -> dict:
        """The gate as /healthz shows it: the limit, what is held (a stalled replica's share apart), the
        controller's last move and, per class, what it holds, how many of its requests wait for the pool
        (`waiting`, by rank) and how long it is held to its share."""
        classes = {}
        for rank, cls in enumerate(self.class_names):
            rest, squeezed = self.held_to_share(rank, now)
            classes[cls] = {"held": round(self.held[rank], 1), "requests": self.count[rank],
                            "waiting": waiting[rank], "rest_s": round(rest, 1), "squeeze_s": round(squeezed, 1)}
        return {"unit": self.spec.unit, "limit": round(self.limit, 1), "held": round(self.inflight, 1),
                "stalled_held": round(self.stuck, 1), "last_action": self.controller.last_action, "classes": classes}

    def held_to_share(self, rank: int, now: float) -> tuple[float, float]:
        """Seconds the class at `rank` still gets no more than its guarantee: (its rest after a request over its
        share, the squeeze a higher class's latency breaker asked for). The squeeze holds even with room."""
        rest = max(0.0, self.rest_until[rank] - now)
        squeezed = max(0.0, self.squeezed_until(rank) - now) if self._squeezes else 0.0
        return rest, squeezed

    def held_back_by(self, rank: int, units: float, now: float) -> str:
        """What keeps a request of the class at `rank` out of the pool now, beyond its guarantee, in words for its
        refusal: an on-call reading "no free slot" looked at the class's cap, which had room (higher classes
        waiting are the caller's to name: PoolGate does not see the queues)."""
        rest, squeezed = self.held_to_share(rank, now)
        if squeezed:
            return (f"held to its min_share for {squeezed:.1f} s more: a higher class's latency breaker opened on "
                    "a full pool")
        if self.room(rank, units):
            return UNGRANTED
        if rest and self.count[rank] == 0:
            return f"resting {rest:.1f} s more after a request over its min_share"
        fill = "" if rank == 0 else f" ({LOWER_FILL:.0%} for classes below the first)"
        unit, digits = ("tokens", 0) if self.tokens else ("requests", 1)
        held = f"{self.inflight - self.stuck:.{digits}f} of {self.limit:.{digits}f} {unit}"
        return f"the limit is full: {held} held{fill}"

    def room(self, rank: int, units: float) -> bool:
        """Under the limit with this request (classes below the first: under their fill of it)."""
        return self.inflight - self.stuck + units <= (self.limit if rank == 0 else self.limit * LOWER_FILL)

    def lower_excess(self) -> float:
        """What the classes below the first hold over their guarantees (`borrow_lower` lends it to the first)."""
        return sum(max(0.0, self.held[r] - self.min_shares[r] * self.limit) for r in range(1, len(self.held)))

    def can_cut(self) -> bool:
        """Whether the limit has room to come down: latency trouble is then the limit's to fix, not a degrade's."""
        return self.limit > self.spec.min

    def lower_hold_more_than_guaranteed(self, rank: int) -> bool:
        """Whether a class below `rank` holds more than its guarantee: what yielding could still free."""
        for r in range(rank + 1, len(self.count)):
            if self.count[r] > 1 and self.held[r] > self.min_shares[r] * self.limit:
                return True
        return False

    def full(self, now: float) -> bool:
        """In flight near the limit: what a lower class holds is what a higher one lacks."""
        return self.inflight - self.stuck >= BINDING * self.limit

    def squeeze(self, rank: int, opened_at: float, until: float) -> bool:
        """Classes below `rank` get only their guarantee until `until` (their running requests finish). Once per
        opening of the breaker that asks (`opened_at`): a breaker that stays open does not starve them for good.
        True when this call squeezed."""
        last = self._squeezes.get(rank)
        if last is not None and last[0] == opened_at:
            return False
        self._squeezes[rank] = (opened_at, until)
        return True

    def _squeezed(self, rank: int, now: float) -> bool:
        """Whether the class at `rank` is held to its guarantee now by a higher class's squeeze."""
        return bool(self._squeezes) and now < self.squeezed_until(rank)

    def squeezed_until(self, rank: int) -> float:
        """Until when the class at `rank` gets only its guarantee: the latest squeeze a class above it asked for."""
        return max((until for r, (_, until) in self._squeezes.items() if r < rank), default=-math.inf)

    def owed(self, rank: int, flow: str, units: float, share: float, now: float,
             borrowed: Callable[[], float] | None = None) -> bool:
        """The owner's return: a flow that, with this request, holds no more than its `share` of what its class
        holds here (and of the class's room under the limit) goes in even on a full pool; the flows over their
        share (borrowers) wait until the pool is back under the limit. So a flood's long requests holding the
        pool make the flood wait, not the others. Over-commit is bounded: owners hold at most their shares of the
        limit, and the pool at most twice the limit (OWED_BOUND). The shares alone bound each class's owners, not
        the pool's: a lower class's one tenant (its class's whole share) went in on top of the first class's flood
        and owners (a limit of 10 held 23), and after a reload or a cut under what is held, owners went in on a pool
        already past twice the new limit. And only the room its own class's other flows hold is owed: a class's one
        flow (its whole share) went in over a pool another class had filled.
        A flow holding nothing here whose share is smaller than its one request is owed it while the class's
        borrowers hold that much over their shares (`borrowed`: FairQueue.borrowed, asked only then): else such a
        flow is never owed. With 24 tenants a weight-1 tenant's share of what the class held was under one request,
        and small tenants asking a fraction of their due lost 3-7% of their requests to the fallback
        (scenarios/audit-zipf-tiers.yaml)."""
        if share <= 0.0 or self._squeezed(rank, now):
            return False
        if self.inflight - self.stuck + units > OWED_BOUND * self.limit:
            return False
        mine = self.held_by(rank, flow)
        if self.held[rank] - mine < units:
            return False  # owed by its own class's borrowers: room another class holds is not its to take back
        cap = self.limit if rank == 0 else self.limit * LOWER_FILL
        if mine + units <= share * min(self.held[rank] + units, cap):
            return True
        return mine == 0.0 and borrowed is not None and borrowed() >= units

    def held_by(self, rank: int, flow: str) -> float:
        """The units one flow of the class at `rank` holds here."""
        mine = self.flows[rank].get(flow)
        return mine[0] if mine is not None else 0.0

    def take(self, rank: int | None, units: float, flow: str = "", stall: int | None = None) -> int:
        """Hold `units`; returns the stall they were taken in (for give_back). `stall`: the one a request moved
        here on a reload was taken in."""
        stall = self.stall if stall is None else stall
        if stall and stall == self.stall:
            self.steered += units
        self.inflight += units
        self.holding += 1
        if rank is None:
            return stall  # a class a reload removed (rank_of): it holds the pool, no class's share of it
        self.held[rank] += units
        self.count[rank] += 1
        mine = self.flows[rank].setdefault(flow, [0.0, 0])
        mine[0] += units
        mine[1] += 1
        return stall

    def give_back(self, rank: int | None, units: float, flow: str = "", stall: int = 0) -> None:
        """Give back what take() held (`stall`: what it returned)."""
        # A float sum drifts: with nothing left it is exactly 0, not -2e-13 (a gauge, and a limit's comparisons).
        self.holding -= 1
        self.inflight = self.inflight - units if self.holding else 0.0
        if stall and stall == self.stall:
            self.steered = self.steered - units if self.holding else 0.0
        if rank is None:
            return
        self.count[rank] -= 1
        self.held[rank] = self.held[rank] - units if self.count[rank] else 0.0
        mine = self.flows[rank].get(flow)
        if mine is not None:
            mine[0] -= units
            mine[1] -= 1
            if mine[1] <= 0:  # keys may be unbounded (a header): keep only flows that hold something
                del self.flows[rank][flow]

    def update(self, now: float, saturation) -> bool:
        """Move the limit (tick). True when it rose: waiters may fit now."""
        before = self.limit
        saturated = roomy = None
        self.stuck = 0.0
        stalled = saturation is not None and saturation.stalled > 0
        if stalled != bool(self.stall):  # a stall begins (what is held may be on the hung replica) or ends
            self.stall, self.steered = next(_STALLS) if stalled else 0, 0.0
            self.controller.stalled_since = now if stalled else -math.inf
        if saturation is not None and saturation.down:
            # No replica up (PoolSaturation.down; a hung one that then died is gone too): no word on load, nor on
            # demand. Read as saturation the limit was cut to its floor; read by latency alone it settled towards
            # the outage's in flight, requests failing in a millisecond (18 -> 3 requests in 12 s). Held, it is
            # what the replicas take back.
            return False
        if saturation is not None:
            saturated = saturation.saturated
            roomy = not saturated and saturation.waiting == 0 and saturation.kv_usage < ROOMY_KV
            if saturation.stalled_requests and self.holding:
                # A hung replica's requests load nothing the limit measures, and end only when their clients give
                # up: counted, they held the limit shut while the working replicas idled. In requests each weighs
                # one unit (vLLM's gauges count sequences, as units() does: weighed by the mean request, n=4 ones
                # counted four times over); in tokens, which of ours they are is unknown: the mean of what is held.
                # Only what was taken before the stall was seen may be there: its gauges go on counting requests
                # whose clients gave up (nothing steps to drop them), and left out of the working replicas' share
                # they let that many over the limit onto those, for as long as the hang lasted.
                per = self.inflight / self.holding if self.tokens else 1.0
                self.stuck = min(self.inflight - self.steered, saturation.stalled_requests * per)
        self.limit = self.controller.update(now, self.inflight - self.stuck, self.short, saturated, bool(roomy),
                                            fleeting=saturation is not None and saturation.fleeting)
        if self.controller.moved_at == now:
            self.short = False
        return self.limit > before
