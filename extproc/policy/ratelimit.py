"""Per-tenant token buckets (requests and tokens per minute) and agent-session budgets."""

from __future__ import annotations

import math
from collections import OrderedDict

from .schema import SessionSpec, TenantSpec


class TokenBucket:
    """`rate` units per second, holding at most `capacity`. May go negative (a request larger than what is left,
    usage corrected upward), but never below -capacity: one request of max_tokens 2**31 charged its worst case
    locked its tenant out for 36 hours; the debt now refills within two burst windows at most."""

    __slots__ = ("rate", "capacity", "level", "_at")

    def __init__(self, rate_per_s: float, capacity: float, now: float):
        self.rate = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self._at = now

    def refill(self, now: float) -> float:
        if now > self._at:
            self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
            self._at = now
        return self.level

    def carry(self, old: TokenBucket | None, now: float) -> None:
        """A reload replaced `old` by this bucket: start from what was left of it, within this one's capacity and
        debt floor (an edit neither hands out a fresh burst nor forgives a debt)."""
        if old is not None:
            self.level = max(-self.capacity, min(self.capacity, old.refill(now)))

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until `n` units are available (0 when they are now; inf when n exceeds the capacity)."""
        level = self.refill(now)
        if level >= n:
            return 0.0
        if n > self.capacity:
            return math.inf
        return (n - level) / self.rate

    def take(self, n: float, now: float) -> float:
        """Take `n` (down to the debt floor); returns what was taken, the most a refund may give back."""
        self.refill(now)
        return self.debit(n)

    def debit(self, n: float) -> float:
        """Take `n` without refilling first, down to -capacity at most; returns what was taken."""
        before = self.level
        self.level = max(self.level - n, -self.capacity)
        return before - self.level

    def give(self, n: float) -> None:
        self.level = min(self.capacity, self.level + n)


class TenantLimits:
    """A tenant's request and token buckets (OpenAI-style x-ratelimit-* headers come from here)."""

    def __init__(self, spec: TenantSpec, now: float):
        self.spec = spec
        self.requests = (TokenBucket(spec.requests_per_minute / 60.0, spec.requests_per_minute * spec.burst_s / 60,
                                     now) if spec.requests_per_minute else None)
        self.tokens = (TokenBucket(spec.tokens_per_minute / 60.0, spec.tokens_per_minute * spec.burst_s / 60, now)
                       if spec.tokens_per_minute else None)

    def carried_from(self, old: TenantLimits | None, now: float) -> TenantLimits:
        """A reload changed the tenant's limits: each bucket both have keeps what was left of it (within the new
        capacity and debt floor), so an edit does not hand the tenant a fresh burst, nor forgive its debt."""
        if old is not None:
            for new_bucket, old_bucket in ((self.requests, old.requests), (self.tokens, old.tokens)):
                if new_bucket is not None:
                    new_bucket.carry(old_bucket, now)
        return self

    def check(self, tokens: int, now: float) -> tuple[str | None, float]:
        """(None, 0) if the request fits, else (the limit it waits for longest, seconds until both would hold
        it). The wait is for both: a refusal by the request limit said when a request was back in its bucket while
        the tokens came back later, and a client that honoured its Retry-After was refused again."""
        which, longest = None, 0.0
        if self.requests is not None:
            # A bucket shallower than one request (requests_per_minute * burst_s < 60) waits for what it can hold,
            # as the token bucket does: waiting for a whole request in it was forever.
            wait = self.requests.wait_s(min(1, self.requests.capacity), now)
            if wait > 0:
                which, longest = "requests", wait
        if self.tokens is not None:
            wait = self.tokens.wait_s(min(tokens, self.tokens.capacity), now)
            if wait > longest:
                which, longest = "tokens", wait
        return which, longest

    def charge(self, tokens: int, now: float) -> int:
        """Returns the tokens taken: fewer than asked when the bucket's debt floor clipped them, none without a
        tokens bucket (later refunds and corrections are relative to what was taken, so they cannot make up tokens
        the bucket never gave: a reload that added a tokens limit had the requests running refunded, into the new
        bucket, tokens they never paid)."""
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            # Rounded down (past a float's noise): a refund must not give back a token the bucket never gave. Up,
            # 4095.0000000000005 taken was booked 4096.
            return math.floor(self.tokens.take(tokens, now) + 1e-6)
        return 0

    def refund(self, tokens: int) -> None:
        """A request charged when it was queued that was never admitted (refused, shed, its client left)."""
        if self.requests is not None:
            self.requests.give(1)
        if self.tokens is not None:
            self.tokens.give(tokens)

    def correct(self, charged: int, actual: int) -> None:
        """Real usage is known: refund what was over-charged (or charge the rest)."""
        if self.tokens is not None:
            if actual < charged:
                self.tokens.give(charged - actual)
            else:
                self.tokens.debit(actual - charged)

    def headers(self, now: float) -> list[tuple[str, str]]:
        out = []
        for name, bucket, limit in (("requests", self.requests, self.spec.requests_per_minute),
                                    ("tokens", self.tokens, self.spec.tokens_per_minute)):
            if bucket is None:
                continue
            level = bucket.refill(now)
            out.append((f"x-ratelimit-limit-{name}", str(limit)))
            out.append((f"x-ratelimit-remaining-{name}", str(max(int(level), 0))))
            # Rounded up: 0.4 s from full read "0s" (reset) beside a remaining below the limit.
            out.append((f"x-ratelimit-reset-{name}", f"{math.ceil(max(bucket.capacity - level, 0) / bucket.rate)}s"))
        return out


