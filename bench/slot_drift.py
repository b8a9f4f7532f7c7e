"""Is the ext_proc's slot count exact under load? Its in-flight gauge against what the upstream has in service,
sampled side by side while wrk keeps a capped class full. Run:  python bench/slot_drift.py [--duration 10]

The upstream is tests/upstream.py (it counts the requests it is serving); every request takes --delay-ms there. A
slot is held from the admission to the end of the gRPC stream, which Envoy ends after the response: the ext_proc's
count should never be below the upstream's (that would be a slot freed while its request still runs) and above it
only by requests on their way in or out. Each sample reads the upstream first, then the ext_proc (a few ms apart),
so a request that ends in between can show as a small negative drift: read the minimum with that in mind.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from overhead import WRK_LUA, wrk  # noqa: E402

from extproc.tools.stack import Stack, exit_on_stop_signals, free_port, wait_http  # noqa: E402


def read_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


def ext_proc_inflight(metrics_url: str, cls: str) -> float:
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=2) as r:
        text = r.read().decode()
    m = re.search(rf'^extproc_inflight\{{class="{cls}"\}} ([\d.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def sample(stop: threading.Event, upstream: str, metrics_url: str, out: list[tuple[int, float]]) -> None:
    while not stop.is_set():
        up = read_json(f"{upstream}/test/stats")["in_service"]
        ours = ext_proc_inflight(metrics_url, "interactive")
        out.append((up, ours))
        time.sleep(0.02)


def main() -> int:
    exit_on_stop_signals()  # a bench stopped by `timeout` stops what it started
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--cap", type=int, default=16)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--delay-ms", type=int, default=50)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="extproc-drift-"))
    port = free_port()
    upstream = subprocess.Popen([sys.executable, str(ROOT / "tests" / "upstream.py"), str(port)],
                                start_new_session=True)
    policy = work / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "classes": {"interactive": {"max_concurrency": args.cap, "max_queue": 1000, "max_wait_ms": 10_000}},
        "models": {"llama-70b": {"cluster": "vllm_llama70b"}}}))
    script = work / "slow.lua"
    script.write_text(WRK_LUA + f'wrk.headers["x-test-delay-ms"] = "{args.delay_ms}"\n')
    up_url = f"http://127.0.0.1:{port}"
    samples: list[tuple[int, float]] = []
    try:
        wait_http(f"{up_url}/health")
        with Stack(work / "stack", {"vllm_llama70b": [("127.0.0.1", port)]}, policy_path=policy) as stack:
            stop = threading.Event()
            sampler = threading.Thread(target=sample, args=(stop, up_url, stack.metrics_url, samples))
            sampler.start()
            r = wrk(stack.url, args.connections, args.duration, script)
            stop.set()
            sampler.join()
            stats = read_json(f"{up_url}/test/stats")
    finally:
        upstream.terminate()
        upstream.wait(10)
    drift = sorted(ours - up for up, ours in samples)
    n = len(drift)
    print(f"{r['rps']:.0f} req/s, {r['non2xx']} non-2xx; most in service at the upstream: {stats['max_in_service']} "
          f"(cap {args.cap}); {n} samples")
    print("| ext_proc in flight - upstream in service | value |")
    print("|---|---:|")
    for label, value in (("mean", sum(drift) / n), ("median", drift[n // 2]), ("p1", drift[n // 100]),
                         ("p99", drift[(99 * n) // 100]), ("min", drift[0]), ("max", drift[-1])):
        print(f"| {label} | {value:+.1f} |")
    below = sum(1 for d in drift if d < 0)
    print(f"| samples with the ext_proc below the upstream | {below} of {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
