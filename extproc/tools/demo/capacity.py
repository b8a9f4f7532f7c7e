"""Fleet capacity for a request mix, measured in the engine model alone (closed loop, simulated time)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from extproc.tools.loadgen import Workload
from extproc.tools.sim.engine import Engine
from extproc.tools.sim.openai_api import (clamp_max_tokens, fixed_output_tokens, ignores_eos, samples_per_prompt,
                                          sent_max_tokens)
from extproc.tools.sim.profile import Profile
from extproc.tools.stats import percentile


@dataclass
class Capacity:
    """Closed-loop throughput of one replica at a fixed concurrency, for a workload mix."""

    concurrency: int
    requests_per_s: float
    output_tokens_per_s: float
    p50_s: float
    p99_s: float
    preemptions: int
    kv_usage: float  # mean share of KV blocks in use (per iteration)
    running: float  # mean sequences running (holding KV), of `concurrency` in the engine


def _earlier_output(profile: Profile, max_tokens: int | None, ignore_eos: bool, rng: random.Random) -> int:
    """The output of one of a session's earlier calls: its max_tokens under ignore_eos, else the profile's draw
    capped by it."""
    ceiling = max_tokens or profile.default_max_tokens
    return ceiling if ignore_eos else min(ceiling, profile.natural_output_tokens(rng))


def closed_loop_mix(profile: Profile, workload: Workload, concurrency: int, requests: int = 3000,
                    seed: int = 0, loras: dict[str, int] | None = None, max_loras: int = 1) -> Capacity:
    """Keep `concurrency` requests of the mix in one engine; each one finished is replaced at once. A session
    kind's request is one of its calls, drawn with the context its earlier calls grew (no think time: a closed
    loop). Each request reaches the engine as the simulator's server passes it on (sim/replica.py): one sequence
    per sample (`n`), max_tokens clamped to the context, and a kind whose body says `ignore_eos` runs every answer
    to it. A request of several samples is done when its last one is. `loras`: the LoRA adapters the replica serves
    (name -> vLLM's lora id), scheduled at most `max_loras` in a batch as vLLM's --max-loras; None: LoRA off."""
    engine = Engine(profile, seed=seed, max_loras=max_loras if loras else None)
    loras = loras or {}
    rng = random.Random(seed)
    now = 0.0
    samples_left: dict[int, list[int]] = {}  # sequence id -> its request's count of samples still running

    def add() -> None:
        kind = workload.pick(rng)
        ignore_eos = ignores_eos(kind.body)
        asked = sent_max_tokens(kind.endpoint, kind.body, kind.max_tokens)
        prompt = kind.sample_call_prompt(rng, lambda: _earlier_output(profile, asked, ignore_eos, rng))
        max_tokens = clamp_max_tokens(asked, prompt, profile.max_model_len, profile.default_max_tokens)
        samples = samples_per_prompt(kind.body)
        left = [samples]
        natural = fixed_output_tokens(max_tokens, ignore_eos)
        for seq in engine.add_samples(prompt, max_tokens, now, samples, natural_tokens=natural,
                                      lora=loras.get(kind.model, 0)):
            samples_left[seq.id] = left

    for _ in range(concurrency):
        add()
    warmup = concurrency * 2
    finished = 0
    latencies: list[float] = []
    t0, tokens0 = 0.0, 0
    kv = running = 0.0
    while len(latencies) < requests:
        step = engine.begin_iteration(now)
        now += step
        if finished >= warmup:
            kv += engine.kv_usage * step
            running += len(engine.running) * step
        for emission in engine.end_iteration(now):
            if emission.finish_reason is None:
                continue
            left = samples_left.pop(emission.seq.id)
            left[0] -= 1
            if left[0]:
                continue
            finished += 1
            if finished == warmup:
                t0, tokens0 = now, engine.stats.generation_tokens
            elif finished > warmup:
                latencies.append(now - emission.seq.arrival)
            add()
    span = now - t0
    latencies.sort()
    return Capacity(concurrency, len(latencies) / span, (engine.stats.generation_tokens - tokens0) / span,
                    percentile(latencies, 50), percentile(latencies, 99), engine.stats.preemptions,
                    kv / span, running / span)
