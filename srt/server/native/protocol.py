"""Request bodies of the native (SGLang) API as pydantic models, and the cheap checks run
before any body is validated; the OpenAI routes' bodies are in openai/protocol.py.

Types are strict: a string is never read as a number or a boolean, and a boolean is not an
integer. ``POST /generate`` takes every field of SGLang's ``GenerateReqInput``, each in one of
three ways, and refuses any other field with a 400 naming it (a typo never passes silently):

- implemented with SGLang's meaning: ``text``, ``input_ids``, ``sampling_params``, ``rid``,
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob`` (a flat
  list of token ids, or one list per prompt of a batch; managers/request_checks.py bounds it),
  ``return_text_in_logprobs``, ``stream``, ``session_params`` (see managers/sessions.py),
  ``log_metrics`` (false: the request is left out of the latency metrics),
  ``return_prompt_token_ids`` (the response, or a stream's last event, gets
  ``prompt_token_ids``: the ids the request ran on, a session's history included),
  ``cache_salt`` (one for the batch or one per prompt: cached prefixes are shared only between
  requests with the same salt, in every KV tier; "" or null: no salt), ``data_parallel_rank`` / ``routed_dp_rank`` (this server is data-parallel
  rank 0: 0 or null only) and ``model`` (routers add it: null or a name of the served model,
  else a 404), ``external_trace_header`` (with ``--enable-trace``: a W3C carrier, the
  request's trace parent when no ``traceparent`` header came), ``bootstrap_host``,
  ``bootstrap_port``, ``bootstrap_room`` (prefill-decode disaggregation, as sglang-router's PD
  mode sends them: on a ``--disaggregation-mode prefill`` or ``decode`` worker only, a 400
  naming the field on a whole server; one value, or a list of one per sequence);
- accepted, with no effect on what is generated: ``session_id`` (a label; not together with
  ``session_params``), ``no_logs`` (request contents are never logged here), ``custom_labels``,
  ``conversation_id``, ``kv_router_hint``, ``kv_hints``,
  ``received_time`` (routing and metric labels this server has no use for);
- not implemented (``UNSUPPORTED_NATIVE``): multimodal inputs, embeddings, LoRA, custom logit
  processors, hidden states, routed experts, disaggregation pair keys and other PD topologies, extra keys,
  sampling masks, flat top logprobs, entropy, reasoning controls and the other fields below. Ignoring one would change what the request means, so a value other than
  its "off" value (listed; null, and per-prompt lists of off values, too) is a 400 naming it.

``routing_key`` (a string of at most 256 characters, one for every prompt of a batch) orders
the queue under ``--schedule-policy routing-key`` (requests whose key the most running requests
share first); any other policy ignores it. The OpenAI routes take it from the
``x-smg-routing-key`` header, as SGLang's.

``priority`` (an integer, one for every prompt of a batch) orders the queue with
``--enable-priority-scheduling`` (scheduler/queue_order.py); without it the value is ignored,
or refused with 503 under ``--abort-on-priority-when-disabled`` (SGLang's contract).
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.sessions import SessionParams
from radixlm.srt.server.http.body import (
    StrictBody,
    check_list_len,
    check_rid,
    check_session_id,
)


class OffValues:
    """The values that mean "off" for an unsupported field; a list (one entry per prompt of a
    batch) of off values is off too."""

    def __init__(self, *values: Any) -> None:
        self.values = (None, *values)

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, list) and value:
            return all(self._is_off(v) for v in value)
        return self._is_off(value)

    def _is_off(self, value: Any) -> bool:
        return any(type(value) is type(v) and value == v for v in self.values)


NOTHING = OffValues([], "", {})
FALSE = OffValues(False)
UNSUPPORTED_NATIVE: dict[str, OffValues] = {
    **dict.fromkeys(
        (
            "image_data", "video_data", "audio_data", "input_embeds", "mm_hashes",
            "mm_content_hashes", "video_config", "modalities", "lora_path",
            "lora_id", "custom_logit_processor", "positional_embed_overrides",
            "bootstrap_pair_key", "decode_tp_size",
            "disagg_prefill_dp_rank", "http_worker_ipc", "max_thinking_tokens", "extra_key",
            "num_items_assigned", "encoder_urls", "max_dynamic_patch",
            "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch",
            "images_config", "multi_item_delimiter_indices", "mm_processor_kwargs",
            "token_indices_to_pool",
        ),
        NOTHING,
    ),
    **dict.fromkeys(
        (
            "use_audio_in_video", "return_sampling_mask", "return_flat_raw_top_logprobs",
            "return_flat_raw_top_logprobs_b64", "return_hidden_states", "return_routed_experts",
            "return_indexer_topk", "background", "require_reasoning", "return_bytes",
            "return_entropy", "need_wait_for_mm_inputs", "return_flat_raw_output_top_logprobs",
        ),
        FALSE,
    ),
    "routed_experts_start_len": OffValues(0),
    "watermark": OffValues(),
    "sampling_logprobs_mode": OffValues("selected"),  # the sampled token's logprob: what is done
}  # fmt: skip


# ---------------------------------------------------------------------- native API
class SessionParamsInput(StrictBody):
    """``session_params`` of /generate (SGLang's SessionParams; see managers/sessions.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    rid: str | None = None
    _id_bounded = field_validator("id")(classmethod(lambda cls, v: check_session_id(v)))
    _rid_bounded = field_validator("rid")(classmethod(lambda cls, v: check_rid(v)))
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None

    def to_params(self) -> SessionParams | None:
        """None without a session id (SGLang runs such a request as a plain one)."""
        return SessionParams.from_dict(self.model_dump())


class GenerateReqInput(StrictBody):
    """``POST /generate``: one prompt or a batch (lists), as text or token ids."""

    # fields outside the model are refused (check_known_fields) or, when unsupported, accepted
    # only at their off value; the schema says so
    model_config = ConfigDict(
        extra="ignore", strict=True, json_schema_extra={"additionalProperties": False}
    )

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    _rid_not_empty = field_validator("rid")(classmethod(lambda cls, rid: check_rid(rid)))
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int] | None] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_params: SessionParamsInput | None = None
    log_metrics: bool = True
    return_prompt_token_ids: bool = False
    cache_salt: str | list[str] | None = None  # checked by the front door
    data_parallel_rank: int | None = None
    # prefill-decode disaggregation (checked by the front door: managers/request_checks.py)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    routed_dp_rank: int | None = None
    priority: int | None = None
    routing_key: str | None = None  # --schedule-policy routing-key; checked by the front door
    model: str | None = None
    # accepted, no effect here (see the module docstring)
    session_id: str | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    conversation_id: str | None = None
    kv_router_hint: dict[str, Any] | None = None
    kv_hints: dict[str, Any] | list[dict[str, Any] | None] | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None

    def check(self) -> None:
        """The checks across fields (after the types); raises GenerateError 400."""
        for name in ("data_parallel_rank", "routed_dp_rank"):
            rank = getattr(self, name)
            if rank not in (None, 0):
                raise GenerateError(
                    f"{name} must be 0 or null: this server is a single data-parallel rank "
                    f"(dp_size 1), got {rank}",
                    400,
                    name,
                )
        if self.session_id is not None and self.session_params is not None:
            raise GenerateError(
                "session_id and session_params cannot both be set", 400, "session_id"
            )


