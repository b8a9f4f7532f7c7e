"""One simulated vLLM server: routes HTTP requests to an engine driven by an asyncio loop in scaled time."""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import asdict, dataclass, fields

from extproc.tools.sim.engine import Emission, Engine, Sequence
from extproc.tools.sim.http11 import HttpRequest, ResponseWriter
from extproc.tools.sim.lora import Adapter, LoraRegistry
from extproc.tools.sim.metrics import ReplicaMetrics
from extproc.tools.sim.openai_api import (ADAPTER_HEADER, CHAT, COMPLETIONS, INVOCATIONS, PRIORITY_HEADER, RESPONSES,
                                          SIM_VERSION, ApiError, GenerationRequest, ResponseRenderer,
                                          ResponsesRenderer, check_json_request, detokenize_body, error_body,
                                          fixed_output_tokens, header_priority, models_body, parse_generation,
                                          parse_invocation, renderer_for, tokenize_body, vllm_json)
from extproc.tools.sim.profile import Profile

# If the loop falls this far behind simulated time (CPU starved), it stops trying to catch up.
MAX_LAG_REAL_S = 0.25
GENERATION_PATHS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/v1/responses": RESPONSES,
                    "/invocations": INVOCATIONS}
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


@dataclass
class Faults:
    """Injected misbehaviour (POST /sim/fault): added latency, random 500s, slower iterations, draining, a hung
    engine."""

    extra_latency_s: float = 0.0  # simulated seconds before a request reaches the engine
    error_rate: float = 0.0  # fraction of generation requests answered with 500
    slowdown: float = 1.0  # multiplies every iteration's duration
    draining: float = 0.0  # 1: /health answers 503, so the load balancer takes the replica out; it still serves
    # 1: the engine stops stepping (a wedged GPU or engine core): requests are taken and held, no token comes,
    # /health and /metrics still answer, the token counters stand still. 0 again: it goes on where it stopped.
    hang: float = 0.0


FAULT_KEYS = frozenset({f.name for f in fields(Faults)} | {"reset"})  # what a POST /sim/fault body may hold


def fault_value(value) -> float:
    """A fault's value as POST /sim/fault takes it: a finite number >= 0 (json.loads takes NaN and Infinity, and a
    NaN slowdown made the engine's clock NaN for good; a negative one ran it backwards)."""
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"must be a finite number >= 0, got {value!r}")
    return number


class SimClock:
    """Simulated seconds since start: real time on the event loop's clock, times `speed`."""

    def __init__(self, speed: float):
        self.speed = speed
        self.origin = asyncio.get_running_loop().time()

    def now(self) -> float:
        return (asyncio.get_running_loop().time() - self.origin) * self.speed

    def real_time_of(self, sim_t: float) -> float:
        return self.origin + sim_t / self.speed


class _Request:
    """A client request: its writer, renderer and sequences (one per choice: n > 1 and prompt lists run several,
    as vLLM runs each as a request of its own, a prompt's samples sharing its blocks), and the outputs of those that
    finished."""

    __slots__ = ("writer", "renderer", "seqs", "outputs", "left")

    def __init__(self, writer: ResponseWriter, renderer: ResponseRenderer | ResponsesRenderer, choices: int):
        self.writer, self.renderer = writer, renderer
        self.seqs: list[Sequence] = []
        self.outputs: list[tuple[int, str] | None] = [None] * choices  # (completion tokens, finish_reason)
        self.left = choices


class _Active:
    """A sequence inside the engine: the request it answers, as choice number `choice`."""

    __slots__ = ("seq", "request", "choice")

    def __init__(self, seq: Sequence, request: _Request, choice: int):
        self.seq, self.request, self.choice = seq, request, choice


