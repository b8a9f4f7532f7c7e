"""The engine model's scheduling properties, driven with a fake clock."""

import pytest

from extproc.tools.sim.engine import FINISHED, RUNNING, WAITING, Engine, EngineStats
from extproc.tools.sim.profile import LogNormal, Profile, Timing


def make_profile(**overrides) -> Profile:
    values = dict(name="test", model_names=("m",), max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=256,
                  kv_cache_blocks=256, timing=Timing(0.01, 0.001, 0.0001, 0.0), output_tokens=LogNormal(50, 0.0))
    values.update(overrides)
    return Profile(**values)


def step(engine: Engine, now: float) -> tuple[float, list]:
    duration = engine.begin_iteration(now)
    return now + duration, engine.end_iteration(now + duration)


def test_iteration_time_follows_the_profile_coefficients():
    engine = Engine(make_profile(max_num_batched_tokens=2048))
    engine.add_request(100, 10, 0.0)
    duration = engine.begin_iteration(0.0)
    assert duration == 0.01 + 0.0001 * 100  # one prefill of 100 tokens, no decode yet


def test_output_length_is_min_of_max_tokens_and_natural_length():
    engine = Engine(make_profile())
    short = engine.add_request(16, 10, 0.0)  # natural 50 > max_tokens 10
    long = engine.add_request(16, 100, 0.0)  # natural 50 < 100
    now = 0.0
    while engine.has_work:
        now, _ = step(engine, now)
    assert (short.generated, short.finish_reason) == (10, "length")
    assert (long.generated, long.finish_reason) == (50, "stop")


def test_chunked_prefill_respects_the_token_budget():
    engine = Engine(make_profile(max_num_batched_tokens=256))
    seq = engine.add_request(600, 5, 0.0)
    tokens = []
    now = 0.0
    while seq.generated == 0:
        engine.begin_iteration(now)
        tokens.append(sum(n for _, n in engine._batch))
        now += 0.01
        engine.end_iteration(now)
    assert tokens == [256, 256, 88]  # 600 prompt tokens in budget-sized chunks; the token comes with the last


def test_decode_and_prefill_share_the_budget():
    engine = Engine(make_profile(max_num_batched_tokens=64))
    first = engine.add_request(32, 100, 0.0)
    now, _ = step(engine, 0.0)
    engine.add_request(200, 100, now)
    engine.begin_iteration(now)
    batch = {seq.id: n for seq, n in engine._batch}
    assert batch == {first.id: 1, 1: 63}


def test_max_num_seqs_caps_the_running_batch():
    engine = Engine(make_profile(max_num_seqs=3, max_num_batched_tokens=4096))
    for _ in range(5):
        engine.add_request(16, 100, 0.0)
    step(engine, 0.0)
    assert len(engine.running) == 3 and len(engine.waiting) == 2


def test_admission_into_the_running_batch_is_fifo():
    engine = Engine(make_profile(max_num_seqs=2, max_num_batched_tokens=4096))
    seqs = [engine.add_request(16, 5, 0.0, natural_tokens=5) for _ in range(4)]
    order = []
    now = 0.0
    while engine.has_work:
        now, emissions = step(engine, now)
        order += [e.seq.id for e in emissions if e.finish_reason]
        assert all(s.state != RUNNING for s in seqs[2:]) or seqs[0].state == FINISHED
    assert order == [0, 1, 2, 3]
    assert [s.first_scheduled for s in seqs] == sorted(s.first_scheduled for s in seqs)


@pytest.mark.parametrize("reserve_full_isl", [True, False])
def test_reserve_full_isl_admits_a_request_only_when_its_whole_prompt_fits_not_its_first_chunk(reserve_full_isl):
    # vLLM's --scheduler-reserve-full-isl (on by default in vLLM 0.32): 8 blocks of 16 tokens, a 32-token budget.
    # The first request holds 5 blocks once it decodes; the second's first chunk (31 tokens, 2 blocks) fits in the 3
    # left, its 96-token prompt (6 blocks) does not: with the flag it waits until the first has finished.
    engine = Engine(make_profile(kv_cache_blocks=8, max_num_batched_tokens=32, max_model_len=128,
                                 scheduler_reserve_full_isl=reserve_full_isl))
    first = engine.add_request(64, 30, 0.0, natural_tokens=30)
    now, _ = step(engine, 0.0)
    now, _ = step(engine, now)  # its prompt is in: 4 blocks
    second = engine.add_request(96, 2, now, natural_tokens=2)
    now, _ = step(engine, now)
    assert second.state == (WAITING if reserve_full_isl else RUNNING)
    while engine.has_work:
        now, _ = step(engine, now)
    assert (second.first_scheduled >= first.finished) == reserve_full_isl and second.finish_reason == "length"


