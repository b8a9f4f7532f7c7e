"""A sans-IO model of vLLM's engine: continuous batching, chunked prefill, paged KV cache and preemption.

Two scheduling policies, as vLLM 0.32's `--scheduling-policy` (vllm/v1/core/sched/scheduler.py): `fcfs` (the
waiting queue in arrival order; a running sequence short of KV blocks preempts the newest running one) and
`priority` (the waiting queue ordered by (priority, arrival), lower first; the victim is the running sequence with
the largest (priority, arrival), wherever it sits in the batch, and a victim already scheduled this step gives its
token budget back). In both a waiting request never preempts anyone: it waits for blocks (with the profile's
`scheduler_reserve_full_isl`, as vLLM's flag, for all its tokens, not just its first chunk's).

Of vLLM's prefix caching (on by default; the profile's `enable_prefix_caching`) it models one part: the samples
of one prompt (`n` > 1, `add_samples`) share the prompt's full KV blocks, computed once (SharedPrompt).

Time never comes from a clock here: callers pass `now` in simulated seconds. One iteration is
`begin_iteration(now)` (schedule the batch, return how long it takes) then `end_iteration(end)` (apply it and
return the tokens it produced). Requests aborted in between simply produce nothing.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from extproc.tools.sim.profile import Profile

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
FCFS, PRIORITY = "fcfs", "priority"
SCHEDULING_POLICIES = (FCFS, PRIORITY)


@dataclass(eq=False)
class Sequence:
    """One request inside the engine, with the times the metrics need (simulated seconds)."""

    id: int
    prompt_tokens: int
    max_tokens: int
    target_tokens: int  # min(max_tokens, natural length): where it will stop
    arrival: float
    cost: float = 1.0
    generated: int = 0
    computed: int = 0  # tokens whose KV entries exist; reset to 0 by preemption (recompute)
    blocks: int = 0
    state: str = WAITING
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    priority: int = 0  # the request's `priority`: lower runs first (only under the priority policy)
    lora: int = 0  # its LoRA adapter's id (vLLM's lora_int_id, from 1); 0: the base model
    prompt: SharedPrompt | None = None  # the blocks it may share with its request's other samples
    shared: int = 0  # its first `shared` blocks are prompt's (held once, whoever holds them)
    # The engine time that was this sequence's (Engine.begin_iteration): its own terms of each step it ran in, and
    # an equal share of the step's fixed part. An independent measure of the GPU-seconds the ext_proc estimates.
    work_s: float = 0.0

    @property
    def length(self) -> int:
        """Tokens that must be in the KV cache before the next token can be sampled."""
        return self.prompt_tokens + self.generated


@dataclass(eq=False)
class SharedPrompt:
    """The prompt of a request's samples. vLLM fans `n` out into n requests of the same prompt, and with prefix
    caching registers each full block of a prompt as it allocates it, so a sample admitted while those blocks are
    cached reads them instead of computing them: all but the block of its last prompt token, which it computes to
    sample (recorded: tests/fixtures/vllm/scheduling.json's samples cases, docs/simulator.md). Blocks no sample
    holds stay cached, counted free, in the engine's free queue until allocations evict them (Engine._free_queue)."""

    samples: list[Sequence] = field(default_factory=list)
    # its blocks cached and held by none: its runs in the engine's free queue ([self, blocks], front first). Its
    # blocks [held, cached) in order, the last one nearest the front: a table is freed from its end, and a read
    # takes back the first ones (the back's), so what allocations evict from the front leaves a prefix cached.
    queued: deque[list] = field(default_factory=deque, repr=False)

    @property
    def held(self) -> int:
        """Its blocks samples hold: they are a prefix of each holder's table, so the longest holder has them all."""
        return max(s.shared for s in self.samples)

    @property
    def cached(self) -> int:
        """Its blocks in the prefix cache now, held or not."""
        return self.held + sum(run[1] for run in self.queued)


class PriorityWaiting:
    """The waiting queue of the priority policy: ordered by (priority, arrival, id), whatever end it is put at
    (vLLM's heap has no front either: a preempted request goes back by its key)."""

    def __init__(self) -> None:
        self._items: list[Sequence] = []

    def append(self, seq: Sequence) -> None:
        bisect.insort(self._items, seq, key=_priority_key)

    appendleft = append

    def popleft(self) -> Sequence:
        return self._items.pop(0)

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def __getitem__(self, index: int) -> Sequence:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)


