"""Prometheus metrics for ``GET /metrics``: request latencies (observed by the tokenizer manager),
token counters, and scheduler gauges refreshed from ``server_info`` at scrape time."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

PREFIX = "radixlm_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
# hierarchical-cache figures of the scheduler's load report, exported as gauges
HICACHE_GAUGES = {
    "device_hit_tokens": "Prompt tokens admissions found on the device (cumulative)",
    "host_hit_tokens": "Prompt tokens loaded back from host memory (cumulative)",
    "disk_hit_tokens": "Prompt tokens loaded back from the disk tier (cumulative)",
    "host_used_tokens": "Tokens held in the host KV pool",
    "host_total_tokens": "Size of the host KV pool in tokens",
    "disk_used_bytes": "Bytes held by the disk KV tier",
    "copy_load_bytes_per_s": "Measured host -> device copy rate",
    "copy_write_bytes_per_s": "Measured device -> host copy rate",
    "disk_bytes_per_s": "Measured disk read rate",
    "loads_skipped_slower": "Loads skipped as slower than recomputing (cumulative)",
}
# speculative decoding figures of the scheduler's server_info, exported as gauges
SPECULATIVE_GAUGES = {
    "acceptance_rate": "Accepted draft tokens / verified draft tokens (since start)",
    "mean_accept_length": "Tokens added per request per verify step (since start)",
    "num_verify_steps": "Verify steps, counted per request (cumulative)",
    "num_proposed_tokens": "Draft tokens verified (cumulative)",
    "num_accepted_tokens": "Draft tokens accepted (cumulative)",
}
# prefill-decode disaggregation figures of the scheduler's server_info (prefill and decode
# workers only), exported as gauges
DISAGGREGATION_GAUGES = {
    "pending_transfers": "KV transfers waiting or in progress",
    "num_transfers": "KV transfers completed (cumulative)",
    "num_transfer_failures": "KV transfers refused, failed or timed out (cumulative)",
    "transfer_bytes_total": "KV bytes written to decode workers (cumulative)",
    "transfer_bytes_per_s": "KV bytes per second of the transfer engine's writes (since start)",
}


class ServerMetrics:
    """Implements the tokenizer manager's ``RequestObserver``; one registry per server."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(
                PREFIX + name, doc, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = hist(
            "time_to_first_token_seconds", "Time to the first streamed token", TTFT_BUCKETS
        )
        self.itl = hist("inter_token_latency_seconds", "Time between streamed tokens", ITL_BUCKETS)
        self.e2e = hist(
            "e2e_request_latency_seconds", "Request latency from arrival to finish", E2E_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache")
        self.requests = counter("requests", "Finished requests")
        self.running = gauge("num_running_reqs", "Requests decoding now")
        self.waiting = gauge("num_waiting_reqs", "Requests waiting for admission")
        self.kv_usage = gauge("token_usage", "Fraction of the KV pool held by running requests")
        self.kv_used = gauge("num_used_tokens", "KV slots held by running requests")
        self.kv_cached = gauge("num_cached_tokens", "KV slots held only by the prefix cache")
        self.cache_hit_rate = gauge("cache_hit_rate", "Cached prompt tokens / prompt tokens")
        self.hicache = {key: gauge(f"hicache_{key}", doc) for key, doc in HICACHE_GAUGES.items()}
        self.speculative = {
            key: gauge(f"speculative_{key}", doc) for key, doc in SPECULATIVE_GAUGES.items()
        }
        self.disaggregation = {
            key: gauge(f"disaggregation_{key}", doc) for key, doc in DISAGGREGATION_GAUGES.items()
        }
        # MoE models: tokens routed to each expert (cumulative) and each layer's imbalance
        self.expert_tokens = Gauge(
            PREFIX + "moe_expert_tokens",
            "Tokens routed to an expert since start (MoE layers)",
            ["model_name", "layer", "expert"],
            registry=self.registry,
        )
        self.expert_imbalance = Gauge(
            PREFIX + "moe_expert_imbalance",
            "Busiest expert's routed tokens over the layer's mean (1: even)",
            ["model_name", "layer"],
            registry=self.registry,
        )
        self.model_name = model_name
        self._prompt_total = 0
        self._cached_total = 0

    # RequestObserver
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_tokens(self, per_token_s: float) -> None:
        self.itl.observe(per_token_s)

    def on_finish(self, e2e_s: float, prompt: int, completion: int, cached: int) -> None:
        self.e2e.observe(e2e_s)
        self.requests.inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        self._prompt_total += prompt
        self._cached_total += cached
        self.cache_hit_rate.set(
            self._cached_total / self._prompt_total if self._prompt_total else 0
        )

    def update_scheduler(self, info: dict[str, Any]) -> None:
        """Gauges from the scheduler's ``server_info`` reply."""
        total = info.get("max_total_tokens") or 0
        evictable = info.get("evictable", 0)
        used = max(total - info.get("available", total) - evictable, 0)
        self.running.set(info.get("num_running", 0))
        self.waiting.set(info.get("num_waiting", 0))
        self.kv_used.set(used)
        self.kv_cached.set(evictable)
        self.kv_usage.set(used / total if total else 0.0)
        sections = (
            ("hicache", self.hicache),
            ("speculative", self.speculative),
            ("disaggregation", self.disaggregation),
        )
        for section, gauges in sections:
            figures = info.get(section) or {}
            for key, g in gauges.items():
                value = figures.get(key)
                if isinstance(value, (int, float)):
                    g.set(value)
        if info.get("expert_load"):
            self._update_expert_load(info["expert_load"])

    def _update_expert_load(self, load: dict[str, Any]) -> None:
        for layer, row, imbalance in zip(
            load["layers"], load["tokens_per_expert"], load["imbalance"], strict=True
        ):
            self.expert_imbalance.labels(self.model_name, str(layer)).set(imbalance)
            for expert, tokens in enumerate(row):
                self.expert_tokens.labels(self.model_name, str(layer), str(expert)).set(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
