"""A model-based test of who pays (ratelimit.py, charging.py) as the core drives it: requests of tenants with
requests- and tokens-per-minute buckets and of agent sessions with GPU-seconds budgets arrive, queue, are refused,
degraded, admitted, end (ok, upstream error, client abort; with usage read or not), leave their queue or time out,
while time passes on a virtual clock and reloads change the tenants' limits and the session knobs mid-sequence.

Every bucket operation is booked to the request it is made for (the Charging step, or the completion, that makes
it). Checked after every step: no bucket holds more than its capacity nor owes more than it (the debt bound); no
request gets back more than it paid, of any bucket, and none pays two requests; a request never admitted has paid
nothing in the end (refunded); a refusal's Retry-After for a rate limit is never before every bucket the request
needs would hold it, and not a second later (docs/troubleshooting.md: exact); any other 429/503 says 1 to
`retry_after_max_s`; a reload carries each bucket's level over, within the new capacity (docs/configuration.md, the
module docstrings: an edit neither hands out a fresh burst nor forgives a debt). Each session holds what its running
and queued requests cost, within its in-flight budget, and its table is back within `max_sessions` (passed only by
the sessions busy) whenever a session is made or a reload lowers it. At the end, everything drained and a long
idle time passed, every session is idle and every bucket full.
"""

from __future__ import annotations

import copy
import math
import random

import pytest

from extproc.policy import charging, outcomes
from extproc.policy.admission import QUEUE, AdmissionController, RequestFacts
from extproc.policy.limits import Completion, Outcome
from extproc.policy.ratelimit import SessionBudgets, TenantLimits, TokenBucket
from extproc.policy.reasons import R_SESSION_RATE, R_TENANT_REQUESTS, R_TENANT_TOKENS
from extproc.policy.schema import load_policy
from tests.conftest import FakeClock, pass_time

MODELS = {"llama": {"cluster": "pool_a", "cost": {"max_context_tokens": 8192}},
          "small": {"cluster": "pool_b"}}
KEYS = {"a": "sk-a", "b": "sk-b", "anonymous": None}
RATE_REASONS = (R_TENANT_REQUESTS, R_TENANT_TOKENS, R_SESSION_RATE)
EPS = 1e-6
ROLES = ("requests", "tokens", "session", "other")


def doc(a: dict, b: dict, sessions: dict, anonymous: dict | None = None) -> dict:
    return {"classes": {"hi": {"max_concurrency": 2, "max_queue": 2, "max_wait_ms": 400, "on_overflow": "fallback",
                               "fallback": {"action": "degrade", "model": "small", "max_tokens": 16,
                                            "max_concurrency": 1}},
                        "lo": {"max_concurrency": 1, "max_queue": 2, "max_wait_ms": 900, "on_overflow": "fallback",
                               "fallback": {"action": "canned", "status": 429}}},
            "default_class": "hi", "models": MODELS, "retry_after_max_s": 30,
            "tenants": [{"name": "a", "api_keys": ["sk-a"], **a},
                        {"name": "b", "api_keys": ["sk-b"], "max_class": "lo", **b}],
            "anonymous": {"max_class": "lo", **(anonymous or {})}, "sessions": sessions}


