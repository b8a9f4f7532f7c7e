"""What every suite shares: the one policy factory (a document, a loaded Policy, or a file) and the one polling helper.

Two base policies, because two kinds of test count on their numbers: CORE for the sans-IO core (small caps, a short
interactive wait, models on pool_a / pool_b) and STACK for Envoy + ext_proc on loopback (models on the local stack's
vllm_* pools). Keyword arguments replace top-level keys of the base.

Its hooks (tests/processes.py) stop what a test leaves running: every process the tests start carries a mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from extproc.policy.decision import NoEvents
from extproc.policy.schema import Policy, load_policy
from extproc.tools.stack import free_port, wait_http
from tests.processes import pytest_configure, pytest_runtest_teardown, pytest_sessionfinish  # noqa: F401 (hooks)


def limits(max_concurrency: int, max_queue: int, max_wait_ms: int) -> dict:
    return {"max_concurrency": max_concurrency, "max_queue": max_queue, "max_wait_ms": max_wait_ms}


def acme(key: str) -> list[dict]:
    return [{"name": "acme", "api_keys": [key], "max_class": "batch", "default_class": "batch"}]


CORE = {"classes": {"interactive": limits(2, 2, 200), "batch": limits(3, 5, 5000), "internal": limits(1, 1, 5000)},
        "default_class": "interactive", "tenants": acme("sk-acme"),
        "models": {"llama": {"cluster": "pool_a"}, "small": {"cluster": "pool_b"}}}
STACK = {"classes": {"interactive": limits(3, 2, 2000), "batch": limits(4, 4, 2000), "internal": limits(1, 1, 500)},
         "default_class": "interactive", "tenants": acme("sk-acme-1"),
         "models": {"llama-70b": {"cluster": "vllm_llama70b"}, "llama-8b": {"cluster": "vllm_llama8b"}}}


def policy_doc(base: dict = STACK, **overrides) -> dict:
    """A policy document: `base` with top-level keys replaced by `overrides`.

    Requests without a key stand for a trusted client in these tests: unless `anonymous` is given they may claim the
    first class. (The schema's default caps them at the lowest class, the safe choice in production.)"""
    data = copy.deepcopy({**base, **overrides})  # a test may edit its copy
    data.setdefault("anonymous", {"max_class": next(iter(data["classes"]))})
    return data


def make_policy(**overrides) -> Policy:
    """The CORE policy, loaded and validated."""
    return load_policy(policy_doc(CORE, **overrides))


def policy_file(tmp_path: Path, name: str = "policy.yaml", **overrides) -> Path:
    """The STACK policy, written as YAML into `tmp_path` (what `extproc serve --policy` reads)."""
    path = tmp_path / name
    path.write_text(yaml.safe_dump(policy_doc(STACK, **overrides), sort_keys=False))
    return path


async def until(read, timeout: float = 5.0, interval: float = 0.05, holds=bool):
    """Call `read` (plain or async) until `holds` its value or `timeout` passes; return the last value read.

    The one way tests wait for something to become true (`assert await until(lambda: ...)`), instead of sleeping a
    guessed time; sync tests use `asyncio.run(until(...))`. That something does NOT happen still needs a fixed wait."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if inspect.isawaitable(value):
            value = await value
        if holds(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval)


class FakeClock:
    """A clock the test moves: the core takes time as an argument, so breakers and queues run in microseconds."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def pass_time(core, clock: FakeClock, waiters: list, until: float, answered: Callable[[], None]) -> None:
    """Move `clock` to `until` as the adapter lives through it: each waiter's own timer fires at its deadline, in
    order, then tick() and reap() run; `answered` is called after each (a model collects the answers)."""
    for w in sorted(waiters, key=lambda w: w.deadline):
        if w.pending and w.deadline <= until:
            clock.t = max(clock.t, w.deadline)
            core.abandon(w, timed_out=True)
            answered()
    clock.t = until
    core.tick()
    core.reap()
    answered()


@pytest.fixture
def clock():
    return FakeClock()


class RecordedEvents(NoEvents):
    """The core's events as a test reads them: every decision counted, the class of every queue entry, the shadow
    calls, every request accounted (ticket, outcome); the rest ignored."""

    def __init__(self) -> None:
        self.decisions: list = []
        self.entries: list[str] = []
        self.shadow_calls: list[tuple[str, str, str]] = []
        self.accounted: list = []

    def decided(self, d) -> None:
        self.decisions.append(d)

    def finished(self, ticket, outcome, latency_s) -> None:
        self.accounted.append((ticket, outcome))

    def queued(self, waiter) -> None:
        self.entries.append(waiter.limiter.name)

    def shadow(self, cls: str, would: str, reason: str) -> None:
        self.shadow_calls.append((cls, would, reason))

    @property
    def outcomes(self) -> list[tuple[str, str]]:
        """(kind, reason) of every decision counted."""
        return [(d.kind, d.reason) for d in self.decisions]


@contextlib.contextmanager
def run_upstream(*args: str):
    """tests/upstream.py in its own process (it records the most requests it ever had in service at once), with
    its `args`: yields (host, port). Stopped with SIGTERM, then SIGKILL after 2 s: a request it still delays must
    not hold the teardown."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "upstream.py"), str(port), *args],
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=20)
        yield ("127.0.0.1", port)
    finally:
        stop_process(proc, 2.0)


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
