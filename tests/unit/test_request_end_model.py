"""A model-based test of how admitted requests end: the ext_proc stream's end (Stream.end after the response
headers or before them, normal or reset), Envoy's access-log completion reports (AccessLogReceiver, batched, with
duplicates, unknown and malformed tickets), reports for another instance relayed to it through the store
(ReportRelay: delivered late, or lost), lease renewal that lags at times, reloads that remove the running class,
time passing and the lease and report-wait safety nets (reap), on two instances sharing one clock, against a
reference model.

Checked after every step: each instance's open tickets and released-but-unreported tickets are exactly the model's;
every ticket is accounted (events.finished and the outcome listeners, which feed the breakers and latency windows)
at most once, with the outcome the model expects (the report's when one arrived in time, else the stream's, else
lease_expired); the class holds exactly the open tickets; the streams' live set is exactly the open streams; the
report counters (matched, unmatched, relayed, unadmitted) match the model, and each report for another instance is
sent on once. At the end, everything drained: every map empty, every ticket accounted exactly once, every gauge of
the snapshot zero.
"""

from __future__ import annotations

import random

from envoy.service.accesslog.v3 import als_pb2

from extproc.policy.admission import REPORT_WAIT_S, AdmissionController
from extproc.policy.decision import NoEvents
from extproc.policy.limits import Outcome
from extproc.server.accesslog import TICKET_HEADER, AccessLogReceiver, TicketTags
from extproc.server.stream import Phase, Processor, Stream
from tests.conftest import FakeClock, make_policy
from tests.unit.test_stream import request_body, request_headers, response_body, response_headers, set_headers

# (status, response flag or None) -> the outcome the report says
REPORTS = [(200, None, Outcome.OK), (503, None, Outcome.UPSTREAM_ERROR),
           (200, "upstream_remote_reset", Outcome.UPSTREAM_ERROR),
           (200, "downstream_remote_reset", Outcome.CLIENT_ABORT), (0, "downstream_connection_termination",
                                                                       Outcome.CLIENT_ABORT)]


class Counting(NoEvents):
    def __init__(self):
        self.finished_calls: list[tuple[int, Outcome]] = []

    def finished(self, ticket, outcome, latency_s):
        self.finished_calls.append((ticket.id, outcome))


class Reports:
    """What the receiver counts (completions_reported and unadmitted_reported), summed."""

    def __init__(self):
        self.counts = {"matched": 0, "unmatched": 0, "relayed": 0, "unadmitted": 0}

    def completions_reported(self, matched, unmatched, relayed=0):
        assert min(matched, unmatched, relayed) >= 0
        self.counts["matched"] += matched
        self.counts["unmatched"] += unmatched
        self.counts["relayed"] += relayed

    def unadmitted_reported(self, count):
        self.counts["unadmitted"] += count

    def header_answers_reported(self, seconds):
        raise AssertionError("no answers log here")


class Listener:
    def __init__(self):
        self.seen: list[tuple[int, Outcome]] = []

    def completed(self, c):
        self.seen.append((c.ticket.id, c.outcome))


class FakeRelay:
    """The store between the instances: a relayed batch waits until the walk delivers or loses it."""

    def __init__(self):
        self.subscribers = {}
        self.pending: list[tuple[str, list[list], object]] = []

    def relay(self, instance, reports, heard):
        self.pending.append((instance, [list(r) for r in reports], heard))

    def on_reports(self, instance, callback):
        self.subscribers[instance] = callback

    def deliver(self, i: int, lose: bool) -> None:
        instance, reports, heard = self.pending.pop(i)
        callback = self.subscribers.get(instance)
        if lose or callback is None:
            heard(False)
            return
        callback(reports)
        heard(True)


class Ref:
    """What the model knows of one ticket."""

    def __init__(self, t, stream: Stream, header: str):
        self.ticket = t
        self.stream = stream     # None once it ended
        self.header = header     # the ticket header Envoy logs
        self.open = True
        self.closed_at = None
        self.stream_outcome = None
        self.report = None       # the outcome of the report the core holds
        self.accounted = None    # the outcome it was accounted with