POLICIES = [load_policy(p) for p in (
    # both limits on a, tokens only on b, requests only on anonymous; both session budgets
    doc({"requests_per_minute": 30, "tokens_per_minute": 6000, "burst_s": 10}, {"tokens_per_minute": 20000},
        {"max_inflight_gpu_seconds": 2.0, "gpu_seconds_per_minute": 6, "max_sessions": 3},
        {"requests_per_minute": 12, "burst_s": 5}),
    # a's limits tightened (smaller buckets: carried levels are clipped), b gains a request limit, sessions' rate
    # halved
    doc({"requests_per_minute": 12, "tokens_per_minute": 3000, "burst_s": 5},
        {"requests_per_minute": 20, "tokens_per_minute": 20000},
        {"max_inflight_gpu_seconds": 2.0, "gpu_seconds_per_minute": 3, "max_sessions": 2}),
    # a loses its token limit, b loses its limits, sessions keep only the in-flight budget
    doc({"requests_per_minute": 60}, {}, {"max_inflight_gpu_seconds": 1.0, "max_sessions": 3},
        {"requests_per_minute": 30, "tokens_per_minute": 4000}),
    # a's token limit back and loosened, b's back, session rate back and raised; no anonymous limit
    doc({"requests_per_minute": 60, "tokens_per_minute": 30000, "burst_s": 20}, {"tokens_per_minute": 8000},
        {"gpu_seconds_per_minute": 12, "max_sessions": 2}),
    # loose limits, a tight in-flight budget per session: its requests queue side by side
    doc({"requests_per_minute": 600}, {"tokens_per_minute": 600_000}, {"max_inflight_gpu_seconds": 1.5}),
)]


class Books:
    """Each bucket operation, booked to the request it is made for: the request's net take of its tenant's requests
    bucket, of its tokens bucket and of its session's bucket (what the bucket's level really moved)."""

    SAVED = {"take": TokenBucket.take, "debit": TokenBucket.debit, "give": TokenBucket.give,
             "admitted": charging.Charging.admitted, "prepay": charging.Charging.prepay,
             "refund": charging.Charging.refund, "clamp": charging.Charging.clamp,
             "released": charging.Charging.released, "completed": outcomes.CostLearning.completed}

    def __init__(self) -> None:
        self.net: dict[int, dict[str, float]] = {}   # id(Charge) -> role -> what it paid, net
        self.asked: dict[int, dict[str, float]] = {}  # the same, with what it asked back (not what was held)
        self.charges: dict[int, object] = {}
        self.current = None                          # the Charge the running step settles
        self.stray: list[str] = []                   # bucket moves no request was being charged for
        self.inside = False
        books = self

        def moved(bucket, op, *args):
            if books.inside:  # take() debits: booked once, by the outer call
                return books.SAVED[op](bucket, *args)
            before, books.inside = bucket.level, True
            try:
                out = books.SAVED[op](bucket, *args)
            finally:
                books.inside = False
            # A give asks for `n` back; the bucket may hold less of it (its capacity, which a reload may lower).
            books._book(bucket, before - bucket.level, -args[0] if op == "give" else before - bucket.level)
            return out

        def for_charge(name):
            def step(self_, charge, *args, **kw):
                return books._within(charge, books.SAVED[name], self_, charge, *args, **kw)
            return step

        def completed(self_, c):
            return books._within(c.ticket.charge, books.SAVED["completed"], self_, c)

        TokenBucket.take = lambda b, n, now: moved(b, "take", n, now)
        TokenBucket.debit = lambda b, n: moved(b, "debit", n)
        TokenBucket.give = lambda b, n: moved(b, "give", n)
        for name in ("admitted", "prepay", "refund", "clamp", "released"):
            setattr(charging.Charging, name, for_charge(name))
        outcomes.CostLearning.completed = completed

    def _within(self, charge, f, *args, **kw):
        before, self.current = self.current, charge
        try:
            return f(*args, **kw)
        finally:
            self.current = before

    def _book(self, bucket, paid: float, asked: float) -> None:
        charge = self.current
        if charge is None:
            if paid:
                self.stray.append(f"{paid:+g} with no request")
            return
        tenant, session = charge.tenant, charge.session
        role = ("requests" if tenant is not None and bucket is tenant.requests else
                "tokens" if tenant is not None and bucket is tenant.tokens else
                "session" if session is not None and bucket is session.bucket else "other")
        self.charges[id(charge)] = charge
        for books, moved in ((self.net, paid), (self.asked, asked)):
            books.setdefault(id(charge), dict.fromkeys(ROLES, 0.0))[role] += moved

    def paid(self, charge, asked: bool = False) -> dict[str, float]:
        return (self.asked if asked else self.net).get(id(charge), dict.fromkeys(ROLES, 0.0))

    @classmethod
    def close(cls) -> None:
        for name in ("take", "debit", "give"):
            setattr(TokenBucket, name, cls.SAVED[name])
        for name in ("admitted", "prepay", "refund", "clamp", "released"):
            setattr(charging.Charging, name, cls.SAVED[name])
        outcomes.CostLearning.completed = cls.SAVED["completed"]