GENERATE_FIELDS = frozenset(GenerateReqInput.model_fields) | frozenset(UNSUPPORTED_NATIVE)


def check_known_fields(data: dict[str, Any], known: frozenset[str], route: str) -> None:
    """A ValueError (its first word the field) for a field the route does not take."""
    unknown = sorted(k for k in data if k not in known)
    if unknown:
        raise ValueError(
            f"{unknown[0]} is not a field of {route} (unknown fields: {unknown[:5]}); check "
            "the spelling"
        )


class OpenSessionInput(StrictBody):
    """``POST /open_session`` (SGLang's OpenSessionReqInput)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    capacity_of_str_len: int
    session_id: str | None = None
    _id_bounded = field_validator("session_id")(classmethod(lambda cls, v: check_session_id(v)))
    streaming: bool | None = None
    timeout: float | None = None


class CloseSessionInput(StrictBody):
    model_config = ConfigDict(extra="forbid", strict=True)
    session_id: str
    _id_bounded = field_validator("session_id")(classmethod(lambda cls, v: check_session_id(v)))


class AbortRequestInput(StrictBody):
    rid: str = ""  # "": none (abort_all, or a 400)
    _rid_bounded = field_validator("rid")(classmethod(lambda cls, v: v and check_rid(v)))
    abort_all: bool = False  # needs the admin key when one is set


class UpdateWeightsFromDiskInput(StrictBody):
    """SGLang's ``UpdateWeightFromDiskReqInput``: its fields are all read; the ones asking for
    what this server does not do (an asynchronous load, staying paused, a tensor manifest)
    are refused by name unless off."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False  # the graphs read the parameters in place: nothing to do
    torch_empty_cache: bool = False  # every update ends with torch.cuda.empty_cache() anyway
    token_step: int = 0  # the trainer's step number, for its own bookkeeping: not used here
    manifest: dict[str, Any] | None = None

    def refused(self) -> str | None:
        """The first field set to something this server does not do, if any."""
        for name in ("is_async", "keep_pause"):
            if getattr(self, name):
                return name
        return "manifest" if self.manifest is not None else None


