#!/usr/bin/env python3
"""Record what vLLM 0.32's own v1 scheduler does, step by step, with generated request sequences, into
tests/fixtures/vllm/scheduling.json.

    .cache/vllm-venv/bin/python scripts/vllm/record_scheduling.py      # (make vllm-setup first; ~20 s)

No server, model or tokenizer runs: vLLM's `Scheduler` class (vllm/v1/core/sched/scheduler.py) is built in-process
with a KV cache of a few blocks and driven with fake model outputs (each request whose KV has caught up samples one
token, never EOS, so it stops at max_tokens). Each case draws (seeded) a scheduling policy, a KV cache size (small,
so preemption happens), max_num_seqs, max_num_batched_tokens (small, so chunked prefill happens) and requests
(arrival step, prompt length, max_tokens, priority), and --scheduler-reserve-full-isl on or off. Prefix caching is
off (the simulator models only the part the samples cases show) and scheduling synchronous (one step scheduled,
then its output applied); everything else is vLLM's default.

The samples cases come after those: requests with `n` of 1 to 4, fanned out as vLLM's front end does (n requests
of one prompt, ids `{k}_{parent}`, one arrival time), with prefix caching on, distinct prompts and a KV cache that
holds every request at once (no preemption: a preempted request's own cached blocks are not modelled). They show
what n > 1 costs: the first sample computes the prompt, the others read its full blocks.

For every step (from 0, one a scheduler call, arrivals before it) the fixture holds, in this order (`step_fields`):
`scheduled` ([sequence index, tokens] in the order the scheduler took them), `preempted` (in order), `running` and
`waiting` (queue order) after scheduling, `finished` after the output, and `free_blocks` (the KV blocks free after
scheduling; with prefix caching, cached blocks no request holds count as free, as vLLM counts them). A request's
samples are consecutive sequences: request i's are numbered after all samples of the requests before it.
tests/sim/test_scheduling_parity.py replays each case through extproc/tools/sim/engine.py (without vLLM).
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "vllm" / "scheduling.json"
SEED = 46
CASES = 120
SAMPLES_SEED = 47
SAMPLES_CASES = 24
BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
MAX_STEPS = 2000  # a case that has not drained by then is a recording error
# each step of a case: one list per field, in this order
STEP_FIELDS = ["scheduled", "preempted", "running", "waiting", "finished", "free_blocks"]


def generate_cases(seed: int = SEED, count: int = CASES) -> list[dict]:
    """Mixed cases (any sizes, arrivals spread out), and every other one under KV pressure: requests of a few
    blocks arriving together in a cache of a few blocks, so that they cross block boundaries in the same step and
    preempt one another (more than one victim a step, a victim scheduled earlier in the step, the one that needed
    the block its own victim)."""
    rng = random.Random(seed)
    cases = []
    for k in range(count):
        pressure = k % 2 == 1
        blocks = rng.choice([4, 5, 6, 8, 10, 12] if pressure else [4, 6, 8, 12, 16, 24, 40, 200])
        capacity = blocks * BLOCK_SIZE
        requests = []
        for _ in range(rng.randint(3, 10) if pressure else rng.randint(2, 14)):
            if pressure:
                prompt = rng.choice([1, 2, 15, 16, 17, 30])
                max_tokens = rng.choice([16, 17, 20, 33, 40])
                arrival = rng.choice([0, 0, 0, 1, 2, 3, 5])
            else:
                prompt = rng.choice([1, 3, 15, 16, 17, 31, 40, 64, 100, 150])
                max_tokens = rng.choice([1, 2, 5, 16, 17, 30, 60])
                arrival = rng.choice([0, 0, 0, 1, 2, 3, 5, 8, 13, 20])
            if prompt + max_tokens > capacity:  # one request alone must fit in the cache, or vLLM never runs it
                prompt = max(1, capacity - max_tokens)
            requests.append({"arrival_step": arrival, "prompt": prompt, "max_tokens": max_tokens,
                             "priority": rng.choice([0, 0, 1, 2, 5])})
        requests.sort(key=lambda r: r["arrival_step"])  # index order is arrival order
        batched_tokens = rng.choice([64, 512, 2048] if pressure else [8, 16, 32, 64, 100, 512, 2048])
        cases.append({"name": f"case{k:03d}", "policy": rng.choice(["fcfs", "priority"]),
                      "kv_cache_blocks": blocks, "block_size": BLOCK_SIZE,
                      # vLLM refuses max_num_batched_tokens < max_num_seqs
                      "max_num_seqs": min(rng.choice([8, 256] if pressure else [1, 2, 3, 4, 8, 256]), batched_tokens),
                      "max_num_batched_tokens": batched_tokens,
                      # vLLM's default is on; the simulator's profiles leave it off (docs/simulator.md)
                      "scheduler_reserve_full_isl": rng.random() < 0.5,
                      "max_model_len": MAX_MODEL_LEN, "requests": requests})
    return cases


def generate_sample_cases(seed: int = SAMPLES_SEED, count: int = SAMPLES_CASES) -> list[dict]:
    """Requests of n = 1 to 4 samples: prompts around block boundaries and of several blocks, chunked prefill
    (small token budgets), few or many sequences a step, both policies; the KV cache holds them all at once."""
    rng = random.Random(seed)
    cases = []
    for k in range(count):
        requests = []
        for _ in range(rng.randint(1, 5)):
            requests.append({"arrival_step": rng.choice([0, 0, 1, 2, 4]), "n": rng.choice([1, 2, 3, 4, 4]),
                             "prompt": rng.choice([1, 15, 16, 17, 33, 64, 100, 150, 300]),
                             "max_tokens": rng.choice([1, 2, 5, 16, 20]), "priority": rng.choice([0, 0, 1, 2])})
        requests.sort(key=lambda r: r["arrival_step"])
        need = sum(r["n"] * -(-(r["prompt"] + r["max_tokens"]) // BLOCK_SIZE) for r in requests)
        batched_tokens = rng.choice([16, 32, 64, 100, 512, 2048])
        cases.append({"name": f"samples{k:03d}", "policy": rng.choice(["fcfs", "priority"]),
                      "kv_cache_blocks": need, "block_size": BLOCK_SIZE,
                      "max_num_seqs": min(rng.choice([2, 3, 4, 256]), batched_tokens),
                      "max_num_batched_tokens": batched_tokens, "scheduler_reserve_full_isl": rng.random() < 0.5,
                      "enable_prefix_caching": True, "max_model_len": MAX_MODEL_LEN, "requests": requests})
    return cases


def build_scheduler(case: dict, model_dir: Path):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, max_model_len=case["max_model_len"],
                        dtype="float32")
    sched = SchedulerConfig(max_num_seqs=case["max_num_seqs"], max_num_batched_tokens=case["max_num_batched_tokens"],
                            max_model_len=case["max_model_len"], enable_chunked_prefill=True,
                            policy=case["policy"], is_encoder_decoder=False, async_scheduling=False,
                            scheduler_reserve_full_isl=case["scheduler_reserve_full_isl"])
    cache = CacheConfig(block_size=case["block_size"], enable_prefix_caching=case.get("enable_prefix_caching", False))
    cache.num_gpu_blocks = case["kv_cache_blocks"]
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    spec = FullAttentionSpec(block_size=case["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float32)
    # vLLM's block pool keeps one block aside (the null block): num_blocks = usable + 1
    kv = KVCacheConfig(num_blocks=case["kv_cache_blocks"] + 1, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(config, kv, structured_output_manager=StructuredOutputManager(config),
                     block_size=case["block_size"], log_stats=False)


def run_case(case: dict, model_dir: Path) -> list[list]:
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    scheduler = build_scheduler(case, model_dir)
    hasher = block_hasher(case)
    index = {}
    pending = list(enumerate(case["requests"]))
    steps = []
    for step in range(MAX_STEPS):
        while pending and pending[0][1]["arrival_step"] <= step:
            i, r = pending.pop(0)
            # a prompt of its own (its first token), which its samples share
            prompt = [10 + i] + [7] * (r["prompt"] - 1)
            for k, rid in enumerate(sample_ids(i, r.get("n", 1))):
                index[rid] = len(index)
                params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
                # arrival_time: the step, plus a sliver so that requests of one step keep their index order
                scheduler.add_request(Request(rid, prompt, params, None, arrival_time=step + i * 1e-4,
                                              priority=r["priority"], block_hasher=hasher))
        if not pending and not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        running = [index[r.request_id] for r in scheduler.running]
        waiting = [index[r.request_id] for r in scheduler.waiting]
        free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        sampled = []
        for rid, n in out.num_scheduled_tokens.items():
            req = scheduler.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)},
                                   sampled_token_ids=sampled)
        engine_outputs = scheduler.update_from_output(out, result)
        finished = sorted(index[o.request_id] for outs in engine_outputs.values() for o in outs.outputs
                          if o.finish_reason is not None)
        steps.append([[[index[rid], n] for rid, n in out.num_scheduled_tokens.items()],
                      [index[r.request_id] for r in scheduler._last_preempted], running, waiting, finished, free])
    else:
        raise RuntimeError(f"{case['name']} did not drain in {MAX_STEPS} steps")
    return steps


def sample_ids(i: int, n: int) -> list[str]:
    """vLLM's request ids for request i's samples: zero-padded, as vLLM breaks (priority, arrival) ties by the id
    string; n > 1 fans out as its front end does (ParentRequest: `{k}_{parent}`, the same arrival time)."""
    rid = f"r{i:03d}"
    return [rid] if n == 1 else [f"{k}_{rid}" for k in range(n)]


def block_hasher(case: dict):
    """The prompt-block hasher vLLM's engine core gives each request when prefix caching is on."""
    if not case.get("enable_prefix_caching"):
        return None
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(case["block_size"], hash_fn)


