"""The shipped Envoy configs validate; `extproc serve` refuses bad policies and serves gRPC health."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.tools import envoyconf

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_envoy_yaml_validates():
    ok, out = envoyconf.validate(ROOT / "envoy" / "envoy.yaml")
    assert ok, out


@pytest.mark.parametrize("mode", envoyconf.MODES)
def test_every_rendered_local_variant_validates(tmp_path, mode):
    cfg = envoyconf.render(envoyconf.load_source(), listen_port=18080, admin_port=18081,
                           extproc=("127.0.0.1", 18082), mode=mode,
                           pools={"vllm_llama70b": [("127.0.0.1", 18083), ("127.0.0.1", 18084)],
                                  "vllm_llama8b": [("127.0.0.1", 18085)]})
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ok, out = envoyconf.validate(path)
    assert ok, out


def test_serve_refuses_an_invalid_policy_with_key_paths(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: {interactive: {max_concurrency: 0}}\nmodels: {m: {cluster: c}}\n")
    run = subprocess.run([sys.executable, "-m", "extproc.cli", "serve", "--policy", str(bad), "--grpc",
                          "127.0.0.1:0", "--metrics", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert "classes.interactive.max_concurrency: must be >= 1, got 0" in run.stderr


def test_grpc_health_service_reports_serving(make_stack):
    s = make_stack()
    with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
