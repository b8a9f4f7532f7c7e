"""vLLM's Prometheus metrics for one simulated replica, in simulated seconds, as text exposition."""

from __future__ import annotations

import time
from bisect import bisect_left

from extproc.tools.sim.engine import Emission, Engine, Sequence

# Bucket boundaries as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM 0.32's vllm:iteration_tokens_total bounds for a 4096-token step budget (tests/fixtures/vllm/metrics.txt)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
# vLLM 0.32's finished_reason label values, all exposed from start-up. The simulator's only aborts are client
# disconnects, which vLLM does not count here (docs/vllm.md), and it has no errors or repetition stops.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
COUNTED_REASONS = ("stop", "length")
HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:num_preemptions_total": "Cumulative number of preemption from the engine.",
    "vllm:prefix_cache_queries_total": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits_total": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:prompt_tokens_total": "Number of prefill tokens processed.",
    "vllm:generation_tokens_total": "Number of generation tokens processed.",
}
# vLLM 0.32's texts, as recorded (tests/fixtures/vllm/metrics.json, lora_metrics.json).
WAITING_BY_REASON_HELP = ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                          "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
                          "blocked status). Sum of all reasons equals vllm:num_requests_waiting.")
LORA_INFO_HELP = "Running stats on lora requests."


class Histogram:
    """A cumulative-bucket histogram; observe() is a bisect and two adds, because it runs once per token."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = []
        cumulative = 0
        for bound, n in zip((*self.bounds, "+Inf"), self.counts):
            cumulative += n
            le = bound if isinstance(bound, str) else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        out.append(f"{name}_sum{{{labels}}} {self.total!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


class ReplicaMetrics:
    """Observes an engine's emissions and renders /metrics with vLLM's names, types and labels."""

    def __init__(self, model_name: str, engine_index: str = "0"):
        self.labels = f'engine="{engine_index}",model_name="{model_name}"'
        self.started = time.time()  # prometheus_client's process_start_time_seconds, as vLLM's /metrics has it
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)  # one observation per engine step
        # vllm:lora_requests_info, with --enable-lora only (max_loras set): one series per adapter list ever current,
        # its value the unix time it last was (vLLM sets it to the current time at every engine step's stats).
        self.max_loras: int | None = None
        self.lora_info: dict[str, float] = {}

    def observe_emissions(self, emissions: list[Emission]) -> None:
        """Record TTFT or inter-token latency per token, and request-level times for finished ones."""
        for emission in emissions:
            seq = emission.seq
            if emission.inter_token_s is None:
                self.ttft.observe(seq.first_token - seq.arrival)
            else:
                self.inter_token.observe(emission.inter_token_s)
            if emission.finish_reason is not None:
                self.observe_finished(seq)

    def observe_finished(self, seq: Sequence) -> None:
        """Request-level histograms for a sequence that finished or was aborted."""
        self.e2e.observe(max(0.0, seq.finished - seq.arrival))
        if seq.first_scheduled is not None:
            self.queue.observe(max(0.0, seq.first_scheduled - seq.arrival))

    def observe_loras(self, adapters: list[str]) -> None:
        """After an engine step: the adapters of the requests it runs. vLLM 0.32 writes the same list (adapters
        with a request its front end has seen queued or scheduled) into both running_lora_adapters and
        waiting_lora_adapters; a request deferred for the LoRA budget is in neither until it runs (recorded)."""
        if self.max_loras is not None:
            self.lora_info[",".join(dict.fromkeys(adapters))] = time.time()  # series stay in creation order

    def render(self, engine: Engine) -> str:
        """Prometheus text exposition (version 0.0.4) of the replica's current state."""
        labels = self.labels
        stats = engine.stats
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")

        family("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.")
        lines.append(f"process_start_time_seconds {self.started!r}")

        # Text format 0.0.4 names counter families with their _total suffix, as prometheus_client writes them.
        for name, kind, value in (
            ("vllm:num_requests_running", "gauge", len(engine.running)),
            ("vllm:num_requests_waiting", "gauge", len(engine.waiting)),
            ("vllm:kv_cache_usage_perc", "gauge", engine.kv_usage),
            ("vllm:prefix_cache_queries_total", "counter", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits_total", "counter", stats.prefix_cache_hits),
            ("vllm:num_preemptions_total", "counter", stats.preemptions),
            ("vllm:prompt_tokens_total", "counter", stats.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", stats.generation_tokens),
        ):
            family(name, kind, HELP[name])
            lines.append(f"{name}{{{labels}}} {float(value)!r}")
        family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
        for reason in FINISH_REASONS:
            count = stats.finished[reason] if reason in COUNTED_REASONS else 0
            lines.append(f'vllm:request_success_total{{{labels},finished_reason="{reason}"}} {float(count)!r}')
        family("vllm:num_requests_waiting_by_reason", "gauge", WAITING_BY_REASON_HELP)
        deferred = engine.deferred
        waiting = float(len(engine.waiting) - deferred)
        lines.append(f'vllm:num_requests_waiting_by_reason{{{labels},reason="capacity"}} {waiting!r}')
        lines.append(f'vllm:num_requests_waiting_by_reason{{{labels},reason="deferred"}} {float(deferred)!r}')
        if self.max_loras is not None:
            family("vllm:lora_requests_info", "gauge", LORA_INFO_HELP)
            for adapters, at in self.lora_info.items():
                lines.append(f'vllm:lora_requests_info{{max_lora="{self.max_loras}",running_lora_adapters="{adapters}",'
                             f'waiting_lora_adapters="{adapters}"}} {at!r}')
        for name, hist, help_text in (
            ("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds."),
            ("vllm:inter_token_latency_seconds", self.inter_token, "Histogram of inter-token latency in seconds."),
            ("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds."),
            ("vllm:request_queue_time_seconds", self.queue,
             "Histogram of time spent in WAITING phase for request."),
            ("vllm:iteration_tokens_total", self.iteration_tokens, "Histogram of number of tokens per engine_step."),
        ):
            family(name, "histogram", help_text)
            lines.extend(hist.lines(name, labels))
        return "\n".join(lines) + "\n"
