"""Set one class's `max_concurrency` in a policy file by editing only that number's characters.

PyYAML's composer gives the exact source span of the value, so comments, key order, flow or block style and
alignment all stay as they were; the edited text is validated with the policy schema before anything is written,
and the file is replaced atomically.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from pathlib import Path

import yaml

from extproc.policy.schema import PolicyError, load_policy


def _mapping_value(node: yaml.Node, key: str, where: str) -> yaml.Node:
    if not isinstance(node, yaml.MappingNode):
        raise PolicyError([f"{where}: must be a mapping"])
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return v
    raise PolicyError([f"{where}.{key}: not found" if where != "(root)" else f"{key}: not found"])


def set_class_cap(text: str, class_name: str, cap: int) -> str:
    """The policy text with classes.<class_name>.max_concurrency set to `cap`; raises PolicyError if the class
    or its cap is missing, or if the edited policy does not validate."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise PolicyError([f"not valid YAML: {e}"]) from e
    classes = _mapping_value(root, "classes", "(root)")
    spec = _mapping_value(classes, class_name, "classes")
    value = _mapping_value(spec, "max_concurrency", f"classes.{class_name}")
    if not isinstance(value, yaml.ScalarNode):
        raise PolicyError([f"classes.{class_name}.max_concurrency: must be an integer"])
    start, end = value.start_mark.index, value.end_mark.index
    edited = text[:start] + str(int(cap)) + text[end:]
    load_policy(yaml.safe_load(edited))  # never hand back (or write) a policy that does not validate
    return edited


def unified_diff(before: str, after: str, path: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                        fromfile=f"{path} (before)", tofile=f"{path} (calibrated)"))


def write_class_cap(path: str, class_name: str, cap: int) -> str:
    """Edit the file in place (atomic replace); returns the unified diff ('' when the cap was already set)."""
    before = Path(path).read_text(encoding="utf-8")
    after = set_class_cap(before, class_name, cap)
    if after == before:
        return ""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".calibrate-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(after)
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return unified_diff(before, after, path)


def policy_snippet(class_name: str, cap: int) -> str:
    """What to paste into a policy when none was given to edit."""
    return f"classes:\n  {class_name}: {{max_concurrency: {cap}}}\n"
