"""The five ways the demo serves the same traffic, and their configs scaled from simulated to wall-clock time."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from extproc.policy.schema import load_policy, read_policy_doc
from extproc.tools.adaptive_concurrency import TUNED

# Policy keys ending in _ms/_s are wall-clock durations for the ext_proc: the demo divides them by --speed. These
# are not (or need not be) scaled: the lease is a safety net far above any request, Retry-After goes to clients.
UNSCALED_POLICY_KEYS = frozenset({"lease_ms", "retry_after_max_s"})
# GPU-seconds are durations too: at speed 5 a replica serves a token in a fifth of the wall time, and the ext_proc
# fits its service-time prediction to wall-clock service times, starting from (and bounded by) the configured
# coefficients. Unscaled, the fit ran into its lower bound (a quarter of the configured ones). Budgets in
# GPU-seconds scale with the coefficients, so they keep their meaning. A rate of GPU-seconds per minute does not
# (both sides scale), but its bucket holds a wall-clock minute's worth: at speed 5, five simulated minutes' (no
# shipped policy sets one).
GPU_SECONDS_KEYS = frozenset({"prefill_s_per_1k_tokens", "decode_s_per_token", "decode_s_per_1k_context",
                              "max_inflight_gpu_seconds"})
# Rates of requests and tokens per minute are per simulated minute in a scenario: at speed 5 a tenant sends five
# times as many a wall minute, so the ext_proc's wall-clock limit is five times the number (its bucket's depth,
# rate x burst_s, stays what the policy says: burst_s is a duration). Unscaled, a tenant the what-if never limited
# was refused in the real demo (a code-completion tenant's tokens_per_minute: 93% refused in the what-if's spike,
# 98% at speed 4, and refusals in its calm phases the what-if did not have).
RATE_KEYS = frozenset({"requests_per_minute", "tokens_per_minute"})


DEFAULT_SPEED = 5.0  # the real demo's simulated seconds per wall second (`extproc demo --speed`)


@dataclass(frozen=True)
class Mode:
    """One way to serve the traffic: an Envoy variant, and for the ext_proc a policy file."""

    key: str
    label: str
    stack_mode: str  # extproc.tools.envoyconf.MODES
    lb_policy: str | None = None
    policy: str | None = None
    # Envoy adaptive_concurrency knobs (extproc.tools.adaptive_concurrency), durations in simulated seconds.
    adaptive: dict[str, Any] = field(default_factory=dict)


MODES = {
    "a": Mode("a", "round robin, no admission control", "plain", lb_policy="ROUND_ROBIN"),
    "b": Mode("b", "Envoy adaptive_concurrency", "adaptive", adaptive=TUNED),
    "c": Mode("c", "static per-class caps (playbook)", "extproc", policy="policies/demo-static.yaml"),
    "d": Mode("d", "our policy (pool-wide limit, strict priority)", "extproc", policy="policies/demo-full.yaml"),
    "e": Mode("e", "per-class adaptive caps (AIMD on the SLO and vLLM saturation)", "extproc",
              policy="policies/demo-adaptive.yaml"),
}
DEFAULT_MODES = "a,b,c,d,e"


def parse_modes(text: str) -> list[Mode]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in MODES]
    if unknown or not keys or len(set(keys)) < len(keys):  # a mode twice ran twice and reported one row
        raise ValueError(f"modes must be a comma-separated subset of {','.join(MODES)}, each once, got {text!r}")
    return [MODES[k] for k in keys]


REPO = Path(__file__).resolve().parents[3]  # a checkout's root: policies/ and scenarios/ live there


def repo_path(path: str) -> str:
    """`path` as given when it exists from here, else from the checkout's root: the shipped `policies/...` and
    `scenarios/...` names then work from any directory."""
    if Path(path).exists() or Path(path).is_absolute() or not (REPO / path).exists():
        return path
    return str(REPO / path)


def with_policies(modes: list[Mode], policies: dict[str, str], adaptive: dict[str, Any] | None = None,
                  labels: dict[str, str] | None = None) -> list[Mode]:
    """The modes with the policy files a scenario names for them (its `policies:`, mode key -> file), mode b
    with the scenario's `envoy_adaptive` knobs over its own, and the scenario's `labels:` for them."""
    wrong = [k for k in policies if k not in MODES or not MODES[k].policy]
    if wrong:
        raise ValueError(f"policies: {', '.join(wrong)} are not ext_proc modes "
                         f"({', '.join(k for k, m in MODES.items() if m.policy)})")
    chosen = [replace(m, policy=policies[m.key]) if m.key in policies else m for m in modes]
    if adaptive:
        chosen = [replace(m, adaptive={**m.adaptive, **adaptive}) if m.adaptive else m for m in chosen]
    if labels:
        chosen = [replace(m, label=labels[m.key]) if m.key in labels else m for m in chosen]
    return [replace(m, policy=repo_path(m.policy)) if m.policy else m for m in chosen]


def scale_durations(data: Any, speed: float, unscaled: frozenset[str] = UNSCALED_POLICY_KEYS) -> Any:
    """A copy of parsed policy YAML with every *_ms / *_s number and every amount of GPU-seconds divided by `speed`
    (int *_ms stay ints, >= 1), and every rate of requests or tokens per minute multiplied by it (RATE_KEYS)."""
    if isinstance(data, list):
        return [scale_durations(v, speed, unscaled) for v in data]
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        is_duration = isinstance(key, str) and (key.endswith(("_ms", "_s")) or key in GPU_SECONDS_KEYS) and \
            key not in unscaled
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in RATE_KEYS and is_number:
            value = max(1, round(value * speed))  # the schema's integers
        elif is_duration and is_number:
            # *_ms are whole milliseconds (>= 1: 0 means "none"); *_s are float seconds, never rounded (an
            # `interval_s: 1` at speed 5 is 0.2 s, not 1 s).
            if key.endswith("_ms") and isinstance(value, int):
                value = max(1, round(value / speed))
            else:
                value = value / speed
        else:
            value = scale_durations(value, speed, unscaled)
        out[key] = value
    return out


def render_policy(source: str | Path, speed: float, dest: Path,
                  endpoints: dict[str, list[tuple[str, int]]] | None = None) -> Path:
    """Write the policy with its durations in wall-clock time for a run at `speed`; validate it first.

    `endpoints` (pool -> the started replicas): a `pools` entry that names neither replicas nor an Envoy admin URL
    is filled with its pool's replica addresses, so the ext_proc scrapes this run's simulated replicas."""
    data = read_policy_doc(str(source))
    for name, pool in (data.get("pools") or {}).items():
        if endpoints and name in endpoints and not pool.get("replicas") and not pool.get("envoy_admin"):
            pool["replicas"] = [f"{host}:{port}" for host, port in endpoints[name]]
    # Every duration the ext_proc will use, the schema's defaults included (load_policy raises PolicyError naming
    # the key path): a default the file leaves out ran at wall-clock speed, so at speed 5 a pool limit that moves
    # every 0.5 s moved every 2.5 simulated s, where the what-if (simulated time throughout) moved it every 0.5.
    scaled = scale_durations(asdict(load_policy(data)), speed)
    load_policy(scaled)
    dest.write_text(yaml.safe_dump(scaled, sort_keys=False), encoding="utf-8")
    return dest
