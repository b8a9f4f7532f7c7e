"""vLLM's LoRA adapters as its OpenAI server shows them, without I/O: `--lora-modules` at start-up, the runtime
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING), and the
adapters' cards in `/v1/models` (`root` their path, `parent` their base model).

An adapter here is a name and a path: no weights are read, and a request for it runs on the replica's engine at
the base model's speed, which is what an adapter costs on vLLM (a small extra per step that the profile's timing
already averages in)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from extproc.tools.sim.openai_api import ApiError, validation_error

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    base: str | None = None  # `base_model_name` when one of the served names was given, else the first served


def parse_module(spec: str) -> Adapter:
    """One `--lora-modules` value as vLLM reads it: `name=path`, or a JSON object with `name`, `path` and an
    optional `base_model_name`."""
    if spec.lstrip().startswith("{"):
        try:
            doc = json.loads(spec)
            return Adapter(str(doc["name"]), str(doc["path"]), doc.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"invalid LoRA module {spec!r}: {exc}") from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"invalid LoRA module {spec!r}: expected name=path or a JSON object")
    return Adapter(name, path)


def runtime_updating_from_env() -> bool:
    """vLLM reads the variable as "1"/"true" (any case) for on."""
    return os.environ.get(RUNTIME_ENV, "0").strip().lower() in ("1", "true")


class LoraRegistry:
    """The adapters one replica serves, by name, in the order they were loaded."""

    def __init__(self, served: tuple[str, ...], modules: list[Adapter] = ()):
        self.served = served
        self.adapters: dict[str, Adapter] = {}
        self.ids: dict[str, int] = {}  # vLLM's lora_int_id: from 1, kept by a load in place
        for a in modules:
            self._add(self._based(a))

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def _add(self, a: Adapter) -> None:
        self.adapters[a.name] = a
        self.ids.setdefault(a.name, max(self.ids.values(), default=0) + 1)

    def parent(self, a: Adapter) -> str:
        return a.base or self.served[0]

    def _based(self, a: Adapter) -> Adapter:
        # vLLM keeps a base_model_name only when it is one of the served names; otherwise the first is the parent.
        return a if a.base in self.served else Adapter(a.name, a.path)

    def load(self, raw: bytes) -> str:
        """POST /v1/load_lora_adapter: the success text, or ApiError as vLLM answers."""
        body = _json_object(raw)
        name, path = _str_field(body, "lora_name"), _str_field(body, "lora_path")
        inplace = bool(body.get("load_inplace", False))
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.adapters and not inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                f"adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        self._add(Adapter(name, path))
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, raw: bytes) -> str:
        """POST /v1/unload_lora_adapter."""
        name = _str_field(_json_object(raw), "lora_name")
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if self.adapters.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.ids[name]
        return f"Success: LoRA adapter '{name}' removed successfully."


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise validation_error("json_invalid", "body.0", "JSON decode error", {}, {"error": str(exc)}) from None
    if not isinstance(body, dict):
        raise validation_error("model_attributes_type", "body", "Input should be a valid dictionary or object to "
                               "extract fields from", body)
    return body


def _str_field(body: dict, name: str) -> str:
    value = body.get(name)
    if name not in body:
        raise validation_error("missing", f"body.{name}", "Field required", body)
    if not isinstance(value, str):
        raise validation_error("string_type", f"body.{name}", "Input should be a valid string", value)
    return value
