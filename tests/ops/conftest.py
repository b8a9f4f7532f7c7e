"""Fixtures for the operational files: paths, Debian tools, and the metric names a live ext_proc exposes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extproc.telemetry import StoreTelemetry
from extproc.tools.stack import Stack, free_port, wait_http

from .promql import PROMETHEUS_SERIES, exposed_names, recorded_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
RULE_FILES = sorted((COMPOSE / "prometheus" / "rules").glob("*.yml"))


def tool(name: str) -> str:
    """Path of a Debian tool; scripts/install-system-deps.sh installs them (`make test` runs it)."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: run scripts/install-system-deps.sh")
    return path


def run_tool(argv: list[str], cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def scrape_once(argv: list[str], port: int, ready_path: str) -> str:
    """Start `extproc <argv>` listening on `port`, fetch its /metrics once it answers `ready_path`, stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}{ready_path}", timeout=30, proc=proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def live_metrics_text() -> str:
    """/metrics of a freshly started `extproc serve` with the default policy (every family has its # TYPE)."""
    port = free_port()
    return scrape_once(["serve", "--policy", str(ROOT / "policies" / "default.yaml"),
                        "--grpc", f"127.0.0.1:{free_port()}", "--metrics", f"127.0.0.1:{port}", "--drain-s", "0"],
                       port, "/healthz")


@pytest.fixture(scope="session")
def replica_metrics_text() -> str:
    """/metrics of a simulated vLLM replica (the vLLM metric names, kept in parity with real vLLM's fixtures)."""
    port = free_port()
    return scrape_once(["sim", "--port", str(port)], port, "/health")


def store_metrics_text() -> str:
    """The shared slot store's families, which an ext_proc exports only where one runs (`store: {kind: redis}`)."""
    registry = CollectorRegistry()
    StoreTelemetry(registry)
    return generate_latest(registry).decode()


@pytest.fixture(scope="session")
def envoy_metrics_text(tmp_path_factory) -> str:
    """Envoy's /stats/prometheus, rendered from envoy/envoy.yaml (its ext_proc filter's counters exist from the
    start); no ext_proc or replica needs to answer."""
    stack = Stack(tmp_path_factory.mktemp("envoy"), {"vllm_llama70b": [("127.0.0.1", free_port())]})
    try:
        stack.start_envoy()
        with urllib.request.urlopen(f"{stack.admin_url}/stats/prometheus", timeout=5) as r:
            return r.read().decode()
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def known_metric_names(live_metrics_text, replica_metrics_text, envoy_metrics_text) -> set[str]:
    """Names a dashboard or rule may use: exported by the ext_proc (its shared store's included), a vLLM replica or
    Envoy, recorded by our rules, or attached by Prometheus."""
    return (exposed_names(live_metrics_text) | exposed_names(store_metrics_text())
            | exposed_names(replica_metrics_text) | exposed_names(envoy_metrics_text) | recorded_names(RULE_FILES)
            | PROMETHEUS_SERIES)
