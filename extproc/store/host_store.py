"""SlotStore shared by the workers of one `extproc serve --workers N` through this host's memory.

The supervisor creates a directory with a small memory-mapped table; every worker opens it. Per class and worker
the table holds the slots taken, their GPU-seconds and whether the worker has requests waiting; an admission
checks the sum over the workers under a file lock (a few microseconds, against a Redis round trip's ~300 us of
client CPU). A release wakes the other workers that wait for that class with a datagram on their Unix socket.

No leases: a worker only ever frees its own slots; when one dies the supervisor clears its cells (forget()) and
stops the rest (they are restarted together, on a fresh table), so a dead worker's slots cannot outlive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import mmap
import os
import socket
import struct
import tempfile
from pathlib import Path
from typing import Callable

from ..policy import schema
from ..policy.slot_store import SlotClaim

MAX_CLASSES = schema.MAX_CLASSES  # rows in the table (a policy has a handful; the schema refuses more)
_NAME = 56                       # bytes of a class name in the table (a longer name is stored as its hash)
_CELL = struct.Struct("=qdq")    # per worker: slots, GPU-seconds, waiting (1/0)
_TABLE = "slots.bin"
_LOCK = "slots.lock"


def _row_size(workers: int) -> int:
    """A class's row: its name, then one cell per worker."""
    return _NAME + workers * _CELL.size


def table_size(workers: int) -> int:
    return MAX_CLASSES * _row_size(workers)


def create(directory: Path, workers: int) -> None:
    """The supervisor's part: an empty table for `workers` workers in `directory`."""
    (directory / _TABLE).write_bytes(bytes(table_size(workers)))
    (directory / _LOCK).touch()


def forget(directory: Path, worker: int, workers: int) -> None:
    """The supervisor's part when a worker has died: its slots, GPU-seconds and waiting flags go back to the table.
    The others drain before they stop (--drain-s, --grace-s), still admitting, and nobody would release them."""
    store = HostStore(directory, worker, workers)
    try:
        with store._locked():
            for row in range(MAX_CLASSES):
                store._set(row, 0, 0.0, 0)
    finally:
        store._close_files()


