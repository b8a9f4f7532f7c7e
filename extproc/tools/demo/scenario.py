"""The demo scenario YAML: fleet, request mix, load phases (as multiples of fleet capacity), SLO, policies."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from extproc.policy.schema import PolicyError, read_policy_doc
from extproc.tools.adaptive_concurrency import TUNED
from extproc.tools.loadgen import (ENDPOINTS, LoadClient, PlannedRequest, RequestKind, SessionShape, Workload,
                                   plan_arrivals)
from extproc.tools.sim.engine import SCHEDULING_POLICIES
from extproc.tools.sim.openai_api import ApiError, ignores_eos, parse_generation, samples_per_prompt
from extproc.tools.sim.profile import load_profile
from extproc.tools.sim.replica import FAULT_KEYS, fault_value

from .capacity import closed_loop_mix
from .modes import MODES


@dataclass(frozen=True)
class Pool:
    """Simulated replicas behind one Envoy cluster."""

    name: str
    profile: str
    replicas: int
    model_names: list[str]
    # vLLM's --scheduling-policy for these replicas: "fcfs" or "priority" (then the body's `priority`, which the
    # ext_proc sets from the class's `vllm_priority`, orders the engine's queue); None: the profile's (fcfs).
    scheduling_policy: str | None = None
    # LoRA adapters the replicas serve on top of the model (vLLM's --enable-lora --lora-modules NAME=PATH; the demo
    # gives each the path /adapters/NAME) and vLLM's --max-loras: adapters in one batch at most (vLLM's default 1);
    # a request for another one waits in the replica's queue, counted as waiting for reason "deferred".
    lora_modules: list[str] = field(default_factory=list)
    max_loras: int = 1

    @property
    def served(self) -> list[str]:
        """The names its replicas answer to: the served model names, then the adapters."""
        return [*self.model_names, *self.lora_modules]

    def serves(self, model: str | None) -> bool:
        return model in self.served

    @property
    def lora_ids(self) -> dict[str, int]:
        """Each adapter's vLLM lora_int_id, from 1 in --lora-modules order (sim/lora.py LoraRegistry)."""
        return {name: i for i, name in enumerate(self.lora_modules, 1)}


@dataclass(frozen=True)
class Phase:
    name: str
    duration_s: float  # simulated seconds
    rate: float  # multiple of the fleet capacity
    # kind name -> factor on that kind's arrival rate in this phase (the other kinds keep theirs)
    weights: dict[str, float] = field(default_factory=dict)


SCENARIO_KEYS = frozenset({"name", "description", "seed", "pools", "phases", "workload", "slo", "client_timeout_s",
                           "capacity", "capacity_concurrency", "events", "windows", "policies", "envoy_adaptive",
                           "labels"})
POOL_KEYS = frozenset({"profile", "replicas", "model_names", "scheduling_policy", "lora_modules", "max_loras"})
PHASE_KEYS = frozenset({"name", "duration_s", "rate", "weights"})
SLO_KEYS = frozenset({"class", "p95_s", "kinds"})
EVENT_KEYS = frozenset({"at_s", "pool", "replica", "fault"})
# A fault is a POST /sim/fault body (extproc.tools.sim.replica.FAULT_KEYS). The what-if models these; the others
# act on the real stack only.
WHATIF_FAULTS = frozenset({"slowdown", "draining", "hang"})


def _envoy_adaptive(d: Any) -> dict[str, float]:
    """A scenario's knobs for mode b, over adaptive_concurrency.TUNED's."""
    if d is None:
        return {}
    _check_keys(d, "envoy_adaptive.", frozenset(TUNED))
    out = {}
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"envoy_adaptive.{k}: a number > 0 is expected, got {v!r}")
        out[k] = v
    return out


def _check_keys(d: Any, where: str, known: frozenset[str]) -> None:
    """A misspelt key must not be ignored: a `polices:` ran the shipped policies instead of the user's."""
    if not isinstance(d, dict):
        raise ValueError(f"{where.rstrip('.') or 'the scenario'}: a mapping is expected, got {type(d).__name__}")
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise ValueError(f"{where}{unknown[0]}: unknown key (known here: {', '.join(sorted(known))})")


