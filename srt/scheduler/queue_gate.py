"""Admission control at the door of the waiting queue: the bound on queued requests
(``--max-queued-requests``) and the time-to-first-token target (``--ttft-target-ms``).

A new request is refused with 503 (the HTTP layer adds ``Retry-After``) when

- the queue (requests waiting for admission, those whose grammar compiles included) already
  holds ``max_queued_requests``: "The request queue is full." (SGLang's words). With priority
  scheduling a new request that outranks the least preferred waiting one (queue_order.py) takes
  its place instead, and that one is refused: "The request is aborted by a higher priority
  request."; a request already admitted once (retracted, with output) is never pushed out;
- or its estimated time to first token exceeds ``ttft_target_ms``: the prompt tokens queued
  ahead of it (waiting requests of a better or equal rank, the rest of a prompt between two
  chunks) plus its own, at the prefill rate measured on this server (an average over recent
  prefill steps; no estimate, so no refusal, before the first one).

Nothing is refused once admitted: running and retracted requests always finish (or are
aborted by their client). What goes first under overload: new requests, the least preferred
first (docs/operations/overload.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from radixlm.srt.config import ServerConfig
from radixlm.srt.scheduler.prefill import PrefillRate
from radixlm.srt.scheduler.queue_order import PriorityRule, queue_victim
from radixlm.srt.scheduler.req import Req

QUEUE_FULL = "The request queue is full."
PUSHED_OUT = "The request is aborted by a higher priority request."


def overloaded(message: str) -> dict:
    """The finish reason of a refused request: an abort carrying HTTP 503."""
    return {"type": "abort", "message": message, "status_code": 503}


class QueueGate:
    def __init__(
        self,
        rule: PriorityRule,
        max_queued_requests: int | None = None,
        ttft_target_ms: float | None = None,
        prefill_rate: PrefillRate | None = None,
    ) -> None:
        self.rule = rule
        self.max_queued_requests = max_queued_requests
        self.ttft_target_s = None if ttft_target_ms is None else ttft_target_ms / 1000
        self.rate = prefill_rate or PrefillRate()  # the scheduler's, fed per prefill step
        self.num_refused = 0

    @classmethod
    def from_config(
        cls, cfg: ServerConfig, rule: PriorityRule, prefill_rate: PrefillRate | None = None
    ) -> QueueGate:
        return cls(rule, cfg.max_queued_requests, cfg.ttft_target_ms, prefill_rate)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.rate.tokens_per_s

    def check(
        self, req: Req, waiting: Sequence[Req], num_compiling: int = 0, num_chunk_left: int = 0
    ) -> tuple[str | None, Req | None]:
        """(why ``req`` is refused, or None; a waiting request it pushes out, or None)."""
        victim = None
        cap = self.max_queued_requests
        if cap is not None and len(waiting) + num_compiling >= cap:
            victim = queue_victim(self.rule, req, waiting)
            if victim is None:
                self.num_refused += 1
                return QUEUE_FULL, None
        late = self._ttft_refusal(req, [r for r in waiting if r is not victim], num_chunk_left)
        if late is not None:
            self.num_refused += 1
            return late, None
        return None, victim

    def estimated_ttft_s(self, req: Req, waiting: Sequence[Req], num_chunk_left: int = 0) -> float:
        """Seconds of prefill ahead of ``req`` and its own (0 before any rate is measured)."""
        if not self.prefill_tokens_per_s:
            return 0.0
        rank = self.rule.rank(req)
        ahead = sum(r.fill_len - r.num_kv_tokens for r in waiting if self.rule.rank(r) <= rank)
        return (ahead + num_chunk_left + req.fill_len) / self.prefill_tokens_per_s

    def _ttft_refusal(self, req: Req, waiting: Sequence[Req], num_chunk_left: int) -> str | None:
        if self.ttft_target_s is None:
            return None
        estimate = self.estimated_ttft_s(req, waiting, num_chunk_left)
        if estimate <= self.ttft_target_s:
            return None
        return (
            f"The server cannot meet its time-to-first-token target of "
            f"{self.ttft_target_s * 1000:.0f} ms for this request (about {estimate * 1000:.0f} ms "
            "of prefill is queued ahead of it); retry later."
        )
