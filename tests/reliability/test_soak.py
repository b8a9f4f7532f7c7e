"""Soak: 10 minutes through real Envoy + the ext_proc + a simulated 70B replica at ~80% of the class caps, with a mix
of classes and tenants, streamed and not, and ~10% of clients giving up at random moments.

Passes when, at the end: nothing is in flight or queued, every admitted request was accounted exactly once, the
ext_proc's RSS grew less than 5% after warm-up, no stream error was counted, and clients saw no error other than
intended refusals (429/503 from the ext_proc) and their own aborts. `make soak`; SOAK_SECONDS shortens it.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from extproc.tools.loadgen import LoadClient, RequestKind, Workload, run_closed_loop
from tests.conftest import policy_file, until
from tests.integration.helpers import healthz, metrics, sample, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.soak]

SECONDS = float(os.environ.get("SOAK_SECONDS", "600"))
CAPS = {"interactive": 16, "batch": 32}
LOAD = 0.8   # closed-loop clients per class, as a share of the class cap
SPEED = float(os.environ.get("SOAK_SPEED", "1"))  # simulator speed: higher = shorter requests, more per second


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@pytest.mark.timeout(SECONDS + 300)
async def test_soak(make_stack, tmp_path, sims):
    big = sims("h100-llama70b-awq", "llama-70b", speed=SPEED)
    policy = policy_file(tmp_path, classes={
        "interactive": {"max_concurrency": CAPS["interactive"], "max_queue": 16, "max_wait_ms": 500},
        "batch": {"max_concurrency": CAPS["batch"], "max_queue": 64, "max_wait_ms": 3000}},
        default_class="interactive", shed={"interactive": ["batch"]},
        tenants=[{"name": "acme", "api_keys": ["sk-acme-1"], "max_class": "batch", "default_class": "batch"},
                 {"name": "chat", "api_keys": ["sk-chat-1"], "max_class": "interactive"}],
        anonymous={"max_class": "batch", "default_class": "batch"})
    s = make_stack(policy, pools={"vllm_llama70b": [big.endpoint], "vllm_llama8b": [big.endpoint]},
                   extproc_args=["--watch-interval", "0", "--log-level", "WARNING"])
    pid = s.process("extproc").popen.pid

    def kinds(cls: str, key: str) -> Workload:
        common = dict(model="llama-70b", prompt_tokens={"min": 64, "max": 512}, abort_prob=0.1,
                      headers={"authorization": f"Bearer {key}", "x-priority": cls}, body={"ignore_eos": False})
        return Workload([RequestKind(name=f"{cls}-stream", stream=True, max_tokens=64, **common),
                         RequestKind(name=f"{cls}-plain", stream=False, max_tokens=32, **common)])

    rss: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def sample_rss():
        while not stop.is_set():
            rss.append((time.monotonic(), rss_kib(pid)))
            try:
                await asyncio.wait_for(stop.wait(), 5.0)
            except TimeoutError:
                pass

    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_rss())
    async with LoadClient([s.url], timeout_s=30.0, pool=128) as client:
        await asyncio.gather(
            run_closed_loop(client, kinds("interactive", "sk-chat-1"), round(CAPS["interactive"] * LOAD),
                            duration_s=SECONDS, seed=1),
            run_closed_loop(client, kinds("batch", "sk-acme-1"), round(CAPS["batch"] * LOAD), duration_s=SECONDS,
                            seed=2))
    elapsed = time.monotonic() - t0
    stop.set()
    await sampler
    records = client.records

    async with aiohttp.ClientSession() as http:
        snap = await wait_idle(http, s.metrics_url, timeout=10)

        async def accounted():
            ms = await metrics(http, s.metrics_url)
            return sample(ms, "extproc_request_duration_seconds_count") == \
                sample(ms, "extproc_requests_total", decision="accept") and ms

        ms = await until(accounted, timeout=10, interval=0.5) or await metrics(http, s.metrics_url)
        health = await healthz(http, s.metrics_url)

    # RSS: median of the samples around the end of warm-up (20% of the run) vs the last ones.
    warm = [k for t, k in rss if t - t0 >= 0.2 * SECONDS][:3] or [rss[0][1]]
    last = [k for _, k in rss[-3:]]
    growth = statistics.median(last) / statistics.median(warm) - 1.0
    outcomes = Counter()
    for r in records:
        if r.ok:
            outcomes["ok"] += 1
        elif r.error == "abort":
            outcomes["client abort (intended)"] += 1
        elif r.status in (429, 503) and (r.error or "").partition(":")[0] in ("rate_limit_error",
                                                                              "service_unavailable_error"):
            outcomes[f"{r.status} from admission (intended)"] += 1
        else:
            outcomes[f"UNEXPECTED {r.status} {r.error}"] += 1
    decisions = {f"{dict(ls)['class']}/{dict(ls)['decision']}/{dict(ls)['reason']}": v
                 for (n, ls), v in ms.items() if n == "extproc_requests_total" and v}
    report = {"seconds": round(elapsed, 1), "requests": len(records), "per_s": round(len(records) / elapsed, 1),
              "client_outcomes": dict(outcomes), "decisions": decisions,
              "accounted": {o: sample(ms, "extproc_request_duration_seconds_count", outcome=o)
                            for o in ("ok", "client_abort", "upstream_error", "ended", "lease_expired",
                                      "ext_proc_error", "not_routed")},
              "rss_kib_warm": statistics.median(warm), "rss_kib_end": statistics.median(last),
              "rss_kib_max": max(k for _, k in rss), "rss_growth_pct": round(100 * growth, 2),
              "stream_errors": sample(ms, "extproc_stream_errors_total"), "final_classes": snap,
              "rss_kib_series": [(round(t - t0), k) for t, k in rss]}
    print("\nSOAK " + json.dumps(report, indent=1))
    out = os.environ.get("SOAK_REPORT")
    if out:
        Path(out).write_text(json.dumps(report, indent=1))

    assert all(c["inflight"] == 0 and c["queue"] == 0 and c["degraded_inflight"] == 0 for c in snap.values()), snap
    assert sample(ms, "extproc_request_duration_seconds_count") == \
        sample(ms, "extproc_requests_total", decision="accept"), "every admitted request accounted once"
    assert report["stream_errors"] == 0 and health["stream_errors"] == 0
    assert not [k for k in outcomes if k.startswith("UNEXPECTED")], outcomes
    assert outcomes["ok"] > 0.5 * len(records)
    assert growth < 0.05, f"ext_proc RSS grew {100 * growth:.1f}% after warm-up"
