"""vLLM 0.32's --scheduling-policy priority in the simulator: the waiting queue by (priority, arrival), the worst
running request preempted when KV blocks run short, and the API that carries a request's priority."""

import aiohttp
import pytest

from extproc.tools.sim.engine import RUNNING, WAITING, Engine
from extproc.tools.sim.fleet import SimFleet
from extproc.tools.sim.openai_api import CHAT, ApiError, header_priority, parse_generation
from extproc.tools.sim.profile import load_profile, profile_from_dict
from tests.sim.test_engine import make_profile, step

MODEL = "meta-llama/Llama-3.1-70B-Instruct-AWQ"


def engine(policy: str, **overrides) -> Engine:
    return Engine(make_profile(scheduling_policy=policy, **overrides))


def admitted_order(e: Engine, seqs) -> list[int]:
    now = 0.0
    order = []
    while e.has_work:
        now, _ = step(e, now)
        order += [s.id for s in seqs if s.state == RUNNING and s.id not in order]
    return order


def test_fcfs_ignores_priority():
    e = engine("fcfs", max_num_seqs=1, max_num_batched_tokens=4096)
    seqs = [e.add_request(16, 3, float(t), natural_tokens=3, priority=p) for t, p in enumerate([9, 5, 0])]
    assert admitted_order(e, seqs) == [0, 1, 2]


def test_priority_admits_waiting_requests_lowest_value_first_then_by_arrival():
    e = engine("priority", max_num_seqs=1, max_num_batched_tokens=4096)
    seqs = [e.add_request(16, 3, float(t), natural_tokens=3, priority=p) for t, p in enumerate([9, 5, 0, 5])]
    assert admitted_order(e, seqs) == [2, 1, 3, 0]


def kv_short(policy: str):
    """8 blocks of 16 tokens; three running sequences of 32-token prompts (2 blocks each) grow into a third block
    and the cache runs out: someone must be preempted."""
    e = engine(policy, kv_cache_blocks=8, max_num_batched_tokens=4096, max_model_len=128)
    high_old = e.add_request(32, 60, 0.0, natural_tokens=60, priority=0)
    low = e.add_request(32, 60, 1.0, natural_tokens=60, priority=5)
    high_new = e.add_request(32, 60, 2.0, natural_tokens=60, priority=0)
    now = 0.0
    while e.stats.preemptions == 0:
        now, _ = step(e, now)
    return e, high_old, low, high_new


def test_fcfs_preempts_the_newest_running_request():
    e, high_old, low, high_new = kv_short("fcfs")
    assert high_new.state == WAITING and low.state == RUNNING


def test_priority_preempts_the_worst_running_request_even_if_it_is_not_the_newest():
    e, high_old, low, high_new = kv_short("priority")
    assert low.state == WAITING and low.computed == 0 and low.blocks == 0
    assert high_old.state == RUNNING and high_new.state == RUNNING


def test_a_victim_scheduled_earlier_in_the_step_leaves_the_batch():
    e, high_old, low, high_new = kv_short("priority")
    assert low.preemptions == 1 and all(s is not low for s, _ in e._batch or [])
    # the step that preempted it ran without it: the next one does not schedule it either (no admission in a
    # step that preempted, and the others hold the blocks)
    e.begin_iteration(100.0)
    assert all(s is not low for s, _ in e._batch)


def test_a_preempted_request_waits_in_its_place_by_priority_not_at_the_front():
    e, high_old, low, high_new = kv_short("priority")
    better = e.add_request(16, 5, 50.0, natural_tokens=5, priority=1)
    worse = e.add_request(16, 5, 51.0, natural_tokens=5, priority=9)
    assert list(e.waiting) == [better, low, worse]


def test_requests_run_to_completion_under_priority():
    e = engine("priority", kv_cache_blocks=8, max_num_batched_tokens=4096, max_model_len=128)
    seqs = [e.add_request(32, 40, float(t), natural_tokens=40, priority=p) for t, p in enumerate([3, 1, 2, 0])]
    now = 0.0
    while e.has_work:
        now, _ = step(e, now)
    assert all(s.generated == 40 for s in seqs) and e.free_blocks == 8
    assert e.stats.preemptions >= 1


# --- the API ---

def parse(body: bytes):
    return parse_generation(CHAT, body, (MODEL,), 4096, 16)


def chat(extra: str = "") -> bytes:
    return (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]%s}' % (MODEL.encode(),
                                                                                   extra.encode()))


def test_the_body_priority_is_a_lax_int64():
    assert parse(chat()).priority == 0
    assert parse(chat(', "priority": -3')).priority == -3
    assert parse(chat(', "priority": "7"')).priority == 7
    for bad in ('"high"', "1.5", str(2**63)):
        with pytest.raises(ApiError) as e:
            parse(chat(f', "priority": {bad}'))
        assert e.value.status == 400 and e.value.param == "body.priority"


def test_the_x_vllm_priority_header_overrides_the_body_when_it_is_an_integer():
    assert header_priority("-10", 5) == -10
    assert header_priority("urgent", 5) == 5
    assert header_priority(None, 5) == 5


def test_profiles_and_the_fleet_take_the_scheduling_policy():
    base = load_profile("h100-llama70b-awq")
    assert base.scheduling_policy == "fcfs"
    assert SimFleet(base, scheduling_policy="priority").profile.scheduling_policy == "priority"
    with pytest.raises(ValueError):
        base.with_scheduling_policy("lifo")
    with pytest.raises(ValueError, match="scheduling_policy"):
        profile_from_dict({**{k: getattr(base, k) for k in ("name", "max_model_len", "max_num_seqs",
                                                            "max_num_batched_tokens", "kv_cache_blocks")},
                           "model_names": ["m"], "timing": vars(base.timing) | {},
                           "output_tokens": {"median": 10}, "scheduling_policy": "lifo"})


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
async def test_a_non_zero_priority_is_accepted_under_either_policy_as_vllm_0_32_does(policy):
    async with SimFleet("h100-llama70b-awq", port=0, speed=50, scheduling_policy=policy) as fleet:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "priority": 4}
            async with http.post(fleet.urls[0] + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
            async with http.get(fleet.urls[0] + "/sim/state") as resp:
                assert (await resp.json())["scheduling_policy"] == policy
