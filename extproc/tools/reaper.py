"""Stop the processes a process started, also when it dies without stopping them (Linux: reads /proc).

A process that calls token() gets a watchdog: a small process in a session of its own that reads a pipe from it
and, once the pipe closes (its starter exited: normally, os._exit, SIGKILL, a crash), stops every process its
starter marked. Two marks, because neither catches everything:

- the token: a process carries it when the variable TOKENS_ENV of the environment it was started with names it.
  Children inherit their parent's environment, so it reaches the servers a process starts, their workers and
  their children, whatever process group or session they run in. But a program may overwrite that environment in
  its memory, where /proc reads it (redis-server does, to show its title in `ps`);
- a session registered by spawn(): every process in it (the process spawn() started in a new session, and its
  children unless they start sessions of their own).

Nothing else is ever signalled: a process the caller did not start carries neither mark. (A session's number is
not reused while a process is in it, and a leader that came back under a reused pid has another start time.)

Ways to mark: spawn() (Stack.spawn and RedisServer use it); child_env(env) for the environment of any other Popen;
guard_environ() to put the token in os.environ, so that every child started afterwards carries it (the test suite
does this in pytest_configure: a fixture cut short by pytest-timeout, Ctrl-C, or a worker that dies leaves nothing
running). leftovers() is the same sweep from within the living process: what it marked that still runs.

This file runs as the watchdog by path (`python -I -S reaper.py TOKEN`), so it imports the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

TOKENS_ENV = "EXTPROC_REAPER_TOKENS"  # tokens of the processes this one descends from, ":"-separated
GRACE_S = 3.0  # SIGTERM, then SIGKILL what is still running this much later


@dataclass
class Marks:
    token: str
    sessions: dict[int, int] = field(default_factory=dict)  # session id -> its leader's start time


@dataclass(frozen=True)
class Found:
    pid: int
    cmdline: str

    def __str__(self) -> str:
        return f"pid {self.pid}: {self.cmdline}"


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (field 3, the state, first); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].decode().split()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return int(stat[19]) if stat else None


def _carries(pid: int, token: bytes) -> bool:
    needle = f"{TOKENS_ENV}=".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # gone, or not ours to read
        return False
    return any(var.startswith(needle) and token in var[len(needle):].split(b":") for var in env.split(b"\0"))


def marked(marks: Marks, exclude: tuple[int, ...] = ()) -> list[Found]:
    """Living processes (not zombies) that carry the token or run in one of the sessions."""
    try:
        pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:  # no /proc: nothing found (and nothing stopped)
        return []
    token = marks.token.encode()
    ours = {sid for sid, t in marks.sessions.items() if start_time(sid) in (None, t)}  # leader gone, or the same
    found = []
    for pid in pids:
        if pid in exclude or pid == os.getpid():
            continue
        stat = _stat(pid)
        if stat is None or stat[0] == "Z":
            continue
        if int(stat[3]) in ours or _carries(pid, token):
            found.append(Found(pid, _cmdline(pid)))
    return found


def running(pid: int) -> Found | None:
    """`pid` if it runs (a zombie does not)."""
    stat = _stat(pid)
    return Found(pid, _cmdline(pid)) if stat is not None and stat[0] != "Z" else None


def in_group(pgid: int) -> list[Found]:
    """The living processes (not zombies) of process group `pgid`."""
    try:
        pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return []
    return [Found(pid, _cmdline(pid)) for pid in pids
            if (stat := _stat(pid)) is not None and stat[0] != "Z" and int(stat[2]) == pgid]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def stop(marks: Marks, grace_s: float = GRACE_S, exclude: tuple[int, ...] = ()) -> list[Found]:
    """SIGTERM every marked process, SIGKILL those still running after `grace_s`; return what was found."""
    found = marked(marks, exclude)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        # Looked up again before each signal: a pid freed and reused meanwhile is not signalled.
        for p in marked(marks, exclude):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, sig)
        if not _still_running(marks, wait_s, exclude):
            break
    return found


def _still_running(marks: Marks, timeout_s: float, exclude: tuple[int, ...]) -> bool:
    """Wait up to `timeout_s` for every marked process to exit; True if some still run."""
    deadline = time.monotonic() + timeout_s
    while marked(marks, exclude):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


# --- the marking process's side ---

@dataclass
class _Guard:
    pid: int        # the process that started the watchdog (a fork's child starts its own)
    marks: Marks
    pipe: int       # write end; the watchdog sees EOF once every copy is closed
    watchdog: subprocess.Popen


_lock = threading.Lock()
_guard: _Guard | None = None


def _guarded() -> _Guard:
    """This process's guard; the first call starts its watchdog. Call with _lock held."""
    global _guard
    if _guard is None or _guard.pid != os.getpid():
        tok = f"{os.getpid()}-{secrets.token_hex(6)}"
        r, w = os.pipe()
        try:
            # A session of its own: a Ctrl-C or a signal to our process group does not stop it before it has
            # stopped the rest. -I -S: no site-packages to import, nothing read from the environment.
            watchdog = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), tok], stdin=r,
                                        stdout=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        _guard = _Guard(os.getpid(), Marks(tok), w, watchdog)
    return _guard


