"""`extproc stack` (a local stack for poking at by hand): SIGTERM or Ctrl-C (SIGINT) stops it, and Envoy and the
ext_proc with it, at once and gracefully. They once started with SIGTERM and SIGINT blocked (inherited from the
stack's own signal mask), so each was SIGKILLed after the 8 s stop timeout instead."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extproc.tools import reaper

BLOCKED = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def _children(pid: int) -> list[int]:
    """Its child processes, but for the watchdog of extproc.tools.reaper (which stops them if it is killed)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in out if reaper.__file__ not in Path(f"/proc/{c}/cmdline").read_text()]


def _blocked_mask(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk for {pid}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_sigterm_or_ctrl_c_stops_the_stack_and_its_children_gracefully(tmp_path, upstream, sig):
    host, port = upstream
    children: list[int] = []
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "stack", "--pool",
                             f"vllm_llama70b={host}:{port}", "--pool", f"vllm_llama8b={host}:{port}",
                             "--workdir", str(tmp_path / "w")], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        started = json.loads(proc.stdout.readline())
        assert started["url"].startswith("http://127.0.0.1:")
        children += _children(proc.pid)
        assert len(children) == 2  # Envoy and the ext_proc
        for pid in children:
            assert _blocked_mask(pid) & BLOCKED == 0, f"{pid} starts with SIGTERM/SIGINT blocked"
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(15) == 0
        assert time.monotonic() - t0 < 6, "a child ignored SIGTERM and waited for the SIGKILL"
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in children:  # in case a stack killed here leaves them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_stack_leaves_nothing_running(tmp_path, upstream):
    """SIGKILL gives `extproc stack` no chance to stop Envoy and the ext_proc (sessions of their own, so nothing
    else would): its reaper watchdog stops them once it is gone."""
    host, port = upstream
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "stack", "--pool", f"vllm_llama70b={host}:{port}",
                             "--workdir", str(tmp_path / "w")], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    children: list[int] = []
    try:
        json.loads(proc.stdout.readline())
        children += _children(proc.pid)
        assert len(children) == 2  # Envoy and the ext_proc
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + reaper.GRACE_S + 5
        while (left := [p for p in map(reaper.running, children) if p]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in filter(None, map(reaper.running, children)):
            os.kill(p.pid, signal.SIGKILL)
