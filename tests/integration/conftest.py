"""Fixtures that start real processes on loopback: the test upstream, and Envoy + ext_proc stacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.tools.sim.fleet import SimFleet
from extproc.tools.stack import Stack, free_port, wait_http
from tests.conftest import policy_file

HERE = Path(__file__).resolve().parent
FLEET_SPEED = 10.0  # simulated seconds per wall second of the `fleets` replicas


@pytest.fixture(scope="session")
def upstream():
    """The small test upstream (tests/upstream.py) in its own process: URL and its port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE.parent / "upstream.py"), str(port)],
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=20)
        yield ("127.0.0.1", port)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:  # a request it still delays (a test that held one) keeps it waiting
            proc.kill()
            proc.wait(5)


@pytest.fixture
def make_stack(tmp_path, upstream):
    stacks = []

    def start(policy: Path | None = None, **kwargs) -> Stack:
        pools = kwargs.pop("pools", {"vllm_llama70b": [upstream], "vllm_llama8b": [upstream]})
        s = Stack(tmp_path / f"stack{len(stacks)}", pools, policy_path=policy or policy_file(tmp_path), **kwargs)
        stacks.append(s)
        return s.start()

    yield start
    for s in stacks:
        s.stop()


@pytest.fixture
async def fleets():
    """The demo's fleet in miniature: one simulated 70B replica and one 8B, at FLEET_SPEED."""
    big = SimFleet("h100-llama70b-awq", replicas=1, speed=FLEET_SPEED, model_names=["llama-70b"])
    small = SimFleet("h100-llama8b", replicas=1, speed=FLEET_SPEED, model_names=["llama-8b"])
    async with big, small:
        yield big, small
