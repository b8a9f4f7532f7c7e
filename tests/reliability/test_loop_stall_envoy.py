"""One client's valid bodies must not stall the ext_proc's event loop for everyone else, through real Envoy.

Every decision runs on one asyncio loop and Envoy gives each message `message_timeout` (0.5 s), then, with
failure_mode_allow, lets the request through unadmitted. Work a single body can make the loop do is therefore
everyone's latency and everyone's admission."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from tests.conftest import policy_file, until
from tests.integration.helpers import chat, metrics, post, sample


def byte_level_tokenizer(path) -> str:
    """A small byte-level BPE (the kind Llama 3 and Qwen ship), trained offline on a few words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words = "the queue in front of the model is short today and admission keeps it so".split()
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 40,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tok.save(str(path))
    return str(path)


async def under_attack(s, path: str, body: bytes, rate: float, attacks: int, interactive: int = 20):
    """An anonymous client posts `attacks` copies of `body` at `rate` a second while an interactive tenant sends
    small chats at 10 a second; returns the attacker's (status, body) and each interactive (status, decision,
    seconds)."""
    victim = {"authorization": "Bearer sk-chat-1"}
    async with aiohttp.ClientSession() as http:
        async def attacker():
            async with http.post(f"{s.url}{path}", data=body, headers={"content-type": "application/json"}) as r:
                return r.status, (await r.read())[:300]

        async def one():
            t = time.monotonic()
            status, headers, _ = await post(http, s.url, chat(), victim)
            return status, headers.get("x-extproc-decision"), time.monotonic() - t

        async def paced(fn, n, every):
            sent = []
            for _ in range(n):
                sent.append(asyncio.create_task(fn()))
                await asyncio.sleep(every)
            return await asyncio.gather(*sent)

        attacked, answers = await asyncio.gather(paced(attacker, attacks, 1 / rate),
                                                 paced(one, interactive, 0.1))
        await asyncio.sleep(1.5)  # the unadmitted log's flush interval is 1 s
        unadmitted = sample(await metrics(http, s.metrics_url), "extproc_unadmitted_requests_total")
    slowest = max(took for _, _, took in answers)
    print(f"\nLOOP STALL: attacker {sorted(st for st, _ in attacked)}; "
          f"interactive statuses {sorted(st for st, _, _ in answers)}, "
          f"unadmitted {sum(d is None for _, d, _ in answers)}, slowest {slowest:.2f}s; "
          f"extproc_unadmitted_requests_total {unadmitted:.0f}")
    return attacked, answers, unadmitted


def policy(tmp_path, anonymous: dict | None = None, **overrides):
    tenants = [{"name": "chat-frontend", "api_keys": ["sk-chat-1"], "max_class": "interactive"}]
    return policy_file(tmp_path, tenants=tenants,
                       anonymous={"max_class": "batch", "default_class": "batch", **(anonymous or {})}, **overrides)