def track_preemption_order() -> None:
    """Remember the order of the last schedule's preemptions (SchedulerOutput carries them as a set)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original_schedule = Scheduler.schedule
    original_preempt = Scheduler._preempt_request

    def schedule(self, *args, **kwargs):
        self._last_preempted = []
        return original_schedule(self, *args, **kwargs)

    def preempt(self, request, *args, **kwargs):
        self._last_preempted.append(request)
        return original_preempt(self, request, *args, **kwargs)

    Scheduler.schedule = schedule
    Scheduler._preempt_request = preempt


def main() -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.disable(logging.WARNING)
    import vllm

    track_preemption_order()
    cases = generate_cases() + generate_sample_cases()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        # A model config only: the scheduler reads the context length and the runner type, no weights
        (model_dir / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "vocab_size": 1000, "max_position_embeddings": MAX_MODEL_LEN, "torch_dtype": "float32"}))
        for case in cases:
            case["steps"] = run_case(case, model_dir)
    preemptions = sum(len(s[1]) for c in cases for s in c["steps"])
    head = json.dumps({"vllm_version": vllm.__version__, "seed": SEED, "step_fields": STEP_FIELDS})
    lines = ",\n".join(json.dumps(case, separators=(",", ":")) for case in cases)  # a case a line
    OUT.write_text(f'{head[:-1]}, "cases": [\n{lines}\n]}}\n')
    print(f"wrote {OUT.relative_to(ROOT)}: {len(cases)} cases, "
          f"{sum(len(c['steps']) for c in cases)} steps, {preemptions} preemptions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
