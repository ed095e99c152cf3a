"""Per-request sampling parameters, with SGLang's field names and defaults.

A request's parameters arrive as a dict (HTTP JSON, the DSL, the in-process Engine):
:meth:`SamplingParams.from_dict` checks names and types, :meth:`SamplingParams.validate` checks
ranges (and token ids against the vocabulary once it is known), :meth:`SamplingParams.to_dict`
gives plain values for the wire, and :meth:`SamplingParams.from_wire` reads them back in the
scheduler without checking them again (the front door, srt/managers/front_door.py, did).
``temperature == 0`` (or ``top_k == 1``) means greedy decoding.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from radixlm.grammar.limits import GrammarLimits, check_spec

# Temperatures below this are treated as 0 (greedy), as SGLang does.
GREEDY_TEMPERATURE_EPS = 1e-6
# Samples per prompt (``n``), as SGLang's and vLLM's users expect; more is a 400.
MAX_N = 128
# Seeds are non-negative int64 values (what OpenAI documents and torch.Generator accepts);
# the samples of an n > 1 request use seed, seed + 1, ... wrapped into this range.
MAX_SEED = 2**63 - 1
# OpenAI's range for logit_bias values.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 2048
# Bounds on the stop lists: each entry costs a string search or an id check per step.
MAX_STOP_STRS = 64
MAX_STOP_STR_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024

_INT_FIELDS = frozenset({"max_new_tokens", "min_new_tokens", "top_k", "n", "seed"})
_FLOAT_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    }
)
_BOOL_FIELDS = frozenset(
    {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
)
_STR_FIELDS = frozenset({"regex", "ebnf"})
_GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "choices")


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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Parameters from a request dict. ``None`` values mean the default (clients send
        nulls). Raises ValueError for unknown names and for values of the wrong type."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be an object, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in _FIELD_NAMES)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s): {', '.join(unknown)}; "
                f"known ones are: {', '.join(sorted(_FIELD_NAMES))}"
            )
        return cls(**{k: _coerce(k, v) for k, v in d.items() if v is not None})

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
                _coerce(f.name, value)
        _check_ranges(self)
        if not self.spaces_between_special_tokens:  # accepted for SGLang clients, never ignored
            raise ValueError(
                "spaces_between_special_tokens=false is not supported: special "
                "tokens are decoded as the tokenizer joins them"
            )
        _check_token_ids("stop_token_ids", self.stop_token_ids or [], vocab_size)
        _check_token_ids("logit_bias", list((self.logit_bias or {}).keys()), vocab_size)
        grammars = [name for name in _GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(grammars) > 1:
            raise ValueError(
                "at most one of json_schema, regex, ebnf, choices may be set, got "
                f"{', '.join(grammars)}"
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
    def logit_bias_by_id(self) -> dict[int, float]:
        """``logit_bias`` with integer keys (JSON clients send ``{"123": 5.0}``)."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def to_dict(self) -> dict[str, Any]:
        """Plain values (orjson-able) such that ``from_dict(p.to_dict()) == p``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.stop, list):
            out["stop"] = list(self.stop)
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


def _type_error(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(
        f"sampling parameter {name} must be {expected}, got {type(value).__name__} {value!r}"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _coerce(name: str, value: Any) -> Any:
    """``value`` converted to the field's plain type; ValueError naming the field if it has
    the wrong type. Never called with None."""
    if name in _INT_FIELDS:
        if not _is_int(value):
            raise _type_error(name, "an integer", value)
        return value
    if name in _FLOAT_FIELDS:
        if not (_is_int(value) or isinstance(value, float)):
            raise _type_error(name, "a number", value)
        try:
            return float(value)
        except OverflowError:  # an int beyond float range
            raise _type_error(name, "a number within float range", value) from None
    if name in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise _type_error(name, "a boolean", value)
        return value
    if name in _STR_FIELDS:
        if not isinstance(value, str):
            raise _type_error(name, "a string", value)
        return value
    return _COERCERS[name](value)


def _coerce_stop(value: Any) -> str | list[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise _type_error("stop", "a string or a list of strings", value)


def _coerce_stop_token_ids(value: Any) -> list[int]:
    if isinstance(value, (list, tuple)) and all(_is_int(t) for t in value):
        return list(value)
    raise _type_error("stop_token_ids", "a list of integer token ids", value)


def _coerce_json_schema(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        try:
            return json.dumps(value)
        except RecursionError:  # nesting far past the grammar depth limit
            raise ValueError("json_schema nests too deeply") from None
    raise _type_error("json_schema", "a JSON schema (string or object)", value)


def _coerce_choices(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)) and value and all(isinstance(c, str) for c in value):
        return list(value)
    raise _type_error("choices", "a non-empty list of strings", value)


def _coerce_logit_bias(value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise _type_error("logit_bias", "an object mapping token ids to numbers", value)
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}"
        )
    out: dict[int, float] = {}
    for key, bias in value.items():
        token_id = _parse_token_id(key)
        if token_id is None:
            raise ValueError(f"logit_bias keys must be integer token ids, got {key!r}")
        if not (_is_int(bias) or isinstance(bias, float)):
            raise _type_error(f"logit_bias[{key!r}]", "a number", bias)
        out[token_id] = _to_float(key, bias)
    return out


def _to_float(key: Any, bias: Any) -> float:
    try:
        return float(bias)
    except OverflowError:
        raise _type_error(f"logit_bias[{key!r}]", "a number within float range", bias) from None


def _parse_token_id(key: Any) -> int | None:
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return None


_COERCERS = {
    "stop": _coerce_stop,
    "stop_token_ids": _coerce_stop_token_ids,
    "json_schema": _coerce_json_schema,
    "choices": _coerce_choices,
    "logit_bias": _coerce_logit_bias,
}


def _require(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_ranges(p: SamplingParams) -> None:
    # Comparisons are written so that NaN fails them.
    _require(
        p.temperature >= 0.0 and math.isfinite(p.temperature),
        "temperature",
        ">= 0 (0 means greedy)",
        p.temperature,
    )
    _require(0.0 < p.top_p <= 1.0, "top_p", "in (0, 1]", p.top_p)
    # top_k above the vocabulary acts as off; bounded so it stays a plain int64
    _require(p.top_k == -1 or 1 <= p.top_k <= 2**31 - 1, "top_k", "-1 (off) or >= 1", p.top_k)
    _require(0.0 <= p.min_p <= 1.0, "min_p", "in [0, 1]", p.min_p)
    _require(
        -2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", p.frequency_penalty
    )
    _require(
        -2.0 <= p.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", p.presence_penalty
    )
    _require(
        0.0 < p.repetition_penalty <= 2.0, "repetition_penalty", "in (0, 2]", p.repetition_penalty
    )
    _require(0 <= p.max_new_tokens <= 2**31 - 1, "max_new_tokens", ">= 0", p.max_new_tokens)
    _require(
        0 <= p.min_new_tokens <= p.max_new_tokens,
        "min_new_tokens",
        f"in [0, max_new_tokens={p.max_new_tokens}]",
        p.min_new_tokens,
    )
    _require(1 <= p.n <= MAX_N, "n", f"in [1, {MAX_N}]", p.n)
    _require(p.seed is None or 0 <= p.seed <= MAX_SEED, "seed", f"in [0, {MAX_SEED}]", p.seed)
    _check_stop_lists(p)
    for token_id, bias in p.logit_bias_by_id.items():
        _require(
            -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
            f"logit_bias[{token_id}]",
            f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            bias,
        )


def _check_stop_lists(p: SamplingParams) -> None:
    stops = p.stop_strs
    _require(
        len(stops) <= MAX_STOP_STRS,
        "stop",
        f"at most {MAX_STOP_STRS} strings",
        f"{len(stops)} strings",
    )
    _require(all(s != "" for s in stops), "stop", "non-empty strings", p.stop)
    longest = max((len(s) for s in stops), default=0)
    _require(
        longest <= MAX_STOP_STR_CHARS,
        "stop",
        f"strings of at most {MAX_STOP_STR_CHARS} characters",
        f"{longest} characters",
    )
    num_ids = len(p.stop_token_ids or [])
    _require(
        num_ids <= MAX_STOP_TOKEN_IDS,
        "stop_token_ids",
        f"at most {MAX_STOP_TOKEN_IDS} token ids",
        f"{num_ids} ids",
    )


def _check_token_ids(name: str, token_ids: list[Any], vocab_size: int | None) -> None:
    for raw in token_ids:
        token_id = _parse_token_id(raw)
        if token_id is None:
            raise ValueError(f"{name} must hold integer token ids, got {raw!r}")
        in_range = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
        allowed = ">= 0" if vocab_size is None else f"in [0, {vocab_size}) (the vocabulary)"
        _require(in_range, f"{name} token id", allowed, token_id)
