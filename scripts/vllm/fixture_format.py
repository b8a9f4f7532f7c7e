"""The shape description used by the vLLM parity fixtures (tests/fixtures/vllm/). Standard library only.

``shape(value)`` turns a decoded JSON value into its type tree, the thing a parity test compares:

* dict  -> ``{key: shape(v) for every key}`` (all keys, sorted)
* list  -> ``[]`` when empty, else ``[shape]`` when every element has the same shape, else
           ``["<mixed>", shape_1, shape_2, ...]`` (distinct shapes in first-seen order)
* str -> ``"str"``, bool -> ``"bool"``, int -> ``"int"``, float -> ``"float"``, None -> ``"null"``

A simulator response matches a fixture when ``shape(sim_body) == fixture["shape"]``. Values that vary run to run
(ids, timestamps, generated text) are replaced in the recorded ``body`` by placeholders such as
``"chatcmpl-<hex>"`` or ``"<unix-seconds>"``; their real type stays in ``shape`` and their format in ``formats``
(a regular expression per JSON path, e.g. ``"$.id": "^chatcmpl-[0-9a-f]+$"``).
"""

from __future__ import annotations

import json
import re
from typing import Any


def shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: shape(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        shapes: list = []
        for item in value:
            s = shape(item)
            if s not in shapes:
                shapes.append(s)
        if not shapes:
            return []
        return shapes if len(shapes) == 1 else ["<mixed>", *shapes]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def key_paths(value: Any, prefix: str = "$") -> list[str]:
    """Every JSON path in ``value`` (``$.choices[].message.content`` style), sorted; handy for diffs."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += key_paths(v, f"{prefix}.{k}")
    elif isinstance(value, list):
        for v in value:
            out += key_paths(v, f"{prefix}[]")
    return sorted(set(out))


# Volatile fields: JSON path (list indices as []) -> (placeholder, regular expression of the real value).
VOLATILE = {
    "$.id": None,  # decided by prefix below
    "$.created": ("<unix-seconds>", r"^[0-9]{9,11}$"),
    "$.system_fingerprint": ("vllm-<version>-<hex>", r"^vllm-[0-9][0-9A-Za-z.+-]*-[0-9a-f]+$"),
    "$.choices[].message.content": ("<generated text>", None),
    "$.choices[].text": ("<generated text>", None),
    "$.choices[].delta.content": ("<generated text>", None),
    "$.data[].created": ("<unix-seconds>", r"^[0-9]{9,11}$"),
    "$.data[].root": ("<model dir>", None),
    "$.data[].permission[].id": ("modelperm-<hex>", r"^modelperm-[0-9a-f]+$"),
    "$.data[].permission[].created": ("<unix-seconds>", r"^[0-9]{9,11}$"),
    # The Responses API (bodies and the typed events of its stream).
    "$.created_at": ("<unix-seconds>", r"^[0-9]{9,11}$"),
    "$.response.id": ("resp_<hex>", r"^resp_[0-9a-f]+$"),
    "$.response.created_at": ("<unix-seconds>", r"^[0-9]{9,11}$"),
    "$.output[].id": ("msg_<hex>", r"^msg_[0-9a-f]+$"),
    "$.response.output[].id": ("msg_<hex>", r"^msg_[0-9a-f]+$"),
    "$.item.id": ("msg_<hex>", r"^msg_[0-9a-f]+$"),
    "$.item_id": ("msg_<hex>", r"^msg_[0-9a-f]+$"),
    "$.output[].content[].text": ("<generated text>", None),
    "$.response.output[].content[].text": ("<generated text>", None),
    "$.item.content[].text": ("<generated text>", None),
    "$.part.text": ("<generated text>", None),
    "$.delta": ("<generated text>", None),
    "$.text": ("<generated text>", None),
}
ID_PATTERNS = [("chatcmpl-", r"^chatcmpl-[0-9a-f]+$"), ("cmpl-", r"^cmpl-[0-9a-f]+$"), ("resp_", r"^resp_[0-9a-f]+$")]


def normalize(value: Any, prefix: str = "$", formats: dict | None = None) -> Any:
    """Copy ``value`` with volatile fields replaced by placeholders; record their formats in ``formats``."""
    if isinstance(value, dict):
        return {k: normalize(v, f"{prefix}.{k}", formats) for k, v in value.items()}
    if isinstance(value, list):
        return [normalize(v, f"{prefix}[]", formats) for v in value]
    if prefix == "$.id" and isinstance(value, str):
        for head, pattern in ID_PATTERNS:
            if value.startswith(head) and re.match(pattern, value):
                if formats is not None:
                    formats[prefix] = pattern
                return f"{head}<hex>"
        return value
    rule = VOLATILE.get(prefix)
    if rule and value is not None and not (isinstance(value, str) and value == ""):
        placeholder, pattern = rule
        if formats is not None and pattern:
            formats[prefix] = pattern
        return placeholder
    return value


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, ensure_ascii=False) + "\n"
