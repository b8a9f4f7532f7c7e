"""End to end: clients -> real Envoy -> our ext_proc -> a vLLM target, the target being either

* `sim`: the simulator (`extproc sim --profile cpu-tiny-llama`, its own process), serving `tiny-llama` and
  `tiny-llama-small` like the real server below; runs in the regular `make test`;
* `vllm`: a real vLLM OpenAI server (CPU, the offline tiny Llama) at `$VLLM_URL`, started by `make e2e-vllm`
  (scripts/vllm/serve.py) with `--served-model-name tiny-llama tiny-llama-small`.

`E2E_TARGET` picks: `sim`, `vllm`, or `all`; unset: `sim`, plus `vllm` when `VLLM_URL` is set. A target not picked is
skipped with the reason. Pool `vllm_llama70b` serves `tiny-llama`, pool `vllm_llama8b` (the degrade target) serves
`tiny-llama-small`; both point at the same target.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from extproc.tools import envoyconf
from extproc.tools.stack import Stack
from tests.conftest import policy_doc, stop_process
from tests.integration import conftest as integration

ROOT = Path(__file__).resolve().parents[2]
MODEL, SMALL_MODEL = "tiny-llama", "tiny-llama-small"
TARGETS = ("sim", "vllm")


class Target:
    """Where the vLLM API is: its URL, loopback endpoint and served names."""

    def __init__(self, kind: str, url: str):
        self.kind = kind
        self.url = url.rstrip("/")
        u = urllib.parse.urlsplit(self.url)
        self.endpoint = (u.hostname, u.port or 80)
        self.model = os.environ.get("VLLM_MODEL", MODEL) if kind == "vllm" else MODEL
        self.small_model = os.environ.get("VLLM_SMALL_MODEL", SMALL_MODEL) if kind == "vllm" else SMALL_MODEL

    def __repr__(self) -> str:
        return f"Target({self.kind}, {self.url})"


def _selected() -> set[str]:
    choice = os.environ.get("E2E_TARGET", "").strip().lower()
    if choice in ("", "auto"):
        return {"sim", "vllm"} if os.environ.get("VLLM_URL") else {"sim"}
    if choice == "all":
        return set(TARGETS)
    if choice not in TARGETS:
        raise pytest.UsageError(f"E2E_TARGET={choice!r}: use sim, vllm or all")
    return {choice}


def _skip_reason(kind: str) -> str | None:
    if kind == "vllm" and not os.environ.get("VLLM_URL"):
        return "no real vLLM: set VLLM_URL (`make e2e-vllm` starts one and runs this suite against it)"
    if kind not in _selected():
        return f"E2E_TARGET={os.environ['E2E_TARGET']} leaves out the {kind} target"
    return None


def _start_sim(workdir: Path, profile: str | Path = "cpu-tiny-llama", *extra: str) -> tuple[subprocess.Popen, str]:
    """`extproc sim` in its own process group (real time, like a real server), with `extra` flags (e.g.
    `--scheduling-policy priority`); returns it and its URL."""
    log = workdir / "sim.log"
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "sim", "--profile", str(profile),
                             "--replicas", "1", "--port", "0", "--host", "127.0.0.1", *extra],
                            stdout=subprocess.PIPE, stderr=open(log, "wb"), stdin=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    deadline = time.monotonic() + 30
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("sim ready:"):
            return proc, line.split()[2]
    proc.kill()
    proc.wait(5)
    raise RuntimeError(f"simulator did not start: {line!r}\n{log.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="session", params=TARGETS)
def target(request, tmp_path_factory):
    kind = request.param
    if kind == "vllm" and "vllm" in _selected() and os.environ.get("E2E_TARGET") and not os.environ.get("VLLM_URL"):
        pytest.fail("E2E_TARGET asks for the real vLLM but VLLM_URL is not set (use `make e2e-vllm`)")
    reason = _skip_reason(kind)
    if reason:
        pytest.skip(reason)
    if kind == "vllm":
        yield Target("vllm", os.environ["VLLM_URL"])
        return
    with own_target("sim", tmp_path_factory.mktemp("sim")) as t:
        yield t


@contextlib.contextmanager
def own_target(kind: str, workdir: Path, sim_profile: str | Path = "cpu-tiny-llama", sim_args: tuple = (),
               vllm_args: tuple = (), max_model_len: int | None = None):
    """A target started for the caller and stopped after: the simulator (`sim_profile`, `sim_args`), or a real
    vLLM of its own (scripts/vllm/serve.py, `vllm_args` added to its command line: e.g. `--scheduling-policy
    priority`), for tests that need a server started with other flags than the session's. `max_model_len`: the
    real vLLM's (the simulator's comes from its profile)."""
    if kind == "vllm":
        from scripts.vllm.serve import VLLMServer

        sized = {"max_model_len": max_model_len} if max_model_len else {}
        with VLLMServer(extra_args=vllm_args, log_path=workdir / "vllm.log", **sized) as server:
            yield Target("vllm", server.url)
        return
    proc, url = _start_sim(workdir, sim_profile, *sim_args)
    try:
        yield Target("sim", url)
    finally:
        stop_process(proc, 10.0)


def policy(target: Target, classes: dict | None = None, **overrides) -> dict:
    """The policy document for a target: its two served names on the two pools, no tenants."""
    classes = classes or {"interactive": {"max_concurrency": 8, "max_queue": 4, "max_wait_ms": 2000},
                          "batch": {"max_concurrency": 4, "max_queue": 4, "max_wait_ms": 2000}}
    models = {target.model: {"cluster": "vllm_llama70b"}, target.small_model: {"cluster": "vllm_llama8b"}}
    return policy_doc(classes=classes, models=models, tenants=[], **overrides)


upstream = integration.upstream  # the test upstream (tests/upstream.py), a fixture here too


class BesideCPUvLLM(Stack):
    """The stack, with Envoy waiting up to 5 s for each ext_proc answer instead of envoy.yaml's 0.5 s: the real
    vLLM computes on this machine's two cores, and its long streams can keep the ext_proc from answering within
    0.5 s, after which Envoy lets requests through unadmitted (failure_mode_allow). One CI run's cap test got 5 of 6
    streams through a cap of 2, three of them with no decision. (A GPU's vLLM takes no CPU from the ext_proc.)"""

    def envoy_config(self) -> dict:
        cfg = super().envoy_config()
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == envoyconf.EXT_PROC]
        ext_proc["typed_config"]["message_timeout"] = envoyconf.duration(5.0)
        return cfg


@pytest.fixture
def make_stack(tmp_path, target):
    """Start Envoy + the ext_proc with a policy (a dict) in front of the target; stopped after the test.
    `stack_args`: Stack's own (e.g. answer_sample_percent=100)."""
    stacks: list[Stack] = []

    def start(document: dict | None = None, pools: dict | None = None, **stack_args) -> Stack:
        path = tmp_path / f"policy{len(stacks)}.yaml"
        path.write_text(yaml.safe_dump(document or policy(target), sort_keys=False))
        pools = pools or {"vllm_llama70b": [target.endpoint], "vllm_llama8b": [target.endpoint]}
        kind = BesideCPUvLLM if target.kind == "vllm" else Stack
        s = kind(tmp_path / f"stack{len(stacks)}", pools, policy_path=path, **stack_args)
        stacks.append(s)
        return s.start()

    yield start
    for s in stacks:
        s.stop()