def test_a_full_kv_cache_preempts_the_newest_running_sequence():
    # 8 blocks of 16 tokens; two sequences of 48-token prompts each need 3 blocks, then grow into a 4th.
    engine = Engine(make_profile(kv_cache_blocks=8, max_num_batched_tokens=4096, max_model_len=128))
    old = engine.add_request(48, 60, 0.0, natural_tokens=60)
    new = engine.add_request(48, 60, 0.0, natural_tokens=60)
    now = 0.0
    while engine.stats.preemptions == 0:
        now, _ = step(engine, now)
    assert new.state == WAITING and new.computed == 0 and new.blocks == 0
    assert engine.waiting[0] is new and old.state == RUNNING
    assert new.generated > 0  # kept its output; it must recompute prompt + output later


def test_preempted_sequence_recomputes_and_finishes():
    engine = Engine(make_profile(kv_cache_blocks=8, max_num_batched_tokens=4096, max_model_len=128))
    seqs = [engine.add_request(48, 60, 0.0, natural_tokens=60) for _ in range(2)]
    now = 0.0
    while engine.has_work:
        now, _ = step(engine, now)
    assert engine.stats.preemptions >= 1
    assert all(s.generated == 60 and s.finish_reason == "length" for s in seqs)
    assert engine.free_blocks == 8


def test_preemption_makes_latency_fall_off_a_cliff():
    roomy = make_profile(kv_cache_blocks=4096, max_num_batched_tokens=2048, max_num_seqs=64)
    tight = make_profile(kv_cache_blocks=600, max_num_batched_tokens=2048, max_num_seqs=64)
    finish = {}
    for name, profile in (("roomy", roomy), ("tight", tight)):
        engine = Engine(profile)
        for _ in range(64):
            engine.add_request(256, 200, 0.0, natural_tokens=200)
        now = 0.0
        while engine.has_work:
            now, _ = step(engine, now)
        finish[name] = (now, engine.stats.preemptions)
    assert finish["roomy"][1] == 0 and finish["tight"][1] > 0
    assert finish["tight"][0] > 1.25 * finish["roomy"][0]  # recompute and a smaller batch


def test_abort_frees_blocks_and_admits_the_next_request():
    engine = Engine(make_profile(max_num_seqs=1, max_num_batched_tokens=4096))
    first = engine.add_request(100, 50, 0.0)
    second = engine.add_request(100, 50, 0.0)
    now, _ = step(engine, 0.0)
    assert first.blocks > 0 and second.state == WAITING
    engine.abort(first, now)
    assert first.state == FINISHED and first.finish_reason == "abort" and first.blocks == 0
    assert engine.stats.finished["abort"] == 1
    step(engine, now)
    assert second.state == RUNNING


def test_abort_during_an_iteration_emits_nothing_for_it():
    engine = Engine(make_profile())
    seq = engine.add_request(16, 50, 0.0)
    engine.begin_iteration(0.0)
    engine.abort(seq, 0.001)
    assert engine.end_iteration(0.01) == []
    assert engine.free_blocks == engine.profile.kv_cache_blocks


def test_same_seed_gives_same_output_lengths():
    profile = make_profile(output_tokens=LogNormal(50, 0.8))
    a, b = Engine(profile, seed=3), Engine(profile, seed=3)
    assert [a.add_request(16, 1000, 0.0).target_tokens for _ in range(20)] == \
        [b.add_request(16, 1000, 0.0).target_tokens for _ in range(20)]


def _profile_yaml(**overrides) -> dict:
    values = dict(name="test", model_names=["m"], max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=256,
                  kv_cache_blocks=256, timing={"base_s": 0.01, "per_decode_seq_s": 0.001, "per_prefill_token_s": 0.0},
                  output_tokens={"median": 50})
    values.update(overrides)
    return values


