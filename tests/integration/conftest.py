"""Fixtures that start real processes on loopback: the test upstream, and Envoy + ext_proc stacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.tools.sim.fleet import SimFleet
from extproc.tools.stack import Stack
from tests.conftest import policy_file, run_upstream

FLEET_SPEED = 10.0  # simulated seconds per wall second of the `fleets` replicas


@pytest.fixture(scope="session")
def upstream():
    """The small test upstream (tests/upstream.py) in its own process: URL and its port."""
    with run_upstream() as address:
        yield address


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