def _priority_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.arrival, seq.id


@dataclass
class Emission:
    """A token produced by an iteration; finish_reason is set on a sequence's last token."""

    seq: Sequence
    finish_reason: str | None
    inter_token_s: float | None  # time since this sequence's previous token; None for the first


@dataclass
class EngineStats:
    """Monotonic counters, read by the metrics exposition."""

    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    iterations: int = 0
    inter_token_s: float = 0.0  # the inter-token latency histogram's sum and count (vllm:inter_token_latency_seconds)
    inter_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    # vllm:prefix_cache_queries_total and _hits_total: the tokens of each request admitted with an empty KV, and
    # those of them its prefix-cache lookup found (here only a sibling sample's prompt blocks)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class Engine:
    """Continuous-batching scheduler and cost model for one simulated replica."""

    def __init__(self, profile: Profile, seed: int = 0, max_loras: int | None = None):
        self.profile = profile
        # vLLM's --max-loras with --enable-lora (None: LoRA off): adapters in one batch at most; a waiting request
        # for another adapter is passed over (it stays waiting, and counts as waiting) until one's requests end.
        if max_loras is not None and max_loras < 1:  # as vLLM's LoRA config: with 0 no adapter request would ever run
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        # Those the last schedule passed over for the LoRA budget (vLLM's skipped_waiting queue): they stay deferred
        # until a schedule takes them, even while the adapter that held them back has just ended or been aborted.
        self._skipped: set[Sequence] = set()
        self.rng = random.Random(seed)
        self.priority = profile.scheduling_policy == PRIORITY
        self.waiting: deque[Sequence] | PriorityWaiting = PriorityWaiting() if self.priority else deque()
        self.running: list[Sequence] = []  # admission order: under fcfs the last one is the newest, preempted first
        self.free_blocks = profile.kv_cache_blocks
        self.stats = EngineStats()
        self.slowdown = 1.0  # fault injection: multiplies iteration time
        self._next_id = 0
        # vLLM's free queue, as runs [owner, blocks]: allocation takes from the front (evicting cached blocks), a
        # freed table joins the back from its end, a prefix-cache read takes its blocks out wherever they are.
        # owner: the SharedPrompt whose cached blocks the run is, or None (blocks no prompt can read again).
        self._free_queue: deque[list] = deque([[None, profile.kv_cache_blocks]])
        self._read_taken: list[tuple[list, int]] = []  # the runs the last _read_shared_prompt took blocks from
        self._preempted_now = False  # the step being scheduled preempted someone
        self._batch: list[tuple[Sequence, int]] = []  # the in-flight iteration's (sequence, tokens computed)
        self.step_tokens = 0  # tokens the last iteration scheduled

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt_tokens: int, max_tokens: int, now: float,
                    natural_tokens: int | None = None, priority: int = 0, lora: int = 0) -> Sequence:
        """Queue a request; its output length is drawn now so it is fixed by the seed and arrival order.
        `priority` orders it only under the priority policy (fcfs ignores it, as vLLM does)."""
        natural = self.profile.natural_output_tokens(self.rng)
        if natural_tokens is not None:  # ignore_eos, or a test that wants an exact length
            natural = natural_tokens
        cost = self.profile.cost_multiplier.sample(self.rng)
        seq = Sequence(self._next_id, prompt_tokens, max_tokens, min(max_tokens, natural), now, cost,
                       priority=priority, lora=lora)
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def add_samples(self, prompt_tokens: int, max_tokens: int, now: float, samples: int, **kwargs) -> list[Sequence]:
        """Queue a request's `samples` (its `n`): each a sequence of its own (add_request's arguments), sharing the
        prompt's full blocks when prefix caching is on."""
        seqs = [self.add_request(prompt_tokens, max_tokens, now, **kwargs) for _ in range(samples)]
        if samples > 1 and self.profile.enable_prefix_caching:
            prompt = SharedPrompt(seqs)
            for seq in seqs:
                seq.prompt = prompt
        return seqs

    def abort(self, seq: Sequence, now: float) -> None:
        """Drop a request (client went away) and free its KV blocks at once."""
        if seq.state == FINISHED:
            return
        if seq.state == RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, now, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def deferred(self) -> int:
        """Waiting requests held back by the LoRA budget alone (vLLM 0.32's waiting reason `deferred`): passed over
        by the last schedule (vLLM's skipped_waiting, which keeps them until a schedule takes them: between steps an
        aborted adapter's requests do not turn the others into waiting for capacity), or for an adapter other than
        the --max-loras ones running now (one that arrived since)."""
        if self.max_loras is None:
            return 0
        running = {s.lora for s in self.running if s.lora}
        full = len(running) >= self.max_loras
        return sum(1 for s in self.waiting if s.lora and (s in self._skipped or (full and s.lora not in running)))

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
        return 1.0 - self.free_blocks / self.profile.kv_cache_blocks

    # -- one iteration --------------------------------------------------------------------------------------
    def begin_iteration(self, now: float) -> float | None:
        """Schedule the next batch; return its duration in simulated seconds, or None when idle. A step that only
        preempted (under priority, the first running sequence was its own victim: vLLM schedules nobody else in that
        step) takes no time and is not idle: the next one runs the rest, as vLLM's loop steps again at once. Read as
        idle, a replica parked with requests running until the next arrival."""
        self._preempted_now = False
        batch = self._schedule(now)
        self._batch = batch
        if not batch:
            return 0.0 if self._preempted_now and self.has_work else None
        decode_cost = 0.0
        prefill_tokens = context_tokens = 0
        timing, scale = self.profile.timing, self.slowdown
        fixed = scale * timing.base_s / len(batch)
        for seq, n in batch:
            context_tokens += seq.computed + n
            if n == 1 and seq.computed == seq.length - 1:
                decode_cost += seq.cost
                own = timing.per_decode_seq_s * seq.cost
            else:
                prefill_tokens += n
                own = timing.per_prefill_token_s * n
            seq.work_s += fixed + scale * (own + timing.per_context_token_s * (seq.computed + n))
        self.stats.iterations += 1
        self.step_tokens = sum(n for _, n in batch)  # vllm:iteration_tokens_total observes it (ReplicaMetrics)
        return scale * timing.iteration_s(decode_cost, prefill_tokens, context_tokens)

    def end_iteration(self, now: float) -> list[Emission]:
        """Apply the scheduled batch at time `now`: advance prefills and emit one token per caught-up sequence."""
        emitted = []
        for seq, n in self._batch:
            if seq.state != RUNNING:  # aborted or preempted while the iteration ran
                continue
            seq.computed += n
            if seq.computed < seq.length:
                continue  # a prefill chunk; more to compute before sampling
            seq.generated += 1
            self.stats.generation_tokens += 1
            if seq.generated == 1:  # vLLM counts a prompt's tokens when its prefill is done (its first token)
                self.stats.prompt_tokens += seq.prompt_tokens
            inter_token = None if seq.last_token is None else now - seq.last_token
            if inter_token is not None:
                self.stats.inter_token_s += inter_token
                self.stats.inter_tokens += 1
            if seq.first_token is None:
                seq.first_token = now
            seq.last_token = now
            reason = None
            if seq.generated >= seq.target_tokens:
                reason = "length" if seq.generated >= seq.max_tokens else "stop"
                self.running.remove(seq)
                self._finish(seq, now, reason)
            emitted.append(Emission(seq, reason, inter_token))
        self._batch = []
        return emitted

    # -- scheduling -----------------------------------------------------------------------------------------
    def _schedule(self, now: float) -> list[tuple[Sequence, int]]:
        """vLLM-style: running sequences first (decode or the rest of their prefill), then admit waiting ones in
        queue order (arrival, or (priority, arrival))."""
        budget = self.profile.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.length - seq.computed, budget)
            while not self._allocate(seq, seq.computed + n):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:
                    i -= 1
                for k, (scheduled, tokens) in enumerate(batch):
                    if scheduled is victim:  # scheduled earlier this step: its tokens go back to the budget
                        del batch[k]
                        budget += tokens
                        break
                self._preempt(victim)
                preempted = self._preempted_now = True
                if victim is seq:
                    break
            if seq.state != RUNNING:
                break  # seq itself was the victim: under fcfs nothing after it remains, under priority all
                # the others outrank it (vLLM stops scheduling running requests here too)
            batch.append((seq, n))
            budget -= n
            i += 1
        # Like vLLM, admit nobody new in an iteration that had to preempt: memory is the bottleneck.
        loras = {s.lora for s, _ in batch if s.lora}
        passed_over: list[Sequence] = []
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.profile.max_num_seqs):
            seq = self.waiting[0]
            if seq.lora and self.max_loras is not None and len(loras) >= self.max_loras and seq.lora not in loras:
                passed_over.append(self.waiting.popleft())  # as vLLM: skipped, the ones behind it may go
                continue
            hit = self._read_shared_prompt(seq)
            n = min(seq.length - seq.computed, budget)
            # vLLM's --scheduler-reserve-full-isl: admitted only when the free blocks hold all its tokens, not just
            # the first chunk it is scheduled now
            if (self.profile.scheduler_reserve_full_isl and self._blocks_short(seq, seq.length)
                    or not self._allocate(seq, seq.computed + n)):
                self._unread_shared_prompt(seq)  # the lookup is taken only with the admission
                break  # FIFO: the head waits for memory, nobody overtakes it
            self._count_lookup(seq, hit)
            self.waiting.popleft()
            seq.state = RUNNING
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
            if seq.lora:
                loras.add(seq.lora)
        for seq in reversed(passed_over):  # back at the head, in their order
            self.waiting.appendleft(seq)
        self._skipped = set(passed_over)
        return batch

    def _victim(self) -> Sequence:
        """The running sequence that gives its blocks back: the newest (fcfs), or the one with the largest
        (priority, arrival) (priority)."""
        if self.priority:
            return max(self.running, key=lambda s: (s.priority, s.arrival))
        return self.running[-1]

    def _blocks_needed(self, seq: Sequence, tokens: int) -> int:
        """The blocks seq's table must grow by to hold `tokens` tokens (0 or less: it holds them)."""
        return -(-tokens // self.profile.block_size) - seq.blocks

    def _blocks_short(self, seq: Sequence, tokens: int) -> bool:
        """Whether seq's block table cannot grow to hold `tokens` tokens from the free blocks."""
        return self._blocks_needed(seq, tokens) > self.free_blocks

    def _read_shared_prompt(self, seq: Sequence) -> int:
        """A waiting seq's prefix-cache hit: its prompt's cached blocks, short of the block of its last token (vLLM
        computes that one again to sample). They become the head of its table, the ones no sibling held taken out of
        the free queue (from where they are in it: vLLM's lookup touches them, no allocation). Returns the tokens."""
        prompt = seq.prompt
        self._read_taken = []
        if prompt is None:
            return 0
        held = prompt.held
        hit = min(self._cached(prompt), (seq.length - 1) // self.profile.block_size)
        take = max(hit - held, 0)
        self.free_blocks -= take
        while take:  # its first unheld blocks: the back-most of its runs
            run = prompt.queued[-1]
            n = min(run[1], take)
            run[1] -= n
            take -= n
            self._read_taken.append((run, n))
            if not run[1]:
                prompt.queued.pop()  # left in the free queue, empty, until allocation reaches it
        seq.blocks = seq.shared = hit
        seq.computed = hit * self.profile.block_size
        return seq.computed

    def _unread_shared_prompt(self, seq: Sequence) -> None:
        """Undo _read_shared_prompt for a seq not admitted after all: the cached blocks it took out of the free pool
        go back (still cached). Left taken, each failed admission of the queue's head lost them for good: the
        best-of-n scenario's capacity run ended with 142 of 2,250 blocks free and nothing running."""
        seq.computed = seq.blocks = seq.shared = 0
        for run, n in reversed(self._read_taken):  # back where they were: nothing was allocated since
            if not run[1]:
                run[0].queued.append(run)
            run[1] += n
            self.free_blocks += n
        self._read_taken = []

    def _cached(self, prompt: SharedPrompt) -> int:
        """Its blocks in the prefix cache now, held or not."""
        return prompt.cached

    def _count_lookup(self, seq: Sequence, hit: int) -> None:
        """vLLM counts a prefix-cache lookup when the request it was made for is admitted."""
        if self.profile.enable_prefix_caching:
            self.stats.prefix_cache_queries += seq.length
            self.stats.prefix_cache_hits += hit

    def _allocate(self, seq: Sequence, tokens: int) -> bool:
        """Grow seq's block table to hold `tokens` tokens; False when the cache has too few free blocks."""
        need = self._blocks_needed(seq, tokens)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        # vLLM caches a prompt's full blocks as they are allocated: the sample that holds all the cached ones, and
        # of its own at most the partial block after them, extends them (a sibling's later blocks of the same
        # prompt are copies, not shared)
        prompt = seq.prompt
        if prompt is not None and seq.blocks - 1 <= seq.shared == self._cached(prompt):
            seq.shared = min(tokens, seq.prompt_tokens) // self.profile.block_size
        self.free_blocks -= need
        seq.blocks += need
        queue = self._free_queue
        while need:  # from the front of the free queue: a cached block taken is evicted
            run = queue[0]
            n = min(run[1], need)
            run[1] -= n
            need -= n
            if not run[1]:
                queue.popleft()
                owner = run[0]
                if owner is not None and owner.queued and owner.queued[0] is run:
                    owner.queued.popleft()
        return True

    def _release(self, seq: Sequence) -> None:
        """Free seq's blocks: its own, and the shared ones no sibling holds."""
        own = seq.blocks - seq.shared
        self._enqueue(None, own)  # vLLM frees a table from its end: its own blocks join the free queue first
        prompt = seq.prompt
        if prompt is not None and seq.shared:
            held = prompt.held
            seq.shared = 0
            if prompt.held < held:  # they stay cached, at the back of the free queue, its last block first
                self._enqueue(prompt, held - prompt.held)
        seq.blocks = 0

    def _enqueue(self, owner: SharedPrompt | None, blocks: int) -> None:
        """Free `blocks` blocks at the back of the free queue (owner's cached ones, or of no prompt)."""
        if blocks <= 0:
            return
        self.free_blocks += blocks
        back = self._free_queue[-1] if self._free_queue else None
        if back is not None and back[0] is owner and (owner is None or owner.queued and owner.queued[-1] is back):
            back[1] += blocks
            return
        run = [owner, blocks]
        self._free_queue.append(run)
        if owner is not None:
            owner.queued.append(run)

    def _preempt(self, seq: Sequence) -> None:
        """Evict seq: free its blocks, forget its KV (recompute later) and put it at the front of the queue (under
        priority: back in its place by (priority, arrival))."""
        self._release(seq)
        seq.computed = 0
        seq.state = WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, now: float, reason: str) -> None:
        self._release(seq)
        seq.state = FINISHED
        seq.finished = now
        seq.finish_reason = reason
        self.stats.finished[reason] += 1
