"""One generate request as the tokenizer manager takes it (``GenerateInput``, SGLang's native
field names, one sequence) and once it is checked and tokenized (``PreparedReq``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from radixlm.srt.managers.sessions import SessionParams, Turn, TurnPlan
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.sampling.params import SamplingParams


class RequestObserver(Protocol):
    """Receives per-request timings (the server's Prometheus metrics implement it)."""

    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, per_token_s: float) -> None: ...
    def on_finish(self, e2e_s: float, prompt: int, completion: int, cached: int) -> None: ...


@dataclass
class GenerateInput:
    """One (non-batched) generate request in SGLang's native field names."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    rid: str | None = None  # the client's rid (display and abort_request), not the wire rid
    abort_keys: tuple[str, ...] = ()  # more client rids that abort this one (a batch's rid)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # checked by the front door
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_params: SessionParams | None = None  # a turn of a session (sessions.py)
    log_metrics: bool = True  # false: left out of the latency metrics
    return_prompt_token_ids: bool = False  # the response gets the ids the request ran on
    priority: int | None = None  # SGLang's priority (with --enable-priority-scheduling)
    cache_salt: str | None = None  # shares cached prefixes only with the same salt
    # SGLang's: requests whose key running requests share go first (--schedule-policy
    # routing-key); checked by the front door
    routing_key: str | None = None
    # SGLang's field: a W3C carrier (traceparent) parenting the request's trace when traced
    external_trace_header: dict[str, Any] | None = None
    # prefill-decode disaggregation (SGLang's fields; a prefill or decode worker only): the
    # prefill worker's bootstrap address and the pair's room, one per sequence
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    @property
    def continues_session(self) -> bool:
        """A turn after an earlier one: its text is tokenized without special tokens."""
        return self.session_params is not None and self.session_params.rid is not None


@dataclass
class PreparedReq:
    inp: GenerateInput
    params: SamplingParams
    msg: TokenizedGenerateReq
    client_rid: str  # the client's rid, or the internal one when the client gave none
    session_plan: TurnPlan | None = None
    session_turn: Turn | None = None  # set when ``open`` adds the turn to its session
    # the HTTP call's trace and dump record (srt/observability/http_call.py) while tracing or
    # the request dump is on, else None
    observer: Any = None

    @property
    def rid(self) -> str:
        """The internal rid (unique, what the scheduler knows the request by)."""
        return self.msg.rid