def test_a_profile_that_could_never_serve_a_request_is_refused_when_loaded():
    # max_num_seqs 0 or a token budget of 0: every request waited forever while /health said 200; a name written as
    # a string (model_names: m-70b) served one model per character.
    import pytest

    from extproc.tools.sim.profile import profile_from_dict

    assert profile_from_dict(_profile_yaml()).model_names == ("m",)
    for bad in ({"max_num_seqs": 0}, {"max_num_batched_tokens": 0}, {"max_num_seqs": -1}, {"model_names": "m-70b"},
                {"model_names": []}, {"max_model_len": 0}, {"default_max_tokens": 0}, {"block_size": 2.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            profile_from_dict(_profile_yaml(**bad))


def test_a_profile_whose_timing_is_not_a_finite_non_negative_number_is_refused():
    # base_s: .nan made every iteration's duration NaN, and with it the replica's clock for good (as a NaN fault did);
    # a negative coefficient ran the clock backwards for big batches.
    import pytest

    from extproc.tools.sim.profile import profile_from_dict

    timing = _profile_yaml()["timing"]
    for key, value in (("base_s", float("nan")), ("per_decode_seq_s", -0.001), ("per_prefill_token_s", float("inf")),
                       ("per_context_token_s", -1.0)):
        with pytest.raises(ValueError, match=f"timing.{key}"):
            profile_from_dict(_profile_yaml(timing={**timing, key: value}))


def test_each_step_is_attributed_to_its_sequences_in_full_and_a_long_prompt_weighs_more():
    # The engine time each sequence is charged (work_s) adds up to the time the engine ran, preemptions and
    # chunked prefills included, and a long prompt costs more than a short one with the same answer (its prefill,
    # and attention over its context at every decode step): the reference the ext_proc's GPU-seconds are checked
    # against (bench/noisy_neighbour.py --backlogged).
    engine = Engine(make_profile(kv_cache_blocks=40, max_num_batched_tokens=256, max_model_len=1024,
                                 timing=Timing(0.01, 0.001, 0.0001, 0.00001)))
    short = [engine.add_request(50, 40, 0.0, natural_tokens=40) for _ in range(3)]
    long = [engine.add_request(500, 40, 0.0, natural_tokens=40) for _ in range(3)]
    now = 0.0
    while engine.has_work:
        now, _ = step(engine, now)
    assert engine.stats.preemptions >= 1
    assert sum(s.work_s for s in short + long) == pytest.approx(now)
    assert min(s.work_s for s in long) > 2 * max(s.work_s for s in short)


def _first_step_of_four_samples(prompt: int, **profile) -> tuple[list[int], int, EngineStats]:
    engine = Engine(make_profile(max_num_batched_tokens=2048, **profile))
    engine.add_samples(prompt, 4, 0.0, 4, natural_tokens=4)
    engine.begin_iteration(0.0)
    scheduled = [n for _, n in engine._batch]
    engine.end_iteration(0.1)
    return scheduled, engine.profile.kv_cache_blocks - engine.free_blocks, engine.stats


def test_samples_of_a_prompt_compute_its_full_blocks_once():
    """vLLM 0.32 with prefix caching (its default), n=4 and a 300-token prompt in 16-token blocks, recorded in-process:
    the first sample computes 300 tokens, each other one reads 18 blocks and computes the last 12; 22 blocks held."""
    scheduled, used, stats = _first_step_of_four_samples(300)
    assert scheduled == [300, 12, 12, 12] and used == 22
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prompt_tokens) == (1200, 864, 1200)


def test_a_sample_recomputes_the_block_of_its_last_prompt_token():
    """320 tokens fill 20 blocks, but a sample must compute its last token to sample: it reads 19 and copies the 20th."""
    scheduled, used, _ = _first_step_of_four_samples(320)
    assert scheduled == [320, 16, 16, 16] and used == 23


def test_without_prefix_caching_each_sample_prefills_the_prompt():
    scheduled, used, stats = _first_step_of_four_samples(300, enable_prefix_caching=False)
    assert scheduled == [300] * 4 and used == 76
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)


