"""``Program.trace`` (SGLang's): the expressions a program appends, found by running its body
on a recording state instead of a backend. Nothing is sent anywhere.

Arguments not given to ``trace`` become :class:`Argument` nodes and variables read back with
``s["name"]`` become :class:`Variable` nodes: both can be appended and concatenated like text
(``s += "Q: " + question``), and any other use of them (formatting, comparing, arithmetic,
attributes, ``len``) ends the trace there, with ``complete=False`` and the reason in
``stopped_by``: what the program would do next depends on a value only a run can give.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang.ir import (
    Expr,
    Gen,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
    to_expr,
)
from radixlm.lang.state import JOIN_MODES, ProgramStateGroup, StateMethods


class TraceStop(Exception):
    """The body used a value that only a run can give."""


def _stop_on(what: str) -> Callable[..., Any]:
    def stop(self: Any, *_: Any, **__: Any) -> Any:
        raise TraceStop(f"{what} of {self!r}")

    return stop


class _Unknown(Expr):
    """A value only known when the program runs: it can be appended (``s += value``) and
    concatenated with text or expressions; nothing else."""

    __str__ = _stop_on("str()")
    __format__ = _stop_on("formatting")
    __bool__ = _stop_on("a truth test")
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _stop_on("a comparison")
    __hash__ = object.__hash__
    __len__ = _stop_on("len()")
    __iter__ = _stop_on("iteration")
    __contains__ = _stop_on("`in`")
    __getitem__ = _stop_on("indexing")
    __int__ = __float__ = __index__ = _stop_on("a number conversion")
    __mul__ = __rmul__ = __mod__ = __rmod__ = __sub__ = __rsub__ = _stop_on("arithmetic")
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _stop_on("arithmetic")
    __call__ = _stop_on("a call")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # protocol probes (copy, pickle, hasattr) see a plain object
            raise AttributeError(name)
        raise TraceStop(f"attribute {name!r} of {self!r}")


@dataclass(frozen=True, eq=False, repr=True)
class Argument(_Unknown):
    """A program argument that was not given to ``trace``."""

    name: str


@dataclass(frozen=True, eq=False, repr=True)
class Variable(_Unknown):
    """A variable read back from the state (``s["name"]``): a generation's result."""

    name: str


class TraceState(StateMethods):
    """The ``s`` a traced body receives: records every expression appended to it."""

    def __init__(self) -> None:
        self.nodes: list[Expr] = []
        self.variables: dict[str, Any] = {}  # name -> the gen/select/var_scope node that sets it
        self.forks: list[list[TraceState]] = []

    @property
    def last_node(self) -> Expr | None:
        return self.nodes[-1] if self.nodes else None

    def __iadd__(self, other: Any) -> TraceState:
        for node in flatten(to_expr(other)):
            self.nodes.append(node)
            if isinstance(node, (Gen, Select)) and node.name:
                self.variables[node.name] = node
        return self

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        begin = VarScopeBegin(name)
        self += begin
        yield
        self += VarScopeEnd(name)
        self.variables[name] = begin

    def fork(self, size: int = 1) -> TraceGroup:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork(size) needs an integer size >= 1, got {size!r}")
        branches = [TraceState() for _ in range(size)]
        self.forks.append(branches)
        return TraceGroup(branches, self)

    def __getitem__(self, name: str) -> Variable:
        return Variable(name)

    get_var = __getitem__

    def __setitem__(self, name: str, value: Any) -> None:
        self.variables[name] = value

    set_var = __setitem__

    def __contains__(self, name: str) -> bool:
        return name in self.variables

    def _needs_a_run(self, *_: Any, **__: Any) -> Any:
        raise TraceStop("reading the state's text, messages or meta info needs a run")

    text = messages = get_meta_info = text_iter = _needs_a_run

    def sync(self) -> None:
        """Nothing runs while tracing, so there is nothing to wait for."""

    def __repr__(self) -> str:
        return f"TraceState({len(self.nodes)} nodes, variables={sorted(self.variables)})"


class TraceGroup(ProgramStateGroup):
    """The branches of a traced ``fork``: indexed, iterated and appended to as a running
    fork's; ``join`` gathers their recorded variables."""

    def join(self, mode: str = "gather_variable") -> None:
        """Each branch's variables become, in the parent, the list of their nodes per branch
        (None where a branch does not set it); ``concate_join`` also appends each branch's
        nodes to the parent's."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {list(JOIN_MODES)}, got {mode!r}")
        names: list[str] = []
        for b in self.states:
            names.extend(n for n in b.variables if n not in names)
        for name in names:
            self.parent.variables[name] = [b.variables.get(name) for b in self.states]
        if mode == "concate_join":
            for b in self.states:
                self.parent.nodes.extend(b.nodes)
        self.is_joined = True


@dataclass
class ProgramTrace:
    """What ``Program.trace`` found: ``nodes`` (the flattened expressions, in order: Text, Gen,
    Select, RoleBegin/RoleEnd, VarScopeBegin/End, Argument, Variable, ...), ``variables`` (name
    -> the node that sets it), ``forks`` (per ``fork`` call, each branch's own ``TraceState``),
    ``complete`` (False when the body stopped at a value only a run gives; ``stopped_by`` says
    where) and ``returned`` (what the body returned, if it ran to the end)."""

    state: TraceState
    complete: bool
    stopped_by: str | None = None
    returned: Any = None
    nodes: list[Expr] = field(init=False)
    variables: dict[str, Any] = field(init=False)
    forks: list[list[TraceState]] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = self.state.nodes
        self.variables = self.state.variables
        self.forks = self.state.forks

    @property
    def last_node(self) -> Expr | None:
        return self.state.last_node


def trace_program(func: Callable[..., Any], arg_names: list[str], given: dict[str, Any]):
    """Runs ``func(state, **arguments)``, arguments missing from ``given`` as placeholders."""
    state = TraceState()
    arguments = {name: Argument(name) for name in arg_names if name not in given}
    try:
        returned = func(state, **arguments, **given)
    except Exception as e:  # noqa: BLE001 - TraceStop, or the body tripping over a placeholder
        return ProgramTrace(state, complete=False, stopped_by=f"{type(e).__name__}: {e}")
    return ProgramTrace(state, complete=True, returned=returned)
