"""Start and stop a local stack: real Envoy (rendered from envoy/envoy.yaml) + the ext_proc + upstream replicas."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from . import envoyconf, reaper


LOWEST_PORT = 10000
KILL_WAIT_S = 5.0  # how long a process may take to be gone after SIGKILL
_given: set[int] = set()  # ports this process handed out: not handed out twice before their server binds them


def _ephemeral_low() -> int:
    """The bottom of the kernel's ephemeral range (where outgoing connections get their local ports)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started next. Picked below the ephemeral range: a port the
    kernel hands out for a bind to 0 comes from that range, and any outgoing connection (a test's client, Envoy's
    upstream pool) may be given it before the server binds it (a CI run failed on exactly that)."""
    low = _ephemeral_low()
    for _ in range(200 if low - LOWEST_PORT > 1000 else 0):
        port = random.randrange(LOWEST_PORT, low)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range on this machine
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """A port p with p .. p+n-1 all free (`extproc serve --workers n` listens on consecutive ports)."""
    while True:
        base = free_port(host)
        with contextlib.ExitStack() as held:
            try:
                for i in range(1, n):
                    held.enter_context(socket.socket()).bind((host, base + i))
                return base
            except OSError:
                continue


def wait_http(url: str, timeout: float = 30.0, ok=(200,), proc: subprocess.Popen | None = None,
              check: Callable[[], None] | None = None) -> None:
    """Poll `url` until it answers with an `ok` status; give up early if `proc` exits, or with what `check` raises
    (called before each try: every 50 ms while the port refuses or the answer is not ok, the usual wait; up to 2 s
    apart for a listener that never answers, a try's own timeout)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if check is not None:
            check()
        if proc is not None and proc.poll() is not None:
            raise TimeoutError(f"process exited with code {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
        except Exception as e:  # noqa: BLE001 - anything means "not yet"
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}")


def stop_group(popen: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 8.0) -> None:
    """Stop the process group `popen` leads (a process started in a session of its own, with its children: the
    workers of `extproc serve --workers N`): `sig` to the group, and SIGKILL to whatever of it still runs once the
    leader has exited (a child it left) or `timeout` has passed (the leader too). The leader is reaped last: until
    then its pid, the group's id, cannot be given to another process, so no other group is signalled. Returns once
    nothing of the group runs, or KILL_WAIT_S after the SIGKILL (subprocess.TimeoutExpired if the leader runs on)."""
    if popen.returncode is not None:  # reaped already: nothing of its group can be told apart safely
        return
    _signal_group(popen.pid, sig)
    deadline = time.monotonic() + timeout
    while not _exited(popen) and time.monotonic() < deadline:
        time.sleep(0.02)
    if popen.returncode is None:  # not reaped (by a wait elsewhere): the group's id is still its own
        _signal_group(popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while reaper.in_group(popen.pid) and time.monotonic() < deadline:  # SIGKILL takes a moment to end one
            time.sleep(0.02)
    popen.wait(KILL_WAIT_S)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _exited(popen: subprocess.Popen) -> bool:
    """Whether the process has exited, without reaping it."""
    if popen.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by a wait elsewhere meanwhile: poll() records it (returncode 0)
        popen.poll()
        return True


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 8.0) -> None:
        stop_group(self.popen, sig, timeout)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Stack:
    """Envoy in front of `pools`, with the ext_proc deciding (mode "extproc") or not ("plain", "adaptive")."""

    workdir: Path
    pools: dict[str, list[tuple[str, int]]]
    policy_path: Path | None = None
    mode: str = "extproc"
    envoy_concurrency: int = 1
    lb_policy: str | None = None
    adaptive: dict | None = None  # mode "adaptive"'s knobs, simulated seconds (envoyconf.adaptive_filter); None: b's
    extproc_args: list[str] = field(default_factory=list)
    extprocs: int = 1   # ext_proc instances behind Envoy's one `extproc` cluster (a rolling restart needs two)
    failure_mode_allow: bool | None = None  # override envoy.yaml's (False: fail closed)
    speed: float = 1.0  # the demo's time compression (envoyconf.render's `speed`)
    answer_sample_percent: int | None = None  # envoyconf.render's: None keeps envoy.yaml's
    # Called with what is about to happen (a process starting, or the wait for one to become ready, at each poll);
    # raises to start nothing more and end that wait (`extproc demo` once a signal came: its start is synchronous,
    # and the task's cancel lands only at the next await, after the whole start: a signal during a readiness wait
    # was acted on up to 30 s later).
    check: Callable[[str], None] | None = None
    processes: list[Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pick_ports()

    def pick_ports(self) -> None:
        self.listen_port = free_port()
        self.admin_port = free_port()
        self.grpc_ports = [free_port() for _ in range(self.extprocs)]
        self.metrics_ports = [free_port() for _ in range(self.extprocs)]
        self.grpc_port, self.metrics_port = self.grpc_ports[0], self.metrics_ports[0]  # the first instance

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def checker(self, what: str) -> Callable[[], None] | None:
        """`check` for `what`, as the argless callable a wait takes (None: nothing to check)."""
        return (lambda: self.check(what)) if self.check is not None else None

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> Process:
        if self.check is not None:
            self.check(f"{name} started")
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "ab")
        # reaper.spawn: if this process dies without stop(), its watchdog stops them.
        popen = reaper.spawn(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})})
        log.close()
        proc = Process(name, popen, log_path)
        self.processes.append(proc)
        return proc

    @staticmethod
    def extproc_name(i: int) -> str:
        return "extproc" if i == 0 else f"extproc{i}"

    def start_extproc(self, i: int = 0) -> Process:
        """Start ext_proc instance `i` and wait until its /healthz says it serves. Local stacks skip the drain on
        SIGTERM (nothing to move to when they stop) unless extproc_args asks for one."""
        assert self.policy_path is not None, "mode extproc needs a policy"
        proc = self.spawn(self.extproc_name(i), [
            sys.executable, "-m", "extproc.cli", "serve", "--policy", str(self.policy_path),
            "--grpc", f"127.0.0.1:{self.grpc_ports[i]}", "--metrics", f"127.0.0.1:{self.metrics_ports[i]}",
            "--drain-s", "0", "--grace-s", "5", *self.extproc_args])
        try:
            wait_http(f"http://127.0.0.1:{self.metrics_ports[i]}/healthz", timeout=30, proc=proc.popen,
                      check=self.checker(f"{proc.name} ready"))
        except TimeoutError:
            raise RuntimeError(f"ext_proc did not start:\n{proc.tail()}") from None
        return proc

    def envoy_config(self) -> dict:
        base = envoyconf.with_pools(envoyconf.load_source(), list(self.pools))
        return envoyconf.render(base, listen_port=self.listen_port, admin_port=self.admin_port,
                                extproc=[("127.0.0.1", p) for p in self.grpc_ports], pools=self.pools, mode=self.mode,
                                lb_policy=self.lb_policy, adaptive=self.adaptive, health_check_interval_s=1.0,
                                failure_mode_allow=self.failure_mode_allow, speed=self.speed,
                                answer_sample_percent=self.answer_sample_percent)

    def start_envoy(self) -> Process:
        path = self.workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(self.envoy_config(), sort_keys=False))
        proc = self.spawn("envoy", [envoyconf.envoy_binary(), "-c", str(path), "--concurrency",
                                    str(self.envoy_concurrency), "--log-level", "warning",
                                    "--base-id", str(self.admin_port), "--disable-hot-restart"])
        try:
            wait_http(f"{self.admin_url}/ready", timeout=30, proc=proc.popen, check=self.checker("envoy ready"))
        except TimeoutError:
            raise RuntimeError(f"envoy did not start:\n{proc.tail()}") from None
        return proc

    def start(self, attempts: int = 3) -> "Stack":
        """Start the ext_proc(s), then Envoy. A port taken between picking it and binding it (another process on
        the machine) is not this stack's failure: pick new ports and start again."""
        for attempt in range(attempts):
            try:
                if self.mode == "extproc":
                    for i in range(self.extprocs):
                        self.start_extproc(i)
                self.start_envoy()
                return self
            except RuntimeError as e:
                self.stop()
                if "in use" not in str(e) or attempt == attempts - 1:
                    raise
                self.pick_ports()
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        """Stop every process, the last started first (Envoy, then the ext_proc(s) it calls, then the upstreams).
        A stop that raises (a wait that timed out, a Ctrl-C, a signal handler's exception) does not leave the
        processes after it running: each is still stopped, whatever still runs after that gets SIGKILL, and then
        the first error is raised, the others added to it as notes."""
        errors: list[BaseException] = []
        for proc in reversed(self.processes):
            try:
                proc.stop()
            except BaseException as e:  # noqa: BLE001 - raised below, once every process is stopped
                errors.append(e)
        for proc in self.processes:
            try:
                stop_group(proc.popen, signal.SIGKILL, KILL_WAIT_S)
            except BaseException as e:  # noqa: BLE001 - the same
                errors.append(e)
        self.processes.clear()
        if errors:
            for later in errors[1:]:
                errors[0].add_note(f"stopping the stack also raised {later!r}")
            raise errors[0]

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)