class Session:
    __slots__ = ("inflight_gpu_s", "inflight", "bucket", "tenant", "queued", "queued_gpu_s", "key")

    def __init__(self, tenant: str, key: tuple[str, str] | None = None):
        self.key = key     # (tenant, session id): its place in the table
        self.inflight_gpu_s = 0.0
        self.inflight = 0  # requests: what says whether it runs (the GPU-seconds' float sum drifts)
        self.queued = 0    # requests queued (they prepaid its rate): it is kept for them as for those running
        self.queued_gpu_s = 0.0  # what they will hold in flight once granted
        self.bucket: TokenBucket | None = None
        self.tenant = tenant


class SessionBudgets:
    """Requests with the same session id share an in-flight GPU-seconds budget and a GPU-seconds-per-minute
    bucket. Session ids come from clients, so the table is bounded (least recently used forgotten first) and
    never becomes a metric label."""

    def __init__(self, spec: SessionSpec):
        self.spec = spec
        self.sessions: dict[tuple[str, str], Session] = {}
        # The idle sessions (nothing running or queued), least recently seen or ended first: those that may be
        # forgotten, without a pass over the busy ones (each fresh session id looked at every session running).
        self._idle: OrderedDict[tuple[str, str], None] = OrderedDict()

    def carried_from(self, old: SessionBudgets | None, now: float) -> SessionBudgets:
        """A reload changed the session knobs: the sessions go on, each with what it has in flight (its running
        requests release against it) and what was left of its per-minute bucket (within the new capacity and debt
        floor), so an edit does not hand every session a fresh budget."""
        if old is None:
            return self
        rate = self.spec.gpu_seconds_per_minute
        for key, s in old.sessions.items():
            bucket, s.bucket = s.bucket, TokenBucket(rate / 60.0, rate, now) if rate else None
            if s.bucket is not None:
                s.bucket.carry(bucket, now)
            self.sessions[key] = s
        self._idle = OrderedDict(old._idle)
        self._forget_idle()  # a lowered max_sessions holds from now, not from the next new session
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.spec.max_inflight_gpu_seconds or self.spec.gpu_seconds_per_minute)

    def get(self, tenant: str, session_id: str, now: float) -> Session:
        key = (tenant, session_id)  # per tenant: one tenant cannot drain another's session by guessing its id
        s = self.sessions.get(key)
        if s is None:
            s = self.sessions[key] = Session(tenant, key)
            self._idle[key] = None
            if self.spec.gpu_seconds_per_minute:
                rate = self.spec.gpu_seconds_per_minute
                s.bucket = TokenBucket(rate / 60.0, rate, now)
            self._forget_idle(keep=key)
        elif key in self._idle:  # the order forgetting reads is the idle ones' own
            self._idle.move_to_end(key)
        return s

    def _forget_idle(self, keep: tuple[str, str] | None = None) -> None:
        """Down to `max_sessions`, forgetting the idle sessions least recently seen (or ended) but `keep` (the one
        just made, the idle one seen last); one running or queued is kept (forget nothing held). Stopping at the
        first busy one kept every idle one behind it: the table passed max_sessions by more than the sessions
        running."""
        excess = len(self.sessions) - self.spec.max_sessions
        idle = self._idle
        while excess > 0 and idle:
            key = next(iter(idle))
            if key == keep:
                return
            del idle[key]
            del self.sessions[key]
            excess -= 1

    def _busy(self, s: Session) -> None:
        self._idle.pop(s.key, None)

    def _maybe_idle(self, s: Session) -> None:
        """Nothing of `s` runs or waits any more: it may be forgotten, after those idle longer."""
        if s.inflight == 0 and s.queued == 0 and self.sessions.get(s.key) is s:
            self._idle[s.key] = None

    def check(self, s: Session, gpu_s: float, now: float) -> tuple[str | None, float]:
        cap = self.spec.max_inflight_gpu_seconds
        # Its queued requests count as in flight: granted together when slots free, those that each fitted beside
        # the running ones alone ran past the budget at once (0.6 GPU-s in flight on a budget of 0.5).
        held = s.inflight_gpu_s + s.queued_gpu_s
        if cap and held > 0 and held + gpu_s > cap:
            return "session_inflight", 1.0
        wait = self.rate_wait(s, gpu_s, now)
        if wait > 0:
            return "session_rate", wait
        return None, 0.0

    @staticmethod
    def rate_wait(s: Session, gpu_s: float, now: float) -> float:
        """Seconds until the session's per-minute bucket holds `gpu_s` (at most its capacity); 0 without one."""
        return s.bucket.wait_s(min(gpu_s, s.bucket.capacity), now) if s.bucket is not None else 0.0

    def charge(self, s: Session, gpu_s: float, now: float, rate: bool = True) -> float:
        """In flight from now; `rate`: also take it from the per-minute bucket (False: taken when queued). Returns
        what was taken from the bucket."""
        s.inflight_gpu_s += gpu_s
        s.inflight += 1
        self._busy(s)
        return self.charge_rate(s, gpu_s, now) if rate else 0.0

    def enqueue(self, s: Session, gpu_s: float) -> None:
        s.queued += 1
        s.queued_gpu_s += gpu_s
        self._busy(s)

    def dequeue(self, s: Session, gpu_s: float) -> None:
        s.queued = max(s.queued - 1, 0)
        s.queued_gpu_s = max(s.queued_gpu_s - gpu_s, 0.0) if s.queued else 0.0  # no float dust left queued
        self._maybe_idle(s)

    @staticmethod
    def charge_rate(s: Session, gpu_s: float, now: float) -> float:
        """Take `gpu_s` from the per-minute bucket; returns what was taken (down to its debt floor; none without
        a bucket), the most a refund may give back."""
        return s.bucket.take(gpu_s, now) if s.bucket is not None else 0.0

    @staticmethod
    def refund_rate(s: Session, gpu_s: float) -> None:
        if s.bucket is not None:
            s.bucket.give(gpu_s)

    def release(self, s: Session, gpu_s: float) -> None:
        s.inflight = max(s.inflight - 1, 0)
        # Nothing in flight is exactly 0: parallel calls' costs added and taken out in another order left dust
        # (3e-17) that kept an idle session from ever being forgotten, and the table grew past max_sessions.
        s.inflight_gpu_s = max(s.inflight_gpu_s - gpu_s, 0.0) if s.inflight else 0.0
        self._maybe_idle(s)
