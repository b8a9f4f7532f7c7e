"""A real redis-server on a free loopback port, with no persistence, started and stopped by the tests."""

from __future__ import annotations

import shutil

import pytest

from extproc.store.local_redis import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/install-system-deps.sh installs it)")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
