"""No server a test starts outlives its pytest run, however the run is cut short (tests/processes.py).

Once, pytest-timeout cut short the setup of tests/ops/test_incident_drills.py's module fixture, and Prometheus,
Envoy, the simulators and the ext_proc kept running after pytest exited (each in a session of its own, so nothing
else stopped them). Each case here runs pytest on a small file whose module fixture starts real servers with the
repository's helpers (a RedisServer, and Envoy from a Stack), the way a drill does, writes their pids, and is then
cut short before its `yield`; afterwards no process of that run may be left.

Every process of the inner run carries a probe token of this test's (extproc.tools.reaper's variable): the test
lists what still carries it, and stops what it finds, whatever happened.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extproc.tools import reaper

ROOT = Path(__file__).resolve().parent.parent

INNER = '''
import os, signal, time
from pathlib import Path
import pytest
from extproc.tools.local_redis import RedisServer
from extproc.tools.stack import Stack, free_port

CASE = os.environ["INNER_CASE"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    redis = RedisServer(tmp).start()
    stack = Stack(tmp / "stack", {"vllm_llama70b": [("127.0.0.1", free_port())]}, mode="plain").start()
    Path(os.environ["INNER_PIDS"]).write_text(" ".join(str(p) for p in [redis.proc.pid, stack.processes[0].popen.pid]))
    if CASE == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # an xdist worker that dies
    if CASE == "interrupt":
        raise KeyboardInterrupt
    time.sleep(60)  # the timeout cuts the setup short here
    yield
    stack.stop()
    redis.stop()


@pytest.mark.timeout(4, method=os.environ.get("INNER_METHOD", "signal"))
def test_uses_servers(servers):
    pass
'''

# case -> (extra pytest arguments, pytest-timeout's method, what the inner run's output shows)
CASES = {
    "thread-timeout": ([], "thread", "Timeout"),              # pytest-timeout calls os._exit(1)
    "signal-timeout": ([], "signal", "still running at its end"),  # raises in the setup: the teardown never runs
    "interrupt": ([], "signal", "still running at its end"),  # Ctrl-C in the setup
    "sigkill": (["-n", "1"], "signal", "crashed"),            # the xdist worker is killed
}


@pytest.mark.parametrize("case", CASES)
def test_no_server_outlives_an_interrupted_fixture(case, tmp_path):
    args, method, shown = CASES[case]
    (tmp_path / "test_inner.py").write_text(INNER)
    probe = f"probe-{secrets.token_hex(6)}"
    pids = tmp_path / "pids"
    env = {**os.environ, "INNER_CASE": case.split("-")[0], "INNER_METHOD": method, "INNER_PIDS": str(pids),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           reaper.TOKENS_ENV: reaper.with_token(os.environ.get(reaper.TOKENS_ENV), probe)}
    started: list[int] = []
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.processes",
                              "--rootdir", str(tmp_path), "-o", "addopts=", *args, str(tmp_path / "test_inner.py")],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
        out = run.stdout + run.stderr
        started = [int(p) for p in pids.read_text().split()] if pids.exists() else []
        assert len(started) == 2, out  # the servers did start
        assert run.returncode != 0 and shown in out, out
        # The watchdog of a pytest that died stops its servers once it sees it gone (SIGTERM, then SIGKILL after
        # reaper.GRACE_S). redis-server overwrites its environment (its title in `ps`): looked for by its pid.
        deadline = time.monotonic() + reaper.GRACE_S + 10
        while (left := survivors(probe, started)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"left running by the interrupted run:\n{out}\n" + "\n".join(map(str, left))
    finally:
        for p in survivors(probe, started):
            os.kill(p.pid, signal.SIGKILL)


def survivors(probe: str, pids: list[int]) -> list[reaper.Found]:
    """What the inner run started that still runs: a carrier of the probe's token, or one of the servers' pids."""
    found = reaper.marked(reaper.Marks(probe))
    return found + [p for pid in pids if pid not in {f.pid for f in found} and (p := reaper.running(pid))]


BENCH = '''
import subprocess, sys, time
from extproc.tools.stack import exit_on_stop_signals
exit_on_stop_signals()
child = subprocess.Popen(["sleep", "300"], start_new_session=True)  # as a bench starts Envoy: a session of its own
try:
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(300)
finally:
    child.kill()
    child.wait()
'''


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_bench_stopped_by_a_signal_stops_what_it_started(sig, tmp_path):
    # bench/*.py start Envoy, upstreams and ext_procs in sessions of their own and stop them in `finally`; Python's
    # default SIGTERM skipped that, and `timeout` left fifteen such processes running (exit_on_stop_signals).
    script, pid_file = tmp_path / "bench.py", tmp_path / "child.pid"
    script.write_text(BENCH)
    proc = subprocess.Popen([sys.executable, str(script), str(pid_file)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        proc.send_signal(sig)
        assert proc.wait(20) == 128 + sig
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    finally:
        proc.kill()
        if pid_file.exists() and pid_file.read_text():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
