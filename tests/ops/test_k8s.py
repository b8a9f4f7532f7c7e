"""deploy/k8s: the kustomize overlays render, every object passes its schema, and the manifests keep the promises
docs/kubernetes.md makes (one source for every config file, pinned images, probes, drain timing, who may call what).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from extproc.policy.schema import load_policy_file
from extproc.server import main as server_main
from extproc.tools import envoyconf

from . import k8s_schemas
from .conftest import RULE_FILES, ROOT, run_tool
from .kustomize import Rendered, containers, pod_spec, render
from .promql import metric_names

K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("standard", "envoy-gateway")
EDGE = ("extproc", "envoy", "redis")   # our own containers: locked down fully (vLLM's image needs root)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, Rendered]:
    return request.param, render(K8S / "overlays" / request.param)


@pytest.fixture(scope="module")
def standard() -> Rendered:
    return render(K8S / "overlays" / "standard")


@pytest.fixture(scope="module")
def gateway() -> Rendered:
    return render(K8S / "overlays" / "envoy-gateway")


def workloads(r: Rendered) -> list[dict]:
    return [o for o in r.objects if pod_spec(o) is not None]


def container(r: Rendered, name: str) -> dict:
    (c,) = containers(r.get("Deployment", name))
    return c


# --- rendering and schemas -----------------------------------------------------------------------------------------

def _without_hash(name: str, r: Rendered) -> str:
    hashed = {v: k for k, v in r.renamed.items()}
    return hashed.get(name, re.sub(r"-[a-z0-9]{10}$", "", name))


def _comparable(objects: list[dict], r: Rendered) -> dict[tuple, dict]:
    """Objects by (kind, namespace, name), ConfigMap names and references without their hash suffix."""
    out = {}
    for o in objects:
        o = yaml.safe_load(yaml.safe_dump(o))
        if o["kind"] == "ConfigMap":
            o["metadata"]["name"] = _without_hash(o["metadata"]["name"], r)
        for v in (pod_spec(o) or {}).get("volumes", []):
            if "configMap" in v:
                v["configMap"]["name"] = _without_hash(v["configMap"]["name"], r)
        out[(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])] = o
    return out


def test_the_python_renderer_agrees_with_kubectl_kustomize(overlay):
    name, r = overlay
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the Python renderer is checked on its own below)")
    out = run_tool([kubectl, "kustomize", "--load-restrictor=LoadRestrictionsNone", str(K8S / "overlays" / name)])
    assert out.returncode == 0, out.stderr
    theirs = _comparable([d for d in yaml.safe_load_all(out.stdout) if d], r)
    ours = _comparable(r.objects, r)
    assert sorted(theirs) == sorted(ours)
    for key in ours:
        assert ours[key] == theirs[key], key


def test_every_core_object_passes_the_kubernetes_openapi_schema(overlay):
    _, r = overlay
    crds = k8s_schemas.crd_schemas()
    core = [o for o in r.objects if (o["apiVersion"], o["kind"]) not in crds]
    assert {o["kind"] for o in core} >= {"Deployment", "Service", "ConfigMap", "NetworkPolicy",
                                         "PodDisruptionBudget", "Namespace"}
    for obj in core:
        k8s_schemas.validate_core(obj)   # a kind with neither schema raises SchemaNotFoundError here


def test_every_custom_resource_passes_its_vendored_crd_schema(overlay):
    _, r = overlay
    crds = k8s_schemas.crd_schemas()
    custom = [o for o in r.objects if (o["apiVersion"], o["kind"]) in crds]
    assert custom
    for obj in custom:
        errors = k8s_schemas.validate_custom(obj, crds[(obj["apiVersion"], obj["kind"])])
        assert errors == [], (obj["kind"], obj["metadata"]["name"])


def test_the_core_check_catches_a_misspelt_field(standard):
    deployment = yaml.safe_load(yaml.safe_dump(standard.get("Deployment", "extproc")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_schemas.validate_core(deployment)


def test_the_crd_check_catches_a_misspelt_field(standard):
    monitor = yaml.safe_load(yaml.safe_dump(standard.get("ServiceMonitor", "extproc")))
    monitor["spec"]["endpoints"][0]["intervall"] = "5s"
    fixture = k8s_schemas.crd_schemas()[("monitoring.coreos.com/v1", "ServiceMonitor")]
    assert any("intervall" in e for e in k8s_schemas.validate_custom(monitor, fixture))


# --- one source for every file ---------------------------------------------------------------------------------

REPO_SOURCES = {
    "envoy-config": {"envoy.yaml": ROOT / "envoy" / "envoy.yaml"},
    "extproc-policy": {"policy.yaml": ROOT / "policies" / "kubernetes.yaml"},
    "extproc-grafana-dashboard": {"extproc.json": ROOT / "compose" / "grafana" / "dashboards" / "extproc.json"},
}


def test_config_maps_are_generated_from_the_repo_files_not_copies(standard):
    by_name = {_without_hash(n, standard): g for n, g in standard.generated.items()}
    for name, files in REPO_SOURCES.items():
        assert by_name[name].sources == files, name
        (cm,) = [o for o in standard.objects if o["kind"] == "ConfigMap"
                 and _without_hash(o["metadata"]["name"], standard) == name]
        for key, path in files.items():
            assert cm["data"][key] == path.read_text(), f"{name}/{key} differs from {path}"
    copies = [p for p in K8S.rglob("*") if p.name in {"envoy.yaml", "extproc.json", "default.yaml"}
              and p.read_text() in {f.read_text() for files in REPO_SOURCES.values() for f in files.values()}]
    assert copies == []


def test_kubectl_renders_each_config_map_byte_for_byte_from_its_file():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = run_tool([kubectl, "kustomize", "--load-restrictor=LoadRestrictionsNone", str(K8S / "overlays" / "standard")])
    maps = {re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"]): d["data"]
            for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ConfigMap"}
    for name, files in REPO_SOURCES.items():
        for key, path in files.items():
            assert maps[name][key] == path.read_text(), f"{name}/{key} differs from {path}"


def test_prometheus_rule_holds_the_compose_rule_files(standard):
    rule = standard.get("PrometheusRule", "extproc")
    groups = [g for path in RULE_FILES for g in yaml.safe_load(path.read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    generated = run_tool([sys.executable, str(ROOT / "scripts" / "k8s-prometheusrule.py")])
    committed = (K8S / "components" / "prometheus-operator" / "prometheusrule.yaml").read_text()
    assert generated.stdout == committed, "stale: run `make k8s`"


def test_kubernetes_policy_is_the_default_policy_with_the_shared_store():
    default = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    k8s = yaml.safe_load((ROOT / "policies" / "kubernetes.yaml").read_text())
    store = k8s.pop("store")
    assert k8s == default
    assert store["kind"] == "redis" and store["url"].startswith("redis://redis:6379")
    load_policy_file(str(ROOT / "policies" / "kubernetes.yaml"))


def test_store_instances_match_the_extproc_replicas(overlay):
    _, r = overlay
    store = yaml.safe_load((ROOT / "policies" / "kubernetes.yaml").read_text())["store"]
    assert store["instances"] == r.get("Deployment", "extproc")["spec"]["replicas"]


# --- images, resources, probes, security ---------------------------------------------------------------------

def test_every_image_is_pinned_to_a_version(overlay):
    _, r = overlay
    for obj in workloads(r):
        for c in containers(obj):
            name, _, tag = c["image"].rpartition(":")
            assert name and "/" not in tag and tag not in ("", "latest"), (obj["metadata"]["name"], c["image"])


def test_every_container_requests_resources_and_has_probes(overlay):
    _, r = overlay
    for obj in workloads(r):
        for c in containers(obj):
            where = (obj["metadata"]["name"], c["name"])
            requests = c.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(requests), where
            assert "memory" in c["resources"].get("limits", {}), where
            assert "readinessProbe" in c and "livenessProbe" in c, where


def test_edge_containers_run_unprivileged_on_a_read_only_root(overlay):
    _, r = overlay
    for obj in workloads(r):
        if obj["metadata"]["name"] not in EDGE:
            continue
        pod = pod_spec(obj)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        for c in containers(obj):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]


def test_replicated_edge_pods_spread_over_nodes_and_have_a_disruption_budget(overlay):
    _, r = overlay
    for obj in workloads(r):
        name = obj["metadata"]["name"]
        if name not in ("extproc", "envoy"):
            continue
        assert obj["spec"]["replicas"] >= 2
        assert obj["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
        terms = pod_spec(obj)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        pdb = r.get("PodDisruptionBudget", name)
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1


# --- the ext_proc: drain, policy reload ------------------------------------------------------------------------

def _extproc_args(r: Rendered) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server_main.add_arguments(parser)
    return parser.parse_args(container(r, "extproc")["args"][1:])


def test_extproc_grace_period_covers_its_drain_and_grace(overlay):
    _, r = overlay
    args = _extproc_args(r)
    grace_period = pod_spec(r.get("Deployment", "extproc"))["terminationGracePeriodSeconds"]
    assert grace_period >= args.drain_s + args.grace_s + 5


def test_extproc_listens_on_the_pod_network_on_the_ports_probes_and_services_use(overlay):
    _, r = overlay
    args, c = _extproc_args(r), container(r, "extproc")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert args.grpc == ("0.0.0.0", ports["grpc"]) and args.metrics == ("0.0.0.0", ports["metrics"])
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["livenessProbe"]["grpc"]["port"] == ports["grpc"]
    service = r.get("Service", "extproc")
    assert service["spec"]["clusterIP"] == "None"   # Envoy's STRICT_DNS sees every pod
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"grpc", "metrics"}


def test_policy_is_a_whole_config_map_directory_so_updates_reach_the_pod(overlay):
    _, r = overlay
    args, c = _extproc_args(r), container(r, "extproc")
    (mount,) = [m for m in c["volumeMounts"] if Path(args.policy).parent == Path(m["mountPath"])]
    assert "subPath" not in mount   # a subPath mount never sees a ConfigMap update
    (volume,) = [v for v in pod_spec(r.get("Deployment", "extproc"))["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == "extproc-policy"   # no hash suffix: updated in place, not replaced
    assert Path(args.policy).name in r.get("ConfigMap", "extproc-policy")["data"]


# --- Envoy ------------------------------------------------------------------------------------------------------

def _envoy_flag(c: dict, name: str) -> str:
    return c["args"][c["args"].index(name) + 1]


def test_envoy_started_as_the_deployment_starts_it_passes_envoy_validate(standard, tmp_path):
    c = container(standard, "envoy")
    (cm,) = [o for o in standard.objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("envoy-config")]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(Path(_envoy_flag(c, "--config-path")).parent)]
    config = tmp_path / "envoy.yaml"
    config.write_text(cm["data"][Path(_envoy_flag(c, "--config-path")).name])
    args = [str(config) if a == _envoy_flag(c, "--config-path") else a for a in c["args"]]
    out = run_tool([envoyconf.envoy_binary(), "--mode", "validate", *args])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--config-yaml" in args and mount["readOnly"] is True


def test_envoy_reaches_the_extproc_and_pools_by_their_service_names(standard):
    cfg = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    for cluster in cfg["static_resources"]["clusters"]:
        for group in cluster["load_assignment"]["endpoints"]:
            for ep in group["lb_endpoints"]:
                addr = ep["endpoint"]["address"]["socket_address"]
                service = standard.get("Service", addr["address"])
                assert service["spec"]["clusterIP"] == "None", cluster["name"]   # every replica, not one VIP
                assert addr["port_value"] in {p["port"] for p in service["spec"]["ports"]}


def test_envoy_probes_and_prestop_match_its_drain(standard):
    c, pod = container(standard, "envoy"), pod_spec(standard.get("Deployment", "envoy"))
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "health"}
    env = {e["name"]: float(e["value"]) for e in c["env"]}
    assert pod["terminationGracePeriodSeconds"] > env["LB_DEREGISTER_S"] + env["STREAM_DRAIN_S"]
    script = c["lifecycle"]["preStop"]["exec"]["command"][-1]
    (mount,) = [m for m in c["volumeMounts"] if script.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (cm,) = [o for o in standard.objects if o["metadata"]["name"] == volume["configMap"]["name"]]
    assert cm["data"][Path(script).name] == (K8S / "components" / "envoy" / "prestop.sh").read_text()


# --- who may reach what ----------------------------------------------------------------------------------------

def _ingress(r: Rendered, name: str) -> dict[str, list[dict]]:
    """Port name -> the peers allowed to reach it."""
    out: dict[str, list[dict]] = {}
    for rule in r.get("NetworkPolicy", name)["spec"]["ingress"]:
        for port in rule["ports"]:
            out.setdefault(port["port"], []).extend(rule.get("from", [{"anyone": True}]))
    return out


PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_only_envoy_reaches_the_extproc_grpc_port_and_only_prometheus_its_metrics(overlay):
    name, r = overlay
    ingress = _ingress(r, "extproc")
    assert set(ingress) == {"grpc", "metrics"}
    assert ingress["metrics"] == [PROMETHEUS]
    (caller,) = ingress["grpc"]
    if name == "standard":
        assert caller == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "envoy"}}}
    else:
        assert caller["podSelector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "envoy-gateway"


def test_only_the_extproc_reaches_redis(overlay):
    _, r = overlay
    assert _ingress(r, "redis") == {"redis": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "extproc"}}}]}


# --- autoscaling (components/keda) -------------------------------------------------------------------------------

def scaled_object(r: Rendered) -> dict:
    (so,) = [o for o in r.objects if o["kind"] == "ScaledObject"]
    return so


def test_scaled_object_targets_a_deployment_defined_here(standard):
    so = scaled_object(standard)
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    ref = so["spec"]["scaleTargetRef"]
    assert ref.get("kind", "Deployment") == "Deployment"
    standard.get("Deployment", ref["name"])
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]


def test_the_deployment_the_scaled_object_scales_leaves_its_replica_count_to_the_hpa(standard, gateway):
    """`kubectl apply` sets every field of the manifest that differs from the live object: a `replicas` in the
    scaled Deployment put the pool back to that count on each apply (the policy hot reload of docs/kubernetes.md
    re-applies the overlay), dropping the replicas the HPA had added mid-peak and their requests in flight."""
    target = scaled_object(standard)["spec"]["scaleTargetRef"]["name"]
    assert "replicas" not in standard.get("Deployment", target)["spec"]
    assert gateway.get("Deployment", target)["spec"]["replicas"] >= 2   # no autoscaler there: two, as before


def test_a_trigger_without_data_holds_the_pool_rather_than_reading_zero(standard):
    # KEDA's prometheus scaler reads an empty result as 0 under ignoreNullValues "true" (its default): an ext_proc
    # outage or a missing recording rule would scale the GPU pool down under load. "false" makes it an error, and
    # the HPA keeps the replicas it has.
    for t in scaled_object(standard)["spec"]["triggers"]:
        assert t["metadata"].get("ignoreNullValues", "true") == "false", t["name"]


def test_triggers_are_prometheus_queries_on_sustained_signals_that_exist(standard, known_metric_names):
    triggers = scaled_object(standard)["spec"]["triggers"]
    assert triggers
    for t in triggers:
        assert t["type"] == "prometheus"
        assert t.get("metricType", "AverageValue") in ("Value", "AverageValue")
        meta = t["metadata"]
        assert meta["serverAddress"].startswith("http")
        float(meta["threshold"])  # KEDA wants a string holding a number
        names = metric_names(meta["query"])
        assert names and names <= known_metric_names, names - known_metric_names
        # Sustained, not instantaneous: every series queried is a 5-minute average or the ext_proc's own average.
        assert all(re.search(r"avg5m|_avg$", n) for n in names), names


def test_scale_down_is_slower_than_scale_up(standard):
    behavior = scaled_object(standard)["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]


def test_pools_are_gpu_vllm_replicas_behind_headless_services_the_policy_routes_to(overlay):
    _, r = overlay
    policy = load_policy_file(str(ROOT / "policies" / "kubernetes.yaml"))
    served = set()
    for deployment in [o for o in workloads(r) if o["metadata"]["name"].startswith("vllm-")]:
        name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        (c,) = pod["spec"]["containers"]
        assert c["image"].startswith("vllm/vllm-openai:")
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        model = c["args"][c["args"].index("--served-model-name") + 1]
        cluster = name.replace("-", "_")
        assert policy.models[model].cluster == cluster == pod["metadata"]["labels"]["pool"]
        served.add(model)
        # Headless, so Envoy's STRICT_DNS cluster sees every ready pod (a ClusterIP would hide them behind one address).
        service = r.get("Service", name)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert served == set(policy.models)   # the 70B pool and the 8B degrade pool


# --- monitoring ----------------------------------------------------------------------------------------------------

def test_extproc_is_scraped_as_the_job_its_alerts_name(standard):
    monitor = standard.get("ServiceMonitor", "extproc")
    service = standard.get("Service", "extproc")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["name"] == "extproc"   # the job label; the alerts use up{job="extproc"}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    pod = standard.get("Deployment", "extproc")["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9090"


def test_grafana_dashboard_config_map_is_labelled_for_the_sidecar(standard):
    cm = standard.get("ConfigMap", "extproc-grafana-dashboard")
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}


# --- Envoy Gateway ---------------------------------------------------------------------------------------------

def test_envoy_gateway_overlay_replaces_our_envoy(gateway):
    assert not [o for o in gateway.objects if o["metadata"]["name"].startswith("envoy")]
    policy = gateway.get("EnvoyExtensionPolicy", "extproc-admission")
    (ext,) = policy["spec"]["extProc"]
    (ref,) = ext["backendRefs"]
    service = gateway.get("Service", ref["name"])
    assert ref["port"] in {p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"}
    assert ext["processingMode"]["request"]["body"] == "Buffered" and ext["failOpen"] is True
    for target in policy["spec"]["targetRefs"]:
        gateway.get(target["kind"], target["name"])


def test_envoy_gateway_ext_proc_breaker_is_as_high_as_envoy_yamls(gateway):
    # Every request holds an ext_proc stream; Envoy Gateway's default breaker (1,024) let a thousand held streams
    # turn admission off (failOpen passes the rest unadmitted), where envoy.yaml's cluster allows 100,000.
    ours = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    (cluster,) = [c for c in ours["static_resources"]["clusters"] if c["name"] == "extproc"]
    (limits,) = cluster["circuit_breakers"]["thresholds"]
    (ext,) = gateway.get("EnvoyExtensionPolicy", "extproc-admission")["spec"]["extProc"]
    breaker = ext["backendSettings"]["circuitBreaker"]
    assert breaker["maxConnections"] >= limits["max_connections"]
    assert breaker["maxPendingRequests"] >= limits["max_pending_requests"]
    assert breaker["maxParallelRequests"] >= limits["max_requests"]


H2_OPTIONS = ("typed_extension_protocol_options", "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
              "explicit_http_config", "http2_protocol_options")


def _ext_proc_cluster_patches(gateway: Rendered) -> list[dict]:
    """The patches on the cluster Envoy Gateway generates for the ext_proc (fields of it, not whole clusters)."""
    ext = gateway.get("EnvoyExtensionPolicy", "extproc-admission")
    name = f"envoyextensionpolicy/{ext['metadata']['namespace']}/{ext['metadata']['name']}/0"
    return [p for p in gateway.get("EnvoyPatchPolicy", "extproc-admission")["spec"]["jsonPatches"]
            if p["type"].endswith("Cluster") and p["name"] == name]


def test_envoy_gateway_ext_proc_http2_frame_limits_are_envoy_yamls(gateway):
    # Envoy cuts an HTTP/2 connection with more than 1,000 control frames (10,000 in all) waiting to go out; a busy
    # ext_proc reads late and every stream on the connection then failed open. envoy.yaml's extproc cluster raises
    # both limits; Envoy Gateway's backendSettings.http2 has no field for them, so the overlay patches its cluster.
    ours = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    (cluster,) = [c for c in ours["static_resources"]["clusters"] if c["name"] == "extproc"]
    h2 = cluster
    for key in H2_OPTIONS:
        h2 = h2[key]
    patched = {}
    for p in _ext_proc_cluster_patches(gateway):
        op = p["operation"]
        assert op["op"] == "add" and "jsonPath" not in op
        *where, field = op["path"].lstrip("/").split("/")
        assert tuple(where) == H2_OPTIONS, op["path"]
        patched[field] = op["value"]
    limits = {k: h2[k] for k in ("max_outbound_frames", "max_outbound_control_frames")}
    assert patched == limits


def test_envoy_patch_policy_names_the_resources_envoy_gateway_generates_for_ours(gateway):
    ext = gateway.get("EnvoyExtensionPolicy", "extproc-admission")
    ns, name = ext["metadata"]["namespace"], ext["metadata"]["name"]
    patch = gateway.get("EnvoyPatchPolicy", "extproc-admission")
    route = gateway.get("HTTPRoute", "openai")
    (parent,) = route["spec"]["parentRefs"]
    assert patch["metadata"]["namespace"] == parent["namespace"]
    assert patch["spec"]["targetRef"]["name"] == parent["name"]
    listener = f"{parent['namespace']}/{parent['name']}/{parent['sectionName']}"
    text = yaml.safe_dump(patch)
    assert f"envoy.filters.http.ext_proc/envoyextensionpolicy/{ns}/{name}/extproc/0" in text
    assert f"cluster_name: envoyextensionpolicy/{ns}/{name}/0" in text
    ops = patch["spec"]["jsonPatches"]
    assert {p["name"] for p in ops if not p["type"].endswith("Cluster")} == {listener}
    added = [p for p in ops if p["type"].endswith("Cluster") and p["operation"]["path"] == ""]
    pools = {p["operation"]["value"]["name"] for p in added}
    assert pools == {m.cluster for m in load_policy_file(str(ROOT / "policies" / "kubernetes.yaml")).models.values()}
    # Every other cluster patch is on the ext_proc's cluster, by the name Envoy Gateway gives it.
    assert [p for p in ops if p["type"].endswith("Cluster") and p not in added] == _ext_proc_cluster_patches(gateway)
    for p in added:
        host = p["operation"]["value"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
        fqdn = host["endpoint"]["address"]["socket_address"]["address"]
        svc, svc_ns = fqdn.split(".")[:2]
        assert svc_ns == ns and gateway.get("Service", svc)["spec"]["clusterIP"] == "None"


def test_envoy_gateway_strips_every_header_of_ours_a_client_sends_as_envoy_yaml_does(gateway):
    """The Gateway's early header mutation is envoy.yaml's: every x-extproc-* and x-ratelimit-* by prefix. A
    fixed list of names let a client's x-extproc-reason through, and would let any header of ours added later."""
    ops = gateway.get("EnvoyPatchPolicy", "extproc-admission")["spec"]["jsonPatches"]
    (early,) = [p["operation"]["value"] for p in ops
                if p["operation"]["path"] == "/early_header_mutation_extensions"]
    hcm = envoyconf.load_source()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert early == hcm["early_header_mutation_extensions"]


