"""Typed messages between the tokenizer manager, the scheduler and the detokenizer.

Every message is a dataclass of plain values; :func:`encode` / :func:`decode` carry them over
ZMQ as orjson with a type tag (no pickle on the wire). The in-process Engine passes the same
objects without encoding them.

Requests: :class:`TokenizedGenerateReq` (one request, tokenized and validated) and
:class:`AbortReq`. Outputs: :class:`BatchTokenOut` (scheduler -> detokenizer) and
:class:`BatchStrOut` (detokenizer -> tokenizer manager).

Control: one :class:`ControlMessage` subclass per verb, each answered by one
:class:`ControlReply` (handled in ``scheduler/control.py``):

- ``load`` (:class:`LoadReq`): the load figures; answered without waiting for the step in flight
- ``server_info`` (:class:`ServerInfoReq`): the scheduler's state
- ``flush_cache`` (:class:`FlushCacheReq`): empty the prefix cache, while idle
- ``set_weight_version`` (:class:`SetWeightVersionReq`): relabel the loaded weights
- ``update_weights_from_disk`` (:class:`UpdateWeightsFromDiskReq`): load another checkpoint
- ``update_weights_from_tensor`` (:class:`UpdateWeightsFromTensorReq`): copy tensors into the
  weights; in-process only, never encoded
- ``get_weights_by_name`` (:class:`GetWeightsByNameReq`): read one weight back
- ``pause`` (:class:`PauseReq`) and ``continue`` (:class:`ContinueReq`): stop and resume batches
- ``start_profile`` (:class:`StartProfileReq`) and ``stop_profile`` (:class:`StopProfileReq`):
  a torch.profiler trace of the scheduler steps
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import orjson


@dataclass
class TokenizedGenerateReq:
    """tokenizer manager -> scheduler: one request, already tokenized and validated."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams fields, already validated
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs; else from this prompt position on
    top_logprobs_num: int = 0
    # token ids whose logprobs are returned at every logprob position (SGLang's
    # token_ids_logprob; None: none); only with return_logprob
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    # the GrammarSpec kind, decided once by the front door ("json_object" for the any-object
    # schema, which has no text to compile); None: no grammar, or a sender that left it to
    # the scheduler, which then takes the kind of the grammar field that is set
    grammar_kind: str | None = None
    priority: int | None = None  # SGLang's request priority (only with priority scheduling)
    caller: str = ""  # the caller's namespace (managers/caller_scope.py), for fair scheduling
    # the prefix-cache partition (the radix tree's namespace, the disk pages' chained keys):
    # prefixes are shared only between requests with the same salt; None: the shared one
    cache_salt: str | None = None
    routing_key: str | None = None  # SGLang's: --schedule-policy routing-key groups by it
    # a session turn: the caller-scoped session key its finished prefix is held under
    # between turns (scheduler/retention.py); None: not a session turn
    retain_key: str | None = None
    # W3C trace context of the request's root span (srt/observability/tracing.py); None: the
    # request is not traced
    trace_context: dict[str, str] | None = None
    # prefill-decode disaggregation (SGLang's fields, as sglang-router's PD mode sends them):
    # the prefill worker's bootstrap host and port and the pair's room; None: a whole request
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass
class ReleaseSessionReq:
    """A session was closed or expired: let go of its held prefix (scheduler/retention.py)."""

    key: str


@dataclass
class AbortReq:
    """Abort the request whose rid is exactly ``rid`` (all requests when ``abort_all``)."""

    rid: str = ""
    abort_all: bool = False


@dataclass(kw_only=True)
class ControlMessage:
    """A question or an action for the scheduler, answered between two steps by one
    :class:`ControlReply` with the same ``req_id``. Each verb is a subclass (see the module
    docstring); the sender sets ``req_id`` and ``expires_at``."""

    verb: ClassVar[str]  # its name in logs and errors (SGLang's route name, mostly)
    # whether the scheduler reads the step in flight back before answering (so the answer
    # reflects the settled state); a load query does not: it must not wait on the device
    waits_for_step: ClassVar[bool] = True
    # a query with no fields that changes nothing: when the scheduler answers late (a long
    # step), the last answer it gave stands in, with its age
    read_only: ClassVar[bool] = False

    req_id: str = ""
    # wall-clock time (time.time()) after which nobody waits for the answer: an action that
    # reaches the scheduler later (it was in a long step) is not carried out
    expires_at: float | None = None


@dataclass
class LoadReq(ControlMessage):
    """The load figures routers balance on (``reports.load_info``)."""

    verb: ClassVar[str] = "load"
    waits_for_step: ClassVar[bool] = False
    read_only: ClassVar[bool] = True


@dataclass
class ServerInfoReq(ControlMessage):
    """The scheduler's state (``reports.server_info``)."""

    verb: ClassVar[str] = "server_info"
    read_only: ClassVar[bool] = True


@dataclass
class FlushCacheReq(ControlMessage):
    """Empty the prefix cache and the compiled grammars; refused while requests run."""

    verb: ClassVar[str] = "flush_cache"


@dataclass
class SetWeightVersionReq(ControlMessage):
    """Relabel the loaded weights (``weight_version`` in ``server_info``)."""

    verb: ClassVar[str] = "set_weight_version"
    weight_version: str


