"""A simulator in its own process (so the sweep's client does not slow the simulated GPU), shared by the module."""

import subprocess
import sys

import pytest

from tests.conftest import stop_process

SPEED = 20


def start_sim(profile: str = "h100-llama70b-awq", speed: float = SPEED) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "sim", "--profile", profile, "--port", "0",
                             "--speed", str(speed), "--seed", "1"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("sim ready:"):
        proc.kill()
        raise RuntimeError(f"simulator did not start: {line!r}")
    return proc, line.split()[2]


@pytest.fixture(scope="module")
def sim_url():
    proc, url = start_sim()
    yield url
    stop_process(proc, 5.0)
