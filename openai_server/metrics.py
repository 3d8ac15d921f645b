"""Prometheus metrics: request counters and latency histograms per adapter, engine gauges read at scrape time."""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adapters_registry import AdapterEntry
from engine.lora_manager import LoRAResidency

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class _EngineCollector:
    """Reads the engine's live state on every scrape, so gauges are never stale."""

    def __init__(self, engine, adapters: Callable[[], list[tuple[AdapterEntry, LoRAResidency | None]]]) -> None:
        self.engine = engine
        self.adapters = adapters

    def collect(self):
        stats = self.engine.stats()
        for name, value, doc in (
            ("loraserve_num_requests_running", stats.num_running, "Requests in the running batch."),
            ("loraserve_num_requests_waiting", stats.num_waiting, "Requests waiting to be scheduled."),
            ("loraserve_kv_blocks_used", stats.kv_blocks_used, "KV-cache blocks in use."),
            ("loraserve_kv_blocks_total", stats.kv_blocks_total, "KV-cache blocks in the pool."),
            ("loraserve_lora_slots_used", stats.lora_slots_used, "Adapter slots (max_loras) holding an adapter."),
            ("loraserve_lora_slots_total", stats.lora_slots_total, "Adapter slots (max_loras)."),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, value, doc in (
            ("loraserve_num_preemptions", stats.num_preemptions, "Sequences preempted for KV blocks (recomputed later)."),
            ("loraserve_lora_slot_loads", stats.lora_slot_loads, "Adapters copied into a device slot."),
            ("loraserve_lora_disk_reads", stats.lora_disk_reads, "Adapters read from disk into host memory."),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        running = GaugeMetricFamily(
            "loraserve_adapter_running_requests",
            "Running requests per adapter (one unloaded while they run included, until they end).", labels=["adapter"]
        )
        resident = GaugeMetricFamily(
            "loraserve_adapter_resident", "1 when the adapter holds an adapter slot.", labels=["adapter"]
        )
        counts, slots = self._per_name()
        for name in counts:
            running.add_metric([name], counts[name])
            resident.add_metric([name], slots[name])
        yield running
        yield resident

    def _per_name(self) -> tuple[dict[str, int], dict[str, int]]:
        """Running requests and slot residency per adapter name: an adapter replaced in place whose old version
        still runs requests is two entries, and a label may appear once."""
        counts: dict[str, int] = {}
        slots: dict[str, int] = {}
        for entry, residency in self.adapters():
            counts[entry.name] = counts.get(entry.name, 0) + (residency.running if residency else 0)
            slots[entry.name] = max(slots.get(entry.name, 0), int(residency is not None and residency.slot is not None))
        return counts, slots


class ServerMetrics:
    """All of one app's metrics, in the app's own registry (so several apps can live in one process)."""

    def __init__(self, engine, adapters: Callable[[], list[tuple[AdapterEntry, LoRAResidency | None]]],
                 base_label: str) -> None:
        """adapters: each served adapter with its residency (`AdapterService.served`). base_label: the `adapter`
        label of base-model requests, the served model's name (no adapter may take it, so it never mixes with one)."""
        self.base_label = base_label
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "loraserve_requests", "Requests received, by endpoint and adapter.", ["endpoint", "adapter"],
            registry=self.registry,
        )
        self.finished = Counter(
            "loraserve_requests_finished", "Engine requests finished, by adapter and finish reason.",
            ["adapter", "finish_reason"], registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "loraserve_prompt_tokens", "Prompt tokens processed.", ["adapter"], registry=self.registry
        )
        self.generation_tokens = Counter(
            "loraserve_generation_tokens", "Tokens generated.", ["adapter"], registry=self.registry
        )
        self.ttft = Histogram(
            "loraserve_time_to_first_token_seconds", "Time from arrival to the first generated token.",
            ["adapter"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "loraserve_time_per_output_token_seconds", "Mean time per generated token after the first.",
            ["adapter"], buckets=_TOKEN_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "loraserve_e2e_request_latency_seconds", "Time from arrival to the last token.",
            ["adapter"], buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine, adapters))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def label(self, lora_request) -> str:
        """The `adapter` label of a request for this adapter (None: the base model)."""
        return lora_request.lora_name if lora_request is not None else self.base_label

    def tracker(self, lora_request) -> RequestTracker:
        return RequestTracker(self, self.label(lora_request))


class RequestTracker:
    """Timing and token counts of one engine request, recorded once when it ends."""

    def __init__(self, metrics: ServerMetrics, adapter: str) -> None:
        self.metrics = metrics
        self.adapter = adapter
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.done = False

    def observe(self, num_generated: int) -> None:
        if self.first_token is None and num_generated > 0:
            self.first_token = time.perf_counter()
            self.metrics.ttft.labels(self.adapter).observe(self.first_token - self.arrival)

    def finish(self, finish_reason: str, prompt_tokens: int, generated_tokens: int, longest_choice: int) -> None:
        """generated_tokens: over all n choices; longest_choice: the most one choice made, which the time per
        output token divides by (the choices decode side by side, one token each a step)."""
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        m = self.metrics
        m.finished.labels(self.adapter, finish_reason).inc()
        m.prompt_tokens.labels(self.adapter).inc(prompt_tokens)
        m.generation_tokens.labels(self.adapter).inc(generated_tokens)
        m.e2e.labels(self.adapter).observe(now - self.arrival)
        if self.first_token is not None and longest_choice > 1:
            m.tpot.labels(self.adapter).observe((now - self.first_token) / (longest_choice - 1))