def policies():
    """Two policies a reload switches between: the second removes the first's class (its running requests stay with
    the retired limiter) and the pool's limit moves to a new gate each time."""
    pools = {"pool_a": {"limit": {"enabled": True, "unit": "requests", "initial": 1000, "min": 1, "max": 1000}}}
    return [make_policy(tenants=[{"name": "free", "api_keys": ["kf"]}], shed={}, pools=pools, default_class=name,
                        classes={name: {"max_concurrency": 1000}}) for name in ("batch", "other")]


class Instance:
    def __init__(self, name: str, clock: FakeClock, relay: FakeRelay):
        self.policies = policies()
        self.events = Counting()
        self.core = AdmissionController(self.policies[0], clock=clock, events=self.events)
        self.listener = Listener()
        self.core.listeners.append(self.listener)
        self.tags = TicketTags(instance=name)
        self.processor = Processor(self.core, tags=self.tags)
        self.reports = Reports()
        self.receiver = AccessLogReceiver(self.core, self.reports, tags=self.tags, relay=relay)
        self.counts = {"matched": 0, "unmatched": 0, "relayed": 0, "unadmitted": 0}  # the model's
        self.refs: dict[int, Ref] = {}
        self.accounted: list[tuple[int, Outcome]] = []  # the model's


def entry_into(msg, header: str | None, report) -> None:
    status, flag, _ = report
    entry = msg.http_logs.log_entry.add()
    entry.response.response_code.value = status
    if flag:
        setattr(entry.common_properties.response_flags, flag, True)
    entry.common_properties.time_to_last_downstream_tx_byte.nanos = 5_000_000
    if header is not None:
        entry.request.request_headers[TICKET_HEADER] = header


