"""The primitives a program appends: ``gen``, ``select`` and the chat roles.

They only build expressions and check their arguments (a ValueError naming the primitive);
nothing is sent until the interpreter executes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from radixlm.lang.choices import ChoicesMethod, resolve_method, token_length_normalized
from radixlm.lang.ir import (
    ROLES,
    Concat,
    Expr,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    flatten,
    to_expr,
)
from radixlm.srt.parsers.reasoning import REASONING_PARSERS

INT_REGEX = r"-?[0-9]+"
FLOAT_REGEX = r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?"
DTYPE_REGEX = {int: INT_REGEX, float: FLOAT_REGEX}


def _where(primitive: str, name: str | None) -> str:
    return f"{primitive}({name!r})" if name is not None else f"{primitive}()"


def _check_regex(where: str, regex: str) -> str:
    if not isinstance(regex, str) or not regex:
        raise ValueError(f"{where}: regex must be a non-empty string, got {regex!r}")
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(
            f"{where}: regex {regex!r} is not a valid regular expression: {e}"
        ) from None
    return regex


def _check_stop_regex(where: str, stop_regex: Any) -> str | tuple[str, ...] | None:
    if stop_regex is None:
        return None
    patterns = [stop_regex] if isinstance(stop_regex, str) else list(stop_regex)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{where}: stop_regex must hold non-empty strings, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"{where}: stop_regex {pattern!r} is not a valid regular expression: {e}"
            ) from None
    return _as_tuple(stop_regex)


def _schema_string(where: str, schema: Any) -> str:
    """A JSON schema given as a dict, a JSON string or a pydantic model class, as a string."""
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: json_schema is not valid JSON: {e}") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise ValueError(
            f"{where}: json_schema must be a JSON object (dict, JSON string or "
            f"pydantic model), got {type(schema).__name__}"
        )
    return json.dumps(parsed)


def check_n(where: str, n: Any) -> None:
    """SGLang's ``n``: one sample per gen here (``s.fork(n)`` gives several)."""
    if n not in (None, 1):
        raise ValueError(f"{where}: n must be 1 (for several samples use s.fork(n)), got {n!r}")


def _check_numbers(where: str, max_tokens: Any, temperature: Any, top_p: Any) -> None:
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
        raise ValueError(f"{where}: max_tokens must be an integer >= 0, got {max_tokens!r}")
    if temperature is not None and temperature < 0:
        raise ValueError(f"{where}: temperature must be >= 0, got {temperature!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"{where}: top_p must be in (0, 1], got {top_p!r}")


def _as_tuple(value: Any) -> tuple | None:
    if value is None or isinstance(value, str):
        return value
    return tuple(value)


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod | str = token_length_normalized,
    dtype: type | None = None,
    stop_regex: str | Sequence[str] | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> Expr:
    """Generate text into variable ``name``. ``choices`` makes it a :func:`select`; ``dtype``
    int or float constrains the text to a number and stores the converted value; ``regex`` and
    ``json_schema`` constrain decoding (passed to the server); generation stops where a
    ``stop_regex`` pattern matches (the match is not kept, like a ``stop`` string).
    ``min_tokens``: at least that many tokens before a stop counts. ``return_logprob`` (with
    ``top_logprobs_num``, ``logprob_start_len``, ``return_text_in_logprobs``) puts the
    output's logprobs in ``s.get_meta_info(name)``, as SGLang's frontend does."""
    where = _where("gen", name)
    check_n(where, n)
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    _check_numbers(where, max_tokens, temperature, top_p)
    if min_tokens is not None and (not isinstance(min_tokens, int) or min_tokens < 0):
        raise ValueError(f"{where}: min_tokens must be an integer >= 0, got {min_tokens!r}")
    if dtype not in (None, str, int, float):
        raise ValueError(f"{where}: dtype must be int, float or str, got {dtype!r}")
    if regex is not None and json_schema is not None:
        raise ValueError(f"{where}: give regex or json_schema, not both")
    if regex is None and dtype in DTYPE_REGEX and json_schema is None:
        regex = DTYPE_REGEX[dtype]
    params = GenParams(
        max_new_tokens=max_tokens,
        stop=_as_tuple(stop),
        stop_token_ids=_as_tuple(stop_token_ids),
        stop_regex=_check_stop_regex(where, stop_regex),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        min_new_tokens=min_tokens,
        regex=None if regex is None else _check_regex(where, regex),
        json_schema=None if json_schema is None else _schema_string(where, json_schema),
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )
    return Gen(name, params, None if dtype is str else dtype)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float | None = None,
    choices_method: ChoicesMethod | str = token_length_normalized,
) -> Select:
    """Append the most likely of ``choices`` (ranked by ``choices_method`` from input-token
    logprobs) and store it in variable ``name``. The ranking is deterministic: ``temperature``
    (SGLang's argument) may only be 0."""
    where = _where("select", name)
    if temperature not in (None, 0):
        raise ValueError(
            f"{where}: select ranks the choices deterministically; temperature must be 0, "
            f"got {temperature!r} (sample with gen(..., regex=...) instead)"
        )
    if isinstance(choices, str) or not choices:
        raise ValueError(f"{where}: choices must be a non-empty list of strings, got {choices!r}")
    items = tuple(choices)
    if not all(isinstance(c, str) and c for c in items):
        raise ValueError(f"{where}: every choice must be a non-empty string, got {list(items)!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"{where}: choices must be distinct, got {list(items)!r}")
    try:
        method = resolve_method(choices_method)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return Select(name, items, method)


def image(expr: Any) -> Expr:
    """SGLang's image input: refused, the supported models read text only."""
    raise ValueError("image(): the models this runtime serves take text only")


def video(path: Any, num_frames: int = -1) -> Expr:
    """SGLang's video input: refused, the supported models read text only."""
    raise ValueError("video(): the models this runtime serves take text only")


# ---------------------------------------------------------------------- roles
def _role(role: str, expr: Any) -> Concat:
    assert role in ROLES
    body = () if expr is None else (to_expr(expr),)
    return Concat((RoleBegin(role), *body, RoleEnd(role)))


def system(expr: Any = None) -> Concat:
    """A system message whose content is ``expr`` (text and primitives)."""
    return _role("system", expr)


def user(expr: Any = None) -> Concat:
    return _role("user", expr)


def assistant(expr: Any = None) -> Concat:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    """SGLang's ``separate_reasoning``: runs ``expr`` (gens or selects, possibly in a list),
    then moves each one's ``<think>`` block out: the variable keeps the answer, the block goes
    to ``<name>_reasoning_content`` and leaves the state's text, so later turns do not carry
    it. ``model_type``: a reasoning parser (``qwen3``, ``deepseek-r1``: its outputs start
    inside the block). Streamed states split the variables and leave the streamed text."""
    if model_type not in REASONING_PARSERS:
        raise ValueError(
            f"separate_reasoning(): model_type must be one of {list(REASONING_PARSERS)}, "
            f"got {model_type!r}"
        )
    if expr is None:
        return Concat(())
    expr = to_expr(expr)
    names = tuple(e.name for e in flatten(expr) if isinstance(e, (Gen, Select)) and e.name)
    if not names:
        raise ValueError("separate_reasoning(): expr must hold a named gen or select")
    return Concat((expr, SeparateReasoning(names, model_type)))
