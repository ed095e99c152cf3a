"""Typed messages between the tokenizer manager, the scheduler and the detokenizer.

Every message is a dataclass of plain values; :func:`encode` / :func:`decode` carry them over
ZMQ as orjson with a type tag (no pickle on the wire). The in-process Engine passes the same
objects without encoding them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


@dataclass
class AbortReq:
    """Abort the request whose rid is exactly ``rid`` (all requests when ``abort_all``)."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class ControlReq:
    """A request for the scheduler's state or an action with a reply, matched by ``req_id``."""

    req_id: str
    kind: str  # "flush_cache" | "server_info" | "load" | "start_profile" | "stop_profile"
    args: dict[str, Any] = field(default_factory=dict)
    # wall-clock time (time.time()) after which nobody waits for the answer: an action that
    # reaches the scheduler later (it was in a long step) is not carried out
    expires_at: float | None = None


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


@dataclass
class BatchStrOut:
    """detokenizer -> tokenizer manager: BatchTokenOut plus the text decoded so far.

    ``text_delta`` is new text since the previous message for that rid, never splitting a
    UTF-8 character; on the final message the matched stop string has been trimmed.
    """

    token_out: BatchTokenOut
    text_delta: list[str]


MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReq,
        AbortReq,
        ControlReq,
        ControlReply,
        BatchTokenOut,
        BatchStrOut,
    )
}


def encode(msg: Any) -> bytes:
    return orjson.dumps({"t": type(msg).__name__, "d": msg}, option=orjson.OPT_SERIALIZE_NUMPY)


def decode(raw: bytes) -> Any:
    obj = orjson.loads(raw)
    cls = MESSAGE_TYPES[obj["t"]]
    data = obj["d"]
    if cls is BatchStrOut:
        return BatchStrOut(
            token_out=BatchTokenOut(**data["token_out"]), text_delta=data["text_delta"]
        )
    return cls(**data)
