"""Metric names referenced by PromQL expressions, and the metric names the ext_proc exposes or will expose."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

# Series Prometheus itself attaches to every target.
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                       "unless", "offset", "inf", "nan", "atan2"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels, strings and durations stripped)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "{}", text)          # label matchers (and Grafana ${vars})
    text = re.sub(r"\[[^\]]*\]", "[]", text)          # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS or re.fullmatch(r"\d.*", name):
            continue
        names.add(name)
    return names


def exposed_names(exposition: str) -> set[str]:
    """Every series name a /metrics text can carry: families from # TYPE lines, with histogram suffixes."""
    names = set()
    for line in exposition.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            name, kind = parts[2], parts[3]
            names.add(name)
            if kind in ("histogram", "summary"):
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
    return names


def recorded_names(rule_files: list[Path]) -> set[str]:
    names = set()
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            names.update(r["record"] for r in group["rules"] if "record" in r)
    return names


def rule_expressions(rule_files: list[Path]) -> list[tuple[str, str]]:
    """(rule name, expression) for every recording rule and alert."""
    out = []
    for path in rule_files:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for r in group["rules"]:
                out.append((r.get("record") or r["alert"], r["expr"]))
    return out