def test_envoy_gateway_asks_for_the_response_attributes_envoy_yaml_asks_for(gateway):
    """response.code_details tells the ext_proc that Envoy answered a request itself (not_routed) where no access
    log reports it; the Gateway's ext_proc filter must ask for what envoy.yaml's does."""
    ops = gateway.get("EnvoyPatchPolicy", "extproc-admission")["spec"]["jsonPatches"]
    (asked,) = [p["operation"]["value"] for p in ops if p["operation"]["path"] == "/response_attributes"]
    hcm = envoyconf.load_source()["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    assert asked == hcm["http_filters"][0]["typed_config"]["response_attributes"]


def test_envoy_patch_policy_values_pass_envoy_validate(gateway, tmp_path):
    """The Envoy config the patches add, assembled into one bootstrap: clusters as they are, the ext_proc filter and
    connection manager as envoy.yaml has them with the patched fields replaced by the patch values."""
    ops = gateway.get("EnvoyPatchPolicy", "extproc-admission")["spec"]["jsonPatches"]
    base = envoyconf.load_source()
    hcm = base["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    ext_cluster = next(c for c in base["static_resources"]["clusters"] if c["name"] == "extproc")
    clusters = [ext_cluster]
    for p in ops:
        op, value = p["operation"], p["operation"].get("value")
        if p["type"].endswith("Cluster") and op["path"] == "":
            clusters.append(value)
        elif p["type"].endswith("Cluster"):   # a field of the ext_proc's cluster: set it on envoy.yaml's
            *where, field = op["path"].lstrip("/").split("/")
            node = ext_cluster
            for key in where:
                node = node.setdefault(key, {})
            node[field] = value
        elif op["path"] in ("/request_trailer_mode", "/response_trailer_mode"):
            ext_proc["processing_mode"][op["path"][1:]] = value
        elif op["path"] in ("/max_message_timeout", "/response_attributes"):
            ext_proc[op["path"][1:]] = value
        elif op["path"] == "/early_header_mutation_extensions":
            hcm["early_header_mutation_extensions"] = value
        elif op["path"] == "/access_log/-":
            value["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "extproc"
            hcm["access_log"] = [value]
        elif op["path"] == "/routes/0":
            routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
            routes[0] = value
        else:
            raise AssertionError(f"a patch this test does not know how to check: {op}")
    base["static_resources"]["clusters"] = clusters
    config = tmp_path / "patched.yaml"
    config.write_text(yaml.safe_dump(base))
    out = run_tool([envoyconf.envoy_binary(), "--mode", "validate", "-c", str(config), "--log-level", "error"])
    assert out.returncode == 0, out.stdout + out.stderr


def test_envoy_gateway_routes_every_compute_endpoint_through_admission_and_nothing_else_around_it(gateway):
    """As envoy/envoy.yaml: every path on which vLLM computes is on the route the ext_proc runs on, and the only
    other routes are the read-only GETs. A catch-all route without admission would let /v1/responses,
    /invocations, embeddings or vLLM's admin endpoints reach the replicas unadmitted."""
    from extproc.server.openai import ENDPOINTS

    admitted = gateway.get("HTTPRoute", gateway.get("EnvoyExtensionPolicy", "extproc-admission")
                           ["spec"]["targetRefs"][0]["name"])
    paths = {m["path"]["value"] for rule in admitted["spec"]["rules"] for m in rule["matches"]
             if m["path"]["type"] == "Exact"}
    assert paths == set(ENDPOINTS)
    assert all(m["path"]["type"] == "Exact" for rule in admitted["spec"]["rules"] for m in rule["matches"])
    # The model list (and one model's card): GET only, answered by the ext_proc, which must run on that route.
    targets = {t["name"] for t in gateway.get("EnvoyExtensionPolicy", "extproc-admission")["spec"]["targetRefs"]}
    listing = gateway.get("HTTPRoute", "openai-models")
    assert listing["metadata"]["name"] in targets
    assert [m for rule in listing["spec"]["rules"] for m in rule["matches"]] == [
        {"path": {"type": "PathPrefix", "value": "/v1/models"}, "method": "GET"}]
    for route in (o for o in gateway.objects if o["kind"] == "HTTPRoute" and o not in (admitted, listing)):
        assert route["metadata"]["name"] not in targets
        for rule in route["spec"]["rules"]:
            for m in rule["matches"]:
                assert m["path"]["type"] == "Exact" and m.get("method") == "GET", (route["metadata"]["name"], m)
                assert m["path"]["value"] in {"/health", "/ping", "/version"}, m
