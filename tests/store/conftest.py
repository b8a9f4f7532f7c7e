"""A real redis-server on a free loopback port, with no persistence, started and stopped by the tests; and the
recording upstream (tests/upstream.py) the Envoy tests send to."""

from __future__ import annotations

import shutil

import pytest

from extproc.tools.local_redis import RedisServer
from tests.conftest import run_upstream


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
    with run_upstream() as address:
        yield address