@pytest.mark.parametrize("seed", range(12))
def test_samples_sharing_a_prompt_under_kv_pressure_never_lose_a_block(seed):
    """Every block is free, a running sequence's own, or a shared prompt's held once, at every step; and a workload
    of n > 1 requests that keeps the cache full, with aborts, runs to its end. Found by the best-of-n scenario's
    capacity run: an admission that failed after its prefix-cache lookup kept the cached blocks it had taken out of
    the free pool, and the engine stalled with 142 of 2,250 blocks free and nothing running."""
    import random
    rng = random.Random(seed)
    engine = Engine(make_profile(kv_cache_blocks=96, block_size=16, max_num_seqs=16, max_num_batched_tokens=512))
    total, now, live = engine.profile.kv_cache_blocks, 0.0, []
    for i in range(300):
        if i < 200 and rng.random() < 0.7:
            live += engine.add_samples(rng.randint(20, 700), rng.randint(1, 48), now, rng.choice((1, 2, 4)),
                                       natural_tokens=rng.randint(1, 48))
        if live and rng.random() < 0.05:
            engine.abort(rng.choice(live), now)
        took = engine.begin_iteration(now)
        if took is None:
            assert not engine.running and not engine.waiting, "stalled with requests waiting"
            now += 0.01
            continue
        now += took
        engine.end_iteration(now)
        prompts = {id(s.prompt): s.prompt for s in engine.running if s.prompt is not None}
        own = sum(s.blocks - s.shared for s in engine.running)
        assert engine.free_blocks + own + sum(p.held for p in prompts.values()) == total
    while engine.running or engine.waiting:
        took = engine.begin_iteration(now)
        assert took is not None, "stalled with requests waiting"
        now += took
        engine.end_iteration(now)
    assert engine.free_blocks == total


def test_a_step_that_only_preempted_is_not_idle():
    """Under priority, a running sequence that needs a block and is the lowest priority preempts itself, and vLLM
    schedules nobody else in that step. Read as idle (None), a simulated replica parked with a higher-priority
    request still running, until the next arrival (found by a review's fuzz: 14 of 300 seeds)."""
    engine = Engine(make_profile(scheduling_policy="priority", kv_cache_blocks=4, block_size=16,
                                 max_num_batched_tokens=256, max_num_seqs=4))
    low = engine.add_request(30, 30, 0.0, natural_tokens=30, priority=5)  # 2 blocks, a third at token 33
    now, _ = step(engine, 0.0)
    high = engine.add_request(30, 10, now, natural_tokens=10, priority=0)  # the other 2 blocks
    while low.computed < 32:
        now, _ = step(engine, now)
    took = engine.begin_iteration(now)  # low needs a third block, none is free: it is its own victim
    assert low.state == WAITING and engine._batch == [] and took == 0.0
    engine.end_iteration(now)
    while engine.has_work:
        took = engine.begin_iteration(now)
        assert took is not None
        now += took
        engine.end_iteration(now)
    assert high.state == FINISHED and low.state == FINISHED



class _FreeQueueChecked(Engine):
    """An engine checked against vLLM's free queue kept block by block, apart from the engine's runs: a list of
    labels, (prompt, block index) for a prompt's cached block held by none, None for any other free block, driven
    by the engine's own calls. Allocation takes from the front (a prompt's block taken is evicted), a freed table
    joins the back from its end (vLLM's free_blocks(reversed(blocks))), a prefix-cache read takes its blocks out
    wherever they are (vLLM's touch), and a read not taken puts them back where they were."""

    def __init__(self, profile):
        super().__init__(profile)
        self.ref: list = [None] * profile.kv_cache_blocks
        self.evictions = 0  # prompts' cached blocks taken by allocation
        self.late_frees = 0  # frees of a prompt's blocks while blocks of it freed earlier were still queued
        self.reads_ahead = 0  # reads that took a prompt's blocks from ahead of another prompt's queued ones
        self._before_read: list | None = None

    def ref_cached(self, prompt) -> int:
        """vLLM's lookup: the longest prefix of the prompt's blocks held or still in the free queue."""
        queued = {label[1] for label in self.ref if label is not None and label[0] is prompt}
        cached = prompt.held
        while cached in queued:
            cached += 1
        return cached

    def _allocate(self, seq, tokens):
        need = self._blocks_needed(seq, tokens)
        ok = super()._allocate(seq, tokens)
        if ok and need > 0:
            taken, self.ref = self.ref[:need], self.ref[need:]
            self.evictions += sum(label is not None for label in taken)
        return ok

    def _read_shared_prompt(self, seq):
        prompt = seq.prompt
        held = prompt.held if prompt is not None else 0
        self._before_read = list(self.ref)
        tokens = super()._read_shared_prompt(seq)
        if prompt is not None and seq.shared > held:
            at = []
            for i in range(held, seq.shared):
                assert (prompt, i) in self.ref, f"a read of block {i}, evicted"
                at.append(self.ref.index((prompt, i)))
            if any(label is not None and label[0] is not prompt for label in self.ref[min(at):]):
                self.reads_ahead += 1
            self.ref = [label for k, label in enumerate(self.ref) if k not in at]
        return tokens

    def _unread_shared_prompt(self, seq):
        super()._unread_shared_prompt(seq)
        self.ref = self._before_read

    def _release(self, seq):
        prompt = seq.prompt
        own, held = seq.blocks - seq.shared, (prompt.held if prompt is not None else 0)
        super()._release(seq)
        self.ref += [None] * own
        if prompt is not None and prompt.held < held:
            if any(label is not None and label[0] is prompt for label in self.ref):
                self.late_frees += 1
            self.ref += [(prompt, i) for i in reversed(range(prompt.held, held))]