def token() -> str:
    """This process's token; the first call starts its watchdog."""
    with _lock:
        return _guarded().marks.token


def with_token(tokens: str | None, tok: str) -> str:
    have = [t for t in (tokens or "").split(":") if t]
    return ":".join(have if tok in have else [*have, tok])


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with this process's token added: what a child it should stop is started with."""
    env = dict(os.environ if env is None else env)
    env[TOKENS_ENV] = with_token(env.get(TOKENS_ENV), token())
    return env


def guard_environ() -> str:
    """Put this process's token in os.environ: every child it starts from now on is stopped after it exits."""
    tok = token()
    os.environ[TOKENS_ENV] = with_token(os.environ.get(TOKENS_ENV), tok)
    return tok


def spawn(argv: list[str], env: dict[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen in a new session, marked both ways: stopped once this process exits, if not before."""
    popen = subprocess.Popen(argv, env=child_env(env), start_new_session=True, **popen_kwargs)
    started = start_time(popen.pid)
    if started is not None:
        with _lock:
            guard = _guarded()
            guard.marks.sessions[popen.pid] = started
            with contextlib.suppress(OSError):  # a watchdog gone has nothing left to do
                os.write(guard.pipe, f"{popen.pid} {started}\n".encode())
    return popen


def leftovers(settle_s: float = 2.0) -> list[Found]:
    """What this process marked that still runs after up to `settle_s` (to exit on its own), each stopped now
    (SIGTERM, then SIGKILL); empty if it marked nothing."""
    with _lock:
        guard = _guard if _guard is not None and _guard.pid == os.getpid() else None
    if guard is None:
        return []
    exclude = (guard.watchdog.pid,)
    if not _still_running(guard.marks, settle_s, exclude):
        return []
    return stop(guard.marks, exclude=exclude)


def _forget_after_fork() -> None:
    """A fork's child neither holds the pipe open (the watchdog would wait for it too) nor shares the marks."""
    global _guard, _lock
    if _guard is not None:
        with contextlib.suppress(OSError):
            os.close(_guard.pipe)
        _guard = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


# --- the watchdog ---

def main(argv: list[str]) -> int:
    """Read the sessions spawn() registers until the pipe closes; then stop everything marked."""
    marks = Marks(argv[0])
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    with os.fdopen(0, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(4096):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                sid, started = map(int, line.split())
                marks.sessions[sid] = started
    for p in stop(marks):
        print(f"extproc reaper: stopped {p} (its starter, pid {marks.token.split('-')[0]}, exited without stopping"
              " it)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
