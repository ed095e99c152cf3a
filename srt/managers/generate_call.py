"""A ``/generate`` call as both fronts take it, and its split into one input per sequence.

The Engine's ``generate`` keywords and the server's ``/generate`` body both become one
:class:`GenerateCall` (SGLang's native field names; a field may hold one value per prompt);
:func:`split_call` turns it into one :class:`GenerateInput` per prompt and sample. This is the
one place a ``/generate`` field is mapped: a field that every sequence shares is copied by
name, so a new one is added to the two dataclasses and to the front door's message.

Sample ``j`` of a prompt with rid ``r`` shows rid ``r_j`` (as SGLang); a batch given one rid
``r`` shows ``r_i`` for prompt ``i``. The batch's rid and the prompt's rid are the sample's
abort keys: aborting either aborts every sample under it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixlm.srt.managers.generate_input import GenerateInput
from radixlm.srt.managers.request_checks import token_ids_logprob_per_prompt
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.sessions import SessionParams
from radixlm.srt.sampling.params import MAX_N

__all__ = [
    "MAX_SEQUENCES_PER_REQUEST",
    "GenerateCall",
    "check_num_sequences",
    "engine_prompts",
    "split_call",
]

# The most sequences (prompts x n) one server request may ask for.
MAX_SEQUENCES_PER_REQUEST = 1024
# per-sequence fields of prefill-decode disaggregation (sglang-router's PD mode sends one value
# for one sequence, else a list of one per sequence)
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# per-prompt fields: one value for every prompt, or a list of one per prompt (null: the default)
PER_PROMPT_DEFAULTS: dict[str, Any] = {
    "return_logprob": False,
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "cache_salt": None,
}


@dataclass
class GenerateCall:
    """One ``/generate`` call: a prompt or a batch (``text`` or ``input_ids``), SGLang's names."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int] | None] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    session_params: SessionParams | None = None  # a turn of a session (sessions.py)
    log_metrics: bool = True
    return_prompt_token_ids: bool = False
    priority: int | None = None
    cache_salt: str | list[str] | None = None  # one for every prompt, or one per prompt
    routing_key: str | None = None  # SGLang's: orders the queue under --schedule-policy routing-key
    external_trace_header: dict[str, Any] | None = None  # W3C carrier: the trace's parent
    # prefill-decode disaggregation: one value, or one per sequence (prompts x n, in order)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> GenerateCall:
        """The call of the fields named as its own (other names are left for the caller)."""
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields})


# GenerateInput fields copied unchanged from the call into every sequence
_SHARED = tuple(
    f.name
    for f in dataclasses.fields(GenerateInput)
    if f.name in {g.name for g in dataclasses.fields(GenerateCall)}
    and f.name not in {"text", "input_ids", "sampling_params", "rid", "token_ids_logprob"}
    and f.name not in PER_PROMPT_DEFAULTS
    and f.name not in BOOTSTRAP_FIELDS
)


def check_num_sequences(num: int) -> None:
    if num > MAX_SEQUENCES_PER_REQUEST:
        raise GenerateError(
            f"this request asks for {num} sequences (prompts x n); at most "
            f"{MAX_SEQUENCES_PER_REQUEST} per request",
            400,
            "n",
        )