def _largest_prompt(kind: RequestKind) -> int | None:
    """The longest prompt a kind's first call can send (None: unbounded, a log-normal without `max`)."""
    spec = kind.prompt_tokens
    if isinstance(spec, int):
        return spec
    if "median" in spec:
        return int(spec["max"]) if "max" in spec else None
    return int(spec["max"])


def _check_context(workload: Workload, pools: list[Pool]) -> None:
    """A prompt as long as the context is a 400 from the simulator (and vLLM), but the what-if and the capacity
    measurement clamp its output to a negative room and run it as a near-empty answer: a RAG scenario of 6-12K-token
    prompts on an 8K-context profile printed sub-second latencies in the what-if for requests the real stack refuses
    every one of. Refuse it here, naming the kind, the pool and the context."""
    for kind in workload.kinds:
        largest = _largest_prompt(kind)
        serving = [p for p in pools if p.serves(kind.model)] or pools[:1]
        for pool in serving:
            context = load_profile(pool.profile).max_model_len
            # As vLLM: max_tokens below 1 or beyond the context is a 400 (the what-if served them, clamped).
            if kind.max_tokens is not None and not 1 <= kind.max_tokens <= context:
                raise ValueError(f"workload kind {kind.name!r}: max_tokens {kind.max_tokens}, but pool {pool.name!r} "
                                 f"(profile {pool.profile}) takes 1 to its max_model_len {context}: the simulator "
                                 "answers 400 to every such request")
            if largest is not None and largest >= context:
                raise ValueError(f"workload kind {kind.name!r}: prompts of up to {largest} tokens, but pool "
                                 f"{pool.name!r} (profile {pool.profile}) has max_model_len {context}: the simulator "
                                 "answers 400 to a prompt that long (give the pool a profile file with a longer "
                                 "context, docs/simulator.md \"Profiles\")")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_count(spec: Any, where: str, least: int, lognormal: bool) -> None:
    """A count the load generator draws (extproc.tools.loadgen.sample_count): an int, {min, max}, or where
    `lognormal`, {median, sigma[, max]}; none below `least`."""
    shapes = "an int, {min, max} or {median, sigma, max}" if lognormal else "an int or {min, max}"
    if isinstance(spec, int) and not isinstance(spec, bool):
        ok = spec >= least
    elif isinstance(spec, dict) and lognormal and "median" in spec:
        ok = set(spec) <= {"median", "sigma", "max"} and all(_number(v) for v in spec.values()) and \
            spec["median"] > 0 and spec.get("sigma", 0) >= 0 and spec.get("max", least) >= least
    elif isinstance(spec, dict):
        ok = set(spec) == {"min", "max"} and all(isinstance(v, int) and not isinstance(v, bool)
                                                 for v in spec.values()) and least <= spec["min"] <= spec["max"]
    else:
        ok = False
    if not ok:
        raise ValueError(f"{where}: {shapes} of at least {least} (min <= max), got {spec!r}")


def _check_kinds(workload: Workload) -> None:
    """What the load generator draws each arrival from: no kind, weights that are all 0, a session of 0 calls or
    of log-normal calls, an empty {min, max} range or an endpoint it has no path for crashed the what-if mid-run
    (ZeroDivisionError, KeyError, an unnamed ValueError), and the real demo once it had started its stack."""
    if not workload.kinds:
        raise ValueError("workload.kinds: at least one kind")
    for kind in workload.kinds:
        where = f"workload kind {kind.name!r}"
        if kind.endpoint not in ENDPOINTS:
            raise ValueError(f"{where}: endpoint: one of {', '.join(ENDPOINTS)}, got {kind.endpoint!r}")
        if not _number(kind.weight) or kind.weight < 0:
            raise ValueError(f"{where}: weight: a number >= 0, got {kind.weight!r}")
        for key in ("headers", "body"):
            if not isinstance(getattr(kind, key), dict):
                raise ValueError(f"{where}: {key}: a mapping is expected, got {getattr(kind, key)!r}")
        _check_count(kind.prompt_tokens, f"{where}: prompt_tokens", 1, lognormal=True)
        _check_types(kind, where)
        if kind.session is not None:
            _check_count(kind.session.calls, f"{where}: session.calls", 1, lognormal=False)
            _check_count(kind.session.growth_tokens, f"{where}: session.growth_tokens", 0, lognormal=True)
    if not sum(k.weight for k in workload.kinds) > 0:
        raise ValueError("workload.kinds: every weight is 0: no request would be sent")


