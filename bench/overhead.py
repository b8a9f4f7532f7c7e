"""What the ext_proc costs: Envoy alone vs Envoy + ext_proc (production envoy.yaml), side by side, with wrk.

The upstream is a second Envoy answering every request with a fixed OpenAI-shaped JSON (`direct_response`), so
neither the upstream nor Python on the upstream side limits the numbers. Both front configurations are rendered
from envoy/envoy.yaml; "alone" only drops the ext_proc filter.
`--baseline REF` adds a third setup, the ext_proc and envoy.yaml of another commit (e.g. `main`), in the same run.
`--scenario` picks what each request takes: `common` (admitted, nothing rewritten), `degrade` (cap 1, overflow
degraded with a body rewrite: the body path at 64 connections), `reject` (cap 1: nearly all refused), `learn` (every response's usage read).
Run:  python bench/overhead.py [--duration 10] [--baseline main] [--scenario common]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import tarfile
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from extproc.tools.envoyconf import envoy_binary  # noqa: E402
from extproc.tools.stack import Stack, exit_on_stop_signals, free_port, wait_http  # noqa: E402

BODY = {"model": "llama-70b", "messages": [{"role": "user", "content": "Say hello in five words."}],
        "max_tokens": 16, "stream": False}
REPLY = json.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "llama-70b",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}})

POLICY = {"classes": {"interactive": {"max_concurrency": 10000, "max_queue": 0, "max_wait_ms": 0}},
          "models": {"llama-70b": {"cluster": "vllm_llama70b"}}}
SCENARIOS = {
    "common": POLICY,
    # One slot, no queue: at 64 connections nearly every request overflows into a degrade that rewrites the body
    # (max_tokens clamped): the body is read and written back. At 1 connection the slot is always free.
    "degrade": {"classes": {"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0,
                                            "on_overflow": "fallback",
                                            "fallback": {"action": "degrade", "max_tokens": 8,
                                                         "max_concurrency": 10000}}},
                "models": {"llama-70b": {"cluster": "vllm_llama70b"}}},
    # One slot, no queue, no fallback: at 64 connections nearly every request is refused (429 with its JSON body,
    # answered by the ext_proc itself): how fast a flood is told no. At 1 connection the slot is always free.
    "reject": {"classes": {"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0}},
               "models": {"llama-70b": {"cluster": "vllm_llama70b"}}},
    # Every response's usage read for cost learning (the response headers and body come to the ext_proc).
    "learn": {**POLICY, "learn_sample": 1.0},
}
SETUPS = {"plain": "Envoy alone", "baseline": "Envoy + ext_proc (baseline)", "extproc": "Envoy + ext_proc"}


def upstream_config(port: int, admin: int) -> dict:
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {"listeners": [{
                "name": "up", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager."
                                 "v3.HttpConnectionManager",
                        "stat_prefix": "up",
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": REPLY}},
                            "response_headers_to_add": [{"header": {"key": "content-type",
                                                                    "value": "application/json"}}]}]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]}]}}


WRK_LUA = """
wrk.method = "POST"
wrk.body = [[%s]]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
""" % json.dumps(BODY)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (robust to a noisy machine, unlike wall-clock throughput)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, connections: int, duration: int, script: Path, pid: int | None = None,
        envoy_pid: int | None = None) -> dict:
    """One wrk run; with `pid` (the ext_proc's) and `envoy_pid`, each process's CPU per request too."""
    cpu0 = cpu_seconds(pid) if pid else 0.0
    envoy0 = cpu_seconds(envoy_pid) if envoy_pid else 0.0
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script),
                          f"{url}/v1/chat/completions"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    lat = {p: _ms(re.search(rf"\s{p}%\s+([\d.]+\w+)", out).group(1)) for p in ("50", "99")}
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))
    cpu_us = (cpu_seconds(pid) - cpu0) / max(total, 1) * 1e6 if pid else 0.0
    envoy_us = (cpu_seconds(envoy_pid) - envoy0) / max(total, 1) * 1e6 if envoy_pid else 0.0
    return {"rps": rps, "p50": lat["50"], "p99": lat["99"], "non2xx": int(non2xx.group(1)) if non2xx else 0,
            "socket_errors": errors.group(1) if errors else "", "cpu_us": cpu_us, "envoy_us": envoy_us}


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def export_tree(ref: str, dest: Path) -> Path:
    """The repository at `ref`, as files (git archive: no worktree to clean up)."""
    dest.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(dest, filter="data")
    return dest


@contextlib.contextmanager
def baseline_stack(tree: Path, workdir: Path, pools: dict, policy: Path):
    """`extproc stack` run from another commit's tree (its ext_proc, its envoy.yaml): (url, ext_proc pid, Envoy
    pid)."""
    pool_args = [a for name, eps in pools.items() for a in ("--pool", f"{name}=" + ",".join(f"{h}:{p}" for h, p in eps))]
    proc = subprocess.Popen([sys.executable, "-m", "extproc.cli", "stack", "--policy", str(policy), *pool_args,
                             "--workdir", str(workdir)], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        info = json.loads(proc.stdout.readline())
        yield info["url"], _child_serving(proc.pid), _child_running(proc.pid, b"envoy")
    finally:
        # An older `extproc stack` left its ext_proc and Envoy (each in a session of its own) running after
        # SIGTERM: stop them by pid.
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _children(parent: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(stat.parent.name))
    return out


def _child_serving(parent: int) -> int:
    return _child_running(parent, b"serve")


def _child_running(parent: int, word: bytes) -> int:
    """The child of `parent` whose command line has `word` as one of its arguments."""
    for pid in _children(parent):
        with contextlib.suppress(OSError):
            if any(arg.endswith(word) for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")):
                return pid
    raise RuntimeError(f"the baseline's {word.decode()} process was not found")


def main() -> int:
    exit_on_stop_signals()  # a bench stopped by `timeout` stops what it started
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--rounds", type=int, default=2, help="alternate the two setups this many times")
    ap.add_argument("--output", help="append the markdown table to this file")
    ap.add_argument("--no-uvloop", action="store_true", help="run the ext_proc on asyncio's default event loop")
    ap.add_argument("--baseline", metavar="REF", help="also measure the ext_proc + envoy.yaml of this git ref")
    ap.add_argument("--scenario", choices=SCENARIOS, default="common")
    ap.add_argument("--extproc-arg", action="append", default=[], help="extra `extproc serve` argument (repeat)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="extproc-bench-"))
    up_port, up_admin = free_port(), free_port()
    cfg = work / "upstream.yaml"
    cfg.write_text(yaml.safe_dump(upstream_config(up_port, up_admin)))
    upstream = subprocess.Popen([envoy_binary(), "-c", str(cfg), "--concurrency", "1", "--log-level", "error",
                                 "--base-id", str(up_admin), "--disable-hot-restart"], start_new_session=True)
    policy = work / "policy.yaml"
    policy.write_text(yaml.safe_dump(SCENARIOS[args.scenario]))
    baseline = export_tree(args.baseline, work / "baseline-tree") if args.baseline else None
    modes = ("plain", "baseline", "extproc") if baseline else ("plain", "extproc")
    script = work / "post.lua"
    script.write_text(WRK_LUA)
    pools = {"vllm_llama70b": [("127.0.0.1", up_port)]}
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        wait_http(f"http://127.0.0.1:{up_admin}/ready")
        for n in range(args.rounds):
            for mode in modes:
                with _setup(mode, work / f"{mode}{n}", pools, policy, baseline, args) as (url, pid, envoy):
                    wrk(url, 4, 2, script)  # warm up connections and code paths
                    for c in args.connections:
                        r = wrk(url, c, args.duration, script, pid, envoy)
                        results.setdefault((mode, c), []).append(r)
                        print(f"  {mode:8s} c={c:<3d} {r['rps']:9.0f} req/s  p50 {r['p50']:.3f} ms  "
                              f"p99 {r['p99']:.3f} ms  ext_proc CPU {r['cpu_us']:.0f} us/req  Envoy CPU {r['envoy_us']:.0f} "
                              f"us/req  non2xx {r['non2xx']} "
                              f"{r['socket_errors']}", flush=True)
                time.sleep(1)
    finally:
        upstream.terminate()
        upstream.wait(10)
    table = render(results, args, modes)
    print(table)
    if args.output:
        with open(args.output, "a", encoding="utf-8") as f:
            f.write(table + "\n")
    return 0


@contextlib.contextmanager
def _setup(mode: str, workdir: Path, pools: dict, policy: Path, baseline: Path | None, args):
    """(url, ext_proc pid or None, Envoy pid) of one setup, for the time of the `with`."""
    if mode == "baseline":
        with baseline_stack(baseline, workdir, pools, policy) as got:
            yield got
        return
    extproc_args = (["--no-uvloop"] if args.no_uvloop else []) + args.extproc_arg
    with Stack(workdir, pools, policy_path=policy, mode=mode, extproc_args=extproc_args) as stack:
        yield (stack.url, stack.process("extproc").popen.pid if mode == "extproc" else None,
               stack.process("envoy").popen.pid)


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def render(results: dict, args, modes: tuple[str, ...]) -> str:
    lines = [f"Envoy alone vs Envoy + ext_proc; scenario `{args.scenario}`; wrk -t1, {args.duration}s per run, "
             f"median of {args.rounds} alternating rounds; POST /v1/chat/completions with a JSON body"
             + (f"; baseline = {args.baseline}" if args.baseline else "") + ".", "",
             "| connections | setup | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s ratio | "
             "ext_proc CPU per request | Envoy CPU per request |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in args.connections:
        base = {k: _median([r[k] for r in results[("plain", c)]]) for k in ("rps", "p50", "p99")}
        for mode in modes:
            m = {k: _median([r[k] for r in results[(mode, c)]]) for k in ("rps", "p50", "p99", "cpu_us", "envoy_us")}
            added = (f"{m['p50'] - base['p50']:+.3f} | {m['p99'] - base['p99']:+.3f}" if mode != "plain"
                     else "  |  ")
            cpu = f"{m['cpu_us']:.0f} us" if mode != "plain" else ""
            lines.append(f"| {c} | {SETUPS[mode]} | {m['rps']:.0f} | {m['p50']:.3f} | {m['p99']:.3f} | {added} | "
                         f"{m['rps'] / base['rps']:.2f} | {cpu} | {m['envoy_us']:.0f} us |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