def split_call(call: GenerateCall, capped: bool = True) -> tuple[list[GenerateInput], bool]:
    """One GenerateInput per prompt and sample (``sampling_params.n``), and whether the answer
    is a list; ``capped``: at most MAX_SEQUENCES_PER_REQUEST of them. Raises GenerateError."""
    prompts, is_batch = _prompts(call)
    n = len(prompts)
    token_ids = token_ids_logprob_per_prompt(call.token_ids_logprob, n)
    shared = {name: getattr(call, name) for name in _SHARED}
    inputs: list[GenerateInput] = []
    for i, prompt in enumerate(prompts):
        sp = dict(_pick(call.sampling_params, i, n, "sampling_params") or {})
        num_samples = _num_samples(sp)
        is_batch = is_batch or num_samples > 1
        if capped:
            check_num_sequences(len(inputs) + num_samples)
        rid = _prompt_rid(call, i, n)
        per_prompt = {
            k: _pick(getattr(call, k), i, n, k, d) for k, d in PER_PROMPT_DEFAULTS.items()
        }
        parents = tuple(dict.fromkeys(r for r in (call.rid, rid) if isinstance(r, str)))
        for j in range(num_samples):
            sample_rid = f"{rid}_{j}" if rid is not None and num_samples > 1 else rid
            inputs.append(
                GenerateInput(
                    text=prompt if call.text is not None else None,
                    input_ids=prompt if call.input_ids is not None else None,
                    sampling_params=sp,
                    rid=sample_rid,
                    abort_keys=tuple(p for p in parents if p != sample_rid),
                    token_ids_logprob=token_ids[i],
                    **per_prompt,
                    **shared,
                )
            )
    _spread_bootstrap(call, inputs)
    rids = [inp.rid for inp in inputs if inp.rid is not None]
    if len(set(rids)) != len(rids):
        raise GenerateError("rids must be unique within a batch", 400, "rid")
    return inputs, is_batch


def _spread_bootstrap(call: GenerateCall, inputs: list[GenerateInput]) -> None:
    """Gives each sequence its bootstrap fields: a list has one entry per sequence; a single
    value serves a single sequence only (two sequences never share a room)."""
    for name in BOOTSTRAP_FIELDS:
        value = getattr(call, name)
        if value is None:
            continue
        if not isinstance(value, list):
            if len(inputs) > 1 and name == "bootstrap_room":
                raise GenerateError(
                    f"bootstrap_room needs one room per sequence; this request has {len(inputs)}",
                    400,
                    name,
                )
            value = [value] * len(inputs)
        if len(value) != len(inputs):
            raise GenerateError(
                f"{name} has {len(value)} entries for {len(inputs)} sequences", 400, name
            )
        for inp, v in zip(inputs, value, strict=True):
            setattr(inp, name, v)


def _pick(value: Any, i: int, n: int, name: str, default: Any = None) -> Any:
    """The i-th entry of a per-prompt list field, or the shared scalar; null is ``default``."""
    if isinstance(value, list):
        if len(value) != n:
            raise GenerateError(f"{name} has {len(value)} entries for {n} prompts", 400, name)
        value = value[i]
    return default if value is None else value


def _prompts(call: GenerateCall) -> tuple[list[Any], bool]:
    if (call.text is None) == (call.input_ids is None):
        raise GenerateError("send exactly one of text and input_ids", 400)
    if call.text is not None:
        is_batch = isinstance(call.text, list)
        prompts = list(call.text) if is_batch else [call.text]
    else:
        ids = call.input_ids or []
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = list(ids) if is_batch else [ids]
    if not prompts:
        raise GenerateError("the batch is empty", 400)
    return prompts, is_batch


def _prompt_rid(call: GenerateCall, i: int, n: int) -> str | None:
    if isinstance(call.rid, str) and n > 1:
        return f"{call.rid}_{i}"
    return _pick(call.rid, i, n, "rid")


def _num_samples(sp: dict[str, Any]) -> int:
    n = sp.get("n")
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_N:
        raise GenerateError(f"n must be an integer in [1, {MAX_N}], got {n!r}", 400, "n")
    return n


def engine_prompts(prompt: Any, input_ids: Any, sampling_params: Any) -> None:
    """The Engine's checks of its arguments' shapes (the server's body model checks the same
    types), with the Engine's messages; raises GenerateError."""
    if (prompt is None) == (input_ids is None):
        raise GenerateError("pass exactly one of prompt (str or list of str) and input_ids")
    if prompt is not None:
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise GenerateError("prompt must be a non-empty str or list of str")
        num = len(texts)
    elif input_ids and isinstance(input_ids[0], int):
        num = 1
    elif not input_ids or not all(isinstance(x, list) and x for x in input_ids):
        raise GenerateError("input_ids must be a non-empty list of ints or of non-empty lists")
    else:
        num = len(input_ids)
    if isinstance(sampling_params, list) and len(sampling_params) != num:
        raise GenerateError(f"got {len(sampling_params)} sampling_params for {num} prompts")
