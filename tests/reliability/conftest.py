"""Reuses the integration fixtures (the test upstream, Envoy + ext_proc stacks) and adds fault-injection helpers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from extproc.tools.stack import Stack, free_port, wait_http
from tests.integration.conftest import make_stack, upstream  # noqa: F401 (fixtures)


def restart_extproc(stack: Stack, sig: int = signal.SIGKILL) -> float:
    """Kill the stack's ext_proc with `sig` and start a fresh one on the same ports; return the seconds it took."""
    old = stack.process("extproc")
    t0 = time.monotonic()
    old.stop(sig)
    stack.processes.remove(old)
    stack.start_extproc()
    return time.monotonic() - t0


class SimProcess:
    """`extproc sim` in its own process, so it can be SIGKILLed like a crashing vLLM replica."""

    def __init__(self, workdir, profile: str, model: str, speed: float = 10.0):
        self.port = free_port()
        self.log = open(os.path.join(workdir, f"sim-{model}.log"), "ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "extproc.cli", "sim", "--profile", profile, "--port", str(self.port),
             "--speed", str(speed), "--model-name", model], stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        wait_http(f"{self.url}/health", timeout=30, proc=self.popen)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def close(self) -> None:
        self.kill()
        self.log.close()


@pytest.fixture
def sims(tmp_path):
    started: list[SimProcess] = []

    def start(profile: str, model: str, speed: float = 10.0) -> SimProcess:
        s = SimProcess(tmp_path, profile, model, speed)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()
