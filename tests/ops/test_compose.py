"""The compose stacks: valid for docker-compose, and every file they mount exists and passes its own validator.

There is no Docker engine here: `docker-compose config` (Debian's v1) validates against the compose schema and
resolves `extends`, anchors and relative paths offline, and the tests read its resolved output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.policy.schema import load_policy_file
from extproc.tools import envoyconf
from extproc.tools.sim.profile import shipped_profile_names

from .conftest import COMPOSE, ROOT, run_tool, tool

STACKS = {"gpu": COMPOSE / "docker-compose.yml", "cpu": COMPOSE / "docker-compose.cpu.yml"}
REPLICAS = ("vllm-llama70b-0", "vllm-llama70b-1", "vllm-llama8b-0")
SHARED = ("envoy", "extproc", "prometheus", "grafana")


@pytest.fixture(scope="module", params=sorted(STACKS))
def stack(request) -> tuple[str, dict]:
    """(variant, the compose file as docker-compose resolves it)."""
    path = STACKS[request.param]
    r = run_tool([tool("docker-compose"), "-f", str(path), "config"])
    assert r.returncode == 0, r.stdout + r.stderr
    return request.param, yaml.safe_load(r.stdout)


def bind_mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of each bind mount (named volumes left out)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v.get("source", ""), v["target"]
        if source.startswith("/"):
            out[target] = Path(source)
    return out


def host_path(service: dict, container_path: str) -> Path:
    """The host file behind `container_path`, through the service's bind mounts."""
    for target, source in sorted(bind_mounts(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == target or container_path.startswith(target.rstrip("/") + "/"):
            return source / Path(container_path).relative_to(target)
    raise AssertionError(f"{container_path} is not mounted")


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_docker_compose_config_quiet_passes():
    for path in STACKS.values():
        r = run_tool([tool("docker-compose"), "-f", str(path), "config", "-q"])
        assert r.returncode == 0, f"{path}: {r.stdout}{r.stderr}"


def test_every_stack_has_the_service_names_envoy_and_prometheus_address(stack):
    _, cfg = stack
    services = set(cfg["services"])
    assert services == set(SHARED) | set(REPLICAS)
    envoy_hosts = set(re.findall(r"address: (\S+), port_value", (ROOT / "envoy" / "envoy.yaml").read_text()))
    envoy_hosts -= {"0.0.0.0", "127.0.0.1"}
    # A pool is one address in envoy.yaml, a network alias that every replica of the pool carries.
    aliases = {a for s in cfg["services"].values() for n in (s.get("networks") or {}).values()
               for a in (n or {}).get("aliases", [])}
    assert envoy_hosts <= services | aliases, envoy_hosts - services - aliases
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets <= services, targets - services


def test_every_bind_mount_exists(stack):
    _, cfg = stack
    for name, service in cfg["services"].items():
        for target, source in bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"


def test_envoy_config_it_mounts_validates(stack):
    _, cfg = stack
    envoy = cfg["services"]["envoy"]
    path = host_path(envoy, flag(envoy["command"], "-c"))
    r = run_tool([envoyconf.envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert envoy["image"].endswith(":v" + _wheel_envoy_version()), "image and tested Envoy versions differ"


def _wheel_envoy_version() -> str:
    out = subprocess.run([envoyconf.envoy_binary(), "--version"], capture_output=True, text=True).stdout
    return re.search(r"/(\d+\.\d+\.\d+)/", out).group(1)


def test_policy_it_mounts_passes_extproc_check(stack):
    _, cfg = stack
    extproc = cfg["services"]["extproc"]
    command = extproc["command"]
    assert command[0] == "serve"
    assert flag(command, "--grpc") == "0.0.0.0:50051" and flag(command, "--metrics") == "0.0.0.0:9090"
    policy = host_path(extproc, flag(command, "--policy"))
    r = run_tool([sys.executable, "-m", "extproc.cli", "check", str(policy)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_prometheus_config_it_mounts_passes_promtool(stack):
    _, cfg = stack
    prom = cfg["services"]["prometheus"]
    config = host_path(prom, next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file=")))
    r = run_tool([tool("promtool"), "check", "config", str(config)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafana_provisioning_it_mounts_points_at_the_dashboards(stack):
    _, cfg = stack
    grafana = cfg["services"]["grafana"]
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    providers = yaml.safe_load((provisioning / "dashboards" / "extproc.yml").read_text())["providers"]
    for p in providers:
        folder = host_path(grafana, p["options"]["path"])
        dashboards = list(folder.glob("*.json"))
        assert dashboards, folder
        for d in dashboards:
            json.loads(d.read_text())
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [s["url"] for s in sources] == ["http://prometheus:9090"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(grafana, home).exists()


def test_replicas_serve_the_models_the_policy_routes(stack):
    variant, cfg = stack
    policy = load_policy_file(str(ROOT / "policies" / "default.yaml"))
    cluster_of = {name: m.cluster for name, m in policy.models.items()}
    for name in REPLICAS:
        service = cfg["services"][name]
        command = service["command"]
        served = flag(command, "--served-model-name" if variant == "gpu" else "--model-name")
        # vllm-llama70b-0 serves the model that the policy routes to cluster vllm_llama70b
        assert cluster_of[served] == "vllm_" + name.split("-")[1], (name, served)
        assert flag(command, "--port") == "8000"
        if variant == "cpu":
            assert command[0] == "sim" and flag(command, "--host") == "0.0.0.0"
            assert flag(command, "--profile") in shipped_profile_names()


def test_gpu_replicas_are_real_vllm_with_their_own_gpu():
    r = run_tool([tool("docker-compose"), "-f", str(STACKS["gpu"]), "config"])
    cfg = yaml.safe_load(r.stdout)
    gpus = []
    for name in REPLICAS:
        service = cfg["services"][name]
        assert service["image"].startswith("vllm/vllm-openai:")
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        assert "start_period" in service["healthcheck"]
    assert len(gpus) == len(set(gpus)), "two replicas share a GPU"


def test_image_build_installs_the_project():
    dockerfile = (COMPOSE / "extproc.Dockerfile").read_text()
    assert re.search(r"^RUN pip install --no-cache-dir \.", dockerfile, re.M)
    assert re.search(r'^ENTRYPOINT \["extproc"\]', dockerfile, re.M)
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for source in line.split()[:-1]:
            assert (ROOT / source).exists(), source
            assert f"!{source.rstrip('/')}" in (COMPOSE / "extproc.Dockerfile.dockerignore").read_text(), source
