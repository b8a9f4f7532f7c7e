"""The one awaitable final admission: the class queue's verdict, then the shared store's gate, or given back."""

from __future__ import annotations

import asyncio

import pytest

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF, InternalError

from extproc.policy.admission import ACCEPT, QUEUE, REJECT, REPORT_WAIT_S, AdmissionController, RequestFacts
from extproc.policy.limits import Outcome
from extproc.server.final_admission import FinalAdmission
from extproc.server.servicer import ExtProcServicer
from extproc.server.stream import Phase, Stream
from extproc.telemetry import Telemetry

from ..conftest import FakeClock, RecordedEvents
from .conftest import make_policy


class FakeStore:
    """The shared store's side of a gated admission (SharedSlots' try_now/wait/deadline/abandon), recorded."""

    def __init__(self, grants_at_once: bool = True):
        self.grants_at_once = grants_at_once
        self.calls: list[str] = []

    async def try_now(self, d):
        self.calls.append("try_now")
        return d if self.grants_at_once else None

    async def wait(self, d):
        self.calls.append("wait")
        return d

    def deadline(self, ticket) -> float:
        return ticket.admitted_at + 2.0

    def abandon(self, d) -> None:
        self.calls.append("abandon")


def core(shared: bool = False, max_wait_ms: int = 1000, **kwargs) -> AdmissionController:
    c = AdmissionController(make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 1,
                                                                 "max_wait_ms": max_wait_ms}}, tenants=[]), **kwargs)
    c.shared_slots = shared  # what SharedSlots sets: admissions need a global slot too
    return c


def decide(c: AdmissionController):
    return c.decide(RequestFacts(model="llama"))


class Extensions:
    """The driver's override_message_timeout writes, recorded."""

    def __init__(self, then=None):
        self.seconds: list[float] = []
        self.then = then  # something that happens while the override is being written

    async def __call__(self, seconds: float) -> None:
        self.seconds.append(seconds)
        if self.then is not None:
            self.then()
        await asyncio.sleep(0)


async def queued_behind_one(c: AdmissionController):
    """A request queued behind a running one, awaiting its settle(): (the running one, its FinalAdmission, the task)."""
    first = decide(c)
    wait = FinalAdmission(c, None, decide(c))
    settling = asyncio.create_task(wait.settle(Extensions()))
    await asyncio.sleep(0.01)
    return first, wait, settling


async def test_a_queue_verdict_is_the_final_admission_when_no_store_gates_it():
    c = core()
    first, wait, settling = await queued_behind_one(c)
    c.finish(first.ticket, Outcome.OK)
    d = await asyncio.wait_for(settling, 1)
    assert d.kind == ACCEPT and d.ticket is not None and wait.waiter is None


async def test_the_message_timeout_is_extended_once_to_the_queue_deadline():
    c = core(max_wait_ms=1000)
    decide(c)
    extend = Extensions()
    settling = asyncio.create_task(FinalAdmission(c, None, decide(c)).settle(extend))
    await asyncio.sleep(0.01)
    settling.cancel()
    assert len(extend.seconds) == 1 and 0.9 < extend.seconds[0] <= 1.0


async def test_a_verdict_given_while_the_timeout_was_being_extended_is_heard_at_once():
    c = core(max_wait_ms=5000)
    first = decide(c)
    extend = Extensions(then=lambda: c.finish(first.ticket, Outcome.OK))
    d = await asyncio.wait_for(FinalAdmission(c, None, decide(c)).settle(extend), 1)
    assert d.kind == ACCEPT


async def test_a_queue_wait_past_its_deadline_is_refused_429():
    c = core(max_wait_ms=20)
    decide(c)
    d = await asyncio.wait_for(FinalAdmission(c, None, decide(c)).settle(Extensions()), 1)
    assert (d.kind, d.status, d.reason) == (REJECT, 429, "queue_timeout")
    assert c.snapshot()["interactive"]["queue"] == 0


