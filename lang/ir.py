"""What a program appends to its state: text, generations, selections, role and scope markers.

Expressions are immutable and compose with ``+`` (``"Q: " + gen("a")`` is a :class:`Concat`).
The interpreter (:mod:`radixlm.lang.interpreter`) executes them in order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

ROLES = ("system", "user", "assistant")


REQUEST_OPTIONS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)


@dataclass(frozen=True)
class GenParams:
    """Sampling parameters of one ``gen``; None means "inherit" (from ``run``, then the server).

    Names follow SGLang's frontend (``max_new_tokens``); :meth:`to_sampling_params` gives the
    dict that ``/generate`` and ``Engine.generate`` take.
    """

    max_new_tokens: int | None = None
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_regex: str | tuple[str, ...] | None = None  # Python re patterns (the server bounds them)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    min_new_tokens: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # a JSON schema serialised as a string
    # request options, not sampling parameters: the logprobs reported in the gen's meta info
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def merged_over(self, defaults: GenParams) -> GenParams:
        """These parameters, with every unset one taken from ``defaults``."""
        changes = {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }
        return dataclasses.replace(defaults, **changes)

    def to_sampling_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in REQUEST_OPTIONS:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def request_options(self) -> dict[str, Any]:
        """The logprob options that are set, as ``/generate`` / ``Engine.generate`` take them."""
        return {k: getattr(self, k) for k in REQUEST_OPTIONS if getattr(self, k) is not None}


class Expr:
    """Base of every expression; ``a + b`` concatenates."""

    def __add__(self, other: Any) -> Concat:
        return Concat((self, to_expr(other)))

    def __radd__(self, other: Any) -> Concat:
        return Concat((to_expr(other), self))


@dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams
    dtype: type | None = None  # int / float: the generated text is converted


@dataclass(frozen=True, eq=False)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: Any  # a radixlm.lang.choices.ChoicesMethod


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True, eq=False)
class SeparateReasoning(Expr):
    """After the gens/selects ``names`` ran: each variable keeps only the text after its
    reasoning block, the block goes to ``<name>_reasoning_content``, and so does the state's
    text (the reasoning leaves the conversation)."""

    names: tuple[str, ...]
    model_type: str


@dataclass(frozen=True, eq=False)
class CommitPrefix(Expr):
    """Send the text so far as a prefill-only request, so that what follows hits the cache."""


@dataclass(frozen=True, eq=False)
class Concat(Expr):
    items: tuple[Expr, ...]

    def flatten(self) -> list[Expr]:
        out: list[Expr] = []
        for item in self.items:
            out.extend(item.flatten() if isinstance(item, Concat) else [item])
        return out


def to_expr(value: Any) -> Expr:
    """A string or an expression as an expression; anything else is a TypeError."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(
        f"a program can append str or gen/select/role expressions, got {type(value).__name__}: "
        f"{value!r}; convert it with str() first"
    )


def flatten(expr: Expr) -> list[Expr]:
    return expr.flatten() if isinstance(expr, Concat) else [expr]
