"""Generated request bodies for the simulator-vs-vLLM differential test (tests/sim/test_parity_generated.py).

Each case is one field of a valid base body set to one value from a table of valid and invalid values (wrong types,
out of range, null), plus seeded pairs of two such changes. Standard library only: the recorder
(scripts/vllm/record_differential.py) sends them to a real vLLM, the test to the simulator.

Prompts are short and max_tokens small or beyond the whole context, so no outcome hangs on the token count
(the simulator estimates tokens; it has no tokenizer).
"""

from __future__ import annotations

import random

SEED = 45
MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "hello there"}]
PROMPT = "The admission server said"

BASES = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}),
    "responses": ("/v1/responses", {"model": MODEL, "input": "hello there", "max_output_tokens": 3}),
}

# field -> values; "<absent>" deletes the field. Shared by chat and completions unless named in a kind's table.
SAMPLING = {
    "temperature": [0, 0.7, 2.5, -1, "hot", "0.5", None, True],
    "top_p": [0.5, 0, 1.5, -0.1, "x", None],
    "top_k": [5, -1, 0, -2, 2.5, "x", None],
    "min_p": [0.1, -0.1, 1.5, "x"],
    "presence_penalty": [1.0, 2.5, -2.5, "x", None],
    "frequency_penalty": [1.0, 2.5, -2.5, "x"],
    "repetition_penalty": [1.2, 0, -1, "x"],
    "seed": [7, -1, 1.5, "7", "x", None],
    "stop": ["x", ["a", "b"], [], 5, [5], None],
    "stop_token_ids": [[5], "x", [-1], None],
    "n": [1, 2, 0, -1, 1.5, "2", None],
    "max_tokens": [1, "3", 3.0, 3.5, 0, -1, 4096, True, None, "x", "<absent>"],
    "min_tokens": [0, 2, -1, 5, "x", None],
    "ignore_eos": [False, "yes", "maybe", 2, None],
    "stream": [False, "no", "maybe", 2, None],
    "stream_options": [{}, {"include_usage": True}, "x", None],
    "model": ["no-such-model", "tiny-llama-small", 5, None, "", "<absent>"],
    "priority": [0, 5, -5, "1", "x", 1.5, None],
    "user": ["u1", 5, None],
    "logit_bias": [{"5": 1.0}, {"x": 1.0}, {"5": 200}, "x", None],
    "response_format": [{"type": "text"}, {"type": "json_object"}, {"type": "bogus"}, {"type": "json_schema"},
                        "x", None],
    "skip_special_tokens": [False, "x"],
    "include_stop_str_in_output": [True, "x"],
    "truncate_prompt_tokens": [2, -1, 0, 5000, "x"],
    "unknown_field": [1],
}

