"""vLLM's LoRA adapters as its OpenAI server shows them, without I/O: `--lora-modules` at start-up, the runtime
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING), and the
adapters' cards in `/v1/models` (`root` their path, `parent` their base model).

An adapter here is a name and a path: no weights are read, and a request for it runs on the replica's engine at
the base model's speed, which is what an adapter costs on vLLM (a small extra per step that the profile's timing
already averages in). A runtime load checks only that a local path holds an adapter_config.json, as vLLM finds
out when it reads the adapter."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from extproc.tools.sim.openai_api import ApiError, _bool_field, validation_error

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
        self._last_id = 0  # vLLM's counter: an unloaded adapter's id is never given again
        for a in modules:
            self._add(self._based(a))

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def _add(self, a: Adapter) -> None:
        self.adapters[a.name] = a
        if a.name not in self.ids:
            self._last_id += 1
            self.ids[a.name] = self._last_id

    def parent(self, a: Adapter) -> str:
        return a.base or self.served[0]

    def _based(self, a: Adapter) -> Adapter:
        # vLLM keeps a base_model_name only when it is one of the served names; otherwise the first is the parent.
        return a if a.base in self.served else Adapter(a.name, a.path)

    def load(self, raw: bytes) -> str:
        """POST /v1/load_lora_adapter: the success text, or ApiError as vLLM answers."""
        body = _json_object(raw)
        name, path = _str_field(body, "lora_name"), _str_field(body, "lora_path")
        inplace = _bool_field(body, "load_inplace")  # pydantic's lax boolean, as vLLM reads it: "false" is False
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.adapters and not inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                f"adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        if not_an_adapter(path):
            # vLLM 0.32 (recorded): 404 and nothing added, the message's path hidden as its error handler hides it.
            raise ApiError(404, _hide_paths(f"Loading lora {name} failed: No adapter found for {path}"),
                           "NotFoundError")
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


def not_an_adapter(path: str) -> bool:
    """True when vLLM would find no adapter at `path`: an absolute (or ~) path, or a relative one that exists, is
    read from disk and must hold an adapter_config.json. Any other name is a hub id, which vLLM downloads and the
    simulator, without a hub, takes as found."""
    local = os.path.expanduser(path)
    if not (os.path.isabs(local) or os.path.exists(local)):
        return False
    return not os.path.isfile(os.path.join(local, "adapter_config.json"))


# vLLM's error handler replaces paths in messages by "<path>": those under the usual system roots, and any path
# that ends in a file name with an extension.
_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


def _hide_paths(message: str) -> str:
    return _FILE_PATH.sub("<path>", _SYSTEM_PATH.sub("<path>", message)).strip()


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
