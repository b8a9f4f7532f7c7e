"""The ext_proc gRPC servicer: the async driver that reads each stream's messages into a Stream and writes back."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc.aio import EOF, InternalError

from ..policy.admission import AdmissionController
from ..policy.limits import Ticket
from ..store.shared_slots import SharedSlots
from .accesslog import TicketTags
from .final_admission import FinalAdmission
from .protocol import wait_override
from .stream import Processor, Stream

log = logging.getLogger("extproc.server")


def _nothing() -> None:
    pass


# Added to Envoy's message timeout while a request waits for its admission (its max_message_timeout must cover the
# longest wait plus this: extproc check --envoy compares them).
QUEUE_GRACE_S = 0.5


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """One gRPC stream per HTTP request. Every message gets an answer of its own phase; slots are freed once."""

    def __init__(self, core: AdmissionController, max_body_bytes: int = 4 << 20, queue_grace_s: float = QUEUE_GRACE_S,
                 shared: SharedSlots | None = None, on_error: Callable[[], None] = _nothing,
                 tags: TicketTags | None = None, max_pending_bodies: int = 10_000) -> None:
        self.processor = Processor(core, shared, max_body_bytes, tags, max_pending_bodies)
        self.queue_grace_s = queue_grace_s   # added to Envoy's timeout while a request waits for its admission
        self._on_error = on_error            # called once per failed stream (the extproc_stream_errors counter)

    @property
    def live(self) -> set[Ticket]:
        """Tickets whose stream is still open."""
        return self.processor.live

    def renew_live(self) -> None:
        self.processor.renew_live()

    async def Process(self, request_iterator, context) -> None:
        # context.read()/write() rather than an async generator: one wrapping layer less per message.
        stream = Stream(self.processor)
        normal_end = failed = False
        pending_read = None
        read, write = context.read, context.write
        try:
            while True:
                if stream.phase.decided:
                    # Once decided, the next read usually outlives the HTTP request and ends in Envoy's reset.
                    pending_read = _read_through_reset(read)
                    req = await asyncio.shield(pending_read)
                    pending_read = None  # taken: answered below
                else:
                    req = await read()
                if req is EOF:
                    break
                answer = stream.receive(req)
                if type(answer) is FinalAdmission:  # queued, or waiting for a global slot
                    answer = stream.admitted(await answer.settle(
                        lambda seconds: write(wait_override(seconds + self.queue_grace_s))))
                await write(answer)
            normal_end = True
        except asyncio.CancelledError:
            # Envoy ends a decided stream (its request done, or its client gone: Stream.end tells them apart where
            # it can) with an end of stream and a reset, which grpc.aio may deliver before the end of stream, or
            # before our last write's completion. Not a normal end: a message Envoy sent and did not wait for.
            normal_end = not _left_unanswered(pending_read)
            raise
        except InternalError:
            # A write failed: Envoy reset the stream as the answer went out (its client left at that moment).
            # A client abort, not a failure of ours; the slot is freed below like any other abort.
            log.debug("ext_proc stream reset by the peer during a write")
        except Exception:  # a bug here must never take the stream's slot with it
            self._on_error()
            log.exception("ext_proc stream failed")
            if stream.phase.decided:
                failed = True
                raise
            # Undecided: refuse this request rather than fail the stream, which Envoy's failure_mode_allow
            # would turn into an unadmitted request (a body that trips a bug must not buy a way around us).
            await write(stream.fail())
        finally:
            stream.end(normal_end, failed)


def _read_through_reset(read) -> asyncio.Task:
    """The next message, read so that a stream reset cannot abandon the read half-way (await it shielded).

    Envoy resets most ext_proc streams as their HTTP request ends, and grpc.aio cancels the handler. A read
    cancelled in flight leaks its batch's native op array (grpc/grpc#43360: ~100 bytes a stream, the soak's RSS
    growth). Shielded, the read runs to its end (end of stream) and grpc frees it; only the handler is cancelled.
    """
    task = asyncio.ensure_future(read())
    task.add_done_callback(_retrieve)
    return task


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a read that failed after its handler left: nothing to do, but do not warn about it


def _left_unanswered(task) -> bool:
    """Whether the decided stream's read `task` got a message the reset kept the handler from answering."""
    return (task is not None and task.done() and not task.cancelled() and task.exception() is None
            and task.result() is not EOF)