async def test_a_tokenizer_on_megabyte_prompts_does_not_stall_other_clients_admission(make_stack, tmp_path):
    """Before: with `cost.tokenizer` set, the whole prompt was tokenized on the event loop: about 0.5 s per MB of
    text here, so an anonymous client posting 1.5 MB prompts at 4 per second held the loop for seconds, and an
    interactive client's small requests waited past message_timeout and went through unadmitted (16 of 20)."""
    cost = {"tokenizer": byte_level_tokenizer(tmp_path / "tokenizer.json")}
    s = make_stack(policy(tmp_path, models={"llama-70b": {"cluster": "vllm_llama70b", "cost": cost},
                                            "llama-8b": {"cluster": "vllm_llama8b", "cost": cost}}))
    words = "the queue in front of the model is short today ".encode()
    big = json.dumps(chat(messages=[{"role": "user", "content": "x"}])).encode().replace(
        b'"x"', b'"' + words * (1_500_000 // len(words)) + b'"')
    # The attacker's requests are admitted; the test upstream then refuses bodies over 1 MiB (413): no matter.
    _, answers, unadmitted = await under_attack(s, "/v1/chat/completions", big, rate=4, attacks=6)
    assert all(st == 200 and d == "accept" for st, d, _ in answers), answers
    assert max(took for _, _, took in answers) < 0.5, answers
    assert unadmitted == 0


async def test_a_prompt_list_of_a_million_strings_does_not_stall_other_clients_admission(make_stack, tmp_path):
    """Before: a completions `prompt` of 1.36 million empty strings (4 MB) cost ~180 ms of parse and prompt walks
    on the event loop; at 8 a second an interactive client's small requests waited past message_timeout (p50
    0.5 s) and a third of them went through unadmitted. Now refused (400) on a count over the raw bytes."""
    s = make_stack(policy(tmp_path))
    big = b'{"model": "llama-70b", "max_tokens": 1, "prompt": [' + b",".join([b'""'] * 1_360_000) + b"]}"
    attacked, answers, unadmitted = await under_attack(s, "/v1/completions", big, rate=8, attacks=24, interactive=30)
    assert {st for st, _ in attacked} == {400}, attacked
    assert all(st == 200 and d == "accept" for st, d, _ in answers), answers
    assert max(took for _, _, took in answers) < 0.5, answers
    assert unadmitted == 0


async def test_token_id_lists_do_not_stall_other_clients_admission(make_stack, tmp_path):
    """Before: 20,000 token-id lists of 100 (4 MB of embeddings input) cost ~220 ms each: the parse, then a depth
    walk and the pooling estimate that visited all 2 million ids; at 5 a second an interactive client's requests
    waited past message_timeout (p50 0.5 s, 3 of 30 unadmitted). Now the depth is read from the brackets and an
    id list counted by its length: ~80 ms, most of it the parse."""
    s = make_stack(policy(tmp_path, endpoints={"embeddings": True}))
    big = b'{"model": "llama-70b", "input": [' + b",".join([b"[" + b"1," * 100 + b"1]"] * 19_990) + b"]}"
    _, answers, unadmitted = await under_attack(s, "/v1/embeddings", big, rate=5, attacks=15, interactive=30)
    assert all(st == 200 and d == "accept" for st, d, _ in answers), answers
    assert max(took for _, _, took in answers) < 0.5, answers
    assert unadmitted == 0


async def test_a_tenants_body_limit_keeps_its_megabyte_bodies_from_stalling_everyone(make_stack, tmp_path):
    """What is left once the walks are bounded is the parse itself: ~55 ms of orjson for 4 MB of token ids, so
    twenty such bodies a second filled the loop (17 of 30 interactive requests unadmitted, slowest 1.1 s). A
    low-priority tenant's `max_body_bytes` refuses them before the parse."""
    s = make_stack(policy(tmp_path, endpoints={"embeddings": True}, anonymous={"max_body_bytes": 262144}))
    big = b'{"model": "llama-70b", "input": [' + b",".join([b"[" + b"1," * 100 + b"1]"] * 19_990) + b"]}"
    attacked, answers, unadmitted = await under_attack(s, "/v1/embeddings", big, rate=20, attacks=40)
    assert all(st == 413 and b"body_too_large" in text for st, text in attacked), attacked[:3]
    assert all(st == 200 and d == "accept" for st, d, _ in answers), answers
    assert max(took for _, _, took in answers) < 0.5, answers
    assert unadmitted == 0


async def test_a_canned_fallback_does_not_write_a_choice_per_sequence_of_a_huge_n(make_stack, tmp_path):
    """Before: a class whose overflow answers `canned` wrote one choice per sequence asked for: `n: 300000` held
    the event loop past message_timeout building a 30 MB answer, and Envoy's failure_mode_allow forwarded the
    request unadmitted to the full class's pool (200 from the replica after 0.5 s, counted unadmitted);
    `n: 2147483647` would have built two billion. Past CANNED_MAX_CHOICES the fallback rejects instead."""
    classes = {"interactive": {"max_concurrency": 1, "max_queue": 0, "max_wait_ms": 0, "on_overflow": "fallback",
                               "fallback": {"action": "canned", "status": 200}}}
    s = make_stack(policy_file(tmp_path, classes=classes, default_class="interactive", tenants=[]))
    async with aiohttp.ClientSession() as http:
        held = asyncio.ensure_future(post(http, s.url, chat(), {"x-test-delay-ms": "1500"}))
        await until(lambda: _inflight(http, s.metrics_url), timeout=5)
        t = time.monotonic()
        status, headers, body = await post(http, s.url, chat(n=300_000))
        took = time.monotonic() - t
        canned = await post(http, s.url, chat(n=2))
        await held
        await asyncio.sleep(1.5)  # the unadmitted log's flush interval is 1 s
        ms = await metrics(http, s.metrics_url)
    print(f"\nCANNED n=300000: {status} {headers.get('x-extproc-decision')} {len(body):,} B in {took:.2f}s; "
          f"unadmitted {sample(ms, 'extproc_unadmitted_requests_total')}, "
          f"stream errors {sample(ms, 'extproc_stream_errors_total')}")
    assert status == 429 and headers["x-extproc-decision"] == "reject", (status, dict(headers), body[:300])
    assert b"cannot serve this request" in body
    assert canned[0] == 200 and len(json.loads(canned[2])["choices"]) == 2  # a small n is still answered
    assert sample(ms, "extproc_unadmitted_requests_total") == 0
    assert sample(ms, "extproc_stream_errors_total") == 0


async def _inflight(http, metrics_url) -> bool:
    return sample(await metrics(http, metrics_url), "extproc_inflight", **{"class": "interactive"}) >= 1
