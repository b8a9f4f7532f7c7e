"""The engine model's scheduling against vLLM 0.32's own v1 scheduler, step by step.

tests/fixtures/vllm/scheduling.json holds generated cases (policy, a small KV cache, max_num_seqs,
max_num_batched_tokens, --scheduler-reserve-full-isl on or off, requests with arrival step, prompt length, max_tokens and priority) and, for each step of
vLLM's `Scheduler` driven in-process with fake model outputs (scripts/vllm/record_scheduling.py, `make
vllm-scheduling`): the tokens each request was scheduled, in the order it was taken; the requests preempted, in
order; the running list and the waiting queue after scheduling; the requests that finished; the free KV blocks.
Its samples cases run requests of n > 1 with prefix caching on (each sample a sequence; a request's are numbered
consecutively). engine.py claims to schedule as vLLM's V1 scheduler does (docs/simulator.md, "The engine model"),
in steps: all of that must match.
Time is not compared (vLLM's steps here take no time; the engine's come from a profile).
"""

import json
from pathlib import Path

import pytest

from extproc.tools.sim.engine import Engine, Sequence
from tests.sim.test_engine import make_profile

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm" / "scheduling.json").read_text())
FIELDS = FIXTURE["step_fields"]  # scheduled, preempted, running, waiting, finished, free_blocks


def vllm_steps(case: dict) -> list[dict]:
    return [{"step": k, **dict(zip(FIELDS, values))} for k, values in enumerate(case["steps"])]


class RecordingEngine(Engine):
    """The engine, remembering the order of each schedule's preemptions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.preempted: list[Sequence] = []

    def _preempt(self, seq: Sequence) -> None:
        self.preempted.append(seq)
        super()._preempt(seq)


def replay(case: dict) -> list[dict]:
    """The engine's steps for a case, in the fixture's shape."""
    engine = RecordingEngine(make_profile(
        scheduling_policy=case["policy"], kv_cache_blocks=case["kv_cache_blocks"], block_size=case["block_size"],
        max_num_seqs=case["max_num_seqs"], max_num_batched_tokens=case["max_num_batched_tokens"],
        max_model_len=case["max_model_len"], scheduler_reserve_full_isl=case["scheduler_reserve_full_isl"],
        enable_prefix_caching=case.get("enable_prefix_caching", False)))
    pending = list(enumerate(case["requests"]))
    index: dict[Sequence, int] = {}
    steps = []
    for step in range(len(case["steps"]) + 1):  # one more: the engine must have drained when vLLM had
        while pending and pending[0][1]["arrival_step"] <= step:
            i, r = pending.pop(0)
            # the recorder's arrival times: the step, plus a sliver that keeps one step's requests in index order
            for seq in engine.add_samples(r["prompt"], r["max_tokens"], step + i * 1e-4, r.get("n", 1),
                                          natural_tokens=r["max_tokens"], priority=r["priority"]):
                index[seq] = len(index)
        if not pending and not engine.has_work:
            break
        engine.preempted = []
        engine.begin_iteration(float(step))
        scheduled = [[index[seq], n] for seq, n in engine._batch]
        record = {"step": step, "scheduled": scheduled, "preempted": [index[s] for s in engine.preempted],
                  "running": [index[s] for s in engine.running], "waiting": [index[s] for s in engine.waiting],
                  "free_blocks": engine.free_blocks}
        emitted = engine.end_iteration(step + 0.5)
        record["finished"] = sorted(index[e.seq] for e in emitted if e.finish_reason is not None)
        steps.append(record)
    return steps


def first_difference(ours: list[dict], theirs: list[dict]) -> str | None:
    for mine, vllm in zip(ours, theirs):
        if mine != vllm:
            keys = [k for k in vllm if mine.get(k) != vllm[k]]
            return f"step {vllm['step']}: " + "; ".join(f"{k} engine {mine.get(k)} vLLM {vllm[k]}" for k in keys)
    if len(ours) != len(theirs):
        return f"engine drained in {len(ours)} steps, vLLM in {len(theirs)}"
    return None


def test_the_fixture_exercises_what_it_compares():
    """What the cases must contain for the comparison to mean something (counted on vLLM's own steps)."""
    seen = {"fcfs preemptions": 0, "priority preemptions": 0, "steps with two victims": 0,
            "victims scheduled earlier in their step": 0, "chunked prefills": 0, "max_num_seqs full": 0,
            "priority admissions out of arrival order": 0}
    for case in FIXTURE["cases"]:
        prompts = [r["prompt"] for r in case["requests"] for _ in range(r.get("n", 1))]  # a sequence's
        before: list[int] = []  # the running list as the step starts: the last one's, less those that finished
        for step in vllm_steps(case):
            seen[f"{case['policy']} preemptions"] += len(step["preempted"])
            seen["steps with two victims"] += len(step["preempted"]) > 1
            taken = [i for i, _ in step["scheduled"] if i in before]
            seen["victims scheduled earlier in their step"] += any(
                before.index(v) < before.index(i) for v in step["preempted"] if v in before for i in taken)
            seen["chunked prefills"] += sum(1 for i, n in step["scheduled"] if 1 < n < prompts[i])
            seen["max_num_seqs full"] += len(step["running"]) == case["max_num_seqs"] and bool(step["waiting"])
            new = [i for i, _ in step["scheduled"] if i not in before]
            seen["priority admissions out of arrival order"] += case["policy"] == "priority" and any(
                w < i for i in new for w in step["waiting"])
            before = [i for i in step["running"] if i not in step["finished"]]
    seen["samples that read a sibling's prompt blocks"] = sum(_shared_readers(case) for case in FIXTURE["cases"])
    for flag in (True, False):
        seen[f"cases with reserve_full_isl {flag}"] = sum(c["scheduler_reserve_full_isl"] == flag
                                                          for c in FIXTURE["cases"])
    assert min(seen.values()) >= 5, seen


def _shared_readers(case: dict) -> int:
    """The sequences that computed less than their prompt and output (never preempted here): they read blocks."""
    computed: dict[int, int] = {}
    for step in vllm_steps(case):
        for i, n in step["scheduled"]:
            computed[i] = computed.get(i, 0) + n
    own = [r["prompt"] + r["max_tokens"] - 1 for r in case["requests"] for _ in range(r.get("n", 1))]
    return sum(computed[i] < tokens for i, tokens in enumerate(own))


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: c["name"])
def test_engine_schedules_as_vllm(case):
    difference = first_difference(replay(case), vllm_steps(case))
    assert difference is None, (
        f"{case['name']} ({case['policy']}, {case['kv_cache_blocks']} blocks, max_num_seqs {case['max_num_seqs']}, "
        f"max_num_batched_tokens {case['max_num_batched_tokens']}): {difference}")
