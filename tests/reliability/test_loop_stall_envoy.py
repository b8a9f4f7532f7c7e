"""One client's valid bodies must not stall the ext_proc's event loop for everyone else, through real Envoy.

Every decision runs on one asyncio loop and Envoy gives each message `message_timeout` (0.5 s), then, with
failure_mode_allow, lets the request through unadmitted. Work a single body can make the loop do is therefore
everyone's latency and everyone's admission."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from tests.conftest import policy_file
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


async def test_a_tokenizer_on_megabyte_prompts_does_not_stall_other_clients_admission(make_stack, tmp_path):
    """Before: with `cost.tokenizer` set, the whole prompt was tokenized on the event loop: about 0.5 s per MB of
    text here, so an anonymous client posting 1.5 MB prompts at 4 per second held the loop for seconds, and an
    interactive client's small requests waited past message_timeout and went through unadmitted."""
    tokenizer = byte_level_tokenizer(tmp_path / "tokenizer.json")
    cost = {"tokenizer": tokenizer}
    models = {"llama-70b": {"cluster": "vllm_llama70b", "cost": cost},
              "llama-8b": {"cluster": "vllm_llama8b", "cost": cost}}
    tenants = [{"name": "chat-frontend", "api_keys": ["sk-chat-1"], "max_class": "interactive"}]
    s = make_stack(policy_file(tmp_path, models=models, tenants=tenants,
                               anonymous={"max_class": "batch", "default_class": "batch"}))
    words = "the queue in front of the model is short today ".encode()
    big = json.dumps(chat(messages=[{"role": "user", "content": "x"}])).encode().replace(
        b'"x"', b'"' + words * (1_500_000 // len(words)) + b'"')
    victim = {"authorization": "Bearer sk-chat-1"}
    async with aiohttp.ClientSession() as http:
        async def attack():
            sent = []
            for _ in range(6):  # 4 per second for 1.5 s
                sent.append(asyncio.create_task(post(http, s.url, big)))
                await asyncio.sleep(0.25)
            return await asyncio.gather(*sent)

        async def interactive():
            async def one():
                t = time.monotonic()
                status, headers, _ = await post(http, s.url, chat(), victim)
                return status, headers.get("x-extproc-decision"), time.monotonic() - t
            sent = []
            for _ in range(20):
                sent.append(asyncio.create_task(one()))
                await asyncio.sleep(0.1)
            return await asyncio.gather(*sent)

        # The attacker's requests are admitted; the test upstream then refuses bodies over 1 MiB (413): no matter.
        attacks, answers = await asyncio.gather(attack(), interactive())
        slowest = max(took for _, _, took in answers)
        print(f"\nLOOP STALL: attacker {sorted(st for st, _, _ in attacks)}; interactive statuses "
              f"{sorted(st for st, _, _ in answers)}, unadmitted {sum(d is None for _, d, _ in answers)}, "
              f"slowest {slowest:.2f}s")
        assert all(st == 200 and d == "accept" for st, d, _ in answers), answers
        assert slowest < 0.5, answers
        await asyncio.sleep(1.5)  # the unadmitted log's flush interval is 1 s
        assert sample(await metrics(http, s.metrics_url), "extproc_unadmitted_requests_total") == 0