class Walk:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.relay = FakeRelay()
        self.inst = [Instance("a", self.clock, self.relay), Instance("b", self.clock, self.relay)]
        self.lease_s = self.inst[0].core._lease_s
        self.senders: list[tuple[Instance, int]] = []  # who sent each batch the store holds, and how many reports

    # --- the model's rules ---

    def account(self, inst: Instance, ref: Ref, outcome: Outcome) -> None:
        assert ref.accounted is None, f"ticket {ref.ticket.id} accounted twice"
        ref.accounted = outcome
        inst.accounted.append((ref.ticket.id, outcome))

    def close(self, inst: Instance, ref: Ref, outcome: Outcome) -> None:
        ref.open = False
        ref.closed_at = self.clock()
        ref.stream_outcome = outcome
        if ref.report is not None or outcome is Outcome.LEASE_EXPIRED:
            self.account(inst, ref, ref.report or outcome)

    def reported(self, inst: Instance, ticket_id: int, outcome: Outcome) -> None:
        ref = inst.refs.get(ticket_id)
        if ref is None or ref.accounted is not None:
            inst.counts["unmatched"] += 1
            return  # unknown, or already accounted: ignored
        inst.counts["matched"] += 1
        ref.report = outcome
        if not ref.open:
            self.account(inst, ref, outcome)

    def reaped(self, inst: Instance) -> None:
        now = self.clock()
        for ref in inst.refs.values():
            if ref.open and ref.ticket.lease_until <= now:
                self.close(inst, ref, Outcome.LEASE_EXPIRED)
        for ref in sorted(inst.refs.values(), key=lambda r: r.closed_at or 0):
            if not ref.open and ref.accounted is None and now - ref.closed_at >= REPORT_WAIT_S:
                self.account(inst, ref, ref.stream_outcome)

    # --- steps ---

    def admit(self) -> None:
        inst = self.rng.choice(self.inst)
        s = Stream(inst.processor)
        s.receive(request_headers(authorization=b"Bearer kf"))
        answer = s.receive(request_body())
        assert s.phase is Phase.FORWARDING, answer
        header = set_headers(answer)[TICKET_HEADER].decode()
        ticket = s.held
        assert inst.tags.parse(header) == (ticket.id, inst.tags.process)
        inst.refs[ticket.id] = Ref(ticket, s, header)

    def stream_end(self) -> None:
        """The ext_proc stream ends: after the response headers or before them, after the whole body it reads or
        before its end, normally or by a reset."""
        inst = self.rng.choice(self.inst)
        refs = [r for r in inst.refs.values() if r.stream is not None]
        if not refs:
            return
        ref = self.rng.choice(refs)
        s, ref.stream = ref.stream, None
        status = self.rng.choice([None, 200, 503])
        if status is not None:
            s.receive(response_headers(status))
            if s.phase is Phase.READING_USAGE and self.rng.random() < 0.5:
                s.receive(response_body(b"{}", eos=True))
        cut = s.phase is Phase.READING_USAGE and not s.response_done  # a body read, its end never came
        normal_end = self.rng.random() < 0.6
        if status is not None and status >= 500:
            outcome = Outcome.UPSTREAM_ERROR
        elif normal_end and not cut:
            outcome = Outcome.OK if status else Outcome.ENDED
        else:
            outcome = Outcome.CLIENT_ABORT
        s.end(normal_end)
        if ref.open:  # else the lease ran out first: its end changes nothing
            self.close(inst, ref, outcome)

    def reload(self) -> None:
        inst = self.rng.choice(self.inst)
        inst.core.apply(inst.policies[inst.core.policy is inst.policies[0]])

    def renew(self) -> None:
        """The server's periodic renewal of the open streams' leases (it may lag: advance() skips it at times)."""
        self.rng.choice(self.inst).processor.renew_live()

    def log_batch(self) -> None:
        """One access-log message to one instance: entries for either instance's tickets, duplicates, unknown ids,
        garbage headers and no header."""
        receiver_inst = self.rng.choice(self.inst)
        msg = als_pb2.StreamAccessLogsMessage()
        local, sent = [], {}
        for _ in range(self.rng.randint(1, 5)):
            report = self.rng.choice(REPORTS)
            owner = self.rng.choice(self.inst)
            kind = self.rng.random()
            tid = None
            if kind < 0.7 and owner.refs:
                tid = self.rng.choice(list(owner.refs))
                assert owner.refs[tid].header == owner.tags.value(tid)
            elif kind < 0.8:  # a ticket of one instance under the other's tag: nobody's
                other = self.inst[0] if owner is self.inst[1] else self.inst[1]
                tid = self.rng.choice(list(other.refs)) if other.refs else 10_000
            elif kind < 0.85:
                tid = 10_000 + self.rng.randint(0, 5)  # unknown id
            elif kind < 0.93:
                entry_into(msg, self.rng.choice(["", "x", "1.", ".a", "-1.a", "1-2-3.a", "²."]), report)
                receiver_inst.counts["unmatched"] += 1
            else:
                entry_into(msg, None, report)  # no cluster: counted as unadmitted
                receiver_inst.counts["unadmitted"] += 1
            if tid is not None:
                entry_into(msg, owner.tags.value(tid), report)
                if owner is receiver_inst:
                    local.append((tid, report[2]))
                else:
                    sent.setdefault(owner.tags.process, []).append((tid, report[2].value))
        before = len(self.relay.pending)
        receiver_inst.receiver._report(msg)
        # another instance's tickets go to it through the store, each exactly once, and only those
        relayed = {}
        for instance, reports, _ in self.relay.pending[before:]:
            relayed.setdefault(instance, []).extend((r[0], r[1]) for r in reports)
            self.senders.append((receiver_inst, len(reports)))
        assert relayed == sent
        for tid, outcome in local:
            self.reported(receiver_inst, tid, outcome)

    def deliver(self) -> None:
        if not self.relay.pending:
            return
        i = self.rng.randrange(len(self.relay.pending))
        instance, reports, _ = self.relay.pending[i]
        lose = self.rng.random() < 0.2
        if self.rng.random() < 0.2:
            reports.append(["junk"])  # a malformed report among them
        self.relay.deliver(i, lose)
        self.delivered(i, instance, reports, lose)

    def delivered(self, i: int, instance: str, reports: list[list], lose: bool) -> None:
        sender, n = self.senders.pop(i)
        sender.counts["unmatched" if lose else "relayed"] += n
        if not lose:
            inst = next(x for x in self.inst if x.tags.process == instance)
            for r in reports:
                if isinstance(r[0], int):
                    self.reported(inst, r[0], Outcome(r[1]))
                else:
                    inst.counts["unmatched"] += 1

    def advance(self) -> None:
        if self.rng.random() < 0.7:
            for inst in self.inst:
                inst.processor.renew_live()
        self.clock.advance(self.rng.choice([0.01, 0.5, 2.0, REPORT_WAIT_S, self.lease_s / 2]))
        for inst in self.inst:
            inst.core.reap()
            self.reaped(inst)

    # --- checks ---

    def check(self) -> None:
        for inst in self.inst:
            core = inst.core
            assert set(core.tickets) == {i for i, r in inst.refs.items() if r.open}
            assert set(core._unreported) == {i for i, r in inst.refs.items()
                                             if not r.open and r.accounted is None}
            # the order within one step is no promise: which tickets, with which outcome, once each, is
            assert sorted(inst.events.finished_calls, key=str) == sorted(inst.accounted, key=str)
            assert sorted(inst.listener.seen, key=str) == sorted(inst.accounted, key=str)
            opened = [r.ticket for r in inst.refs.values() if r.open]
            for lim in {r.ticket.limiter for r in inst.refs.values()} | set(core.limiters.values()):
                assert lim.inflight == sum(t.limiter is lim for t in opened), lim.name
            assert [g.holding for g in core.gates.values()] == [len(opened)]
            assert all(lim.inflight for lim in core._retired)  # a removed class is kept only while it runs requests
            assert inst.reports.counts == inst.counts
            assert inst.processor.live == {r.ticket for r in inst.refs.values() if r.stream is not None}
            assert inst.processor.pending_bodies == 0

    def run(self, steps: int) -> None:
        rules = [(self.admit, 3), (self.stream_end, 3), (self.log_batch, 3), (self.deliver, 2), (self.advance, 2),
                 (self.renew, 1), (self.reload, 1)]
        fns = [f for f, _ in rules]
        weights = [w for _, w in rules]
        for _ in range(steps):
            self.rng.choices(fns, weights)[0]()
            self.check()
        # drain: every stream ends, the store delivers what it holds, then time runs past every report wait
        while any(r.stream is not None for i in self.inst for r in i.refs.values()):
            self.stream_end()
        while self.relay.pending:
            instance, reports, _ = self.relay.pending[0]
            self.relay.deliver(0, False)
            self.delivered(0, instance, reports, False)
            self.check()
        for _ in range(2):
            self.clock.advance(self.lease_s + REPORT_WAIT_S + 1)
            for inst in self.inst:
                inst.core.reap()
                self.reaped(inst)
            self.check()
        for inst in self.inst:
            assert not inst.core.tickets and not inst.core._unreported
            assert all(r.accounted is not None for r in inst.refs.values())
            assert len({tid for tid, _ in inst.accounted}) == len(inst.accounted) == len(inst.refs)
            for lim in {r.ticket.limiter for r in inst.refs.values()} | set(inst.core.limiters.values()):
                assert (lim.inflight, lim.inflight_cost, len(lim.queue), lim.reserved) == (0, 0.0, 0, 0)
                assert all(f.inflight == 0 for f in lim.queue._flows.values())
                assert all(st.inflight == 0 and st.waiting == 0 for st in lim.queue.stats.values())
            for name, pool in inst.core.pools_snapshot().items():
                assert (pool["held"], sum(c["requests"] for c in pool["classes"].values())) == (0, 0), name
            for name, c in inst.core.snapshot().items():
                assert (c["inflight"], c["queue"], c["inflight_cost"], c["degraded_inflight"]) == (0, 0, 0.0, 0), name
            assert not inst.core._retired and not inst.processor.live


def test_every_request_ends_once_whichever_of_stream_end_and_report_comes_first():
    for seed in range(150):
        Walk(seed).run(120)
