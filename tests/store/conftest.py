"""A real redis-server on a free loopback port, with no persistence, started and stopped by the tests; and the
recording upstream (tests/upstream.py) the Envoy tests send to."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.store.local_redis import RedisServer
from extproc.tools.stack import free_port, wait_http

HERE = Path(__file__).resolve().parent


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/install-system-deps.sh installs it)")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def upstream():
    """tests/upstream.py in its own process: it records the most requests it ever had in service at once."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE.parent / "upstream.py"), str(port)], start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=20)
        yield ("127.0.0.1", port)
    finally:
        proc.kill()  # no graceful drain: some tests leave long requests running
        proc.wait(10)
