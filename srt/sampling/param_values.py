"""Types and ranges of sampling parameter values (SamplingParams' checks, srt/sampling/params.py).

:func:`coerce` converts one value to its field's plain type (ValueError naming the field when
the type is wrong); :func:`check_ranges` and :func:`check_token_ids` check the ranges of
parsed parameters. Every message starts with the parameter's name (the front door turns it
into the 400's ``param``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlm.srt.sampling.params import SamplingParams

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
# custom_params: a small JSON object (it only feeds a custom logit processor; see the field)
MAX_CUSTOM_PARAMS_ENTRIES = 64
MAX_CUSTOM_PARAMS_BYTES = 16 * 1024
MAX_STREAM_INTERVAL = 2**31 - 1

# sampling_seed: SGLang's name for seed (params.py reads it into seed)
_INT_FIELDS = frozenset(
    {"max_new_tokens", "min_new_tokens", "top_k", "n", "seed", "sampling_seed", "stream_interval"}
)
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
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "choices", "structural_tag")


def _type_error(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(
        f"sampling parameter {name} must be {expected}, got {type(value).__name__} {value!r}"
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def coerce(name: str, value: Any) -> Any:
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


def _coerce_str_or_strs(name: str, value: Any) -> str | list[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise _type_error(name, "a string or a list of strings", value)


def _coerce_stop_token_ids(value: Any) -> list[int]:
    if isinstance(value, (list, tuple)) and all(_is_int(t) for t in value):
        return list(value)
    raise _type_error("stop_token_ids", "a list of integer token ids", value)


def _coerce_json_text(name: str, what: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        try:
            return json.dumps(value)
        except RecursionError:  # nesting far past the grammar depth limit
            raise ValueError(f"{name} nests too deeply") from None
        except (TypeError, ValueError) as e:  # only from the Engine: JSON clients send JSON
            raise ValueError(f"{name} must be JSON: {e}") from None
    raise _type_error(name, f"{what} (string or object)", value)


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
    # plain ASCII decimals only: int() would also read " 1", "+1", "1_0" and other scripts'
    # digits, so two spellings could name one token
    digits = key[1:] if isinstance(key, str) and key.startswith("-") else key
    if isinstance(digits, str) and digits.isascii() and digits.isdigit() and len(digits) <= 18:
        return int(key)
    return None


def coerce_custom_params(value: Any) -> dict[str, Any]:
    """A copy of ``custom_params``: an object with string keys whose values are JSON scalars,
    lists of scalars or flat objects of scalars (SGLang's shape), at most
    MAX_CUSTOM_PARAMS_ENTRIES entries and MAX_CUSTOM_PARAMS_BYTES of JSON."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _type_error("custom_params", "an object with string keys", value)
    if len(value) > MAX_CUSTOM_PARAMS_ENTRIES:
        raise ValueError(
            f"custom_params may hold at most {MAX_CUSTOM_PARAMS_ENTRIES} entries, got {len(value)}"
        )
    out = {key: _custom_value(key, v) for key, v in value.items()}
    size = len(json.dumps(out, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_CUSTOM_PARAMS_BYTES:
        raise ValueError(
            f"custom_params is {size} bytes of JSON; at most {MAX_CUSTOM_PARAMS_BYTES} are allowed"
        )
    return out


def _is_json_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)  # NaN and infinities are not JSON
    return value is None or isinstance(value, (bool, int, str))


def _custom_value(key: str, value: Any) -> Any:
    if _is_json_scalar(value):
        return value
    if isinstance(value, (list, tuple)) and all(_is_json_scalar(v) for v in value):
        return list(value)
    if isinstance(value, Mapping) and all(
        isinstance(k, str) and _is_json_scalar(v) for k, v in value.items()
    ):
        return dict(value)
    raise _type_error(
        f"custom_params[{key!r}]",
        "a JSON scalar, a list of scalars or an object of scalars",
        value,
    )


_COERCERS = {
    "stop": lambda v: _coerce_str_or_strs("stop", v),
    "stop_regex": lambda v: _coerce_str_or_strs("stop_regex", v),
    "stop_token_ids": _coerce_stop_token_ids,
    "json_schema": lambda v: _coerce_json_text("json_schema", "a JSON schema", v),
    "structural_tag": lambda v: _coerce_json_text("structural_tag", "a structural tag", v),
    "choices": _coerce_choices,
    "logit_bias": _coerce_logit_bias,
    "custom_params": coerce_custom_params,
}


def _require(ok: bool, name: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_ranges(p: SamplingParams) -> None:
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
    _require(
        0 <= p.max_new_tokens <= 2**31 - 1, "max_new_tokens", "in [0, 2^31 - 1]", p.max_new_tokens
    )
    _require(
        0 <= p.min_new_tokens <= p.max_new_tokens,
        "min_new_tokens",
        f"in [0, max_new_tokens={p.max_new_tokens}]",
        p.min_new_tokens,
    )
    _require(1 <= p.n <= MAX_N, "n", f"in [1, {MAX_N}]", p.n)
    _require(p.seed is None or 0 <= p.seed <= MAX_SEED, "seed", f"in [0, {MAX_SEED}]", p.seed)
    _require(
        p.stream_interval is None or 1 <= p.stream_interval <= MAX_STREAM_INTERVAL,
        "stream_interval",
        "in [1, 2^31 - 1] (output tokens between streamed updates)",
        p.stream_interval,
    )
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


def check_token_ids(name: str, token_ids: list[Any], vocab_size: int | None) -> None:
    for raw in token_ids:
        token_id = _parse_token_id(raw)
        if token_id is None:
            raise ValueError(f"{name} must hold integer token ids, got {raw!r}")
        in_range = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
        allowed = ">= 0" if vocab_size is None else f"in [0, {vocab_size}) (the vocabulary)"
        _require(in_range, f"{name} token id", allowed, token_id)
