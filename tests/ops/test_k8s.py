"""The Kubernetes autoscaling example: manifests parse, the ScaledObject targets the pool on sustained signals."""

from __future__ import annotations

import re

import yaml

from extproc.policy.schema import load_policy_file

from .conftest import ROOT
from .promql import metric_names

K8S = ROOT / "deploy" / "k8s"


def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def scaled_object() -> dict:
    (so,) = [d for (kind, _), d in manifests().items() if kind == "ScaledObject"]
    return so


def test_scaled_object_targets_a_deployment_defined_here():
    so = scaled_object()
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    ref = so["spec"]["scaleTargetRef"]
    assert ref.get("kind", "Deployment") == "Deployment"
    assert ("Deployment", ref["name"]) in manifests()
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]


def test_triggers_are_prometheus_queries_on_sustained_signals_that_exist(known_metric_names):
    triggers = scaled_object()["spec"]["triggers"]
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


def test_scale_down_is_slower_than_scale_up():
    behavior = scaled_object()["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]


def test_pool_deployment_is_a_gpu_vllm_replica_behind_a_headless_service():
    m = manifests()
    name = scaled_object()["spec"]["scaleTargetRef"]["name"]
    deployment = m[("Deployment", name)]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["image"].startswith("vllm/vllm-openai:")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    args = container["args"]
    served = args[args.index("--served-model-name") + 1]
    policy = load_policy_file(str(ROOT / "policies" / "default.yaml"))
    assert policy.models[served].cluster == name.replace("-", "_")  # the Envoy cluster this pool backs
    service = m[("Service", name)]
    # Headless, so Envoy's STRICT_DNS cluster sees every ready pod (a ClusterIP would hide them behind one address).
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