def _shared_prompts_under_pressure(seed: int) -> _FreeQueueChecked:
    """A random workload of n > 1 requests (prompts of whole blocks and not) on a small cache with chunked prefill,
    preemption (fcfs or priority) and aborts; the block invariant and every prompt's cache checked at every step."""
    import random

    rng = random.Random(seed)
    engine = _FreeQueueChecked(make_profile(kv_cache_blocks=40, block_size=16, max_num_seqs=8,
                                            max_num_batched_tokens=64, max_model_len=2048,
                                            scheduling_policy=("fcfs", "priority")[seed % 2]))
    total, now, live = engine.profile.kv_cache_blocks, 0.0, []
    for i in range(300):
        if i < 200 and rng.random() < 0.5:
            live += engine.add_samples(rng.choice((16, 32, 48, 64, rng.randint(17, 300))), rng.randint(1, 40), now,
                                       rng.choice((1, 2, 3, 4)), natural_tokens=rng.randint(1, 40),
                                       priority=rng.randint(0, 2))
        if live and rng.random() < 0.08:
            engine.abort(rng.choice(live), now)
        took = engine.begin_iteration(now)
        now += 0.01 if took is None else took
        if took is not None:
            engine.end_iteration(now)
        prompts = {id(s.prompt): s.prompt for s in live if s.prompt is not None}.values()
        own = sum(s.blocks - s.shared for s in [*engine.running, *engine.waiting])
        assert engine.free_blocks + own + sum(p.held for p in prompts) == total
        assert engine.free_blocks == len(engine.ref) == sum(run[1] for run in engine._free_queue)
        for p in prompts:
            assert p.held <= engine._cached(p) <= p.samples[0].prompt_tokens // engine.profile.block_size
            assert engine._cached(p) == engine.ref_cached(p), f"step {i}: the engine's cache is not vLLM's"
            # cached and held by none: counted among the free blocks, so no more of them
            assert engine._cached(p) - p.held <= engine.free_blocks
    return engine


@pytest.mark.parametrize("seed", range(4))
def test_a_prompts_cached_blocks_are_those_vllms_free_queue_still_holds(seed):
    """Every prompt's cached blocks, at every step, are those held and those vLLM's free queue, kept block by block
    (_FreeQueueChecked), still holds: no eviction counted late, none counted twice. Both ways the engine's single
    (allocated, blocks ahead) mark per prompt used to count evictions late are reached: a prompt's blocks freed
    while older ones of it were still queued (the mark moved to the back for all of them), and a read taking a
    prompt's blocks from ahead of another's (blocks out of the queue without an allocation)."""
    engine = _shared_prompts_under_pressure(seed)
    assert engine.evictions and engine.late_frees, "the cases not reached"


def test_a_read_from_ahead_of_another_prompts_cached_blocks_is_reached():
    assert sum(_shared_prompts_under_pressure(seed).reads_ahead for seed in range(4)), "the case not reached"


@pytest.mark.parametrize("seed", range(4))
def test_a_prompts_blocks_cached_and_held_by_none_fit_in_the_free_pool(seed):
    """Found by the same workload: a prompt counted as cached more unheld blocks than there were free blocks (seed
    0: 3 cached, 0 held, 2 free), so its samples read as cache hits blocks that were evicted. The engine kept one
    mark per prompt, (blocks allocated so far, free blocks ahead) at its last free, and counted its blocks evicted
    once the allocations since passed it. Two things broke it: a later free of the prompt's blocks moved the mark
    to the back of the queue for the blocks freed earlier too (seed 0, step 31: prompt P11's block 2 freed 17
    blocks from the front, blocks 1 and 0 at 20, all counted at 20; at step 38, another free, all at 21 while
    block 2 was 6 from the front), and a read (_read_shared_prompt) took blocks ahead of it out of the queue
    without an allocation. The engine now keeps the free queue itself, as runs (Engine._free_queue)."""
    _shared_prompts_under_pressure(seed)  # checked at every step
