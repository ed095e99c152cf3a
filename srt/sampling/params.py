"""Per-request sampling parameters, with SGLang's field names and defaults.

A request's parameters arrive as a dict (HTTP JSON, the DSL, the in-process Engine):
:meth:`SamplingParams.from_dict` checks names and types, :meth:`SamplingParams.validate` checks
ranges (and token ids against the vocabulary once it is known), :meth:`SamplingParams.to_dict`
gives plain values for the wire, and :meth:`SamplingParams.from_wire` reads them back in the
scheduler without checking them again (the front door, srt/managers/front_door.py, did).
``temperature == 0`` (or ``top_k == 1``) means greedy decoding.

Every field of SGLang's ``SamplingParams`` that a ``/generate`` client may send is a field here
with SGLang's meaning (``sampling_seed`` is read as ``seed``, its alias), plus ``choices``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from radixlm.grammar.limits import GrammarLimits, check_spec
from radixlm.srt.sampling.param_values import (
    GRAMMAR_FIELDS,
    GREEDY_TEMPERATURE_EPS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STR_CHARS,
    MAX_STOP_STRS,
    MAX_STOP_TOKEN_IDS,
    check_ranges,
    check_token_ids,
    coerce,
)
from radixlm.srt.sampling.stop_regex import check_stop_regexes

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "MAX_N",
    "MAX_SEED",
    "MAX_STOP_STRS",
    "MAX_STOP_STR_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "OFF_ONLY",
    "SEED_ALIAS",
    "UP_TO_CONTEXT",
    "SamplingParams",
]

# SGLang's name for ``seed``: read into ``seed`` (SamplingParams has no field of that name)
SEED_ALIAS = "sampling_seed"
# ``max_new_tokens: null`` (SGLang: no cap): as many tokens as the context leaves; the front door
# (srt/managers/front_door.py) turns it into that number once the prompt's length is known
UP_TO_CONTEXT = 2**31 - 1
# SGLang sampling fields this server does not implement, accepted at their "off" values only
# (null, or the listed ones): beam search and watermarking would change what comes out
OFF_ONLY: dict[str, tuple[Any, ...]] = {"beam_width": (1,), "watermark": ()}
# an empty grammar means "no grammar" (SGLang), not "generate nothing"
_EMPTY_MEANS_UNSET = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Build it with :meth:`from_dict`."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    choices: list[str] | None = None  # the output is exactly one of these strings
    logit_bias: dict[str | int, float] | None = None  # token id -> added to its logit
    # stop when one of these patterns (Python re syntax) matches the decoded output; bounds and
    # how the output is searched: srt/sampling/stop_regex.py, srt/scheduler/stop.py
    stop_regex: str | list[str] | None = None
    structural_tag: str | None = None  # JSON text (an object is accepted and serialized)
    # arguments of a custom logit processor (SGLang's custom_params). radixlm runs no custom
    # logit processors (the native API refuses custom_logit_processor with a 400), so these
    # values reach the scheduler and change nothing: the same as SGLang without a processor
    custom_params: dict[str, Any] | None = None
    # a streaming request is reported every this many output tokens (and always its first token
    # and its finish); None: the server's --stream-interval
    stream_interval: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Parameters from a request dict. ``None`` values mean the default (clients send
        nulls), except ``max_new_tokens: null``: up to the context length, as in SGLang. An
        empty grammar string means no grammar. Raises ValueError for unknown names, values of
        the wrong type and :data:`OFF_ONLY` fields that are not off."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _ACCEPTED_NAMES and k not in OFF_ONLY)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; "
                f"known ones are: {', '.join(sorted(_ACCEPTED_NAMES))}"
            )
        for name, off in OFF_ONLY.items():
            value = d.get(name)
            if value is not None and not any(type(value) is type(v) and value == v for v in off):
                allowed = " or ".join(["null", *map(repr, off)])
                raise ValueError(
                    f"{name} is not supported by this server (no beam search or watermarking); "
                    f"send {allowed}, got {value!r}"
                )
        values = {
            k: coerce(k, v)
            for k, v in d.items()
            if v is not None and k not in OFF_ONLY and not (k in _EMPTY_MEANS_UNSET and v == "")
        }
        if "max_new_tokens" in d and d["max_new_tokens"] is None:
            values["max_new_tokens"] = UP_TO_CONTEXT
        return cls(**_resolve_seed_alias(values))

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Parameters from a wire message's dict (:meth:`to_dict` of params the front door
        has already parsed and validated): built without checking them again. ``logit_bias``
        keys, strings after JSON, become ints again so that ``from_wire(p.to_dict()) == p``."""
        values = dict(d)
        if values.get("logit_bias") is not None:
            values["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()}
        return cls(**values)

    def validate(
        self, vocab_size: int | None = None, grammar_limits: GrammarLimits | None = None
    ) -> None:
        """Raise ValueError naming the parameter and its allowed range if a value is invalid.
        Token ids (``stop_token_ids``, ``logit_bias`` keys) are checked against ``vocab_size``
        when it is given; a grammar against ``grammar_limits`` (size, JSON nesting, control
        characters; default ``GrammarLimits()``) before anything compiles it."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                coerce(f.name, value)
        check_ranges(self)
        if self.stop_regex is not None:
            check_stop_regexes(self.stop_regexes)
        if not self.spaces_between_special_tokens:  # accepted for SGLang clients, never ignored
            raise ValueError(
                "spaces_between_special_tokens=false is not supported: special "
                "tokens are decoded as the tokenizer joins them"
            )
        check_token_ids("stop_token_ids", self.stop_token_ids or [], vocab_size)
        check_token_ids("logit_bias", list((self.logit_bias or {}).keys()), vocab_size)
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(
                f"at most one of {', '.join(GRAMMAR_FIELDS)} may be set, got {', '.join(grammars)}"
            )
        for name in grammars:
            check_spec(name, getattr(self, name), grammar_limits)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def stop_strs(self) -> list[str]:
        """The stop strings as a list (empty when there are none)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    @property
    def stop_regexes(self) -> list[str]:
        """The stop regexes as a list (empty when there are none)."""
        if self.stop_regex is None:
            return []
        if isinstance(self.stop_regex, str):
            return [self.stop_regex]
        return list(self.stop_regex)

    @property
    def logit_bias_by_id(self) -> dict[int, float]:
        """``logit_bias`` with integer keys (JSON clients send ``{"123": 5.0}``)."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def to_dict(self) -> dict[str, Any]:
        """Plain values (orjson-able) such that ``from_dict(p.to_dict()) == p``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("stop", "stop_regex"):
            if isinstance(out[name], list):
                out[name] = list(out[name])
        if self.custom_params is not None:
            out["custom_params"] = {
                k: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                for k, v in self.custom_params.items()
            }
        if self.choices is not None:
            out["choices"] = list(self.choices)
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias is not None:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return out

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
_ACCEPTED_NAMES = _FIELD_NAMES | {SEED_ALIAS}


def _resolve_seed_alias(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``sampling_seed`` moved to ``seed``; ValueError when both differ."""
    if SEED_ALIAS not in values:
        return values
    alias = values.pop(SEED_ALIAS)
    if values.get("seed", alias) != alias:
        raise ValueError(
            f"sampling_seed ({alias}) and seed ({values['seed']}) are the same parameter "
            "(sampling_seed is SGLang's name for seed) and differ; send one of them"
        )
    values["seed"] = alias
    return values
