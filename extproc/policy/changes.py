"""What a policy reload changed, in one log line: operators read it to see what a ConfigMap edit did (a reload
that only logged "policy reloaded" hid a removed class until its waiters got 503 class_removed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .schema import Policy

KEYED = ("classes", "models", "pools")  # name -> spec: added, removed, and the fields that changed
SECRET = ("api_keys", "url")  # tenants' keys and store.url (it may hold a password): named, never shown
SHOWN = 40  # characters of a value shown
# Entries (added, removed or changed) a section names; the rest are counted. A reload that raised each of 20,000
# tenants' limits logged a line of ~1 MB, past what log shippers take as one line.
NAMED = 10


def policy_changes(old: Policy, new: Policy) -> str:
    """'classes.interactive.max_concurrency 48 -> 24; pools +vllm_b; tenants -jobs' style summary, or 'no change'."""
    out: list[str] = []
    for f in dataclasses.fields(Policy):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if f.name in KEYED:
            out += _keyed(f.name, a, b)
        elif f.name == "tenants":  # a list, but each tenant is known by its (unique) name
            out += _keyed(f.name, {t.name: t for t in a}, {t.name: t for t in b}, ordered=False)
        else:
            out += _fields(f.name, a, b)
    return "; ".join(out + _defaults(old, new)) or "no change"


def _defaults(old: Policy, new: Policy) -> list[str]:
    """Defaults that follow the class list: a class added first or last moves them without their key changing
    (a class put on top protected itself from everything below, anonymous requests fell to a class put last)."""
    out = []
    if old.shed is None and new.shed is None and old.shed_map() != new.shed_map():
        out.append(f"shed (default) {_shed(old)} -> {_shed(new)}")
    if old.default_class is None and new.default_class is None and old.fallback_class() != new.fallback_class():
        out.append(f"default_class (default: the first class) {old.fallback_class()!r} -> {new.fallback_class()!r}")
    highest = [next(iter(p.classes)) for p in (old, new)]
    uncapped = [t.name for t in new.tenants if t.max_class is None]
    if highest[0] != highest[1] and uncapped:
        shown = ", ".join(uncapped[:5]) + (f" and {len(uncapped) - 5} more" if len(uncapped) > 5 else "")
        out.append(f"tenants.max_class (default: the highest class) {highest[0]!r} -> {highest[1]!r} for {shown}")
    lowest = [list(p.classes)[-1] for p in (old, new)]
    if old.anonymous.max_class is None and new.anonymous.max_class is None and lowest[0] != lowest[1]:
        out.append(f"anonymous.max_class (default: the lowest class) {lowest[0]!r} -> {lowest[1]!r}")
    return out


def _shed(p: Policy) -> str:
    return "{" + "; ".join(f"{k}: {', '.join(v)}" for k, v in p.shed_map().items()) + "}"


def _keyed(section: str, a: dict[str, Any], b: dict[str, Any], ordered: bool = True) -> list[str]:
    entries = [(k, "+") for k in b if k not in a] + [(k, "-") for k in a if k not in b] + \
        [(k, "") for k in a if k in b and a[k] != b[k]]
    out = []
    for k, sign in entries[:NAMED]:
        out += [f"{section} {sign}{k}"] if sign else _fields(f"{section}.{k}", a[k], b[k])
    rest = [sign for _, sign in entries[NAMED:]]
    if rest:
        out.append(f"{section}: {len(rest):,} more ({rest.count('+'):,} added, {rest.count('-'):,} removed, "
                   f"{rest.count(''):,} changed)")
    if ordered and list(a) != list(b) and set(a) == set(b):
        out.append(f"{section} reordered")  # class order is priority
    return out


def _fields(where: str, a: Any, b: Any) -> list[str]:
    """Each leaf that differs, by its full key path (`classes.x.fallback.action 'degrade' -> 'reject'`): a nested
    section shown whole was cut to a few characters of its repr and hid what changed."""
    if a == b:
        return []
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        return [line for f in dataclasses.fields(a) for line in _fields(f"{where}.{f.name}", getattr(a, f.name),
                                                                         getattr(b, f.name))]
    if where.rpartition(".")[2] in SECRET:
        return [f"{where} changed"]
    return [f"{where} {_short(a)} -> {_short(b)}"]


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."
