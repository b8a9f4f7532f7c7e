"""Stack.stop stops every process of the stack, whatever one of them does: one stop that raised (a wait that timed
out, a Ctrl-C during it) used to skip the processes after it, and they ran on (under `extproc stack` or the demo,
until the process itself exited)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from extproc.tools import reaper
from extproc.tools.demo.runner import Interrupt, start_pool
from extproc.tools.stack import Process, Stack, stop_group
from tests.conftest import until
from tests.integration.test_stack_cli import _children


@pytest.fixture
def stack(tmp_path):
    """A Stack of no server, for processes the test spawns; whatever the test leaves running is killed after it."""
    s = Stack(tmp_path, {})
    spawned: list[Process] = []
    spawn = s.spawn
    s.spawn = lambda *args, **kwargs: spawned.append(spawn(*args, **kwargs)) or spawned[-1]
    yield s
    for proc in spawned:
        if proc.alive():
            os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(5)


def raises(error: BaseException):
    """A Process.stop that raises `error`."""
    def stop(*args, **kwargs):
        raise error
    return stop


@pytest.mark.parametrize("error", [subprocess.TimeoutExpired("sleep", 8.0), KeyboardInterrupt()],
                         ids=["timeout", "ctrl-c"])
def test_a_stop_that_raises_leaves_no_process_of_the_stack_running(stack, monkeypatch, error):
    first = stack.spawn("first", ["sleep", "60"])
    # A shell and its own child (the process group a stop signals: an ext_proc's workers, a simulator's replicas).
    middle = stack.spawn("middle", ["sh", "-c", "sleep 60 & wait"])
    last = stack.spawn("last", ["sleep", "60"])
    pids = [first.popen.pid, middle.popen.pid, *asyncio.run(until(lambda: _children(middle.popen.pid))), last.popen.pid]
    assert len(pids) == 4

    monkeypatch.setattr(middle, "stop", raises(error))  # before it has stopped anything
    with pytest.raises(type(error)) as raised:
        stack.stop()  # the last started first: `last`, then `middle` raises, then `first`
    assert raised.value is error  # the first error, raised once the rest are stopped
    assert [p for p in map(reaper.running, pids) if p] == []
    assert stack.processes == []


def test_every_error_is_told(stack, monkeypatch):
    """Two stops that raise: the first error is raised and names the second."""
    procs = [stack.spawn(f"p{i}", ["sleep", "60"]) for i in range(3)]
    for i, proc in enumerate(procs[:2]):
        monkeypatch.setattr(proc, "stop", raises(OSError(f"stop {i} failed")))
    with pytest.raises(OSError, match="stop 1 failed") as raised:
        stack.stop()
    assert any("stop 0 failed" in note for note in raised.value.__notes__)
    assert [p for p in (reaper.running(p.popen.pid) for p in procs) if p] == []


def test_stop_group_stops_what_the_leader_leaves_behind(stack):
    """The leader exits on SIGTERM; its child ignores SIGTERM and would run on: it gets SIGKILL once the leader is
    gone, not after the timeout (`extproc serve --workers N`'s supervisor and its workers are such a group)."""
    proc = stack.spawn("leader", ["sh", "-c", "(trap '' TERM; exec sleep 60) & wait"])
    pids = [proc.popen.pid, *asyncio.run(until(lambda: _children(proc.popen.pid)))]
    assert len(pids) == 2
    t0 = time.monotonic()
    stop_group(proc.popen, timeout=20)
    assert time.monotonic() - t0 < 5
    assert proc.popen.returncode == -signal.SIGTERM  # the leader exited on the SIGTERM
    assert [p for p in map(reaper.running, pids) if p] == []


@pytest.mark.parametrize("start", ["sim", "extproc", "envoy"])
def test_a_signal_during_a_readiness_wait_ends_the_wait_at_once_and_starts_nothing_more(stack, monkeypatch, start):
    """`extproc demo` waits up to 30 s for each process of a stack to be ready (synchronous code: the cancel of its
    task lands at the next await only). A SIGTERM during that wait was acted on when the wait ended, up to 30 s
    later; the wait now checks the demo's interrupt at each poll. The process here never becomes ready."""
    interrupt = Interrupt()
    stack.check, stack.policy_path = interrupt.check, Path("policies/default.yaml")
    stack.pools["vllm_llama70b"] = [("127.0.0.1", stack.listen_port)]  # for Envoy's config; nothing is sent there
    # The signal is timed from the spawn, so that the readiness wait is what it lands in: timed from the call, it
    # once landed while Envoy's config was still being rendered on a loaded CI machine ("before envoy started").
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))  # as the demo's handler does (_main)
    spawned = []
    spawn = stack.spawn

    def spawn_then_signal(name, argv, env=None):
        proc = spawn(name, ["sleep", "60"])
        spawned.append(time.monotonic())
        timer.start()
        return proc

    monkeypatch.setattr(stack, "spawn", spawn_then_signal)
    begin = {"sim": lambda: start_pool(stack, "p", "h100-llama70b-awq", 1, ["m"], 1.0, 0),
             "extproc": stack.start_extproc, "envoy": stack.start_envoy}[start]
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(interrupt, "signum", signum))
    try:
        with pytest.raises(asyncio.CancelledError, match="SIGTERM came before .* ready"):
            begin()
        took = time.monotonic() - spawned[0]
    finally:
        timer.cancel()
        if timer.is_alive():
            timer.join()
        signal.signal(signal.SIGTERM, previous)
    assert took < 2.0  # 30 s before
    with pytest.raises(asyncio.CancelledError, match="SIGTERM came before next started"):
        stack.spawn("next", ["sleep", "60"])
    assert [p.name for p in stack.processes] == ["sim-p" if start == "sim" else start]
    stack.stop()
    assert stack.processes == []
