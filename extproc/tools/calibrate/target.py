"""What the calibrated target is: served models, vLLM version, simulator profile and speed, MoE or not."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

import aiohttp

# Model-name patterns of mixture-of-experts models: Mixtral, "...-MoE-...", Qwen's "-A3B" active-parameter suffix,
# DeepSeek V2/V3, DBRX, gpt-oss. A heuristic: `--moe` / `--no-moe` overrides it.
MOE_NAME_PATTERNS = [r"mixtral", r"moe", r"-a\d+(\.\d+)?b\b", r"deepseek-v[23]", r"dbrx", r"gpt-oss"]


class TargetError(RuntimeError):
    """The target cannot be calibrated (unreachable, not OpenAI-compatible, model not served)."""


@dataclass
class TargetIdentity:
    """Enough about the target to tell later whether a calibration still applies to it."""

    url: str
    model: str
    served_models: list[str]
    max_model_len: int | None
    version: str | None  # vLLM's GET /version
    sim_profile: str | None = None  # GET /sim/state, only on the simulator
    sim_speed: float | None = None
    probed_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def describe(self) -> str:
        sim = f", simulator profile {self.sim_profile} at --speed {self.sim_speed:g}" if self.sim_profile else ""
        return (f"target {self.url}: model {self.model}, vLLM {self.version or 'unknown version'}{sim}; "
                f"probed {self.probed_at}")


def moe_hint(names: list[str]) -> str | None:
    """The first name that looks like an MoE model, or None."""
    for name in names:
        if any(re.search(p, name.lower()) for p in MOE_NAME_PATTERNS):
            return name
    return None


async def _get_json(session: aiohttp.ClientSession, url: str) -> object | None:
    """GET and parse JSON; None on any error status or unparsable body (the endpoint is optional)."""
    async with session.get(url) as resp:
        if resp.status != 200:
            return None
        try:
            return await resp.json(content_type=None)
        except ValueError:
            return None


async def probe(url: str, model: str | None, timeout_s: float = 10.0) -> TargetIdentity:
    """Ask the target who it is; `model` None picks its first served model. Raises TargetError."""
    url = url.rstrip("/")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            models = await _get_json(session, url + "/v1/models")
            version = await _get_json(session, url + "/version")
            sim = await _get_json(session, url + "/sim/state")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise TargetError(f"{url} is not reachable: {type(e).__name__}: {e}") from e
    if not isinstance(models, dict) or not models.get("data"):
        raise TargetError(f"{url}/v1/models did not list any model: is this an OpenAI-compatible server?")
    served = [m.get("id") for m in models["data"]]
    if model is None:
        model = served[0]
    elif model not in served:
        raise TargetError(f"model {model!r} is not served by {url} (served: {', '.join(served)})")
    max_len = next((m.get("max_model_len") for m in models["data"] if m.get("id") == model), None)
    identity = TargetIdentity(url=url, model=model, served_models=served, max_model_len=max_len,
                              version=version.get("version") if isinstance(version, dict) else None)
    if isinstance(sim, dict) and "profile" in sim:
        identity.sim_profile, identity.sim_speed = sim["profile"], float(sim.get("speed", 1.0))
    return identity
