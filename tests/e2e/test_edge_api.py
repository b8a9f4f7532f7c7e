"""What the edge adds to the OpenAI API, against the session's target (conftest: the simulator, or the real vLLM
`make e2e-vllm` starts; no server of this module's own):

* `GET /v1/models[/{id}]` answered by the ext_proc from the policy's names and those its pool's replicas list
  (`names_from_replicas`), each once, the replica's names with the very card the replica gives;
* the official openai SDK through Envoy: chat (plain, and streamed with usage), completions, the models, and a full
  class raising RateLimitError;
* Envoy's own measure of its wait for the ext_proc's answers (`extproc_header_answer_seconds`), every request sampled.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import until
from tests.integration.helpers import metrics, sample, wait_idle

from .conftest import policy
from .test_e2e import MESSAGES, PROMPT

ALIAS = "house-llama"  # a name only the policy knows
BATCH = {"x-priority": "batch"}


def same_card(card: dict) -> dict:
    """A card less what differs from one call to the next: `created`, and the permission's `id` and `created`."""
    return {**{k: v for k, v in card.items() if k != "created"},
            "permission": [{k: v for k, v in p.items() if k not in ("id", "created")} for p in card["permission"]]}


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, dict, dict]:
    async with http.get(url) as r:
        return r.status, r.headers, json.loads(await r.read())


async def test_get_models_lists_the_policys_names_and_the_replicas_own_with_the_replicas_cards(make_stack, target):
    """One policy model on one pool, with an alias and names_from_replicas: the replica's other served name is
    listed too, once, and both of the replica's names carry the card the replica itself answers."""
    host, port = target.endpoint
    doc = policy(target, pools={"vllm_llama70b": {"replicas": [f"{host}:{port}"], "models_interval_ms": 200}})
    doc["models"] = {target.model: {"cluster": "vllm_llama70b", "aliases": [ALIAS], "names_from_replicas": True}}
    s = make_stack(doc)
    async with aiohttp.ClientSession() as http:
        status, _, direct = await get_json(http, target.url + "/v1/models")
        assert status == 200
        own = {c["id"]: same_card(c) for c in direct["data"]}
        assert list(own) == [target.model, target.small_model]

        async def listing():
            status, headers, body = await get_json(http, s.url + "/v1/models")
            assert status == 200 and "x-extproc-decision" not in headers, body
            return body

        body = await until(listing, 10, holds=lambda b: len(b["data"]) == 3)
        assert body["object"] == "list"
        assert [c["id"] for c in body["data"]] == [target.model, ALIAS, target.small_model]
        cards = {c["id"]: c for c in body["data"]}
        for name in own:
            assert same_card(cards[name]) == own[name], name
        # The alias is the policy's alone: vLLM's card shape, fields from what the policy knows.
        assert set(cards[ALIAS]) == set(direct["data"][0])
        assert (cards[ALIAS]["object"], cards[ALIAS]["owned_by"], cards[ALIAS]["root"], cards[ALIAS]["parent"]) == \
            ("model", "vllm", target.model, None)

        for name in (target.small_model, ALIAS):
            status, _, card = await get_json(http, f"{s.url}/v1/models/{name}")
            assert status == 200 and same_card(card) == same_card(cards[name])
        status, headers, err = await get_json(http, s.url + "/v1/models/no-such-model")
        assert status == 404 and headers["x-extproc-reason"] == "unknown_model"
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
        assert (err["error"]["type"], err["error"]["param"], err["error"]["code"]) == \
            ("invalid_request_error", "model", "unknown_model")  # OpenAI types a 404 so


def sdk_policy(target) -> dict:
    """batch: one slot, no queue (the second batch request is refused at once)."""
    return policy(target, classes={"interactive": {"max_concurrency": 8, "max_queue": 4, "max_wait_ms": 2000},
                                   "batch": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0}})


