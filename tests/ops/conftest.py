"""Fixtures for the operational files: paths, Debian tools, and the metric names a live ext_proc exposes."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from extproc.telemetry import StoreTelemetry
from extproc.tools.stack import Stack, free_port, wait_http
from tests.conftest import stop_process, until

from .promql import PROMETHEUS_SERIES, exposed_names, recorded_names

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
RULE_FILES = sorted((COMPOSE / "prometheus" / "rules").glob("*.yml"))


def shipped_alert(name: str) -> dict:
    """The alert rule `name` as the rule files ship it."""
    return next(r for path in RULE_FILES for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]
                if r.get("alert") == name)


def description(alert: dict) -> str:
    """An alert's description on one line (the YAML folds it)."""
    return " ".join(alert["annotations"]["description"].split())


class PrometheusAPI:
    def __init__(self, url: str):
        self.url = url

    def query(self, promql: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def by_labels(self, promql: str, *labels: str) -> dict[tuple, float]:
        return {tuple(s["metric"].get(l, "") for l in labels): float(s["value"][1]) for s in self.query(promql)}

    def query_range(self, promql: str, start: float, end: float, step: float = 0.5) -> list[dict]:
        q = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": step})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_range?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, promql: str, predicate, timeout: float = 15.0):
        """Poll a query until predicate(result) holds; return the last result either way."""
        return asyncio.run(until(lambda: self.query(promql), timeout, interval=0.25, holds=predicate))


def start_prometheus(tmp: Path, config: dict) -> tuple[subprocess.Popen, PrometheusAPI]:
    """Debian's Prometheus on a free loopback port with `config` (written to tmp/prometheus.yml), its data and log
    under `tmp`; returns once it is ready. The caller stops the process."""
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    port = free_port()
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={path}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = PrometheusAPI(f"http://127.0.0.1:{port}")
    try:
        wait_http(f"{api.url}/-/ready", timeout=20, proc=proc)
    except BaseException:
        stop_process(proc, 10.0)
        raise
    return proc, api


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
        stop_process(proc, 10.0)


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
