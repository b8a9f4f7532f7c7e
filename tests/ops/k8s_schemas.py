"""Offline schema checks for rendered manifests: core kinds against Kubernetes' OpenAPI (kubernetes-validate),
custom resources against the openAPIV3Schema of their CRD, vendored in tests/fixtures/crds (README there)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kubernetes_validate

CRD_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "crds"
# The oldest Kubernetes the manifests target (gRPC probes, PDB policy/v1 and the rest are GA there).
KUBERNETES_VERSION = "1.30"


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the vendored fixture."""
    out = {}
    for path in CRD_FIXTURES.glob("*.json"):
        fixture = json.loads(path.read_text())
        out[(f"{fixture['group']}/{fixture['version']}", fixture["kind"])] = fixture
    return out


def validate_core(obj: dict) -> None:
    """Raises kubernetes_validate's errors; strict, so an unknown field fails instead of being dropped."""
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def validate_custom(obj: dict, fixture: dict) -> list[str]:
    """Errors of `obj` against its CRD schema. Fields the schema does not declare count as errors: the API server
    would prune them silently, so a misspelt field would just vanish."""
    schema = _no_unknown_fields(fixture["openAPIV3Schema"])
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def _no_unknown_fields(node):
    if isinstance(node, list):
        return [_no_unknown_fields(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _no_unknown_fields(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out
