"""The import arrows point down only (README, "Layout"): checked on the source, so a wrong arrow fails here."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "extproc"
RUNTIME = ("extproc.policy", "extproc.server", "extproc.store", "extproc.telemetry")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every extproc module `path` imports, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "extproc" or m.startswith("extproc.")}


def modules(*prefixes: str) -> list[tuple[str, set[str]]]:
    out = [(module_name(p), imports(p)) for p in sorted(PACKAGE.rglob("*.py"))]
    return [(m, deps) for m, deps in out if any(m == p or m.startswith(p + ".") for p in prefixes)]


def under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_walk_finds_the_packages():
    names = {m for m, _ in modules("extproc")}
    assert {"extproc.policy.admission", "extproc.server.servicer", "extproc.tools.sim.engine"} <= names


@pytest.mark.parametrize("module,deps", modules(*RUNTIME), ids=lambda v: v if isinstance(v, str) else "")
def test_the_runtime_does_not_import_the_tools(module, deps):
    assert not {d for d in deps if under(d, ["extproc.tools"])}


@pytest.mark.parametrize("module,deps", modules("extproc.policy"), ids=lambda v: v if isinstance(v, str) else "")
def test_the_policy_core_imports_nothing_of_ours_outside_itself(module, deps):
    assert not {d for d in deps if not under(d, ["extproc.policy"]) and d != "extproc"}


@pytest.mark.parametrize("module,deps", modules("extproc.tools.sim", "extproc.tools.loadgen", "extproc.tools.stats"),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_the_simulator_and_load_generator_do_not_know_the_policy(module, deps):
    assert not {d for d in deps if under(d, RUNTIME)}


def test_nothing_machine_local_is_tracked():
    """A helper's clone once linked `.cache` to another clone's (/tmp/...) and the link was committed: every fresh
    checkout then had a `.cache` dangling or pointing into a stranger's folder, where `make vllm-setup` and the e2e
    suite put the real vLLM. Nothing under a folder .gitignore names (checked by the name, a link included, which
    git's own ignore rules for `dir/` do not match) is tracked, nor a link out of the repository."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    folders = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
               if line.strip().endswith("/") and not line.startswith("#")}
    bad = []
    for line in tracked.stdout.splitlines():
        mode, path = line.split()[0], line.split("\t", 1)[1]
        if path.split("/")[0] in folders:
            bad.append(path)
        elif mode == "120000" and not (ROOT / path).resolve().is_relative_to(ROOT):
            bad.append(f"{path} -> {os.readlink(ROOT / path)}")
    assert not bad, bad
