"""Fixtures that start real processes on loopback: the test upstream, and Envoy + ext_proc stacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.tools.stack import Stack, free_port, wait_http

HERE = Path(__file__).resolve().parent


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
        proc.wait(10)


def policy_file(tmp_path: Path, **overrides) -> Path:
    data = {
        "classes": {
            "interactive": {"max_concurrency": 3, "max_queue": 2, "max_wait_ms": 2000},
            "batch": {"max_concurrency": 4, "max_queue": 4, "max_wait_ms": 2000},
            "internal": {"max_concurrency": 1, "max_queue": 1, "max_wait_ms": 500},
        },
        "default_class": "interactive",
        "tenants": [{"name": "acme", "api_keys": ["sk-acme-1"], "max_class": "batch", "default_class": "batch"}],
        "models": {"llama-70b": {"cluster": "vllm_llama70b"}, "llama-8b": {"cluster": "vllm_llama8b"}},
    }
    data.update(overrides)
    # Requests without a key stand for a trusted client here (the default caps them at the lowest class).
    data.setdefault("anonymous", {"max_class": next(iter(data["classes"]))})
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


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