def holds(bucket: TokenBucket | None, need: float, at: float, slack: float = EPS) -> bool:
    """Whether a copy of `bucket`, left alone until `at`, holds `need` then (what its check asks: at most its
    capacity), within `slack` (a level summed from floats is off by ~1e-11)."""
    if bucket is None:
        return True
    b = copy.copy(bucket)
    return TokenBucket.refill(b, at) >= min(need, b.capacity) - slack


class PayModel:
    """The core driven with random events on a fake clock; the model keeps what runs, waits and ended."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.which = self.rng.randrange(len(POLICIES))
        self.core = AdmissionController(POLICIES[self.which], clock=self.clock)
        self.live: dict[int, object] = {}     # ticket id -> Ticket
        self.waiting: list = []               # pending Waiters
        self.never_ran: list = []             # charges of requests that never ran, ended in this step
        self.ran: list = []                   # charges of requests that ran
        self.knobs_at: dict[int, object] = {}  # ticket id -> the session knobs in force when it was admitted

    # --- what the core answered ---

    def take(self, d) -> None:
        if d.kind == QUEUE:
            self.waiting.append(d.waiter)
        elif d.ticket is not None:
            self.live[d.ticket.id] = d.ticket
            self.knobs_at[d.ticket.id] = self.core.sessions.spec  # the session knobs it was admitted under
        else:
            self.refused(d)

    def sweep(self) -> None:
        for w in [w for w in self.waiting if not w.pending]:
            self.waiting.remove(w)
            self.take(w.result)

    def refused(self, d) -> None:
        if d.charge is not None:
            self.never_ran.append(d.charge)
        if d.status not in (429, 503):
            return
        if d.reason in RATE_REASONS:
            self.check_rate_retry(d)
        else:
            ceiling = self.core.policy.retry_after_max_s
            assert 1 <= d.retry_after <= ceiling, (d.reason, d.retry_after, ceiling)

    def check_rate_retry(self, d) -> None:
        """Retry-After of a rate-limit refusal: every bucket the request needs holds it then (left alone), and not
        one whole second before."""
        now, retry, ch = self.clock(), d.retry_after, d.charge
        tenant, session = ch.tenant, ch.session
        needs = []
        if tenant is not None:
            needs += [(tenant.requests, 1), (tenant.tokens, ch.tokens)]
        if session is not None:
            needs.append((session.bucket, ch.estimate.gpu_seconds))
        assert retry >= 1, (d.reason, retry)
        assert all(holds(b, n, now + retry) for b, n in needs), \
            (d.reason, d.message, retry, [(b and b.level, n) for b, n in needs])
        if retry > 1:
            assert not all(holds(b, n, now + retry - 1, -EPS) for b, n in needs), (d.reason, retry, "a second late")

    # --- events ---

    def arrive(self) -> None:
        r = self.rng
        facts = RequestFacts(api_key=KEYS[r.choice(sorted(KEYS))], header_class=r.choice([None, "hi", "lo"]),
                             model=r.choice(["llama", "llama", "small"]),
                             max_tokens=r.choice([None, 16, 200, 2000]),
                             doc={"prompt": "x" * r.choice([40, 2000, 12000])},
                             session_id=r.choice([None, "s1", "s2", "s3", "s4"]), reads_usage=r.random() < 0.7)
        known, busy = set(self.core.sessions.sessions), self.busy_sessions()
        d = self.core.decide(facts)
        if set(self.core.sessions.sessions) - known:  # a session made: the others as busy as before the decision
            self.check_table(busy + 1)
        self.take(d)
        self.sweep()

    def busy_sessions(self) -> int:
        return sum(1 for s in self.core.sessions.sessions.values() if s.inflight or s.queued)

    def check_table(self, busy: int) -> None:
        """A session just made, or a reload: the table is back within `max_sessions`, passing it only by the
        sessions running or queued (and the one just made)."""
        table = self.core.sessions
        assert len(table.sessions) <= max(table.spec.max_sessions, busy), \
            (len(table.sessions), table.spec.max_sessions, busy)

    def end(self) -> None:
        if not self.live:
            return
        r = self.rng
        t = self.live.pop(r.choice(sorted(self.live)))
        outcome = r.choice([Outcome.OK, Outcome.OK, Outcome.UPSTREAM_ERROR, Outcome.CLIENT_ABORT])
        status = {Outcome.OK: 200, Outcome.UPSTREAM_ERROR: r.choice([503, 200]), Outcome.CLIENT_ABORT: 499}[outcome]
        if r.random() < 0.7 and t.charge is not None:
            most = t.charge.estimate.most_output or 4000
            self.core.usage(t, r.choice([0, 30, 3000]), r.choice([0, 5, most]))
        self.core.report(t.id, Completion(outcome, status, None, r.choice([0.05, 1.0, 8.0])))
        assert self.core.finish(t, outcome)
        if t.charge is not None:
            self.ran.append(t.charge)
        self.sweep()

    def withdraw(self) -> None:
        """The adapter refused the admitted request after the decision (413): it never ran."""
        if not self.live:
            return
        t = self.live.pop(self.rng.choice(sorted(self.live)))
        assert self.core.withdraw(t)
        if t.charge is not None:
            self.never_ran.append(t.charge)
        self.sweep()

    def leave(self) -> None:
        if not self.waiting:
            return
        w = self.rng.choice(self.waiting)
        self.core.abandon(w, timed_out=False)
        self.sweep()

    def wait(self) -> None:
        pass_time(self.core, self.clock, self.waiting, self.clock() + self.rng.choice([0.05, 0.3, 1.0, 4.0, 15.0]),
                  self.sweep)

    def reload(self) -> None:
        """Another policy; every bucket both policies have carries its level over, clipped to the new capacity."""
        now = self.clock()
        before = {name: (lim.requests and lim.requests.refill(now), lim.tokens and lim.tokens.refill(now))
                  for name, lim in self.core.tenant_limits.items()}
        sessions = {key: s.bucket.refill(now) for key, s in self.core.sessions.sessions.items() if s.bucket}
        sessions_table = self.core.sessions.sessions
        self.which = self.rng.randrange(len(POLICIES))
        self.core.apply(POLICIES[self.which])
        for name, lim in self.core.tenant_limits.items():
            for old, bucket in zip(before.get(name, (None, None)), (lim.requests, lim.tokens)):
                if old is not None and bucket is not None:
                    assert math.isclose(bucket.level, max(-bucket.capacity, min(bucket.capacity, old)),
                                        abs_tol=EPS), (name, old, bucket.level, bucket.capacity)
        if self.core.sessions.sessions is not sessions_table:
            self.check_table(self.busy_sessions())
        for key, s in self.core.sessions.sessions.items():
            if key in sessions and s.bucket is not None:
                cap = s.bucket.capacity
                assert math.isclose(s.bucket.level, max(-cap, min(cap, sessions[key])), abs_tol=EPS), key
        self.sweep()

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.45:
            self.arrive()
        elif r < 0.7:
            self.end()
        elif r < 0.75:
            self.withdraw()
        elif r < 0.8:
            self.leave()
        elif r < 0.95:
            self.wait()
        else:
            self.reload()

    # --- the promises ---

    def buckets(self) -> list[TokenBucket]:
        owners = {id(t): t for t in self.core.tenant_limits.values()}
        sessions: dict[int, object] = {id(s): s for s in self.core.sessions.sessions.values()}
        for ch in [t.charge for t in self.live.values()] + [w.charge for w in self.waiting]:
            if ch is not None and ch.tenant is not None:
                owners.setdefault(id(ch.tenant), ch.tenant)
            if ch is not None and ch.session is not None:
                sessions.setdefault(id(ch.session), ch.session)
        out = [b for t in owners.values() for b in (t.requests, t.tokens) if b is not None]
        return out + [s.bucket for s in sessions.values() if s.bucket is not None]

    def check(self, books: Books) -> None:
        now = self.clock()
        for b in self.buckets():
            level = copy.copy(b)
            TokenBucket.refill(level, now)
            assert -b.capacity - EPS <= level.level <= b.capacity + EPS, ("bucket out of bounds", b.level, b.capacity)
        assert not books.stray, books.stray
        for key, ch in books.charges.items():
            paid = books.net[key]
            assert paid["other"] == 0, ("a bucket not its own", paid)
            assert -EPS <= paid["requests"] <= 1 + EPS, ("requests paid", paid)
            assert paid["tokens"] >= -EPS, ("tokens given back beyond what it paid", paid)
            assert paid["session"] >= -EPS, ("session GPU-seconds given back beyond what it paid", paid)
        self.check_sessions()
        for ch in self.never_ran:  # refunded in full: asked back at least what it paid, to each bucket still kept
            owed = books.paid(ch, asked=True)
            kept = {"requests": ch.tenant and ch.tenant.requests, "tokens": ch.tenant and ch.tenant.tokens,
                    "session": ch.session and ch.session.bucket, "other": None}
            assert all(v <= EPS or kept[role] is None for role, v in owed.items()), ("a request never admitted paid",
                                                                                      owed)
        self.never_ran.clear()  # judged in the step that ended it: a later reload may give a removed bucket back

    def check_sessions(self) -> None:
        """Each session holds what its running and queued requests cost; it keeps its in-flight budget (a request
        alone may pass it: nothing else runs; a reload may lower it under what runs)."""
        table = self.core.sessions
        spec = table.spec
        sessions = {id(s): s for s in table.sessions.values()}
        for t in self.live.values():
            if t.charge is not None and t.charge.session is not None:
                sessions.setdefault(id(t.charge.session), t.charge.session)
        for s in sessions.values():
            running = [t for t in self.live.values() if t.charge is not None and t.charge.session is s]
            queued = [w for w in self.waiting if w.charge is not None and w.charge.session is s]
            assert (s.inflight, s.queued) == (len(running), len(queued)), (s.inflight, s.queued)
            assert math.isclose(s.inflight_gpu_s, sum(t.cost for t in running), abs_tol=EPS)
            assert math.isclose(s.queued_gpu_s, sum(w.charge.queued_gpu_s for w in queued), abs_tol=EPS)
            cap = spec.max_inflight_gpu_seconds
            if cap and all(self.knobs_at[t.id] is spec for t in running):
                assert len(running) == 1 or s.inflight_gpu_s <= cap + EPS, ("session over budget", s.inflight_gpu_s)

    def drain(self, books: Books) -> None:
        for w in list(self.waiting):
            self.core.abandon(w, timed_out=False)
        self.sweep()
        while self.live or self.waiting:
            self.end()
            for w in list(self.waiting):
                self.core.abandon(w, timed_out=False)
            self.sweep()
        self.check(books)
        for s in self.core.sessions.sessions.values():
            assert (s.inflight, s.inflight_gpu_s, s.queued, s.queued_gpu_s) == (0, 0.0, 0, 0.0)
        self.clock.advance(3600.0)
        for b in self.buckets():
            assert b.refill(self.clock()) == b.capacity


@pytest.mark.parametrize("seed", range(80))
def test_who_pays_keeps_its_promises(seed):
    books = Books()
    try:
        model = PayModel(seed)
        for _ in range(250):
            model.step()
            model.check(books)
        model.drain(books)
    finally:
        Books.close()