async def test_the_openai_sdk_through_the_edge_and_envoys_wait_for_every_answer(make_stack, target):
    """The SDK an app uses, pointed at Envoy: answers, streams with usage, the models and a full class. Every
    request's wait for the ext_proc's answer to its headers is logged (answer_sample_percent 100) and counted
    once, in milliseconds."""
    s = make_stack(sdk_policy(target), answer_sample_percent=100)
    c = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    sent = 0
    async with aiohttp.ClientSession() as http:
        raw = await c.chat.completions.with_raw_response.create(model=target.model, messages=MESSAGES, max_tokens=8,
                                                                temperature=0)
        sent += 1
        assert raw.headers["x-extproc-decision"] == "accept"
        answer = raw.parse()
        assert answer.model == target.model and answer.choices[0].finish_reason == "length"
        assert answer.usage.completion_tokens == 8 and answer.choices[0].message.role == "assistant"

        chunks = [ch async for ch in await c.chat.completions.create(
            model=target.model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        sent += 1
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 8

        done = await c.completions.create(model=target.model, prompt=PROMPT, max_tokens=8, temperature=0)
        sent += 1
        assert done.model == target.model and done.usage.completion_tokens == 8 and done.choices[0].text

        assert [m.id async for m in c.models.list()] == [target.model, target.small_model]
        assert (await c.models.retrieve(target.small_model)).id == target.small_model
        sent += 2
        with pytest.raises(openai.NotFoundError) as missing:
            await c.models.retrieve("no-such-model")
        assert missing.value.code == "unknown_model"
        sent += 1

        async def answers():
            return sample(await metrics(http, s.metrics_url), "extproc_header_answer_seconds_count")

        assert await until(answers, 5, holds=lambda n: n >= sent) == sent
        ms = await metrics(http, s.metrics_url)
        total = sample(ms, "extproc_header_answer_seconds_sum")
        # Milliseconds: Envoy's microseconds turned into seconds (not its raw number, nor nothing), none past
        # message_timeout (0.5 s), most within 25 ms.
        assert 0 < total / sent < 0.1, (total, sent)
        assert sample(ms, "extproc_header_answer_seconds_bucket", le="0.5") == sent
        assert sample(ms, "extproc_header_answer_seconds_bucket", le="0.025") >= sent / 2
        quick = sample(ms, "extproc_header_answer_seconds_bucket", le="0.0025")
        print(f"\nE2E {target.kind}: Envoy waited {1000 * total / sent:.2f} ms on average for the ext_proc's answers "
              f"to the headers of {sent} requests ({quick:.0f} within 2.5 ms)")

        # Three long batch streams at once on the class's one slot, no queue: one that finds it held is a
        # RateLimitError, and the others are then dropped (the replica stops generating for a client that left:
        # test_e2e's abort test). Sent together, not one after a slot seen held: while the real vLLM generates on
        # this CPU the other processes here, this test included, may get no CPU until it is done (docs/vllm.md);
        # a request may even be sent after the stream holding the slot ended, then the round is tried again.
        # test_admission_cap_forces_429 checks the cap itself.
        async def stream_batch():
            try:
                return await c.chat.completions.create(model=target.model, messages=MESSAGES, max_tokens=2000,
                                                       stream=True, extra_body={"ignore_eos": True},
                                                       extra_headers=BATCH)
            except openai.RateLimitError as e:
                return e

        limited = None
        for _ in range(3):
            tasks = [asyncio.create_task(stream_batch()) for _ in range(3)]
            for first in asyncio.as_completed(tasks):
                if isinstance(limited := await first, openai.RateLimitError):
                    break
                limited = None
            for t in tasks:
                t.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, openai.AsyncStream):
                    await r.close()
            if limited is not None:
                break
        assert limited is not None, "no batch request found the class full"
        e = limited
        assert (e.status_code, e.code, e.type, e.param) == (429, "queue_full", "rate_limit_error", None)
        assert int(e.response.headers["retry-after"]) >= 1 and e.response.headers["x-extproc-class"] == "batch"
        assert all(cl["inflight"] == 0 for cl in (await wait_idle(http, s.metrics_url, timeout=5)).values())
