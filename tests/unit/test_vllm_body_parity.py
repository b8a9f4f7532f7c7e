"""parse_body reads a body as vLLM 0.32 reads it: the table of tests/fixtures/vllm/body_readings.json, ~1,100
generated bodies and what vLLM's own request models, validators and to_sampling_params made of each (recorded by
scripts/vllm/body_readings.py with the vLLM venv; no vLLM needed here).

For every body vLLM runs, the gateway admits it (or refuses it for a reason listed in REFUSED_ON_PURPOSE) and reads
the same kind, sequences, prompts, output cap, output floor, prompt truncation, stream and beam search, except where
it reads more (OVER_READ: charged more than vLLM runs, never less). Anything else is a way to run more than was
admitted, or a body refused that vLLM would serve."""

from __future__ import annotations

import json
from pathlib import Path

from extproc.server.openai import ENDPOINTS, BadRequest, RequestBody, parse_body

TABLE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "body_readings.json").read_text())
CASES = TABLE["cases"]
RUN_BY_VLLM = [c for c in CASES if "refused" not in c["vllm"]]
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def raw(case: dict) -> bytes:
    return case["body"].encode(case.get("encoding", "utf-8"))


def doc_of(case: dict) -> dict:
    return json.loads(raw(case))


def read(case: dict) -> RequestBody:
    return parse_body(raw(case), ENDPOINTS[case["path"]], "priority", {"interactive", "batch"})


def ours(body: RequestBody) -> dict:
    """The gateway's reading in the table's terms (its sequences are all prompts' together)."""
    return {"kind": body.endpoint.kind, "sequences": body.sequences, "prompts": body.prompts,
            "max_tokens": body.max_tokens, "min_output": body.min_output, "truncate_prompt_tokens": body.prompt_cap,
            "stream": body.stream, "beam_search": body.beam_search}


def theirs(case: dict) -> dict:
    v = case["vllm"]
    return {"kind": v["kind"], "sequences": v["sequences"] * v["prompts"], "prompts": v["prompts"],
            "max_tokens": v["max_tokens"], "min_output": v["min_output"],
            "truncate_prompt_tokens": v["truncate_prompt_tokens"], "stream": v["stream"],
            "beam_search": v["beam_search"]}


def _cap_vllm_does_not_run(case: dict, e: BadRequest) -> bool:
    """A cap below 1 under beam search, which then runs no step. (A cap below 1 beside the one vLLM obeys, chat's
    max_tokens beside a max_completion_tokens, is not refused: vLLM runs the body.)"""
    value = doc_of(case).get(e.param)
    return case["vllm"]["beam_search"] and e.param in TOKEN_FIELDS and type(value) in (int, float) and value < 1


def _both_kinds(case: dict, e: BadRequest) -> bool:
    """/invocations with `messages` and a prompt: vLLM runs it as completions when its chat reading fails
    validation, which cannot be told here (extproc/server/openai.py, _invocation_kind)."""
    return case["path"] == "/invocations" and e.param == "messages"


def _nothing_to_render(case: dict, e: BadRequest) -> bool:
    """`"messages": []`, `"prompt": []` without prompt_embeds, or a prompt list holding an empty list of token ids:
    vLLM's request model takes them, and its renderer (its engine, for the empty token list) refuses them with 400
    before anything runs (differential.json's chat:messages=[], completions:prompt=[] and =[[]], api.json's
    prompt_empty_list). Admitted, each held a slot until that 400; they are refused before admission."""
    value = doc_of(case).get(e.param)
    return e.param in ("messages", "prompt") and (value == [] or (e.param == "prompt" and [] in value))


REFUSED_ON_PURPOSE = (_cap_vllm_does_not_run, _both_kinds, _nothing_to_render)


def _truncation_to_nothing(case: dict, field: str, mine, vllms) -> bool:
    """truncate_prompt_tokens 0 (vLLM's model takes it): charged the whole prompt, not none of it."""
    return field == "truncate_prompt_tokens" and vllms == 0 and mine is None


