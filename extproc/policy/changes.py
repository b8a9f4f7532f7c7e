"""What a policy reload changed, in one log line: operators read it to see what a ConfigMap edit did (a reload
that only logged "policy reloaded" hid a removed class until its waiters got 503 class_removed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .schema import Policy

KEYED = ("classes", "models", "pools")  # name -> spec: added, removed, and the fields that changed
SHOWN = 40  # characters of a value shown


def policy_changes(old: Policy, new: Policy) -> str:
    """'classes.interactive.max_concurrency 48 -> 24; pools +vllm_b; tenants' style summary, or 'no change'."""
    out: list[str] = []
    for f in dataclasses.fields(Policy):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b and (f.name not in KEYED or list(a) == list(b)):  # dicts compare equal in any order
            continue
        if f.name in KEYED:
            out += _keyed(f.name, a, b)
        else:
            out.append(f.name)
    return "; ".join(out) or "no change"


def _keyed(section: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = [f"{section} +{k}" for k in b if k not in a] + [f"{section} -{k}" for k in a if k not in b]
    for k in a:
        if k in b and a[k] != b[k]:
            out += _fields(f"{section}.{k}", a[k], b[k])
    if list(a) != list(b) and set(a) == set(b):
        out.append(f"{section} reordered")  # class order is priority
    return out


def _fields(where: str, a: Any, b: Any) -> list[str]:
    if not (dataclasses.is_dataclass(a) and type(a) is type(b)):
        return [f"{where} {_short(a)} -> {_short(b)}"]
    return [f"{where}.{f.name} {_short(getattr(a, f.name))} -> {_short(getattr(b, f.name))}"
            for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."