# --- CLI: extproc stack (a long-running local stack for poking at by hand) ---

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="policies/default.yaml")
    p.add_argument("--pool", action="append", default=[], metavar="CLUSTER=HOST:PORT[,HOST:PORT]",
                   help="upstream endpoints per pool; required, repeatable (e.g. the ports `extproc sim` prints)")
    p.add_argument("--workdir", default=".cache/stack")
    p.add_argument("--mode", choices=envoyconf.MODES, default="extproc")


def run(args: argparse.Namespace) -> int:
    pools = {}
    for spec in args.pool:
        name, _, eps = spec.partition("=")
        pools[name] = [envoyconf._endpoint(e) for e in eps.split(",") if e]
    if not pools:
        print("give --pool CLUSTER=HOST:PORT (e.g. from `extproc sim`)", file=sys.stderr)
        return 2
    base = envoyconf.load_source()
    try:
        unknown = envoyconf.unknown_pools(base, list(pools), args.policy if args.mode == "extproc" else None)
    except ValueError as e:  # the policy does not load: one line, as `extproc check` says it
        print(f"extproc stack: {e}", file=sys.stderr)
        return 2
    if unknown:
        print(f"extproc stack: {envoyconf.no_cluster(unknown, base)}", file=sys.stderr)
        return 2
    # SIGTERM/SIGINT unwind through `with stack` (which stops Envoy and the ext_proc), also while they start, so
    # that neither is left running on its own. Handlers, not a blocked mask: children inherit a blocked mask
    # across exec, and Envoy and the ext_proc would then ignore the SIGTERM that stops them.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_requested)
    try:
        with Stack(Path(args.workdir), pools, policy_path=Path(args.policy), mode=args.mode) as stack:
            print(json.dumps({"url": stack.url, "metrics": stack.metrics_url, "admin": stack.admin_url,
                              "logs": str(stack.workdir)}), flush=True)
            while True:
                signal.pause()
    except StopRequested:
        return 0


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(Exception):
    """SIGTERM or SIGINT reached `extproc stack`."""


def _stop_requested(signum, frame) -> None:
    _ignore_stop_signals()
    raise StopRequested()


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:  # a second signal must not cut short the stop the first one started
        signal.signal(sig, signal.SIG_IGN)


def exit_on_stop_signals() -> None:
    """For a script that starts processes of its own (bench/): SIGTERM and SIGINT exit through its `finally` blocks
    and `with` statements, which stop them. Python's default SIGTERM ends the script at once, and its children, in
    sessions of their own, got no signal: a bench stopped by `timeout` left its Envoys, upstreams and ext_procs
    running (found 2026-12-07: fifteen of them, an hour later)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit_requested)


def _exit_requested(signum, frame) -> None:
    _ignore_stop_signals()
    raise SystemExit(128 + signum)