class Replica:
    """A simulated vLLM replica: HTTP handler plus the engine loop that paces iterations in real time."""

    def __init__(self, profile: Profile, speed: float = 1.0, seed: int = 0, lora_modules: list[Adapter] = (),
                 runtime_lora: bool = False, max_loras: int = 1):
        self.profile = profile
        self.speed = speed
        self.loras = LoraRegistry(profile.model_names, lora_modules)
        # vLLM registers the load/unload endpoints only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set.
        self.runtime_lora = runtime_lora
        # LoRA is on (vLLM's --enable-lora) when adapters are given or may be loaded; then --max-loras applies.
        self.engine = Engine(profile, seed=seed, max_loras=max_loras if lora_modules or runtime_lora else None)
        self.metrics = ReplicaMetrics(profile.model_names[0])
        self.metrics.max_loras = self.engine.max_loras
        self.faults = Faults()
        self._fault_rng = random.Random(seed + 7919)
        self._active: dict[int, _Active] = {}
        self._clock: SimClock | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._sim_t = 0.0  # the engine's own time: end of the last iteration
        # vLLM publishes its gauges after each engine step, and a step takes in what arrived before it: a request an
        # idle engine can run at once is never seen waiting. Here the step waits for the engine loop's next turn, so
        # a scrape that comes while the parked loop has been woken is answered after that step (_answer_scrapes).
        self._parked = False
        self._scrapes: list[ResponseWriter] = []

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._clock = SimClock(self.speed)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._answer_scrapes()

    # -- engine loop ----------------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock, engine = self._clock, self.engine
        while True:
            if self.faults.hang or not engine.has_work:
                await self._park()
                # Idle (or hung) time passes in simulated time too; while busy, iterations follow each other exactly.
                self._sim_t = max(self._sim_t, clock.now())
                continue
            duration = engine.begin_iteration(self._sim_t)
            self._answer_scrapes()
            if duration is None:  # nothing schedulable right now; wait for an arrival or abort
                await self._park()
                continue
            self._sim_t += duration
            self.metrics.iteration_tokens.observe(engine.step_tokens)
            # Sleep to an absolute deadline, so timer granularity and overshoot do not accumulate.
            delay = clock.real_time_of(self._sim_t) - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                # Behind schedule (CPU starved, or a high speed): still yield once per iteration, or disconnects
                # and new requests would wait until the whole backlog is generated (a stream whose client left
                # would run to its end instead of being aborted, as vLLM aborts between steps).
                await asyncio.sleep(0)
                if delay < -MAX_LAG_REAL_S:
                    self._sim_t = clock.now()
            self._deliver(engine.end_iteration(self._sim_t))

    async def _park(self) -> None:
        """Wait for an arrival, an abort or a fault change."""
        self._answer_scrapes()
        self._wake.clear()
        self._parked = True
        try:
            await self._wake.wait()
        finally:
            self._parked = False

    def _answer_scrapes(self) -> None:
        if not self._scrapes:  # the usual case, after every engine step: no list made
            return
        scrapes, self._scrapes = self._scrapes, []
        for writer in scrapes:
            self._send_metrics(writer)

    def _send_metrics(self, writer: ResponseWriter) -> None:
        writer.send(200, self.metrics.render(self.engine).encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _deliver(self, emissions: list[Emission]) -> None:
        self.metrics.observe_emissions(emissions)
        if self.engine.max_loras is not None:
            names = {i: name for name, i in self.loras.ids.items()}
            self.metrics.observe_loras([names[seq.lora] for seq in self.engine.running if seq.lora in names])
        active = self._active
        for emission in emissions:
            entry = active.get(emission.seq.id)
            if entry is None:
                continue
            seq, request = entry.seq, entry.request
            writer, renderer = request.writer, request.renderer
            reason = emission.finish_reason
            if reason is not None:
                del active[seq.id]
                request.outputs[entry.choice] = (seq.generated, reason)
                request.left -= 1
            if renderer.request.stream:
                event = renderer.token_event(seq.generated - 1, reason, entry.choice)
                if reason is None or request.left:
                    writer.write_chunk(event)
                else:
                    writer.end_stream(event + renderer.closing_events(request.outputs))
            elif reason is not None and not request.left:
                writer.send(200, renderer.full_response(request.outputs))

    # -- HTTP -----------------------------------------------------------------------------------------------
    def handle(self, request: HttpRequest, writer: ResponseWriter) -> None:
        """Route one request (called by the HTTP protocol)."""
        path = request.path
        kind = GENERATION_PATHS.get(path)
        if kind is not None:
            self._generation(kind, request, writer)
        elif path in ("/health", "/ping"):  # vLLM answers /ping (SageMaker's health path) as /health
            writer.send(503 if self.faults.draining else 200, b"")
        elif path == "/metrics":
            if self._parked and self._wake.is_set():
                self._scrapes.append(writer)  # answered after the step the loop is about to take
            else:
                self._send_metrics(writer)
        elif path == "/v1/models":
            cards = [(a.name, a.path, self.loras.parent(a)) for a in self.loras.adapters.values()]
            writer.send(200, models_body(self.profile.model_names, self.profile.max_model_len, adapters=cards))
        elif path in LORA_PATHS and self.runtime_lora:
            self._lora_update(path, request, writer)
        elif path in ("/tokenize", "/detokenize"):
            self._tokenize(path, request, writer)
        elif path == "/version":
            writer.send(200, vllm_json({"version": SIM_VERSION}))
        elif path == "/sim/state":
            writer.send(200, json.dumps(self.state()).encode())
        elif path == "/sim/fault" and request.method == "POST":
            self._set_faults(request, writer)
        else:
            writer.send(404, vllm_json({"detail": "Not Found"}))

    def state(self) -> dict:
        """Engine and fault state, for tests and the operator (GET /sim/state)."""
        e = self.engine
        return {"profile": self.profile.name, "models": list(self.profile.model_names),
                "lora_adapters": list(self.loras.adapters), "speed": self.speed,
                "scheduling_policy": self.profile.scheduling_policy,
                "sim_time_s": self._clock.now() if self._clock else 0.0, "running": len(e.running),
                "waiting": len(e.waiting), "kv_cache_usage": e.kv_usage, "free_blocks": e.free_blocks,
                "preemptions": e.stats.preemptions, "generation_tokens": e.stats.generation_tokens,
                "finished": dict(e.stats.finished), "faults": asdict(self.faults)}

    def _set_faults(self, request: HttpRequest, writer: ResponseWriter) -> None:
        try:
            body = json.loads(request.body or b"{}")
            unknown = sorted(set(body) - FAULT_KEYS)
            if unknown:  # a misspelt fault must not be a silent no-op
                raise ValueError(f"unknown fault {unknown[0]!r} (known: {', '.join(sorted(FAULT_KEYS))})")
            values = {}
            for f in fields(Faults):
                if f.name in body:
                    try:
                        values[f.name] = fault_value(body[f.name])
                    except ValueError as exc:
                        raise ValueError(f"{f.name}: {exc}") from None
            if body.get("reset"):
                self.faults = Faults()
            for name, value in values.items():
                setattr(self.faults, name, value)
        except (ValueError, TypeError, AttributeError) as exc:
            writer.send(400, error_body(400, f"bad fault: {exc}", "BadRequestError"))
            return
        self.engine.slowdown = self.faults.slowdown
        if self._wake is not None:
            self._wake.set()  # a hung engine goes on (or an idle one notices nothing)
        writer.send(200, json.dumps(asdict(self.faults)).encode())

    def _lora_update(self, path: str, request: HttpRequest, writer: ResponseWriter) -> None:
        """POST /v1/load_lora_adapter or /v1/unload_lora_adapter: vLLM answers success as plain text (no
        content-type), errors as its JSON error object."""
        if request.method != "POST":
            writer.send(405, vllm_json({"detail": "Method Not Allowed"}), headers={"allow": "POST"})
            return
        update = self.loras.load if path == LORA_PATHS[0] else self.loras.unload
        try:
            check_json_request(request.headers, request.body)
            writer.send(200, update(request.body).encode(), None)
        except ApiError as exc:
            writer.send(exc.status, exc.body())

    def _tokenize(self, path: str, request: HttpRequest, writer: ResponseWriter) -> None:
        """POST /tokenize or /detokenize: answered on the spot, as vLLM's API server answers them (no engine)."""
        if request.method != "POST":
            writer.send(405, vllm_json({"detail": "Method Not Allowed"}), headers={"allow": "POST"})
            return
        p = self.profile
        try:
            check_json_request(request.headers, request.body)
            if path == "/tokenize":
                writer.send(200, tokenize_body(request.body, p.model_names, p.max_model_len, self.loras))
            else:
                writer.send(200, detokenize_body(request.body, p.model_names, self.loras))
        except ApiError as exc:
            writer.send(exc.status, exc.body())

    def _generation(self, kind: str, request: HttpRequest, writer: ResponseWriter) -> None:
        if request.method != "POST":
            writer.send(405, vllm_json({"detail": "Method Not Allowed"}),  # the web framework's body
                        headers={"allow": "POST"})
            return
        p = self.profile
        try:
            check_json_request(request.headers, request.body, body_param=kind != INVOCATIONS)
            if kind == INVOCATIONS:  # chat or completions, by the body
                parsed = parse_invocation(request.body, request.headers.get(ADAPTER_HEADER), p.model_names,
                                          p.max_model_len, p.default_max_tokens, self.loras)
            else:
                parsed = parse_generation(kind, request.body, p.model_names, p.max_model_len, p.default_max_tokens,
                                          self.loras)
        except ApiError as exc:
            writer.send(exc.status, exc.body())
            return
        parsed.priority = header_priority(request.headers.get(PRIORITY_HEADER), parsed.priority)
        faults = self.faults
        if faults.error_rate > 0 and self._fault_rng.random() < faults.error_rate:
            writer.send(500, error_body(500, "simulated fault", "InternalServerError"))
            return
        if faults.extra_latency_s > 0:
            handle = asyncio.get_running_loop().call_later(faults.extra_latency_s / self.speed,
                                                           self._submit, parsed, writer)
            writer.on_disconnect = handle.cancel
        else:
            self._submit(parsed, writer)

    def _submit(self, parsed: GenerationRequest, writer: ResponseWriter) -> None:
        if writer.disconnected:
            return
        renderer = renderer_for(parsed)
        request = _Request(writer, renderer, parsed.choices)
        now, lora = self._clock.now(), self.loras.ids.get(parsed.model, 0)
        if not self._parked:
            # A busy engine lagging behind the clock (up to MAX_LAG_REAL_S) takes the request in at its own time, the
            # end of the step under way: stamped with the clock, it would be served before it arrived.
            now = min(now, self._sim_t)
        for first in range(0, parsed.choices, parsed.n):  # a prompt's n samples: choices first .. first + n - 1
            prompt_tokens, max_tokens = parsed.sequence(first)
            seqs = self.engine.add_samples(prompt_tokens, max_tokens, now, parsed.n,
                                           natural_tokens=fixed_output_tokens(max_tokens, parsed.ignore_eos),
                                           priority=parsed.priority, lora=lora)
            for choice, seq in enumerate(seqs, first):
                self._active[seq.id] = _Active(seq, request, choice)
            request.seqs.extend(seqs)
        writer.on_disconnect = lambda: self._abort(request)
        if parsed.stream:
            writer.start_stream()
            writer.write_chunk(renderer.opening_events())
        self._wake.set()

    def _abort(self, request: _Request) -> None:
        """The client went away: free its sequences, as vLLM does on disconnect. Like vLLM 0.32, a client abort
        shows only as the running (or waiting) gauge dropping: it is not counted in
        `request_success_total{finished_reason="abort"}` nor observed in the request histograms
        (docs/vllm.md); the engine's own count (GET /sim/state `finished.abort`) still has it."""
        left = [seq for seq in request.seqs if self._active.pop(seq.id, None) is not None]
        if not left:
            return
        now = max(self._sim_t, self._clock.now())
        for seq in left:
            self.engine.abort(seq, now)
        self._wake.set()
