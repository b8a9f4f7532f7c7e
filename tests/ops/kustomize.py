"""Render a kustomization in Python, for the tests: the subset of kustomize that deploy/k8s uses.

Supported, with kustomize's meaning: `resources` (files and directories), `components`, `namespace`,
`configMapGenerator` (`files`, `options.disableNameSuffixHash/labels/annotations`), `patches` (strategic merge
patches by file, matched by kind and name) and `images` (`newName`, `newTag`). Anything else raises, so a
kustomization that starts using more fails loudly here instead of rendering differently from kustomize.
Files may lie outside the kustomization's directory, like `--load-restrictor=LoadRestrictionsNone`.

Where it differs from kustomize: the name suffix of a hashed ConfigMap is a hash of its content computed here,
not kustomize's exact string (tests compare names without it). Strategic merge is simplified: maps merge, lists
whose items all have a `name` merge by name, other lists are replaced (NetworkPolicy rules, args), a
null deletes its field.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "components", "configMapGenerator",
                      "patches", "images"}
GENERATOR_KEYS = {"name", "files", "options"}
GENERATOR_OPTIONS = {"disableNameSuffixHash", "labels", "annotations"}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}


@dataclass
class Generated:
    """A ConfigMap made from files: its object, and the repo file behind each key."""

    obj: dict
    sources: dict[str, Path]


@dataclass
class Rendered:
    objects: list[dict] = field(default_factory=list)
    generated: dict[str, Generated] = field(default_factory=dict)   # by final name
    renamed: dict[str, str] = field(default_factory=dict)           # ConfigMap name as written -> with suffix

    def get(self, kind: str, name: str) -> dict:
        (obj,) = [o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name]
        return obj


def render(directory: Path) -> Rendered:
    out = _build(Path(directory), component=False)
    _fix_config_map_references(out)
    return out


def _load_kustomization(directory: Path, component: bool) -> dict:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this renderer does not support: {sorted(unknown)}")
    expected = "Component" if component else "Kustomization"
    if k.get("kind", "Kustomization") != expected:
        raise ValueError(f"{directory}: kind {k.get('kind')!r}, expected {expected}")
    return k


def _build(directory: Path, component: bool, into: Rendered | None = None) -> Rendered:
    k = _load_kustomization(directory, component)
    out = into if component else Rendered()
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            sub = _build(path, component=False)
            out.objects += sub.objects
            out.generated.update(sub.generated)
            out.renamed.update(sub.renamed)
        else:
            out.objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        made = _generate(directory, gen)
        out.objects.append(made.obj)
        out.generated[made.obj["metadata"]["name"]] = made
        out.renamed[gen["name"]] = made.obj["metadata"]["name"]
    for entry in k.get("components", []):
        _build(directory / entry, component=True, into=out)
    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"{directory}: only `patches: - path: FILE` is supported, got {entry}")
        for patch in yaml.safe_load_all((directory / entry["path"]).read_text()):
            target = _find(out.objects, patch["kind"], patch["metadata"]["name"])
            merged = _strategic_merge(target, patch)
            out.objects[out.objects.index(target)] = merged
    for image in k.get("images", []):
        for obj in out.objects:
            _set_image(obj, image)
    if "namespace" in k:
        for obj in out.objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    return out


def _generate(directory: Path, gen: dict) -> Generated:
    unknown = set(gen) - GENERATOR_KEYS | set(gen.get("options", {})) - GENERATOR_OPTIONS
    if unknown:
        raise ValueError(f"{directory}: configMapGenerator fields this renderer does not support: {sorted(unknown)}")
    data, sources = {}, {}
    for spec in gen["files"]:
        key, _, rel = spec.rpartition("=")
        path = (directory / rel).resolve()
        key = key or path.name
        data[key] = path.read_text()
        sources[key] = path
    options = gen.get("options", {})
    metadata = {"name": gen["name"]}
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    if options.get("annotations"):
        metadata["annotations"] = dict(options["annotations"])
    if not options.get("disableNameSuffixHash"):
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
        metadata["name"] = f"{gen['name']}-{digest}"
    return Generated({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}, sources)


def _find(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(matches) != 1:
        raise KeyError(f"patch target {kind}/{name}: {len(matches)} matches")
    return matches[0]


def _strategic_merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:  # a null in a patch deletes the field
                out.pop(key, None)
            else:
                out[key] = _strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _named(base) and _named(patch):
        out = copy.deepcopy(base)
        index = {item["name"]: i for i, item in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = _strategic_merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _named(items: list) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)


def pod_spec(obj: dict) -> dict | None:
    """The pod spec of a workload (Deployment, StatefulSet, DaemonSet, Job), or None."""
    return obj.get("spec", {}).get("template", {}).get("spec")


def containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj) or {}
    return spec.get("initContainers", []) + spec.get("containers", [])


def _set_image(obj: dict, image: dict) -> None:
    for c in containers(obj):
        name, _, tag = c["image"].partition(":")
        if name == image["name"]:
            c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def _fix_config_map_references(out: Rendered) -> None:
    """What kustomize's name reference transformer does for the references deploy/k8s has: ConfigMap volumes."""
    for obj in out.objects:
        for volume in (pod_spec(obj) or {}).get("volumes", []):
            cm = volume.get("configMap")
            if cm and cm["name"] in out.renamed:
                cm["name"] = out.renamed[cm["name"]]
