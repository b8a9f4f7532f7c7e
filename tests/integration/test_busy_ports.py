"""A port someone else holds: `extproc sim` and `extproc serve` say so in one line and exit 1, no traceback (a
sim printed uvloop's bind traceback; a serve whose metrics port was taken printed grpc's shutdown traceback, from
a gRPC server left to the garbage collector after the loop closed, under its own one-line error)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import policy_file

EXTPROC = [sys.executable, "-m", "extproc.cli"]


@pytest.fixture
def taken():
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*EXTPROC, *args], capture_output=True, text=True, timeout=60)


def test_sim_on_a_taken_port_says_so_in_one_line(taken):
    out = _run("sim", "--port", str(taken))
    assert out.returncode == 1
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith(f"extproc sim: cannot listen on 127.0.0.1 port {taken} ")
    assert "in use" in out.stderr  # the local stack retries on new ports when it reads this


def test_serve_with_its_metrics_port_taken_says_so_in_one_line(taken, tmp_path):
    out = _run("serve", "--policy", str(policy_file(tmp_path)), "--grpc", "127.0.0.1:0",
               "--metrics", f"127.0.0.1:{taken}")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr
    assert f"cannot listen on 127.0.0.1:{taken} for /metrics" in out.stderr