async def test_a_gated_admission_the_store_grants_at_once_needs_no_extension():
    c, store, extend = core(shared=True), FakeStore(), Extensions()
    d = decide(c)
    assert (await FinalAdmission(c, store, d).settle(extend)) is d
    assert store.calls == ["try_now"] and extend.seconds == []


async def test_a_gated_admission_that_must_wait_is_extended_to_the_stores_deadline():
    c, store, extend = core(shared=True), FakeStore(grants_at_once=False), Extensions()
    await FinalAdmission(c, store, decide(c)).settle(extend)
    assert store.calls == ["try_now", "wait"] and len(extend.seconds) == 1 and 1.9 < extend.seconds[0] <= 2.0


async def test_a_queue_verdict_that_needs_a_global_slot_goes_on_to_the_store_extended_only_once():
    c, store, extend = core(shared=True), FakeStore(grants_at_once=False), Extensions()
    first = decide(c)
    wait = FinalAdmission(c, store, decide(c))
    settling = asyncio.create_task(wait.settle(extend))
    await asyncio.sleep(0.01)
    c.finish(first.ticket, Outcome.OK)
    d = await asyncio.wait_for(settling, 1)
    assert d.kind == ACCEPT and store.calls == ["try_now", "wait"] and len(extend.seconds) == 1


def test_giving_back_a_queue_place_leaves_the_queue():
    c = core()
    decide(c)
    queued = decide(c)
    assert queued.kind == QUEUE
    assert FinalAdmission(c, None, queued).give_back() is None
    assert queued.waiter.result.status == 499 and c.snapshot()["interactive"]["queue"] == 0


def test_giving_back_a_gated_admission_abandons_it_at_the_store():
    c, store = core(shared=True), FakeStore()
    assert FinalAdmission(c, store, decide(c)).give_back() is None
    assert store.calls == ["abandon"]


def test_giving_back_a_queue_place_granted_a_gated_slot_abandons_that_slot_at_the_store():
    c, store = core(shared=True), FakeStore()
    first = decide(c)
    wait = FinalAdmission(c, store, decide(c))
    c.finish(first.ticket, Outcome.OK)  # the queue grants it; the global slot is not asked for yet
    assert wait.give_back() is None and store.calls == ["abandon"]


def test_giving_back_a_queue_place_granted_without_a_gate_revokes_the_grant_as_the_client_leaving():
    events = RecordedEvents()
    c = core(events=events)
    c.count_on_forward()  # as the stream's Processor sets it
    first = decide(c)
    c.forwarded(first)
    wait = FinalAdmission(c, None, decide(c))
    c.finish(first.ticket, Outcome.OK)
    granted = wait.waiter.result.ticket
    assert wait.give_back() is None
    assert granted.closed and c.snapshot()["interactive"]["inflight"] == 0
    # Never forwarded: the client's leaving while queued, not an admission.
    assert [(d.kind, d.status) for d in events.decisions] == [(ACCEPT, 200), (REJECT, 499)]


async def test_a_queue_wait_cut_short_by_the_requests_own_deadline_is_extended_over_the_stores_wait_too():
    # Envoy takes one extension per message: it must cover the wait for a global slot that follows the queue's
    # verdict (once the class's max_wait_ms, now the request's own deadline too), or Envoy's message timeout
    # runs out while the store is still awaited and failure_mode_allow sends the request upstream unadmitted.
    from extproc.store.shared_slots import SharedSlots
    c, store, extend = core(shared=True, max_wait_ms=1000), FakeStore(grants_at_once=False), Extensions()
    store.deadline = SharedSlots.deadline
    first = decide(c)
    wait = FinalAdmission(c, store, c.decide(RequestFacts(model="llama", deadline_ms=100)))
    settling = asyncio.create_task(wait.settle(extend))
    await asyncio.sleep(0.01)
    c.finish(first.ticket, Outcome.OK)
    d = await asyncio.wait_for(settling, 1)
    assert d.kind == ACCEPT and store.calls == ["try_now", "wait"] and len(extend.seconds) == 1
    assert 0.05 < extend.seconds[0] <= 0.1  # both waits end at arrival + the request's own 100 ms


