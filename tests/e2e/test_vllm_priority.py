"""vLLM's own priority scheduling behind the ext_proc: a target started with `--scheduling-policy priority` and
`--max-num-seqs 1` (one request runs, the rest wait: contention the tiny model shows within seconds), and a policy
that sets `classes.<name>.vllm_priority` (interactive 0, batch 10).

Per target, like the rest of tests/e2e (conftest): `sim` (the simulator with the same flags, a cpu-tiny-llama
profile with `max_num_seqs: 1`) or `vllm` (a real vLLM of this module's own, started with those flags next to the
session's; it runs when the suite's vLLM target is selected, as in `make e2e-vllm`). What must hold on both:

* requests of both classes are served;
* the client cannot pick its place in the engine's queue: neither a `priority` in the body nor an
  `X-Vllm-Priority` header reaches the replica (a batch request sending -100 both ways still runs after an
  interactive one that arrived later; a body priority vLLM itself refuses is served through the stack);
* an interactive request queued behind batch requests starts first;
* the replica's API takes `priority` the same way on both targets (an integer is accepted, a non-int64 refused
  with the same error), and under fcfs a non-zero priority is accepted and ignored (vLLM 0.32).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import aiohttp
import pytest
import yaml

from tests.conftest import until
from tests.integration.helpers import wait_idle

from .conftest import ROOT, _selected, own_target, policy
from .test_e2e import JSON, chat, metric, post, target_metrics

PRIORITY_FLAGS = ("--scheduling-policy", "priority", "--max-num-seqs", "1")
# This module's targets take contexts up to the tiny model's 4,096 positions, so the stream that holds the one
# running sequence can last ~7 s on the CPU vLLM (1,500 tokens, ~3 s, once ended before the queue had formed).
MAX_MODEL_LEN = 4096
BLOCKER_TOKENS = 3800
CLASSES = {"interactive": {"max_concurrency": 8, "max_queue": 4, "max_wait_ms": 2000, "vllm_priority": 0},
           "batch": {"max_concurrency": 8, "max_queue": 4, "max_wait_ms": 2000, "vllm_priority": 10}}
INT64_MAX = 2**63 - 1
BATCH = {"x-priority": "batch"}
BATCH_TOKENS = 256


def _one_seq_profile(workdir) -> str:
    """cpu-tiny-llama with one running sequence at a time (vLLM's --max-num-seqs 1)."""
    doc = yaml.safe_load((ROOT / "extproc/tools/sim/profiles/cpu-tiny-llama.yaml").read_text())
    doc.update(name="cpu-tiny-llama-1seq", max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
    path = workdir / "cpu-tiny-llama-1seq.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def _want(kind: str) -> None:
    if kind not in _selected():
        pytest.skip(f"the {kind} target is not selected (E2E_TARGET; `make e2e-vllm` selects vllm)")


@pytest.fixture(scope="module", params=["sim", "vllm"])
def target(request, tmp_path_factory):
    """This module's own target, with priority scheduling and one running sequence (overrides conftest's)."""
    _want(request.param)
    workdir = tmp_path_factory.mktemp(f"priority-{request.param}")
    with own_target(request.param, workdir, _one_seq_profile(workdir), PRIORITY_FLAGS[:2],
                    PRIORITY_FLAGS, max_model_len=MAX_MODEL_LEN) as t:
        yield t


@pytest.fixture(scope="module")
def fcfs_url(target, tmp_path_factory):
    """A replica of the same kind under vLLM's default fcfs: a simulator of its own, or the session's real vLLM
    (`$VLLM_URL`, started by `make e2e-vllm` without the flag)."""
    if target.kind == "vllm":
        if not os.environ.get("VLLM_URL"):
            pytest.skip("no fcfs vLLM: set VLLM_URL (`make e2e-vllm` starts one)")
        yield os.environ["VLLM_URL"].rstrip("/")
        return
    with own_target("sim", tmp_path_factory.mktemp("fcfs-sim")) as t:
        yield t.url


async def gauge(http, target, name: str) -> float:
    return metric(await target_metrics(http, target), name)


async def test_both_classes_are_served_with_their_vllm_priority(make_stack, target):
    s = make_stack(policy(target, classes=CLASSES))
    async with aiohttp.ClientSession() as http:
        for headers, cls in (({}, "interactive"), (BATCH, "batch")):
            status, got, raw = await post(http, s.url, "/v1/chat/completions", chat(target), headers)
            assert status == 200, raw[:300]
            assert got["x-extproc-class"] == cls and got["x-extproc-decision"] == "accept"
            assert json.loads(raw)["usage"]["completion_tokens"] == 8
        assert all(c["inflight"] == 0 for c in (await wait_idle(http, s.metrics_url)).values())


async def test_a_body_priority_the_replica_would_refuse_never_reaches_it(make_stack, target):
    """priority 2^63 is past vLLM's int64: 400 at the replica itself, served through the stack (stripped, then set
    to the class's own)."""
    s = make_stack(policy(target, classes=CLASSES))
    async with aiohttp.ClientSession() as http:
        body = chat(target, priority=INT64_MAX + 1)
        status, _, raw = await post(http, target.url, "/v1/chat/completions", body)
        assert status == 400 and json.loads(raw)["error"]["param"] == "body.priority", raw[:300]
        for headers in ({}, BATCH):
            status, _, raw = await post(http, s.url, "/v1/chat/completions", body, headers)
            assert status == 200, raw[:300]


async def test_interactive_queued_behind_batch_starts_first_whatever_the_batch_client_sends(make_stack, target):
    """One sequence runs at a time. A long batch stream holds it; a batch stream that sends priority -100 in its
    body and in X-Vllm-Priority queues next; an interactive stream queues after it. When the first stream ends,
    the interactive one runs first: its class's priority 0 beats batch's 10, and the batch client's -100 (which
    would have put it first) never reached the engine. Seen by the client as: when the interactive stream's first
    token arrives, the queued batch stream has sent (next to) none of its BATCH_TOKENS tokens, not all of them
    (client-side end times are no proof: vLLM's API server may deliver two requests' outputs at once when the
    machine is busy)."""
    s = make_stack(policy(target, classes=CLASSES))
    chunks = {"batch": 0, "interactive": 0}  # data chunks each queued stream has delivered so far
    batch_chunks_at_interactive_start: list[int] = []
    async with aiohttp.ClientSession() as http:

        async def stream(name: str, body: dict, headers: dict) -> int:
            async with http.post(s.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={**JSON, **headers}) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunks[name] += 1
                    if name == "interactive" and chunks[name] == 2:  # its first token (after the role chunk)
                        batch_chunks_at_interactive_start.append(chunks["batch"])
            return chunks[name]

        async def blocker():  # holds the one running sequence until it is cancelled (its client goes away)
            body = json.dumps(chat(target, max_tokens=BLOCKER_TOKENS, stream=True, ignore_eos=True)).encode()
            async with http.post(s.url + "/v1/chat/completions", data=body, headers={**JSON, **BATCH}) as r:
                assert r.status == 200
                try:
                    await r.content.readuntil(b"\n\n")
                    await asyncio.sleep(3600)
                finally:
                    r.close()

        # The engine's own gauges say what runs and waits; nothing waits for the blocker's events, which this CPU's
        # vLLM may deliver in a burst. Bounded waits of 15 s: on a busy 2-core machine a request takes seconds
        # through Envoy, the ext_proc and vLLM's API server to reach the engine's queue.
        finished = await gauge(http, target, "vllm:request_success_total")
        holding = asyncio.create_task(blocker())
        running = await until(lambda: gauge(http, target, "vllm:num_requests_running"), 15, holds=lambda n: n == 1)
        if running != 1 and await gauge(http, target, "vllm:request_success_total") > finished:
            holding.cancel()
            pytest.skip("the CPU vLLM ran the holding stream to its end before the test saw it run (docs/vllm.md)")
        assert running == 1
        jumper = asyncio.create_task(stream(
            "batch", chat(target, max_tokens=BATCH_TOKENS, ignore_eos=True, stream=True, priority=-100),
            {**BATCH, "x-vllm-priority": "-100"}))
        waiting = await until(lambda: gauge(http, target, "vllm:num_requests_waiting"), 15,
                              holds=lambda n: n == 1)
        if waiting != 1 and await gauge(http, target, "vllm:num_requests_running") == 0:
            holding.cancel()
            pytest.skip("no queue could form: the CPU vLLM ran the holding stream to its end before the next "
                        "request reached its engine (while it generates, the other processes here get the CPU in "
                        "bursts; docs/vllm.md)")
        assert waiting == 1, "the batch request never queued behind the stream"
        interactive = asyncio.create_task(stream("interactive", chat(target, max_tokens=8, ignore_eos=True,
                                                                     stream=True), {}))
        waiting = await until(lambda: gauge(http, target, "vllm:num_requests_waiting"), 15,
                              holds=lambda n: n == 2)
        if waiting != 2 and await gauge(http, target, "vllm:request_success_total") > finished:
            for task in (holding, jumper, interactive):
                task.cancel()
            await asyncio.gather(holding, jumper, interactive, return_exceptions=True)
            pytest.skip("no second request could queue: the CPU vLLM ran the holding stream to its end (3,800 "
                        "tokens) before the interactive request reached its engine (docs/vllm.md)")
        assert waiting == 2, "the interactive request never queued"
        holding.cancel()  # the stream's client goes away: its slot frees, the engine picks from its queue
        with contextlib.suppress(asyncio.CancelledError):
            await holding
        delivered = await asyncio.gather(jumper, interactive)
    assert delivered[0] > BATCH_TOKENS // 2 and delivered[1] > 4, delivered  # both ran to the end
    assert batch_chunks_at_interactive_start[0] < 8, (
        f"the batch stream had sent {batch_chunks_at_interactive_start[0]} chunks when the interactive one started: "
        "it ran first (its own priority reached vLLM, or the classes' vllm_priority did not)")


async def test_the_replica_takes_priority_as_vllm_0_32_does(target, fcfs_url):
    """Straight at the replicas (no stack): an integer priority and an unparsable X-Vllm-Priority are accepted
    under either policy (fcfs ignores them); a priority past int64 is refused with pydantic's error."""
    async with aiohttp.ClientSession() as http:
        for url in (target.url, fcfs_url):
            for body, headers in ((chat(target, priority=3), {}), (chat(target, priority=-7), {}),
                                  (chat(target), {"x-vllm-priority": "urgent"})):
                status, _, raw = await post(http, url, "/v1/chat/completions", body, headers)
                assert status == 200, (url, body.get("priority"), raw[:300])
            status, _, raw = await post(http, url, "/v1/chat/completions", chat(target, priority=INT64_MAX + 1))
            err = json.loads(raw)["error"]
            assert status == 400 and (err["type"], err["param"], err["code"]) == ("Bad Request", "body.priority",
                                                                                  400), raw[:300]
            assert "less than or equal to 9223372036854775807" in err["message"], err["message"]