CHAT_FIELDS = {
    "messages": ["<absent>", [], "x", None, [{"role": "user"}], [{"content": "hi"}],
                 [{"role": "bogus", "content": "hi"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                 [{"role": "assistant", "content": "hi"}], ["hi"]],
    "max_completion_tokens": [2, 0, -1, 4096, "x", None],
    "logprobs": [True, False, "x", 2, None],
    "top_logprobs": [0, 2, 20, 21, -1, "x", None],
    "tool_choice": ["none", "auto", "bogus", None],
    "echo": [True, "x"],
    "add_generation_prompt": [False, "x"],
    "continue_final_message": [True],
    "parallel_tool_calls": [False, "x"],
    "reasoning_effort": ["low", "bogus"],
}

COMPLETIONS_FIELDS = {
    "prompt": ["<absent>", "", [], 5, None, [[]], [1.5], ["a", "b"], [5, 6], [[5, 6], [7]], [-1], [True],
               {"a": 1}],
    "logprobs": [0, 2, 5, 20, 21, -1, True, "x", None],
    "echo": [True, "x", None],
    "suffix": ["end", None, 5],
    "best_of": [1, 2, 0, "x"],
    "use_beam_search": [True],
}

RESPONSES_FIELDS = {
    "input": ["<absent>", "", [], 5, None, [{"role": "user", "content": "hi"}],
              [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], ["hi"]],
    "max_output_tokens": [1, 0, -1, 4096, "x", 3.5, None, "<absent>"],
    "instructions": ["be brief", 5, None],
    "model": ["no-such-model", 5, None, "<absent>"],
    "temperature": [0, 2.5, -1, "x"],
    "top_p": [0.5, 1.5, "x"],
    "stream": [False, "x"],
    "store": [False, True],
    "previous_response_id": ["resp_x"],
    "tools": [[]],
    "unknown_field": [1],
}


def field_tables(kind: str) -> dict:
    if kind == "responses":
        return RESPONSES_FIELDS
    return SAMPLING | (CHAT_FIELDS if kind == "chat" else COMPLETIONS_FIELDS)


def changed(base: dict, changes: list[tuple[str, object]]) -> dict:
    body = dict(base)
    for field, value in changes:
        if value == "<absent>":
            body.pop(field, None)
        else:
            body[field] = value
    return body


def name_of(kind: str, changes: list[tuple[str, object]]) -> str:
    return kind + ":" + ",".join(f"{f}={v!r}" for f, v in changes)


def single_cases() -> dict:
    """Every field of every kind set to each of its values, one at a time."""
    out = {}
    for kind, (path, base) in BASES.items():
        for field, values in field_tables(kind).items():
            for value in values:
                changes = [(field, value)]
                out[name_of(kind, changes)] = {"path": path, "body": changed(base, changes), "fields": [field]}
    return out


def pair_cases(count: int = 60, seed: int = SEED) -> dict:
    """Seeded pairs of changes on two fields (which check comes first when both are wrong)."""
    rng = random.Random(seed)
    out: dict = {}
    kinds = sorted(k for k in BASES if k != "responses")
    while len(out) < count:
        kind = rng.choice(kinds)
        path, base = BASES[kind]
        tables = field_tables(kind)
        f1, f2 = rng.sample(sorted(tables), 2)
        changes = [(f1, rng.choice(tables[f1])), (f2, rng.choice(tables[f2]))]
        out.setdefault(name_of(kind, changes), {"path": path, "body": changed(base, changes), "fields": [f1, f2]})
    return out


def stream_cases() -> dict:
    """Streams whose framing, event kinds and usage placement a client reads."""
    chat_path, chat = BASES["chat"]
    comp_path, comp = BASES["completions"]
    options = [None, {}, {"include_usage": True}, {"include_usage": False}, {"include_usage": None},
               {"continuous_usage_stats": True}, {"include_usage": True, "continuous_usage_stats": True},
               {"include_usage": False, "continuous_usage_stats": True}]
    out = {}
    for kind, path, base in (("chat", chat_path, chat), ("completions", comp_path, comp)):
        for opt in options:
            body = dict(base, stream=True) | ({"stream_options": opt} if opt is not None else {})
            out[f"{kind}:stream,stream_options={opt!r}"] = {"path": path, "body": body}
        out[f"{kind}:stream,n=2"] = {"path": path, "body": dict(base, stream=True, n=2, temperature=1.0,
                                                                stream_options={"include_usage": True})}
        out[f"{kind}:stream,max_tokens=1"] = {"path": path, "body": dict(base, stream=True, max_tokens=1)}
        out[f"{kind}:stream,no_max_tokens_unknown_model"] = {
            "path": path, "body": {k: v for k, v in base.items() if k != "max_tokens"} | {"stream": True,
                                                                                      "model": "nope"}}
        out[f"{kind}:stream,max_tokens=4096"] = {"path": path, "body": dict(base, stream=True, max_tokens=4096)}
        out[f"{kind}:stream,stream_options=x"] = {"path": path, "body": dict(base, stream=True, stream_options="x")}
    return out


# What is inside the fields that say what runs (a prompt list's entries, a message's content by its role, the
# Responses API's input items): the bodies vLLM refuses before running anything, which the gateway refuses before
# admission (tests/unit/test_vllm_body_parity.py), and their near misses it runs. Not in field_tables: the seeded
# pairs stay the ones recorded before these were added.
CONTENT_ROLES = ("user", "assistant", "system", "bogus")
CONTENTS = [True, 1.5, None, {}, {"type": "text", "text": "hi"}, [], ["hi"], [5], [None], [["hi"]], [{"type": "text"}]]
ITEM_VALUES = {
    "completions": {"prompt": [[[5], []], [[], [5]], [5, "a"], [5, "6"], ["5", 6], [[5], "a"], [[[5]]], [None],
                               [{}], [[1.5]], [[True]], ["a", [5]], [[5, -1]], [5.0], ["a", ""], [""], ["+5", 6],
                               [" 5 ", 6], ["5.0", 6], ["5e0", 6], ["1_0", 6], [5, "0x1"], [[5, "6"]],
                               [[5], [6, "x"]], [-0.0, 5], [5, False], ["a", None], [[5], None], ["-1", 6]]},
    "chat": {"messages": [[{"role": role, "content": content}] for role in CONTENT_ROLES for content in CONTENTS]
             + [[{"role": "function", "name": "f", "content": None}], [{"role": "function", "content": None}],
                [{"role": "developer", "content": None}], [{"role": "tool", "content": None}],
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": []}]]},
    "responses": {"input": [{}, {"role": "user", "content": "hi"}, [5], [{}], True, [None], [[]],
                            [{"role": "user", "content": 5}], [{"role": "user"}],
                            [{"type": "message", "role": "user", "content": "hi"}]]},
}


def item_cases() -> dict:
    out = {}
    for kind, fields in ITEM_VALUES.items():
        path, base = BASES[kind]
        for field, values in fields.items():
            for value in values:
                changes = [(field, value)]
                out[name_of(kind, changes)] = {"path": path, "body": changed(base, changes), "fields": [field]}
    return out


TOKENIZE_BODIES = {
    "prompt": [PROMPT, "", [], [[]], ["a", "b"], [5, 6], 5, None, "<absent>"],
    "messages": [MESSAGES, [], "x", None],
    "add_special_tokens": [False, "x"],
    "model": ["no-such-model", None, "<absent>"],
}


def tokenize_cases() -> dict:
    """/tokenize: a prompt body's fields one at a time, and a chat body's messages."""
    out = {}
    for field, values in TOKENIZE_BODIES.items():
        base = {"model": MODEL, "messages": MESSAGES} if field == "messages" else {"model": MODEL, "prompt": PROMPT}
        for value in values:
            changes = [(field, value)]
            out[name_of("tokenize", changes)] = {"path": "/tokenize", "body": changed(base, changes),
                                                 "fields": [field]}
    return out


# The output caps when a body sets more than one, or one beside what changes its reading: chat's
# max_completion_tokens x its deprecated max_tokens (vLLM obeys the first that is not null and only type-checks the
# other), completions' max_tokens with echo (0 scores the prompt), the Responses API's max_output_tokens. 4096 is
# beyond the context, 10**20 beyond any integer vLLM's engine holds.
TOKEN_CAPS = [3, 0, -1, None, "<absent>", "x", 4096, 10**20]


def token_cap_cases() -> dict:
    out = {}
    chat_path, chat = BASES["chat"]
    for completion_cap in TOKEN_CAPS:
        for cap in TOKEN_CAPS:
            changes = [("max_completion_tokens", completion_cap), ("max_tokens", cap)]
            out[name_of("chat", changes)] = {"path": chat_path, "body": changed(chat, changes),
                                             "fields": ["max_completion_tokens", "max_tokens"]}
    comp_path, comp = BASES["completions"]
    for echo in (True, "yes", False):
        for cap in TOKEN_CAPS + ["0", 0.0, False]:
            changes = [("echo", echo), ("max_tokens", cap)]
            out[name_of("completions", changes)] = {"path": comp_path, "body": changed(comp, changes),
                                                    "fields": ["echo", "max_tokens"]}
    resp_path, resp = BASES["responses"]
    for cap in (10**20, "3", True, False):
        changes = [("max_output_tokens", cap)]
        out[name_of("responses", changes)] = {"path": resp_path, "body": changed(resp, changes),
                                              "fields": ["max_output_tokens"]}
    return out


def all_cases() -> tuple[dict, dict]:
    """(JSON cases, stream cases), each {name: {"path", "body", "fields"}}."""
    return single_cases() | pair_cases() | tokenize_cases() | item_cases() | token_cap_cases(), stream_cases()