@dataclass
class UpdateWeightsFromDiskReq(ControlMessage):
    """Load another checkpoint of the same architecture and sizes into the running model."""

    verb: ClassVar[str] = "update_weights_from_disk"
    model_path: str
    load_format: str | None = None
    flush_cache: bool = True  # empty the prefix cache (its KV came from the old weights)
    weight_version: str | None = None  # the new label; None keeps the current one


@dataclass
class UpdateWeightsFromTensorReq(ControlMessage):
    """Copy ``(checkpoint name, tensor)`` pairs into the running weights. In-process only (the
    Engine): tensors are not plain values, so this message is never encoded."""

    verb: ClassVar[str] = "update_weights_from_tensor"
    named_tensors: list[tuple[str, Any]]  # Any: torch.Tensor
    load_format: str | None = None
    flush_cache: bool = True


@dataclass
class GetWeightsByNameReq(ControlMessage):
    """The running weight of one checkpoint tensor, its first ``truncate_size`` rows."""

    verb: ClassVar[str] = "get_weights_by_name"
    name: str
    truncate_size: int = 100


@dataclass
class PauseReq(ControlMessage):
    """Stop running batches: ``mode`` is ``"in_place"`` (requests keep their KV) or
    ``"retract"`` (they go back to the waiting queue without it)."""

    verb: ClassVar[str] = "pause"
    mode: str


@dataclass
class ContinueReq(ControlMessage):
    """Run batches again after a pause."""

    verb: ClassVar[str] = "continue"


@dataclass(kw_only=True)
class StartProfileReq(ControlMessage):
    """Start a torch.profiler trace of the scheduler steps: SGLang's ``ProfileReq`` fields as
    the client sent them (None: left out); ``scheduler/profiling.py`` checks them."""

    verb: ClassVar[str] = "start_profile"
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None  # of "CPU", "GPU", "MEM"
    profile_by_stage: bool | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None
    merge_profiles: bool | None = None
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None
    detailed_annotations: bool | None = None


@dataclass
class StopProfileReq(ControlMessage):
    """End the profile and write its trace."""

    verb: ClassVar[str] = "stop_profile"


@dataclass
class ControlReply:
    req_id: str
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class BatchTokenOut:
    """scheduler -> detokenizer: what each request produced in one step.

    Lists are parallel, one entry per request. ``new_token_ids`` are the tokens since the
    previous message for that rid. ``finish_reason`` is None while running, else a dict such as
    ``{"type": "stop", "matched": 2}``, ``{"type": "stop", "matched": "\\n"}``,
    ``{"type": "length", "length": 16}`` or ``{"type": "abort", "message": "..."}``.
    Logprob lists hold ``[logprob, token_id]`` pairs; top-logprob and token-ids-logprob lists
    hold one list of pairs per position. The token-ids-logprob lists are empty when no request
    of the message asked for them (``token_ids_logprob``), else parallel to ``rids`` as well.
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    finish_reason: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    no_stop_trim: list[bool]
    skip_special_tokens: list[bool]
    output_token_logprobs: list[list[list[float]] | None]
    output_top_logprobs: list[list[list[list[float]]] | None]
    input_token_logprobs: list[list[list[float]] | None]  # sent once, with the first output
    input_top_logprobs: list[list[list[list[float]]] | None]
    # the stop strings of each request, so the detokenizer can hold back a partial match
    stop_strs: list[list[str]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[list[list[float]]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[list[float]]] | None] = field(default_factory=list)
    # the trace context of each traced request on its final message (else None); empty when no
    # request of the message is traced (srt/observability/tracing.py)
    trace_contexts: list[dict[str, str] | None] = field(default_factory=list)


@dataclass
class BatchStrOut:
    """detokenizer -> tokenizer manager: BatchTokenOut plus the text decoded so far.

    ``text_delta`` is new text since the previous message for that rid, never splitting a
    UTF-8 character; on the final message the matched stop string has been trimmed.
    """

    token_out: BatchTokenOut
    text_delta: list[str]


CONTROL_TYPES: tuple[type[ControlMessage], ...] = (
    LoadReq,
    ServerInfoReq,
    FlushCacheReq,
    SetWeightVersionReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
    GetWeightsByNameReq,
    PauseReq,
    ContinueReq,
    StartProfileReq,
    StopProfileReq,
)
READ_ONLY_QUERIES = tuple(cls for cls in CONTROL_TYPES if cls.read_only)
# the ProfileReq fields /start_profile and Engine.start_profile take
PROFILE_FIELDS = frozenset(f.name for f in fields(StartProfileReq)) - {
    f.name for f in fields(ControlMessage)
}

MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReq,
        AbortReq,
        ReleaseSessionReq,
        *(c for c in CONTROL_TYPES if c is not UpdateWeightsFromTensorReq),  # tensors: in-process
        ControlReply,
        BatchTokenOut,
        BatchStrOut,
    )
}


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"{name} is not a wire message (see MESSAGE_TYPES in srt/messages.py)")
    return orjson.dumps({"t": name, "d": msg}, option=orjson.OPT_SERIALIZE_NUMPY)


def decode(raw: bytes) -> Any:
    obj = orjson.loads(raw)
    cls = MESSAGE_TYPES[obj["t"]]
    data = obj["d"]
    if cls is BatchStrOut:
        return BatchStrOut(
            token_out=BatchTokenOut(**data["token_out"]), text_delta=data["text_delta"]
        )
    return cls(**data)
