"""Policy hot reload the way Kubernetes delivers a ConfigMap update, against a real `extproc serve`.

The kubelet projects a ConfigMap volume as `..<timestamp>/` holding the files, a `..data` symlink to it, and one
symlink per key (`policy.yaml -> ..data/policy.yaml`). An update writes a new timestamped directory and renames a
fresh `..data_tmp` symlink over `..data` (atomic), then removes the old directory: the path the ext_proc was given
never changes, the file behind it does. These tests do exactly that to a running ext_proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.stack import free_port, wait_http
from tests.conftest import stop_process, until

from .conftest import ROOT

KEY = "policy.yaml"


class ConfigMapVolume:
    """A directory laid out and updated the way the kubelet's atomic writer does it."""

    def __init__(self, root: Path, data: dict[str, str]):
        self.root = root
        self.root.mkdir()
        self._version = 0
        current = self._write_version(data)
        os.symlink(current.name, self.root / "..data")
        for key in data:
            os.symlink(f"..data/{key}", self.root / key)

    def update(self, data: dict[str, str]) -> None:
        old = os.readlink(self.root / "..data")
        current = self._write_version(data)
        os.symlink(current.name, self.root / "..data_tmp")
        os.replace(self.root / "..data_tmp", self.root / "..data")   # the one atomic step
        for path in sorted((self.root / old).iterdir()):
            path.unlink()
        (self.root / old).rmdir()

    def _write_version(self, data: dict[str, str]) -> Path:
        self._version += 1
        directory = self.root / f"..2026_01_01_00_00_{self._version:02d}.{self._version:09d}"
        directory.mkdir()
        for key, text in data.items():
            (directory / key).write_text(text)
        return directory


def policy_text(**interactive) -> str:
    # The default policy: the Kubernetes one differs only by its Redis store, which is not what is tested here.
    policy = yaml.safe_load((ROOT / "policies" / "default.yaml").read_text())
    policy["classes"]["interactive"].update(interactive)
    return yaml.safe_dump(policy, sort_keys=False)


def samples(metrics_url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sample(metrics_url: str, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(metrics_url).items() if n == name and want <= ls)


@pytest.fixture
def mounted(tmp_path):
    """(the ConfigMap volume, the metrics URL of an ext_proc serving the policy from it, the process)."""
    volume = ConfigMapVolume(tmp_path / "policy", {KEY: policy_text()})
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc.cli", "serve", "--policy", str(volume.root / KEY),
         "--grpc", f"127.0.0.1:{free_port()}", "--metrics", f"127.0.0.1:{port}", "--watch-interval", "0.2"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "extproc.log").open("w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", timeout=30, proc=proc)
        yield volume, url, proc
    finally:
        stop_process(proc, 15.0)


def interactive_limit(url: str) -> float:
    return sample(url, "extproc_class_limit", **{"class": "interactive"})


async def test_a_config_map_update_reaches_the_running_extproc(mounted):
    volume, url, _ = mounted
    assert interactive_limit(url) == 24
    volume.update({KEY: policy_text(max_concurrency=7)})
    assert await until(lambda: interactive_limit(url) == 7, timeout=10, interval=0.1)
    assert sample(url, "extproc_config_reload_total", result="applied") == 1
    volume.update({KEY: policy_text(max_concurrency=9)})   # and again: the watch follows the new `..data`
    assert await until(lambda: interactive_limit(url) == 9, timeout=10, interval=0.1)


async def test_an_invalid_config_map_update_is_refused_and_the_running_policy_keeps_serving(mounted):
    volume, url, proc = mounted
    volume.update({KEY: policy_text(max_concurrency=-1)})
    assert await until(lambda: sample(url, "extproc_config_reload_total", result="invalid") == 1, timeout=10,
                       interval=0.1)
    assert sample(url, "extproc_config_last_reload_successful") == 0
    assert interactive_limit(url) == 24   # the old policy
    assert proc.poll() is None            # not restarted, not crashed
    with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    volume.update({KEY: policy_text(max_concurrency=12)})   # the next good update applies as usual
    assert await until(lambda: interactive_limit(url) == 12, timeout=10, interval=0.1)
    assert sample(url, "extproc_config_last_reload_successful") == 1
