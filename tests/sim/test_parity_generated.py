"""The simulator against real vLLM 0.32 on generated request bodies: tests/fixtures/vllm/differential.json
(`python3 -m scripts.vllm.record_differential`; the bodies come from scripts/vllm/differential_cases.py, seeded).

Each body is one field of a valid chat, completions or Responses request set to a valid or invalid value (wrong
type, out of range, null, absent), or a seeded pair of such changes; the streams vary `stream_options`. Compared
with what vLLM answered: the status, the JSON shape, an error's whole body (`error.message/type/param/code`), the
finish reasons of a 200; a stream's framing, event kinds, where `usage` rides and the finish reasons; and each
`vllm:` family the simulator exposes, by type and label names. Generated text and timing are not compared.

What the simulator is known not to do (docs/simulator.md) is listed in UNCHECKED_FIELDS, by field: a case that
sets one of them is skipped, and each entry must still excuse a real difference (so a fix shrinks the list). Where
vLLM reports several validation errors at once, the simulator reports one of them (its first check).
"""

from __future__ import annotations

import json
import re

import aiohttp
import pytest

from extproc.tools.sim.fleet import SimFleet
from scripts.vllm.differential_cases import item_cases
from scripts.vllm.record_differential import json_answer, stream_answer
from scripts.vllm.record_fixtures import parse_metrics
from tests.sim.test_parity import PROFILE, load

RECORDED = load("differential.json")

# kind:field -> why the simulator answers it otherwise. Fields it does not type-check or model.
_NOT_VALIDATED = "not type-checked by the simulator (it ignores the field)"
UNCHECKED_FIELDS = {
    **{f"{kind}:{field}": _NOT_VALIDATED for kind in ("chat", "completions")
       for field in ("stop", "stop_token_ids", "user", "logit_bias", "response_format", "skip_special_tokens",
                     "include_stop_str_in_output", "truncate_prompt_tokens")},
    **{f"chat:{field}": _NOT_VALIDATED for field in ("add_generation_prompt", "continue_final_message",
                                                      "parallel_tool_calls", "reasoning_effort")},
    "chat:echo": "chat echo is not served (docs/simulator.md)",
    "chat:messages": "messages are checked only for what the token estimate needs, not as vLLM's message models",
    "chat:logprobs": "a generated token's `bytes` can be empty in vLLM (text)",
    "completions:prompt": "prompts are checked only for what the token estimate needs (no vocabulary)",
    "completions:logprobs": "-1 means the whole vocabulary, whose size the simulator does not know",
    "completions:suffix": _NOT_VALIDATED,
    "responses:input": "input items are read as chat messages, not checked as vLLM's item models",
    "responses:instructions": _NOT_VALIDATED,
    "responses:max_output_tokens": "without it the length is where the model stops (text)",
    "responses:previous_response_id": "no response store",
}
# Entries whose difference hangs on the generated text: a re-recording may not show it, so they may excuse nothing.
TEXT_DEPENDENT = {"chat:logprobs", "responses:max_output_tokens"}
# Streams whose differences are timing: with n > 1 vLLM may finish one choice before the other's last token.
TIMING_STREAMS = {"chat:stream,n=2", "completions:stream,n=2"}

MANY_ERRORS = re.compile(r"^\d+ validation errors:\n")


async def post(http, url: str, case: dict) -> tuple[int, bytes]:
    async with http.post(url + case["path"], data=json.dumps(case["body"]).encode(),
                         headers={"content-type": "application/json"}) as r:
        return r.status, await r.read()


def one_of_many(want: dict, got: dict) -> bool:
    """vLLM listed several validation errors; the simulator answered with one of them."""
    real, sim = (want.get("body") or {}).get("error", {}), (got.get("body") or {}).get("error", {})
    if not MANY_ERRORS.match(real.get("message", "")) or sim.get("type") != real.get("type"):
        return False
    detail = sim.get("message", "").partition("\n")[2].strip()
    return want["status"] == got["status"] and detail in [line.strip() for line in real["message"].splitlines()[1:]]


def differences(name: str, want: dict, got: dict) -> list[str]:
    if one_of_many(want, got):
        return []
    keys = sorted((set(want) | set(got)) - {"request"})
    return [f"{name}: {k}: sim {got.get(k)!r} != vLLM {want.get(k)!r}" for k in keys if got.get(k) != want.get(k)]