async def test_a_cancel_in_the_loop_turn_the_queue_grants_is_not_lost():
    # Python 3.11's asyncio.wait_for returned the grant and dropped the cancel (python/cpython#86296): the request
    # of a client that had gone was forwarded. The cancel goes on, and give_back() revokes the grant: the client
    # left while queued.
    c = core()
    first, wait, settling = await queued_behind_one(c)
    c.finish(first.ticket, Outcome.OK)  # the queue grants it: its verdict is set, the task not yet woken
    settling.cancel()                   # the client leaves in that same turn
    with pytest.raises(asyncio.CancelledError):
        await settling
    wait.give_back()
    wait.give_back()  # once only
    assert c.snapshot()["interactive"]["inflight"] == 0 and wait.waiter is None


# --- through the servicer: the stream ends in the loop turn its grant comes ---

CHAT = b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}]}'


def generation() -> list[pb.ProcessingRequest]:
    hs = [base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
          base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
          base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")]
    return [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hs))),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=CHAT, end_of_stream=True))]


class HeldWrites:
    """grpc.aio's context for one stream: its request, then a read that waits; the wait's timeout extension is
    written (the override recorded) but its write stays in flight until `written` is resolved."""

    def __init__(self):
        self.messages = generation()
        self.writes: list[pb.ProcessingResponse] = []
        self.written = asyncio.get_running_loop().create_future()

    async def read(self):
        if self.messages:
            return self.messages.pop(0)
        await asyncio.get_running_loop().create_future()
        return EOF

    async def write(self, resp) -> None:
        self.writes.append(resp)
        if resp.HasField("override_message_timeout"):
            await self.written


def metric(t: Telemetry, name: str, **labels) -> float:
    return sum(s.value for m in t.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("ends", ["reset", "write_failed"])
async def test_a_grant_that_comes_as_the_stream_ends_keeps_one_outcome_per_admission(ends):
    """A waiting request's stream ends in the same loop turn as another request's end grants it the slot: Envoy
    resets it (the client left) while the wait's timeout extension is still being written, or that write fails.
    Its handler never forwards the request. Closed as a client abort, that grant was an admitted request with a
    client_abort outcome and duration; taken back uncounted (886553e, reverted), an admission that
    extproc_requests_total counted had no outcome. Each admission has exactly one outcome, and a request that
    never went upstream is none: it is a client that left while queued."""
    clock = FakeClock()
    telemetry = Telemetry()
    core = AdmissionController(make_policy(classes={"interactive": {"max_concurrency": 1, "max_queue": 1,
                                                                    "max_wait_ms": 5000}}, tenants=[]),
                               clock=clock, events=telemetry)
    servicer = ExtProcServicer(core)
    first = Stream(servicer.processor)
    for message in generation():
        first.receive(message)
    assert first.phase is Phase.FORWARDING
    ctx = HeldWrites()
    handler = asyncio.create_task(servicer.Process(None, ctx))
    while not ctx.writes:
        await asyncio.sleep(0)  # until the extension's write is in flight
    first.end(normal_end=True)  # the queue grants the slot in this loop turn...
    if ends == "write_failed":
        ctx.written.set_exception(InternalError("the stream was reset"))  # ...and the write fails in it
    else:
        handler.cancel()  # ...and Envoy resets the stream in it
    await asyncio.wait_for(asyncio.gather(handler, return_exceptions=True), 5)
    assert not any(w.HasField("request_body") for w in ctx.writes)  # never forwarded
    assert core.snapshot()["interactive"]["inflight"] == 0 and not core.tickets and not servicer.live
    clock.advance(REPORT_WAIT_S + 1)
    core.reap()  # every ticket still awaiting Envoy's report is accounted now
    # The first's admission and its outcome; the second counted once, as a client that left while queued.
    assert metric(telemetry, "extproc_requests_total", decision="accept") == 1
    assert metric(telemetry, "extproc_request_duration_seconds_count") == 1
    assert metric(telemetry, "extproc_request_duration_seconds_count", outcome="client_abort") == 0
    assert metric(telemetry, "extproc_requests_total", decision="reject", reason="client_disconnected") == 1