def _check_types(kind: RequestKind, where: str) -> None:
    """A value of the wrong type the what-if reads only once requests flow (a `model: 70` or `max_tokens: .inf`,
    a session's `think_s: 1s`) raised a TypeError mid-run, after the real demo had started its stack."""
    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if kind.model is not None and not isinstance(kind.model, str):
        raise ValueError(f"{where}: model: a model name, got {kind.model!r}")
    if kind.max_tokens is not None and not integer(kind.max_tokens):
        raise ValueError(f"{where}: max_tokens: a whole number of tokens, got {kind.max_tokens!r}")
    if not _number(kind.abort_prob) or not 0 <= kind.abort_prob <= 1:
        raise ValueError(f"{where}: abort_prob: a probability (0 to 1), got {kind.abort_prob!r}")
    shape = kind.session
    if shape is None:
        return
    if not isinstance(shape, SessionShape):
        raise ValueError(f"{where}: session: a mapping is expected, got {shape!r}")
    if not _number(shape.think_s) or shape.think_s < 0:
        raise ValueError(f"{where}: session.think_s: seconds >= 0, got {shape.think_s!r}")
    if not integer(shape.retries) or shape.retries < 0:
        raise ValueError(f"{where}: session.retries: a whole number >= 0, got {shape.retries!r}")
    if shape.max_context_tokens is not None and (not integer(shape.max_context_tokens) or shape.max_context_tokens < 1):
        raise ValueError(f"{where}: session.max_context_tokens: tokens >= 1, got {shape.max_context_tokens!r}")


def _check_bodies(workload: Workload) -> None:
    """A kind's `body.ignore_eos` and `body.n` are read by the what-if and the capacity measurement as the simulator
    reads them; a value it would refuse (400 for every request) is an error here rather than a crash mid-replay."""
    for kind in workload.kinds:
        try:
            ignores_eos(kind.body)
        except ApiError as e:
            raise ValueError(f"workload kind {kind.name!r}: {e.param}: not a boolean: "
                             f"{kind.body.get('ignore_eos')!r}") from None
        try:
            samples_per_prompt(kind.body)
        except ApiError as e:
            raise ValueError(f"workload kind {kind.name!r}: body.n: {e} (the simulator and vLLM answer 400 to "
                             "every such request)") from None


def _check_requests(workload: Workload, pools: list[Pool]) -> None:
    """Each kind's request as the load generator sends it (a short prompt: _check_context judges lengths) through
    the simulator's own validation, on every pool serving its model: a body it answers 400 (`tools` without
    `tool_choice: none`, the simulator being a vLLM started without a tool-call parser; `stream_options` on a
    request that does not stream) had the what-if print goodput for a workload the real demo answers with errors
    only. The model's name is left to the route checks (a 404 is the policy's or the pool's to give)."""
    client = LoadClient([])
    for kind in workload.kinds:
        body = client.body(PlannedRequest(0, kind, prompt_tokens=8, abort_fraction=None))
        # The ext_proc takes `priority` for itself (a class claim, or a scheduling priority it replaces with the
        # class's own: server/openai._read_claim): what reaches the replica there is the policy's.
        body.pop("priority", None)
        serving = [p for p in pools if p.serves(kind.model)] or pools[:1]
        for pool in serving:
            profile = load_profile(pool.profile)
            served = (body["model"],) if isinstance(body.get("model"), str) else profile.model_names
            try:
                parse_generation(kind.endpoint, json.dumps(body).encode(), served, profile.max_model_len,
                                 profile.default_max_tokens)
            except ApiError as e:
                raise ValueError(f"workload kind {kind.name!r}: the simulator (and vLLM) answer 400 to each of its "
                                 f"requests on pool {pool.name!r}: {e}") from None


@dataclass(frozen=True)
class FleetEvent:
    """Something that happens to the fleet mid-run: a /sim/fault body applied to one replica at `at_s`."""

    at_s: float  # simulated seconds from the start of the replay
    pool: str
    replica: int  # index in the pool's replica list
    fault: dict[str, float]


