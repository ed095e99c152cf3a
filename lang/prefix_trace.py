"""A program's constant opening text, found by running its body on placeholders (SGLang's
``Program.cache``): the text it appends before the first thing that depends on an argument, a
generation, a role or any other primitive. Nothing reaches a backend while tracing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StopTracing(Exception):
    """The body reached something that is not constant text."""


def _stop(*_: Any, **__: Any) -> Any:
    raise StopTracing


class Placeholder:
    """Stands for an argument's unknown value: any use of it ends the trace."""

    __slots__ = ()
    __add__ = __radd__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _stop
    __str__ = __repr__ = __format__ = __getitem__ = __iter__ = __len__ = __call__ = _stop
    __bool__ = __eq__ = __hash__ = __contains__ = _stop

    def __getattr__(self, name: str) -> Any:
        raise StopTracing


class PrefixTracer:
    """The ``s`` a body is traced with: keeps the plain text appended to it; anything else
    (a generation, a role, a fork, a variable read) ends the trace."""

    def __init__(self) -> None:
        self.text = ""

    def __iadd__(self, other: Any) -> PrefixTracer:
        if type(other) is not str:
            raise StopTracing
        self.text += other
        return self

    def __getattr__(self, name: str) -> Any:
        raise StopTracing

    __getitem__ = __setitem__ = __contains__ = _stop


def constant_prefix(func: Callable[..., Any], arg_names: list[str], bound: dict[str, Any]) -> str:
    """The text ``func(s, **arguments)`` appends before its first non-constant step, with the
    arguments not in ``bound`` replaced by placeholders. Whatever the body raises (a
    placeholder used as a number, say) ends the trace where it is."""
    tracer = PrefixTracer()
    arguments = {name: Placeholder() for name in arg_names if name not in bound}
    try:
        func(tracer, **arguments, **bound)
    except Exception:  # noqa: BLE001 - StopTracing, or the body tripping over a placeholder
        pass
    return tracer.text