def _one_token_is_all_of_it(case: dict, field: str, mine, vllms) -> bool:
    """A cap of 1 (prompt scoring: echo, max_tokens 0) runs its one token whatever the floor says: read as forced."""
    return field == "min_output" and mine is None and case["vllm"]["max_tokens"] == 1


OVER_READ = (_truncation_to_nothing, _one_token_is_all_of_it)


def differences(case: dict) -> list[str]:
    """How the gateway's reading of a body vLLM runs differs from vLLM's, allowed over-reads left out."""
    try:
        body = read(case)
    except BadRequest as e:
        if any(allowed(case, e) for allowed in REFUSED_ON_PURPOSE):
            return []
        return [f"refused ({e.param}: {e.message})"]
    mine, vllms = ours(body), theirs(case)
    return [f"{field}: ours {mine[field]!r}, vLLM's {vllms[field]!r}" for field in vllms
            if mine[field] != vllms[field] and not any(o(case, field, mine[field], vllms[field]) for o in OVER_READ)]


def test_the_table_is_vllms_and_large_enough_to_mean_something():
    assert TABLE["vllm"] == "0.32.0"
    kinds = {c["vllm"]["kind"] for c in RUN_BY_VLLM}
    assert kinds == {"chat", "completions", "responses"}
    assert len(RUN_BY_VLLM) > 400 and len(CASES) - len(RUN_BY_VLLM) > 200
    assert sum(c["path"] == "/invocations" and c["vllm"]["kind"] == "completions" for c in RUN_BY_VLLM) >= 20


def test_every_body_vllm_runs_is_read_as_vllm_reads_it():
    wrong = {c["body"][:160]: d for c in RUN_BY_VLLM if (d := differences(c))}
    shown = "\n".join(f"{body}\n    {diff}" for body, diff in wrong.items())
    assert not wrong, f"{len(wrong)} bodies read unlike vLLM:\n{shown}"


def test_a_body_vllm_refuses_is_a_400_or_a_reading_here_never_an_error():
    # vLLM answers these itself; the gateway may admit them (vLLM then refuses) but must not fail on them.
    refused = [c for c in CASES if "refused" in c["vllm"]]
    for case in refused:
        try:
            read(case)
        except BadRequest as e:
            assert 400 <= e.status < 500, case["body"]


def _refused_for_its_messages_or_prompt(case: dict) -> bool:
    """A body vLLM refuses for its `messages` (not a list it can loop over) or its prompt (none to run). On
    /invocations, only the former (the latter is also what its completions reading says of a chat body that failed
    validation for another field), and not beside an `input` (a pooling model serves that as embeddings)."""
    why = case["vllm"].get("refused", "")
    if case["path"] == "/invocations":
        return "not iterable" in why and "input" not in doc_of(case)
    return "not iterable" in why or "Either prompt or prompt_embeds" in why


def test_a_body_vllm_refuses_for_its_messages_or_prompt_is_refused_before_admission():
    # Admitted, a chat with `messages: null` or a completions request with `prompt: null` held a slot (and was
    # charged) until the replica answered 400.
    cases = [c for c in CASES if _refused_for_its_messages_or_prompt(c)]
    assert len(cases) >= 15 and {c["path"] for c in cases} == {"/v1/chat/completions", "/v1/completions",
                                                                 "/invocations"}
    admitted = []
    for case in cases:
        try:
            read(case)
            admitted.append(case["body"][:160])
        except BadRequest as e:
            assert (e.status, e.code) == (400, "invalid_body"), case["body"]
    assert not admitted, "\n".join(admitted)


# What real vLLM 0.32 answered (tests/fixtures/vllm/differential.json, scripts/vllm/differential_cases.py) to bodies
# that change the field saying what runs: its prompt list's entries, a message's content by role, Responses input.
DIFFERENTIAL = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm" / "differential.json")
                          .read_text())["cases"]
RUN_FIELD = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}