def excuse(name: str, case: dict) -> str | None:
    kind = name.split(":", 1)[0]
    return next((f"{kind}:{f}" for f in case.get("fields", []) if f"{kind}:{f}" in UNCHECKED_FIELDS), None)


@pytest.fixture
async def sim():
    async with SimFleet(PROFILE, replicas=1, port=0, speed=50) as fleet, aiohttp.ClientSession() as http:
        yield fleet.urls[0], http


async def test_generated_bodies_answered_as_vllm(sim):
    url, http = sim
    found: list[str] = []
    excused_and_differing: set[str] = set()
    for name, want in RECORDED["cases"].items():
        status, payload = await post(http, url, want["request"])
        diff = differences(name, want, json_answer(status, payload))
        reason = excuse(name, want["request"])
        if reason is None:
            found += diff
        elif diff:
            excused_and_differing.add(reason)
    assert not found, f"{len(found)} differences:\n" + "\n".join(found)
    stale = sorted(set(UNCHECKED_FIELDS) - excused_and_differing - TEXT_DEPENDENT)
    assert not stale, f"UNCHECKED_FIELDS entries that no longer excuse any difference (remove them): {stale}"


async def test_generated_streams_framed_as_vllm(sim):
    url, http = sim
    found: list[str] = []
    for name, want in RECORDED["streams"].items():
        status, raw = await post(http, url, want["request"])
        got = stream_answer(status, raw)
        if name in TIMING_STREAMS:  # the same events, in an order timing decides
            want = want | {"sequence": sorted(want["sequence"]), "usage": sorted(want["usage"])}
            got = got | {"sequence": sorted(got["sequence"]), "usage": sorted(got["usage"])}
            want, got = ({k: v for k, v in d.items() if k not in ("sequence", "usage")} | {
                "kinds": sorted({s.rstrip("*") for s in d["sequence"]})} for d in (want, got))
        found += differences(name, want, got)
    assert not found, f"{len(found)} differences:\n" + "\n".join(found)


async def test_metric_families_typed_and_labelled_as_vllm(sim):
    """Every vllm: family the simulator writes (those the ext_proc scrapes among them) exists in vLLM 0.32 with
    the same type and label names."""
    url, http = sim
    async with http.get(url + "/metrics") as r:
        families = {k: v for k, v in parse_metrics(await r.text()).items() if k.startswith("vllm:")}
    real = RECORDED["metrics"]
    found = [f"{name}: sim {fam['type']} {fam['labels']} != vLLM "
             f"{real.get(name, {}).get('type')} {real.get(name, {}).get('labels')}"
             for name, fam in families.items() if (fam["type"], fam["labels"]) != (real.get(name, {}).get("type"),
                                                                                   real.get(name, {}).get("labels"))]
    assert not found, "\n".join(found)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:request_success_total"} <= set(families)


# The bodies of differential_cases.item_cases (what is inside a prompt list, a message's content, Responses input)
# that the simulator answers with another status than vLLM: which content parts a role's message type takes, as
# docs/simulator.md says. Their messages are not compared (UNCHECKED_FIELDS: completions:prompt, chat:messages,
# responses:input); their status is, since the gateway's refusals before admission are checked against it.
ITEM_STATUS_DIFFERENCES = {
    *(f"chat:messages=[{{'role': '{role}', 'content': [{{'type': 'text'}}]}}]" for role in ("user", "assistant",
                                                                                          "system")),
    "chat:messages=[{'role': 'bogus', 'content': {}}]", "chat:messages=[{'role': 'bogus', 'content': ['hi']}]",
    "chat:messages=[{'role': 'function', 'content': None}]",
}


async def test_what_is_inside_a_prompt_list_messages_or_input_is_refused_or_served_as_vllm_does(sim):
    url, http = sim
    names = list(item_cases())
    assert ITEM_STATUS_DIFFERENCES <= set(names)
    wrong, still_differing = [], set()
    for name in names:
        want = RECORDED["cases"][name]
        status, _ = await post(http, url, want["request"])
        if status != want["status"]:
            if name in ITEM_STATUS_DIFFERENCES:
                still_differing.add(name)
            else:
                wrong.append(f"{name}: sim {status}, vLLM {want['status']}")
    assert not wrong, "\n".join(wrong)
    assert still_differing == ITEM_STATUS_DIFFERENCES, sorted(ITEM_STATUS_DIFFERENCES - still_differing)
