"""A request's life inside the scheduler: tokens, KV placement, sampling state, logprobs."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from radixlm.srt.sampling.params import SamplingParams

if TYPE_CHECKING:
    from radixlm.grammar import GrammarMatcher


PENDING_TOKEN = -1  # output id of a token sampled on the device and not read back yet


class ReqStatus(enum.Enum):
    """Where a live request is; a finished one is told by ``is_finished`` (its finish reason)."""

    WAITING = "waiting"
    RUNNING = "running"


@dataclass(eq=False)  # requests compare by identity (they live in lists)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # logprobs of these ids at each position
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: dict[str, Any] | None = None
    generator: torch.Generator | None = None  # own RNG when the request carries a seed

    # KV placement (valid while the request holds a req slot)
    req_slot: int = -1
    num_kv_tokens: int = (
        0  # tokens whose K/V are in the pool, req_to_token[req_slot, :num_kv_tokens]
    )
    num_cached_prefix: int = 0  # of those, the leading tokens owned by the prefix cache
    last_kv_slot: int = 0  # req_to_token[req_slot, num_kv_tokens - 1], kept on the host (pages > 1)
    cache_node: Any = None  # the prefix cache node locked for this request
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted: bool = False  # admitted once (a retracted request coming back keeps its figures)
    prefetch: Any = None  # the prefix cache's prefetch handle while the request waits
    routing_key: str | None = None  # --schedule-policy routing-key: admitted beside its key
    cache_salt: str | None = None  # the prefix cache's namespace: shares only with the same
    retain_key: str | None = None  # a session turn: its prefix is held under this key after

    # prefill-decode disaggregation (scheduler/disaggregation.py): the prefill worker's
    # bootstrap address and the pair's room, as the router sent them; None: a whole request
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    disagg_done: bool = False  # the prefill worker has taken this request's KV hand-off

    # queue order (queue_order.py): priority as given (None: the lowest), the caller's
    # namespace, and the arrival number (FCFS within a priority; kept across retractions)
    priority: int | None = None
    caller: str = ""
    arrival: int = 0
    arrival_time: float = 0.0  # time.monotonic() when the scheduler received it

    # constrained decoding (stays unset for unconstrained requests)
    grammar: GrammarMatcher | None = None  # has accepted exactly output_ids; set once compiled

    # streaming bookkeeping
    num_sent_tokens: int = 0
    sent_input_logprobs: bool = False
    output_token_logprobs: list[list[float]] = field(default_factory=list)
    output_top_logprobs: list[list[list[float]]] = field(default_factory=list)
    partial_input_logprobs: list[list[float | None]] = field(default_factory=list)
    partial_input_top: list[list[list[float]]] = field(default_factory=list)
    input_token_logprobs: list[list[float | None]] | None = None
    input_top_logprobs: list[list[list[float]]] | None = None
    # rows of [logprob, token_id] pairs of token_ids_logprob, as the top-logprob rows
    output_token_ids_logprobs: list[list[list[float]]] = field(default_factory=list)
    partial_input_token_ids: list[list[list[float]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[float]]] | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Every token that must be in the KV cache before the next token can be sampled."""
        return self.prompt_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building the whole list (hot in decode)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:end] + self.output_ids[: max(end - n, 0)]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_normal_finish(self) -> bool:
        """Finished by a stop condition or its length (not aborted, not failed)."""
        return self.finish_reason is not None and self.finish_reason.get("type") in (
            "stop",
            "length",
        )

    @property
    def wants_input_logprobs(self) -> bool:
        return (
            self.return_logprob
            and self.logprob_start_len >= 0
            and self.input_token_logprobs is None
        )

    def max_prefix_match(self) -> int:
        """How many leading fill tokens may come from the cache: never all of them (the last
        one is computed to sample from), and not past the first position whose input logprob
        the user asked for."""
        limit = len(self.fill_ids) - 1
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
