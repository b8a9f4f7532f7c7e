"""Writing a calibrated cap into a policy file: only that number changes, the result validates."""

import shutil
from pathlib import Path

import pytest
import yaml

from extproc.policy.schema import PolicyError, load_policy_file
from extproc.tools.calibrate.policy_edit import policy_snippet, set_class_cap, write_class_cap

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POLICY = ROOT / "policies" / "default.yaml"

BLOCK_STYLE = """\
# top comment
classes:
  interactive:
    max_concurrency: 24   # hand-tuned last spring
    max_queue: 20
  batch:
    max_concurrency: 64
models:
  m: {cluster: c}   # the only model
"""


def test_the_shipped_policy_keeps_every_other_line_and_validates(tmp_path):
    path = tmp_path / "policy.yaml"
    shutil.copy(DEFAULT_POLICY, path)
    before = path.read_text()
    diff = write_class_cap(str(path), "interactive", 16)
    after = path.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines())
    assert changed == [("  interactive: {max_concurrency: 24, max_queue: 20,  max_wait_ms: 200}",
                        "  interactive: {max_concurrency: 16, max_queue: 20,  max_wait_ms: 200}")]
    assert load_policy_file(str(path)).classes["interactive"].max_concurrency == 16
    assert "-  interactive: {max_concurrency: 24" in diff and "+  interactive: {max_concurrency: 16" in diff


def test_block_style_keeps_comments_and_other_classes():
    after = set_class_cap(BLOCK_STYLE, "batch", 40)
    assert after == BLOCK_STYLE.replace("max_concurrency: 64", "max_concurrency: 40")
    after = set_class_cap(BLOCK_STYLE, "interactive", 8)
    assert "    max_concurrency: 8   # hand-tuned last spring\n" in after
    assert yaml.safe_load(after)["classes"]["batch"]["max_concurrency"] == 64


def test_an_unknown_class_is_an_error_naming_it():
    with pytest.raises(PolicyError, match="classes.nope: not found"):
        set_class_cap(BLOCK_STYLE, "nope", 8)


def test_an_edit_that_would_not_validate_is_refused_and_the_file_is_untouched(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(BLOCK_STYLE)
    with pytest.raises(PolicyError, match="max_concurrency: must be >= 1"):
        write_class_cap(str(path), "batch", 0)
    assert path.read_text() == BLOCK_STYLE
    assert [p.name for p in tmp_path.iterdir()] == ["policy.yaml"]


def test_an_already_invalid_policy_is_not_written(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(BLOCK_STYLE.replace("max_queue: 20", "max_queue: -1"))
    before = path.read_text()
    with pytest.raises(PolicyError):
        write_class_cap(str(path), "interactive", 8)
    assert path.read_text() == before


def test_the_snippet_is_a_classes_fragment():
    assert yaml.safe_load(policy_snippet("interactive", 16)) == {"classes": {"interactive": {"max_concurrency": 16}}}
