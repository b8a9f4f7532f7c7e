"""The compose stacks: valid for docker-compose, and every file they mount exists and passes its own validator.

There is no Docker engine here: `docker-compose config` (Debian's v1) validates against the compose schema and
resolves `extends`, anchors and relative paths offline, and the tests read its resolved output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from extproc.policy.schema import load_policy_file
from extproc.tools import envoyconf
from extproc.tools.sim.profile import shipped_profile_names
from extproc.tools.stack import free_port, wait_http
from tests.conftest import stop_process

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
    # As the service starts it: envoy.yaml with the stats listener its --config-yaml adds.
    args = [str(path) if a == flag(envoy["command"], "-c") else a for a in envoy["command"][1:]]
    assert envoy["command"][0] == "envoy" and "--config-yaml" in args
    r = run_tool([envoyconf.envoy_binary(), "--mode", "validate", *args])
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


# --- Envoy's own stats ----------------------------------------------------------------------------------------

K8S_ENVOY = ROOT / "deploy" / "k8s" / "components" / "envoy" / "envoy.yaml"
K8S_MONITORS = ROOT / "deploy" / "k8s" / "components" / "prometheus-operator" / "monitors.yaml"


def envoy_additions(envoy: dict) -> dict:
    """The `--config-yaml` the compose stack starts Envoy with (merged onto envoy.yaml)."""
    return yaml.safe_load(flag(envoy["command"], "--config-yaml"))


def stats_listener(additions: dict) -> tuple[dict, dict, list[dict]]:
    """(the listener serving Envoy's stats, the cluster its routes name, its routes)."""
    (listener,) = additions["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]
    (cluster,) = additions["static_resources"]["clusters"]
    return listener, cluster, routes


def test_prometheus_scrapes_envoys_stats_through_a_listener_that_serves_nothing_else_of_the_admin(stack):
    """ExtprocRequestsUnadmitted reads Envoy's envoy_http_ext_proc_failure_mode_allowed first: the only count of
    the requests let through while the ext_proc is down. Envoy's admin is on loopback in its container (it can also
    quit and drain Envoy), so compose's Prometheus scraped no Envoy and the alert had nothing to read there."""
    _, cfg = stack
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "envoy"]
    (target,) = [t for sc in job["static_configs"] for t in sc["targets"]]
    host, port = target.split(":")
    assert host == "envoy" and job["metrics_path"] == "/stats/prometheus"
    listener, cluster, routes = stats_listener(envoy_additions(cfg["services"]["envoy"]))
    assert listener["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": int(port)}
    # Only the stats path reaches the admin, which stays on loopback.
    assert [(r["match"], r["route"]["cluster"]) for r in routes] == [({"path": job["metrics_path"]}, cluster["name"])]
    admin = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())["admin"]["address"]["socket_address"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert endpoint == admin and admin["address"] == "127.0.0.1"
    assert str(port) in cfg["services"]["envoy"].get("expose", []) and f"{port}:{port}" not in str(
        cfg["services"]["envoy"].get("ports", []))   # reachable by Prometheus, not published on the host


def test_envoys_stats_are_scraped_as_deploy_k8s_scrapes_them(stack):
    """The same listener, port, path, interval and job name as deploy/k8s (its Envoy's health listener and PodMonitor),
    so the alert and dashboard read the same series in both."""
    _, cfg = stack
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "envoy"]
    (deployment,) = [d for d in yaml.safe_load_all(K8S_ENVOY.read_text()) if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    k8s_listener, k8s_cluster, k8s_routes = stats_listener(yaml.safe_load(flag(container["args"], "--config-yaml")))
    listener, cluster, routes = stats_listener(envoy_additions(cfg["services"]["envoy"]))
    assert listener["address"] == k8s_listener["address"] and cluster == k8s_cluster
    assert [r for r in k8s_routes if r["match"] == {"path": job["metrics_path"]}] == routes
    (monitor,) = [m for m in yaml.safe_load_all(K8S_MONITORS.read_text())
                  if m["kind"] == "PodMonitor" and m["metadata"]["name"] == "envoy"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    health = {p["name"]: p["containerPort"] for p in container["ports"]}[endpoint["port"]]
    assert health == listener["address"]["socket_address"]["port_value"]
    assert endpoint["path"] == job["metrics_path"] and endpoint["interval"] == job["scrape_interval"]
    assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"   # job="envoy" there too
    assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == job["job_name"]


def test_envoy_started_as_compose_starts_it_serves_its_stats_and_nothing_else_of_the_admin(tmp_path):
    """Run for real: envoy.yaml rendered for loopback plus the compose stack's `--config-yaml`, ports replaced."""
    r = run_tool([tool("docker-compose"), "-f", str(STACKS["cpu"]), "config"])
    envoy = yaml.safe_load(r.stdout)["services"]["envoy"]
    additions = envoy_additions(envoy)
    listener, cluster, _ = stats_listener(additions)
    listen, stats, admin = free_port(), free_port(), free_port()
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": stats}
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"] = admin
    cfg = envoyconf.render(envoyconf.load_source(), listen_port=listen, admin_port=admin,
                           extproc=("127.0.0.1", free_port()), pools={"vllm_llama70b": [("127.0.0.1", free_port())]})
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([envoyconf.envoy_binary(), "-c", str(path), "--config-yaml", yaml.safe_dump(additions),
                             "--disable-hot-restart", "--concurrency", "1", "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30, proc=proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{stats}/stats/prometheus", timeout=5) as resp:
            text = resp.read().decode()
        assert "envoy_http_ext_proc_failure_mode_allowed" in text   # what ExtprocRequestsUnadmitted reads
        for path_ in ("/quitquitquit", "/healthcheck/fail", "/drain_listeners", "/config_dump", "/stats",
                      "/clusters", "/logging", "/runtime_modify", "/"):
            try:
                urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{stats}{path_}", method="POST"),
                                       timeout=5)
                code = 200
            except urllib.error.HTTPError as e:
                code = e.code
            assert code == 404, path_
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=5) as resp:
            assert resp.status == 200   # still live: nothing above reached the admin
    finally:
        stop_process(proc, 10.0)
