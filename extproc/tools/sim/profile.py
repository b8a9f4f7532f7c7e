"""Replica profiles: the engine's limits, timing coefficients and output-length model, loaded from YAML."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Timing:
    """Iteration time: base + per decode sequence (times its cost) + per prefill token + per KV token read."""

    base_s: float
    per_decode_seq_s: float
    per_prefill_token_s: float
    per_context_token_s: float = 0.0

    def iteration_s(self, decode_cost: float, prefill_tokens: int, context_tokens: int) -> float:
        """Seconds one engine iteration takes for the given batch."""
        return (self.base_s + self.per_decode_seq_s * decode_cost
                + self.per_prefill_token_s * prefill_tokens + self.per_context_token_s * context_tokens)


@dataclass(frozen=True)
class LogNormal:
    """A log-normal draw given by its median and sigma, rounded and clipped to [min, max]."""

    median: float
    sigma: float
    min: float = 1
    max: float = math.inf

    def sample(self, rng: random.Random) -> float:
        value = self.median if self.sigma <= 0 else self.median * math.exp(rng.gauss(0.0, self.sigma))
        return min(self.max, max(self.min, value))


@dataclass(frozen=True)
class Profile:
    """Everything that makes one simulated replica behave like one GPU serving one model."""

    name: str
    model_names: tuple[str, ...]
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_blocks: int
    timing: Timing
    output_tokens: LogNormal
    block_size: int = 16
    default_max_tokens: int = 2048
    # Per-request cost multiplier on decode time (MoE routing, speculative decoding); median 1.
    cost_multiplier: LogNormal = field(default_factory=lambda: LogNormal(1.0, 0.0, 0.0))
    description: str = ""
    # vLLM's --scheduling-policy: "fcfs" or "priority" (the request's `priority`, lower first; engine.py).
    scheduling_policy: str = "fcfs"
    # vLLM's --scheduler-reserve-full-isl: admit a waiting request only when the free KV blocks hold all its tokens,
    # not just its first chunk's (engine.py). vLLM 0.32 has it on by default; off here until the demo's recorded
    # runs are made again with it (docs/simulator.md, "The engine model").
    scheduler_reserve_full_isl: bool = False
    # vLLM's --enable-prefix-caching, on by default: here the samples of one prompt (n > 1) share its full KV blocks,
    # computed once (engine.py's SharedPrompt); false is --no-enable-prefix-caching, each sample computing its own.
    enable_prefix_caching: bool = True

    def natural_output_tokens(self, rng: random.Random) -> int:
        """How many tokens a request would generate if max_tokens did not stop it."""
        return max(1, round(self.output_tokens.sample(rng)))

    def with_model_names(self, names: list[str] | tuple[str, ...]) -> Profile:
        """The same profile serving other model names."""
        return _replace(self, model_names=tuple(names))

    def with_scheduling_policy(self, policy: str) -> Profile:
        """The same profile under another scheduling policy (vLLM's --scheduling-policy)."""
        _check_scheduling_policy(policy, "scheduling_policy")
        return _replace(self, scheduling_policy=policy)


def _check_scheduling_policy(policy: str, where: str) -> None:
    if policy not in ("fcfs", "priority"):
        raise ValueError(f"{where}: must be fcfs or priority, got {policy!r}")


def _replace(profile: Profile, **changes) -> Profile:
    values = {f.name: getattr(profile, f.name) for f in fields(profile)}
    values.update(changes)
    return Profile(**values)


def _lognormal(data: dict, where: str) -> LogNormal:
    if data.get("distribution", "lognormal") != "lognormal":
        raise ValueError(f"{where}.distribution: only 'lognormal' is supported")
    allowed = {"distribution", "median", "sigma", "min", "max"}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return LogNormal(float(data["median"]), float(data.get("sigma", 0.0)),
                     float(data.get("min", 1)), float(data.get("max", math.inf)))


def profile_from_dict(data: dict, source: str = "<dict>") -> Profile:
    """Build a profile from parsed YAML, naming the key path of anything missing or unknown."""
    known = {f.name for f in fields(Profile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}")
    try:
        timing = Timing(**data["timing"])
        values = dict(data)
        values["timing"] = timing
        values["model_names"] = tuple(data["model_names"])
        values["output_tokens"] = _lognormal(data["output_tokens"], "output_tokens")
        if "cost_multiplier" in data:
            values["cost_multiplier"] = _lognormal(data["cost_multiplier"], "cost_multiplier")
        profile = Profile(**values)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: bad profile: {exc}") from exc
    _check_scheduling_policy(profile.scheduling_policy, f"{source}: scheduling_policy")
    for key in ("scheduler_reserve_full_isl", "enable_prefix_caching"):
        if not isinstance(getattr(profile, key), bool):
            raise ValueError(f"{source}: {key} must be true or false, got {getattr(profile, key)!r}")
    names = data["model_names"]
    if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
        # tuple("m-70b") would serve one model per character
        raise ValueError(f"{source}: model_names must be a non-empty list of names, got {names!r}")
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_blocks", "block_size",
                "default_max_tokens"):
        value = getattr(profile, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # 0 seqs or tokens: nothing ever runs
            raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    for f in fields(Timing):
        value = getattr(profile.timing, f.name)
        # A NaN duration makes the replica's clock NaN for good; a negative one runs it backwards
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{source}: timing.{f.name} must be a finite number >= 0, got {value!r}")
    # A request as long as the context must fit in the cache alone, or the engine could never schedule it.
    if profile.kv_cache_blocks * profile.block_size < profile.max_model_len:
        raise ValueError(f"{source}: kv_cache_blocks * block_size must be at least max_model_len")
    return profile


def shipped_profile_names() -> list[str]:
    """Names of the profiles that ship with the package."""
    folder = resources.files("extproc.tools.sim") / "profiles"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        text, source = path.read_text(), str(path)
    else:
        resource = resources.files("extproc.tools.sim") / "profiles" / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise ValueError(f"unknown profile {name_or_path!r}; shipped: {', '.join(shipped_profile_names())}")
        text, source = resource.read_text(), name_or_path
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # a hand-written profile's typo: say where, not a parser traceback
        raise ValueError(f"{source}: not valid YAML: {exc}") from exc
    return profile_from_dict(data, source)
