"""What the scheduler reports about itself: its ready report, its state (``server_info``) and
the load figures routers balance on (``load_info``), with the windowed rates behind them.

``load_info`` is answered between two steps and reads only counters (no device sync, no wait
for the step in flight), so it costs the loop microseconds however often it is asked.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm.srt.scheduler.scheduler import Scheduler

RATE_WINDOW_S = 10.0  # throughput and cache hit rate cover this much recent time
BUCKET_S = 0.25  # events closer together than this share one bucket of the window


class WindowedSum:
    """Sums of values added over the last ``window_s`` seconds, in buckets of ``bucket_s``
    (so the memory is bounded by ``window_s / bucket_s`` buckets)."""

    def __init__(
        self,
        window_s: float = RATE_WINDOW_S,
        bucket_s: float = BUCKET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self.clock = clock
        self.buckets: deque[list[float]] = deque()  # [start time, sum of a, sum of b]
        self.started_s = clock()

    def add(self, a: float, b: float = 0.0) -> None:
        now = self.clock()
        if self.buckets and now - self.buckets[-1][0] < self.bucket_s:
            self.buckets[-1][1] += a
            self.buckets[-1][2] += b
        else:
            self.buckets.append([now, a, b])
        self._prune(now)

    def sums(self) -> tuple[float, float]:
        self._prune(self.clock())
        return sum(x[1] for x in self.buckets), sum(x[2] for x in self.buckets)

    def rate(self) -> float:
        """Sum of ``a`` per second over the window (or since start, when that is shorter)."""
        span = min(self.window_s, self.clock() - self.started_s)
        return self.sums()[0] / span if span > 0 else 0.0

    def _prune(self, now: float) -> None:
        while self.buckets and now - self.buckets[0][0] > self.window_s:
            self.buckets.popleft()


class LoadStats:
    """Counters the scheduler feeds: sampled tokens, and the cached share of admitted prompts."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.generated = WindowedSum(clock=clock)
        self.prompts = WindowedSum(clock=clock)  # (cached tokens, prompt tokens) at admission
        self._step_tokens = 0
        # since start: requests admitted, their prompt tokens and those served from the cache
        self.totals = {"num_admitted_reqs": 0, "num_prompt_tokens": 0, "num_cached_tokens": 0}

    def count_token(self) -> None:
        self._step_tokens += 1

    def end_step(self) -> None:
        if self._step_tokens:
            self.generated.add(self._step_tokens)
            self._step_tokens = 0

    def on_admit(self, cached_tokens: int, prompt_tokens: int) -> None:
        self.prompts.add(cached_tokens, prompt_tokens)
        self.totals["num_admitted_reqs"] += 1
        self.totals["num_prompt_tokens"] += prompt_tokens
        self.totals["num_cached_tokens"] += cached_tokens

    def cache_hit_rate(self) -> float:
        cached, total = self.prompts.sums()
        return cached / total if total else 0.0


def ready_info(s: Scheduler) -> dict[str, Any]:
    r = s.runner
    return {
        "model_path": str(r.model_dir),
        "architecture": r.model_config.architecture,
        "max_total_tokens": s.kv.max_total_tokens,
        "page_size": s.kv.page_size,  # resolved: --enable-hierarchical-cache raises 1 to 16
        "context_length": r.context_length,
        "vocab_size": r.vocab_size,
        "device": str(r.device),
        "dtype": str(r.dtype).replace("torch.", ""),
        "kv_dtype": str(r.kv_pool.storage_dtype).replace("torch.", ""),  # resolved kv_cache_dtype
        "kv_scales": r.kv_pool.scales_info(),  # {"k": [...], "v": [...]} per layer; None: not fp8
        "attention_backend": r.attn_backend.name,
        "eos_token_ids": sorted(s.stop_checker.eos_token_ids),
        "disaggregation_mode": s.disagg.mode,
    }


def server_info(s: Scheduler) -> dict[str, Any]:
    info: dict[str, Any] = s.kv.usage()
    info.update(
        num_running=len(s.running) + (s.chunked is not None),
        num_waiting=len(s.waiting),
        num_forward_steps=s.num_forward_steps,
        num_retractions=s.num_retractions,  # cumulative: requests sent back to wait for KV
        num_preemptions=s.num_preemptions,  # of those, retracted for a higher priority
        num_parked_chunks=s.num_parked_chunks,  # prompts between chunks that waited for one
        num_refused=s.gate.num_refused,  # cumulative: 503s at the queue's door (queue_gate.py)
        weight_version=s.weight_version,  # update_weights_from_disk's label
        paused=s.paused,  # /pause_generation's in_place or retract; None while running
        new_token_ratio=round(s.admission.reserve_ratio, 4),  # prefill.py: room kept for decode
        grammar=s.grammars.info(),
        prefix_cache=dict(s.stats.totals),  # cumulative; bench_serving reads it per worker
    )
    quant = getattr(s.runner, "quant_report", None)  # quantised models: the load-time check
    if quant is not None:
        info["quantization_report"] = quant
    expert_load = getattr(s.runner.model, "expert_load", None)  # MoE models only
    if expert_load is not None:
        info["expert_load"] = expert_load()
    tiers = s.cache.tier_stats()
    if tiers:
        info["hicache"] = tiers
    if s.spec.enabled:
        info["speculative"] = s.spec.info()
    s.retention.expire()
    info["session_retention"] = s.retention.info()
    disagg = s.disagg.info()  # transfers of a prefill or decode worker
    if disagg is not None:
        info["disaggregation"] = disagg
    return info


def load_info(s: Scheduler) -> dict[str, Any]:
    """The scheduler's load now: requests running and waiting (the grammar queue included),
    KV tokens held by requests (the pool less its free and evictable slots), the tokens of the
    waiting prompts, and the recent rates."""
    max_total = s.kv.max_total_tokens
    available, evictable = s.kv.allocator.available_size(), s.cache.evictable_size()
    used = max_total - available - evictable
    compiling = [item.req for item in s.grammars.queue.pending]
    waiting = [*s.waiting, *compiling]
    num_running = len(s.running) + (s.chunked is not None)
    token_usage = used / max_total
    return {
        "timestamp": time.time(),
        "num_running_reqs": num_running,
        "num_waiting_reqs": len(waiting),
        "num_grammar_queue_reqs": len(compiling),
        "num_retracted_reqs": sum(1 for r in s.waiting if r.admitted),
        "num_used_tokens": used,
        "num_available_tokens": available,
        "num_evictable_tokens": evictable,  # held only by the prefix cache
        "num_pending_tokens": sum(r.fill_len for r in waiting),
        "max_total_num_tokens": max_total,
        "max_running_requests": s.cfg.max_running_requests,
        "token_usage": round(token_usage, 4),
        "gen_throughput": round(s.stats.generated.rate(), 2),
        "cache_hit_rate": round(s.stats.cache_hit_rate(), 4),
        # how close the server is to its first limit: the KV pool or the running-request cap
        "utilization": round(max(token_usage, num_running / s.cfg.max_running_requests), 4),
        **({"hicache": tiers} if (tiers := s.cache.tier_stats()) else {}),
    }