def _stored_name(cls: str) -> bytes:
    """A class's name as its row holds it (a name longer than the field is stored as its hash)."""
    name = cls.encode()
    if len(name) > _NAME:
        name = b"#" + hashlib.blake2b(name, digest_size=(_NAME - 1) // 2).hexdigest().encode()
    return name


class TableFull(RuntimeError):
    """Every row of the table holds slots of a class."""


def _socket_path(directory: Path, worker: int) -> str:
    return str(directory / f"worker-{worker}.sock")


SOCKET_PATH_MAX = 100  # bytes of an AF_UNIX path: 108 on Linux and 104 on macOS, with room to spare


def table_parent(workers: int) -> str:
    """Where the supervisor makes the table's directory: the temp dir, unless the workers' sockets in it would be
    too long a path to bind (a long TMPDIR stopped `serve --workers` from starting), then /tmp."""
    base = tempfile.gettempdir()
    longest = _socket_path(Path(base) / "extproc-workers-xxxxxxxx", workers - 1)  # TemporaryDirectory's 8 letters
    return base if len(longest.encode()) <= SOCKET_PATH_MAX else "/tmp"


class HostStore:
    """The caps of every class, shared by the N workers of one host (`extproc serve --workers N`, `kind:
    memory`). Never unavailable: the calls are local and do not fail."""

    shared = True

    def __init__(self, directory: Path, worker: int, workers: int):
        self.directory, self.worker, self.workers = Path(directory), worker, workers
        self._stride = _row_size(workers)
        self._file = open(self.directory / _TABLE, "r+b")  # noqa: SIM115 - held for the store's life
        self._map = mmap.mmap(self._file.fileno(), table_size(workers))
        self._lock_fd = os.open(self.directory / _LOCK, os.O_RDWR)
        self._rows: dict[str, tuple[int, bytes]] = {}         # class -> (row, its name there) when last found
        self._held: dict[tuple[str, str], float] = {}          # (class, holder) -> GPU-seconds, this worker's
        self._removed: set[str] = set()  # classes a reload removed whose row is cached till this worker's slots end
        self._listeners: list[Callable[[str], None]] = []
        self._inbox: socket.socket | None = None
        self._outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._outbox.setblocking(False)

    # --- the table (callers hold the lock) ---

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _row(self, cls: str) -> int:
        """The class's row: found by name, else an empty one, else (the table full) one of a class no worker holds
        a slot of. Rows used to be claimed per name for the table's life, so reloads renaming classes over a
        long life filled it and every request of the 257th name failed. A row can change hands, so a known row
        is checked against its name on each use (56 bytes, under the lock)."""
        known = self._rows.get(cls)
        if known is not None and self._name_at(known[0]) == known[1]:
            return known[0]
        name = known[1] if known is not None else _stored_name(cls)
        idle = None
        for row in range(MAX_CLASSES):
            stored = self._name_at(row)
            if stored == name:
                break
            if not stored:  # rows fill in order: the name is in none after this one
                self._claim(row, name)
                break
            if idle is None and all(n == 0 and gpu == 0.0 for n, gpu, _ in self._cells(row)):
                idle = row  # a worker still waiting for that class finds it again when it next asks
        else:
            if idle is None:
                raise TableFull(f"more than {MAX_CLASSES} classes in use in the shared table")
            row = idle
            self._claim(row, name)
        self._rows[cls] = (row, name)
        return row

    def _name_at(self, row: int) -> bytes:
        start = row * self._stride
        return self._map[start: start + _NAME].rstrip(b"\0")

    def _claim(self, row: int, name: bytes) -> None:
        """Write the name and clear the cells (an idle row's waiting flags were another class's)."""
        self._map[row * self._stride: (row + 1) * self._stride] = name.ljust(self._stride, b"\0")

    def _offset(self, row: int, worker: int) -> int:
        return row * self._stride + _NAME + worker * _CELL.size

    def _cells(self, row: int) -> list[tuple[int, float, int]]:
        return [_CELL.unpack_from(self._map, self._offset(row, w)) for w in range(self.workers)]

    def _set(self, row: int, slots: int, gpu: float, waiting: int) -> None:
        _CELL.pack_into(self._map, self._offset(row, self.worker), slots, gpu, waiting)

    # --- SlotStore ---

    async def acquire(self, claim: SlotClaim) -> bool:
        key = (claim.cls, claim.holder)
        if key in self._held:  # idempotent: already held (only this worker writes its own holdings)
            return True
        with self._locked():
            try:
                row = self._row(claim.cls)
            except TableFull:
                # Every row holds another class's slots (a reload renamed the classes while the old ones run): wait
                # as for a full class, and find a row at a poll once one is idle, rather than fail the stream.
                return False
            cells = self._cells(row)
            mine = cells[self.worker]
            slots = sum(c[0] for c in cells)
            gpu = sum(c[1] for c in cells)
            granted = slots < claim.cap and (claim.budget is None or gpu + claim.cost <= claim.budget * (1 + 1e-9))
            if granted:
                self._set(row, mine[0] + 1, mine[1] + claim.cost, 0)
                self._held[key] = claim.cost
            else:
                self._set(row, mine[0], mine[1], 1)  # a release elsewhere wakes this worker
        return granted

    async def release(self, slots: list[tuple[str, str]]) -> None:
        wake: set[tuple[str, int]] = set()
        with self._locked():
            for cls, holder in slots:
                cost = self._held.pop((cls, holder), None)
                if cost is None:
                    continue  # idempotent
                row = self._row(cls)
                cells = self._cells(row)
                n, gpu, waiting = cells[self.worker]
                self._set(row, n - 1, max(gpu - cost, 0.0) if n > 1 else 0.0, waiting)
                wake.update((cls, w) for w, c in enumerate(cells) if c[2] and w != self.worker)
            if self._removed:  # a class a reload removed: its cached row goes with this worker's last slot of it
                for cls in self._removed.intersection(c for c, _ in slots):
                    self.forget(cls)
        for cls, w in wake:
            with contextlib.suppress(OSError):  # a full or closed inbox: that worker's poll_ms retry covers it
                self._outbox.sendto(cls.encode(), _socket_path(self.directory, w))

    async def renew(self, held: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [slot for slot in held if slot not in self._held]

    async def adopt(self, claims: list[SlotClaim]) -> None:
        """Never needed on one host (the store does not fail); recorded past the cap like the Redis store."""
        with self._locked():
            for c in claims:
                if (c.cls, c.holder) in self._held:
                    continue
                row = self._row(c.cls)
                n, gpu, waiting = self._cells(row)[self.worker]
                self._set(row, n + 1, gpu + c.cost, waiting)
                self._held[(c.cls, c.holder)] = c.cost

    async def ping(self) -> None:
        pass

    def forget(self, cls: str) -> None:
        """A reload removed the class: its cached row goes with this worker's last slot of it (the row itself is
        the table's, found by name by a worker that still asks for it, and taken by another class once idle)."""
        if any(held == cls for held, _ in self._held):
            self._removed.add(cls)
        else:
            self._rows.pop(cls, None)
            self._removed.discard(cls)

    def count(self, cls: str) -> int:
        """Slots of a class held on this host right now (tests and tools)."""
        with self._locked():
            return sum(c[0] for c in self._cells(self._row(cls)))

    def on_release(self, callback: Callable[[str], None]) -> None:
        self._listeners.append(callback)

    async def start(self) -> None:
        path = _socket_path(self.directory, self.worker)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._inbox.bind(path)
        self._inbox.setblocking(False)
        asyncio.get_running_loop().add_reader(self._inbox.fileno(), self._on_datagrams)

    def _on_datagrams(self) -> None:
        classes = set()
        while True:
            try:
                classes.add(self._inbox.recv(4096).decode(errors="replace"))  # names are at most 64 bytes
            except (BlockingIOError, InterruptedError):
                break
        for cls in classes:
            for callback in self._listeners:
                callback(cls)

    async def close(self) -> None:
        if self._inbox is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._inbox.fileno())
            self._inbox.close()
            self._inbox = None
        self._close_files()

    def _close_files(self) -> None:
        self._outbox.close()
        self._map.close()
        self._file.close()
        os.close(self._lock_fd)
