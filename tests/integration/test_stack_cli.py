"""`extproc stack` (a local stack for poking at by hand): SIGTERM stops it, and Envoy and the ext_proc with it, at
once and gracefully. They once started with SIGTERM and SIGINT blocked (inherited from the stack's own signal mask),
so each was SIGKILLed after the 8 s stop timeout instead."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BLOCKED = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _blocked_mask(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigBlk for {pid}")


def test_sigterm_stops_the_stack_and_its_children_gracefully(tmp_path, upstream):
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
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - t0 < 6, "a child ignored SIGTERM and waited for the SIGKILL"
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in children:  # what a killed stack leaves (its children have their own sessions)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