class PauseGenerationInput(StrictBody):
    """SGLang's ``PauseGenerationReqInput``: ``abort``, ``retract`` or ``in_place``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: str = "abort"


class ContinueGenerationInput(StrictBody):
    """SGLang's ``ContinueGenerationReqInput``. ``torch_empty_cache``: each weight update
    already returns the allocator's cached blocks to the driver when it ends."""

    model_config = ConfigDict(extra="forbid", strict=True)
    torch_empty_cache: bool = True


class UpdateWeightVersionInput(StrictBody):
    """SGLang's ``UpdateWeightVersionReqInput``: a new label for the loaded weights."""

    model_config = ConfigDict(extra="forbid", strict=True)
    new_version: str
    abort_all_requests: bool = False


# get_weights_by_name: rows past a tensor's end give the whole tensor (SGLang's slicing), an answer
# is capped by values (executor/weight_update.MAX_WEIGHT_VALUES), this bound is the wire's; a name
# is a checkpoint tensor's
MAX_TRUNCATE_ROWS = 1 << 31
MAX_WEIGHT_NAME_CHARS = 512


class GetWeightsByNameInput(StrictBody):
    """SGLang's ``GetWeightsByNameReqInput``: a checkpoint tensor's name, rows to return."""

    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str | None = None  # SGLang's request base; a read has nothing to name
    _rid_bounded = field_validator("rid")(classmethod(lambda cls, v: check_rid(v)))
    name: str = Field(max_length=MAX_WEIGHT_NAME_CHARS)
    truncate_size: int = Field(default=100, ge=1, le=MAX_TRUNCATE_ROWS)


class TokenizeInput(StrictBody):
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeInput(StrictBody):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


# ---------------------------------------------------------------------- cheap size checks
def precheck_token_ids_logprob(data: dict[str, Any], max_ids: int, max_lists: int) -> None:
    """``token_ids_logprob``: at most ``max_ids`` ids in a list, ``max_lists`` lists."""
    value = data.get("token_ids_logprob")
    if not isinstance(value, list) or not value:
        return
    rows = value if value[0] is None or isinstance(value[0], list) else [value]
    check_list_len(rows, max_lists, "token_ids_logprob")
    for row in rows:
        check_list_len(row, max_ids, "token_ids_logprob")