@dataclass
class Scenario:
    name: str
    description: str
    seed: int
    pools: list[Pool]
    phases: list[Phase]
    workload: Workload
    slo_class: str
    slo_p95_s: float
    client_timeout_s: float
    capacity: float | str = "auto"  # requests/s of the first pool, or "auto"
    capacity_concurrency: int = 32
    events: tuple[FleetEvent, ...] = ()
    # Report windows: name -> phases (consecutive) whose started requests are compared; default: the spike phase.
    windows: dict[str, list[str]] | None = None
    # Mode key -> policy file for this traffic (extproc.tools.demo.modes.MODES' policy where not given).
    policies: dict[str, str] = field(default_factory=dict)
    # Mode b's Envoy adaptive_concurrency knobs for this traffic, over adaptive_concurrency.TUNED (tuned on the
    # spike's 1-2 s requests: a fixed 1 s minimum RTT refuses most of a mix whose requests last 10 s).
    envoy_adaptive: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what the demo prints before it runs
    # The kinds the SLO is judged on (`slo.kinds`: several tenants of one class, each its own kind for the
    # per-kind tables); default: the kind named `slo.class`.
    slo_kinds: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)  # mode key -> what the report calls it (`labels:`)

    def __post_init__(self) -> None:
        if not self.slo_kinds:
            self.slo_kinds = (self.slo_class,)

    @classmethod
    def load(cls, path: str | Path) -> Scenario:
        """Read a scenario file (UTF-8, no key given twice, as policies are read). ValueError names what is wrong."""
        try:
            doc = read_policy_doc(str(path))
        except PolicyError as e:
            raise ValueError("; ".join(e.errors)) from None
        try:
            return cls.from_dict(doc)
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: int() of an infinite number
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{path}: {what}") from None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scenario:
        _check_keys(d, "", SCENARIO_KEYS)
        # A list where a mapping goes (or the reverse) raised AttributeError, a traceback past Scenario.load.
        for key, shape in (("pools", dict), ("workload", dict), ("windows", dict), ("phases", list)):
            if d.get(key) is not None and not isinstance(d[key], shape):
                raise ValueError(f"{key}: a {'mapping' if shape is dict else 'list'} is expected, got "
                                 f"{type(d[key]).__name__}")
        for name, p in (d.get("pools") or {}).items():
            _check_keys(p, f"pools.{name}.", POOL_KEYS)
        for i, p in enumerate(d.get("phases") or []):
            _check_keys(p, f"phases[{i}].", PHASE_KEYS)
            if not isinstance(p.get("weights") or {}, dict):  # an AttributeError past Scenario.load
                raise ValueError(f"phases[{i}].weights: kind name -> factor, got {p['weights']!r}")
        _check_keys(d.get("slo") or {}, "slo.", SLO_KEYS)
        unmodelled = []
        for i, e in enumerate(d.get("events") or []):
            _check_keys(e, f"events[{i}].", EVENT_KEYS)
            _check_keys(e.get("fault"), f"events[{i}].fault.", FAULT_KEYS)  # `fault:` left empty: AttributeError
            for k, v in (e.get("fault") or {}).items():
                try:
                    fault_value(v)  # what the replica's /sim/fault would refuse mid-run
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"events[{i}].fault.{k}: {exc}") from None
            unmodelled += [f"events[{i}].fault.{k}" for k in e.get("fault") or {} if k not in WHATIF_FAULTS]
        for name, p in (d["pools"] or {}).items():  # `pools:` left empty: no pool (an AttributeError)
            if not isinstance(p.get("profile"), str):  # a TypeError mid-run, where the what-if builds its engines
                raise ValueError(f"pools.{name}.profile: a profile name or file, got {p.get('profile')!r}")
            names = p.get("model_names", [])
            # A bare `model_names: llama-70b` was read as its letters: every request answered 404.
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"pools.{name}.model_names: a list of model names, got {names!r}")
            adapters = p.get("lora_modules", [])
            if not isinstance(adapters, list) or not all(isinstance(n, str) and n and "=" not in n for n in adapters):
                raise ValueError(f"pools.{name}.lora_modules: a list of adapter names, got {adapters!r}")
            if len(set(adapters)) < len(adapters) or set(adapters) & set(names):
                raise ValueError(f"pools.{name}.lora_modules: each name once, none of them a model_names name, got "
                                 f"{adapters!r}")
            if "max_loras" in p:
                m = p["max_loras"]
                if not adapters:
                    raise ValueError(f"pools.{name}.max_loras: only with lora_modules (LoRA is off without adapters)")
                if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                    raise ValueError(f"pools.{name}.max_loras: an integer of at least 1 (vLLM refuses less), got {m!r}")
        pools = [Pool(name, p["profile"], int(p.get("replicas", 1)), list(p.get("model_names", [])),
                      p.get("scheduling_policy"), list(p.get("lora_modules", [])), p.get("max_loras", 1))
                 for name, p in (d["pools"] or {}).items()]
        for pool in pools:
            try:  # a pool no kind asks for is read only when the what-if builds its engines: mid-run
                load_profile(pool.profile)
            except ValueError as e:
                raise ValueError(f"pools.{pool.name}.profile: {e}") from None
            if pool.replicas < 1:  # capacity 0, or the what-if's load balancer picks from no replica
                raise ValueError(f"pools.{pool.name}.replicas: at least 1, got {pool.replicas}")
            if pool.scheduling_policy not in (None, *SCHEDULING_POLICIES):
                raise ValueError(f"pools.{pool.name}.scheduling_policy: must be one of "
                                 f"{', '.join(SCHEDULING_POLICIES)}, got {pool.scheduling_policy!r}")
        # The what-if crashed mid-replay on a fault for a pool or replica the fleet lacks, and the real run's fault
        # task died unseen while the report said the fault was applied.
        replicas = {pool.name: pool.replicas for pool in pools}
        for i, e in enumerate(d.get("events") or []):
            if e.get("pool") not in replicas:
                raise ValueError(f"events[{i}].pool: {e.get('pool')} names no pool (pools: {', '.join(replicas)})")
            n, replica = replicas[e["pool"]], int(e.get("replica", 0))
            if not 0 <= replica < n:
                raise ValueError(f"events[{i}].replica: pool {e['pool']} has {n} replicas (0-{n - 1}), got {replica}")
        phases = [Phase(p["name"], float(p["duration_s"]), float(p["rate"]),
                        {k: float(v) for k, v in (p.get("weights") or {}).items()}) for p in d["phases"]]
        if not pools or not phases:
            raise ValueError("a scenario needs at least one pool and one phase")
        workload = Workload.from_dict(d["workload"])
        _check_kinds(workload)
        _check_bodies(workload)
        _check_context(workload, pools)
        _check_requests(workload, pools)
        for i, p in enumerate(phases):  # windows, calm phases and overload onsets find a phase by its name
            first = next(j for j, q in enumerate(phases) if q.name == p.name)
            if first != i:
                raise ValueError(f"phases[{i}]: name {p.name!r} is given to phases[{first}] already")
        names = {k.name for k in workload.kinds}
        for p in phases:
            if set(p.weights) - names:
                raise ValueError(f"phase {p.name!r}: weights name no kind of the workload: "
                                 f"{', '.join(sorted(set(p.weights) - names))} (kinds: {', '.join(sorted(names))})")
            # Finite: an infinite rate or duration drew arrivals for ever (the what-if hung before its first).
            if not (0 < p.duration_s < math.inf and 0 <= p.rate < math.inf):
                raise ValueError(f"phase {p.name!r}: duration_s must be > 0 and rate >= 0 (a share of the capacity), "
                                 f"got {p.duration_s:g} and {p.rate:g}")
            wrong = {k: v for k, v in p.weights.items() if not 0 <= v < math.inf}
            if wrong:  # a negative factor silently removed every arrival of the phase
                raise ValueError(f"phase {p.name!r}: weights: factors >= 0, got {wrong}")
        slo_class = (d.get("slo") or {}).get("class", "interactive")
        listed = (d.get("slo") or {}).get("kinds") or []
        if not isinstance(listed, list):
            raise ValueError(f"slo.kinds: a list of kind names, got {listed!r}")
        slo_kinds = tuple(str(k) for k in listed)
        if set(slo_kinds) - names:
            raise ValueError(f"slo.kinds: {', '.join(sorted(set(slo_kinds) - names))} name no kind of the workload "
                             f"(kinds: {', '.join(sorted(names))})")
        warnings = [] if slo_kinds or slo_class in names else [
            f"slo.class: {slo_class!r} names no kind of the workload (kinds: {', '.join(sorted(names))}): the "
            "report's latency, goodput and targets are that kind's, so they print NaN (`slo.kinds` lists the kinds "
            "that make up the class, e.g. one per tenant)"]
        if not isinstance(d.get("labels") or {}, dict):
            raise ValueError(f"labels: mode key -> text, got {d['labels']!r}")
        labels = {str(k): str(v) for k, v in (d.get("labels") or {}).items()}
        unlabelled = sorted(set(labels) - set(MODES))
        if unlabelled:
            raise ValueError(f"labels: {', '.join(unlabelled)} are not modes ({', '.join(MODES)})")
        if unmodelled:
            warnings.append(f"{', '.join(unmodelled)}: applied on the real stack only (the what-if models "
                            f"{', '.join(sorted(WHATIF_FAULTS))})")
        # The what-if's clients wait for every answer (or their timeout): a kind's aborts read as answers there.
        aborting = [k.name for k in workload.kinds if k.abort_prob]
        if aborting:
            warnings.append(f"abort_prob of {', '.join(aborting)}: applied on the real stack only (the what-if's "
                            "clients wait for every answer or their timeout)")
        # A client timeout of 0 or less printed a p99 of -1 s (timeouts count at it); an SLO of 0, no goodput.
        for key, value in (("client_timeout_s", d.get("client_timeout_s", 60.0)),
                           ("slo.p95_s", (d.get("slo") or {}).get("p95_s", 2.0))):
            if not _number(value) or not value > 0:
                raise ValueError(f"{key}: seconds > 0, got {value!r}")
        if int(d.get("capacity_concurrency", 32)) < 1:  # the capacity loop would run an empty engine
            raise ValueError(f"capacity_concurrency: at least 1, got {d['capacity_concurrency']}")
        capacity = d.get("capacity", "auto")
        if capacity != "auto" and not (isinstance(capacity, (int, float)) and not isinstance(capacity, bool)
                                       and capacity > 0):
            raise ValueError(f"capacity: 'auto' or requests/s > 0, got {capacity!r}")
        phase_names = {p.name for p in phases}
        for w, listed in (d.get("windows") or {}).items():
            if not isinstance(listed, list) or not listed:
                raise ValueError(f"windows.{w}: a list of one or more phases, got {listed!r}")
            unknown = [x for x in listed if x not in phase_names]
            if unknown:
                raise ValueError(f"windows.{w}: {', '.join(map(str, unknown))} name no phase "
                                 f"(phases: {', '.join(p.name for p in phases)})")
            # The window runs from its first phase's start to its last phase's end (report_windows).
            at = sorted({next(i for i, p in enumerate(phases) if p.name == x) for x in listed})
            between = [phases[i].name for i in range(at[0], at[-1] + 1) if i not in at]
            if between:
                raise ValueError(f"windows.{w}: the phases of a window follow each other ({', '.join(between)} lies "
                                 f"between {phases[at[0]].name} and {phases[at[-1]].name})")
        return cls(name=d.get("name", "scenario"), description=d.get("description", ""), seed=int(d.get("seed", 0)),
                   pools=pools, phases=phases, workload=workload,
                   slo_class=slo_class, slo_p95_s=float((d.get("slo") or {}).get("p95_s", 2.0)),
                   client_timeout_s=float(d.get("client_timeout_s", 60.0)),
                   capacity=capacity, capacity_concurrency=int(d.get("capacity_concurrency", 32)),
                   events=tuple(FleetEvent(float(e["at_s"]), e["pool"], int(e.get("replica", 0)),
                                           {k: float(v) for k, v in e["fault"].items()})
                                for e in d.get("events", [])),
                   windows={k: list(v) for k, v in d["windows"].items()} if d.get("windows") else None,
                   policies={str(k): str(v) for k, v in (d.get("policies") or {}).items()},
                   envoy_adaptive=_envoy_adaptive(d.get("envoy_adaptive")), warnings=warnings,
                   slo_kinds=slo_kinds, labels=labels)

    def phase_load(self, phase: Phase) -> float:
        """The phase's requests/s as a multiple of the fleet capacity: its `rate`, times what its `weights` add (a
        phase at 0.6 where one of three equal kinds sends 5x runs at 1.4: an overload, not a calm phase)."""
        total = sum(k.weight for k in self.workload.kinds)
        return phase.rate * sum(k.weight * phase.weights.get(k.name, 1.0) for k in self.workload.kinds) / total

    def shortened(self, phase_s: float) -> Scenario:
        """The same scenario with every phase cut to `phase_s` simulated seconds (tests, quick looks)."""
        phases = [replace(p, duration_s=phase_s) for p in self.phases]
        shortened = Scenario(**{**self.__dict__, "phases": phases})
        # An event keeps its place relative to the phases: the same phase, the same fraction into it.
        events = []
        for e in self.events:
            p = self.phase_at(e.at_s)
            start, end = self.window(p.name)
            at = shortened.window(p.name)[0] + (e.at_s - start) / max(end - start, 1e-9) * phase_s
            events.append(FleetEvent(at, e.pool, e.replica, e.fault))
        shortened.events = tuple(events)
        return shortened

    def with_scheduling_policy(self, policy: str | None) -> Scenario:
        """The same scenario with every pool's replicas under vLLM's --scheduling-policy `policy` (None: each
        profile's own)."""
        if policy not in (None, *SCHEDULING_POLICIES):
            raise ValueError(f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        return replace(self, pools=[replace(p, scheduling_policy=policy) for p in self.pools])

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def fleet_capacity(self) -> float:
        """Requests/s the first pool sustains with this mix (measured in the engine model unless given)."""
        if self.capacity != "auto":
            return float(self.capacity)
        main = self.pools[0]
        # Only the kinds the first pool serves run on it: another model's (an 8B product of its own) once ran in
        # its closed loop, and `rate` 0.55 put 0.52 of the Mixtral pool's capacity on it (scenarios/moe-rag.yaml).
        own = self.first_pool_kinds()
        share = sum(k.weight for k in own) / sum(k.weight for k in self.workload.kinds) if own else 1.0
        point = closed_loop_mix(load_profile(main.profile), Workload(own) if own else self.workload,
                                self.capacity_concurrency, requests=2000, seed=self.seed, loras=main.lora_ids,
                                max_loras=main.max_loras)
        return point.requests_per_s * main.replicas / share

    def first_pool_kinds(self) -> list[RequestKind]:
        """The kinds whose model the first pool serves: all that modes without the ext_proc (a, b) can serve."""
        return [k for k in self.workload.kinds if self.pools[0] in self.serving(k)]

    def serving(self, kind: RequestKind) -> list[Pool]:
        """The pools that serve a kind's model (the first pool when none names it)."""
        return [p for p in self.pools if p.serves(kind.model)] or self.pools[:1]

    def schedule(self, capacity: float) -> list[tuple[float, float]]:
        """(duration_s, requests/s) per phase, for extproc.tools.loadgen.run_open_loop."""
        return [(p.duration_s, p.rate * capacity) for p in self.phases]

    def phase_weights(self) -> list[dict[str, float]]:
        """Each phase's per-kind rate factors, for extproc.tools.loadgen.plan_arrivals / run_open_loop."""
        return [p.weights for p in self.phases]

    def arrivals(self, capacity: float) -> list[PlannedRequest]:
        """Every arrival of the replay (a session's first call; its later calls follow at run time), by seed."""
        return plan_arrivals(self.workload, self.schedule(capacity), self.seed, self.phase_weights())

    def phase_at(self, t: float) -> Phase:
        start = 0.0
        for p in self.phases:
            if t < start + p.duration_s:
                return p
            start += p.duration_s
        return self.phases[-1]

    def report_windows(self) -> dict[str, tuple[float, float]]:
        """Name -> (start, end) in simulated s of each compared window; "overall" is added by the report."""
        if not self.windows:
            spike = max(self.phases, key=self.phase_load).name  # its weights count (a flood at rate 0.6 is 1.4x)
            return {"spike": self.window(spike)}
        out = {}
        for name, phases in self.windows.items():
            spans = [self.window(p) for p in phases]
            out[name] = (min(a for a, _ in spans), max(b for _, b in spans))
        return out

    def window(self, phase_name: str) -> tuple[float, float]:
        """Start and end (simulated s) of the named phase."""
        start = 0.0
        for p in self.phases:
            if p.name == phase_name:
                return start, start + p.duration_s
            start += p.duration_s
        raise KeyError(f"no phase {phase_name!r} (phases: {', '.join(p.name for p in self.phases)})")
