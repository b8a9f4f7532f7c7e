#!/usr/bin/env python3
"""Serve the tiny model with a real vLLM on loopback; stop it (and its children) on exit, failure or signal.

    python3 scripts/vllm/serve.py                      # foreground until Ctrl-C / SIGTERM
    python3 scripts/vllm/serve.py --port 8100
    python3 scripts/vllm/serve.py -- pytest tests/e2e  # run a command against it, then stop; exit code = command's

Any python3 works (standard library only); the server itself runs under .cache/vllm-venv. While a command runs,
VLLM_URL and VLLM_MODEL (and VLLM_SMALL_MODEL) are set in its environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launcher import DEFAULT_MAX_MODEL_LEN, MODEL_DIR, VLLMError, VLLMServer  # noqa: E402


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