def _refusing_param(request: dict) -> str | None:
    try:
        parse_body(json.dumps(request["body"]).encode(), ENDPOINTS[request["path"]], "priority",
                   {"interactive", "batch"})
    except BadRequest as e:
        assert (e.status, e.code) == (400, "invalid_body"), request["body"]
        return e.param
    return None


def _left_to_vllm(request: dict) -> bool:
    """What vLLM refuses inside the field that the gateway leaves it to refuse (admitted, it holds a slot until
    vLLM's 400): which parts a role takes and what a part or a Responses item holds (a union of dozens of types,
    one of them lazily validated), a function message's missing name, an empty object as a custom role's content,
    and a token-id string that Python's int() or float() reads but pydantic does not ("5e0")."""
    value = request["body"][RUN_FIELD[request["path"]]]
    if type(value) is not list or not value:
        return False
    if request["path"] == "/v1/completions":
        return any(type(t) is str and "e" in t.lower() for t in value)
    if request["path"] == "/v1/responses":
        return all(type(item) is dict for item in value)
    message = value[-1]
    content = message.get("content") if type(message) is dict else 0
    return (type(content) is list and all(type(p) in (dict, str) for p in content)) or \
        (content == {} and message["role"] == "bogus") or (content is None and message["role"] == "function")


def test_vllm_runs_every_body_the_gateway_admits_for_what_runs_and_refuses_the_rest_before_running():
    # Admitted, `prompt: [5, "a"]`, `[[5], []]`, a message content of 5 or a Responses `input` of 5 each held a slot
    # (and was charged) until vLLM answered 400; a body vLLM serves (`[5, "6"]`, `[true]`, an assistant's null
    # content, `content: {}` for a user) must stay admitted.
    cases = {name: c for name, c in DIFFERENTIAL.items() if c["request"]["path"] in RUN_FIELD
             and c["request"]["fields"] == [RUN_FIELD[c["request"]["path"]]]}
    assert len(cases) >= 100 and sum(c["status"] == 200 for c in cases.values()) >= 30
    refused_run, admitted_refused = [], []
    for name, case in cases.items():
        request = case["request"]
        refused = _refusing_param(request) == RUN_FIELD[request["path"]]
        if case["status"] == 200 and refused:
            refused_run.append(name)
        if case["status"] != 200 and not refused and not _left_to_vllm(request):
            admitted_refused.append(name)
    assert not refused_run, f"refused, but vLLM runs them: {refused_run}"
    assert not admitted_refused, f"admitted, but vLLM refuses them before running anything: {admitted_refused}"


CAP_FIELDS = {*TOKEN_FIELDS, "echo"}


def test_output_caps_are_refused_exactly_where_vllm_refuses_them():
    # differential.json's token_cap_cases (chat's max_completion_tokens x max_tokens, completions' max_tokens with
    # echo, the Responses API's max_output_tokens) and the single-field ones. `max_tokens: 0` or `-1` beside a
    # valid max_completion_tokens was refused here, and vLLM runs it (it obeys max_completion_tokens). A cap beyond
    # the context is vLLM's 400 too, but the gateway needs the model's context for it: admission refuses it
    # (tests/unit/test_stream.py), so parse_body may let it through.
    cases = {name: c for name, c in DIFFERENTIAL.items() if c["request"]["path"] in RUN_FIELD
             and set(c["request"]["fields"]) <= CAP_FIELDS and set(c["request"]["fields"]) & set(TOKEN_FIELDS)}
    assert len(cases) >= 100 and sum(c["status"] == 200 for c in cases.values()) >= 30
    refused_run, admitted_refused = [], []
    for name, case in cases.items():
        param = _refusing_param(case["request"])
        assert param is None or param in case["request"]["fields"], (name, param)
        if case["status"] == 200 and param is not None:
            refused_run.append(name)
        beyond_context = "cannot be greater than max_model_len" in json.dumps(case.get("body"))
        if case["status"] != 200 and param is None and not beyond_context:
            admitted_refused.append(name)
    assert not refused_run, f"refused, but vLLM runs them: {refused_run}"
    assert not admitted_refused, f"admitted, but vLLM refuses them before running anything: {admitted_refused}"
