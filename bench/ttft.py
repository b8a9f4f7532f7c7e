"""How well the ext_proc sees time to first token: client-measured TTFT vs the ext_proc's two signals.

- extproc_time_to_first_token_seconds: the first body chunk with generated text, on streams whose body the ext_proc
  reads (all of them here: learn_sample 1.0; in production a sampled share);
- extproc_time_to_first_byte_seconds: Envoy's access log, every request, but it times the response headers.
Run:  python bench/ttft.py [--requests 60] [--concurrency 8]   (simulated vLLM at real-time speed)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extproc.tools.sim.fleet import SimFleet  # noqa: E402
from extproc.tools.stack import Stack  # noqa: E402

POLICY = {"classes": {"interactive": {"max_concurrency": 64, "max_queue": 0, "max_wait_ms": 0}},
          "models": {"llama-70b": {"cluster": "vllm_llama70b"}}, "learn_sample": 1.0}


async def one(http, url, prompt_words: int) -> float:
    body = {"model": "llama-70b", "max_tokens": 24, "stream": True,
            "messages": [{"role": "user", "content": "word " * prompt_words}]}
    t0 = time.monotonic()
    first = float("nan")
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        async for line in r.content:  # read to the end: leaving early would be a client abort
            if first != first and line.startswith(b"data: {") and b'"content":"' in line \
                    and b'"content":""' not in line:
                first = time.monotonic() - t0
    return first


def hist_mean(text: str, name: str) -> float:
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total / count if count else float("nan")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="extproc-ttft-"))
    (work / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    async with SimFleet("h100-llama70b-awq", replicas=1, speed=1.0, model_names=["llama-70b"]) as fleet:
        stack = Stack(work, {"vllm_llama70b": [("127.0.0.1", fleet.ports[0])]}, policy_path=work / "policy.yaml")
        await asyncio.to_thread(stack.start)
        try:
            sem = asyncio.Semaphore(args.concurrency)
            async with aiohttp.ClientSession() as http:
                async def bounded(i):
                    async with sem:
                        return await one(http, stack.url, 100 + 40 * (i % 20))
                client = await asyncio.gather(*[bounded(i) for i in range(args.requests)])
                await asyncio.sleep(0.5)
                text = await (await http.get(stack.metrics_url + "/metrics")).text()
        finally:
            await asyncio.to_thread(stack.stop)
    mean_client = statistics.fmean(client)
    ttft = hist_mean(text, "extproc_time_to_first_token_seconds")
    ttfb = hist_mean(text, "extproc_time_to_first_byte_seconds")
    print(f"{args.requests} streams, concurrency {args.concurrency}, simulated 70B at real time")
    print("| signal | mean | vs client |\n|---|---:|---:|")
    print(f"| client: first content delta (loadgen-style) | {mean_client * 1000:.1f} ms | 1.00 |")
    print(f"| extproc_time_to_first_token_seconds (first text chunk) | {ttft * 1000:.1f} ms | "
          f"{ttft / mean_client:.2f} |")
    print(f"| extproc_time_to_first_byte_seconds (access log, headers) | {ttfb * 1000:.1f} ms | "
          f"{ttfb / mean_client:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
