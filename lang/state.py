"""The state ``s`` a program receives, and the group of states ``s.fork(n)`` returns."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.lang.interpreter import StreamExecutor
from radixlm.lang.ir import RoleBegin, RoleEnd, Text, VarScopeBegin, VarScopeEnd, to_expr
from radixlm.lang.primitives import _role

JOIN_MODES = ("gather_variable", "concate_join")


class StateMethods:
    """What running and traced states share, on top of their own ``+=`` and ``fork``:
    ``s.system/user/assistant(expr)`` append a message (without ``expr`` they are context
    managers that wrap the appends inside them) and ``s.copy()``."""

    def _role_scope(self, role: str, expr: Any) -> Any:
        if expr is not None:
            self += _role(role, expr)
            return None
        return self._role_context(role)

    @contextmanager
    def _role_context(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self, expr: Any = None) -> Any:
        """``s.system("...")`` appends a message; ``with s.system(): ...`` wraps appends."""
        return self._role_scope("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role_scope("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role_scope("assistant", expr)

    @contextmanager
    def copy(self) -> Iterator[Any]:
        """``with s.copy() as c: c += ...``: one branch of ``s`` (SGLang's), joined back with
        ``gather_variable`` when the block ends."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()


class ProgramState(StateMethods):
    """``s += "text" + gen("x")`` appends; ``s["x"]`` reads a variable (waiting for it);
    ``s.text()`` and ``s.messages()`` read the whole state."""

    def __init__(self, executor: StreamExecutor) -> None:
        self._ex = executor

    # ------------------------------------------------------------------ appending
    def __iadd__(self, other: Any) -> ProgramState:
        self._ex.submit(to_expr(other))
        return self

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """``with s.var_scope("x"): ...`` stores the text appended inside as variable x."""
        self._ex.submit(VarScopeBegin(name))
        yield
        self._ex.submit(VarScopeEnd(name))

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """``size`` branches continuing from here; the text so far is prefilled first, so that
        every branch reuses its cache. Branches run concurrently."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork(size) needs an integer size >= 1, got {size!r}")
        return ProgramStateGroup([ProgramState(ex) for ex in self._ex.fork(size)], self)

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self._ex.sync()
        return name in self._ex.variables

    def get_var(self, name: str) -> Any:
        self._ex.sync()
        if name not in self._ex.variables:
            known = sorted(self._ex.variables)
            raise KeyError(f"no variable {name!r} in this program state; it has {known}")
        return self._ex.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self._ex.sync()
        self._ex._set(name, value)

    def get_meta_info(self, name: str) -> Any:
        """What the server reported for the gen/select that filled ``name`` (for select: the
        method, per-choice scores and token logprobs)."""
        self._ex.sync()
        return self._ex.meta_info.get(name)

    def variables(self) -> dict[str, Any]:
        self._ex.sync()
        return dict(self._ex.variables)

    def text(self) -> str:
        self._ex.sync()
        return self._ex.text

    def messages(self) -> list[dict[str, str]]:
        """The completed chat messages (role and content)."""
        self._ex.sync()
        return [dict(m) for m in self._ex.messages]

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced (with ``run(stream=True)``, generations arrive piece by
        piece), until the program ends; only variable ``var_name``'s pieces if given."""
        seen = 0
        while True:
            chunks, is_ended = self._ex.wait_chunks(seen)
            seen += len(chunks)
            for text, var in chunks:
                if var_name is None or var == var_name:
                    yield text
            if is_ended and not chunks:
                break
        if self._ex.error is not None:
            raise self._ex.error

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """:meth:`text_iter` for asyncio code (waits off the event loop); with
        ``return_meta_data`` each piece comes as ``(text, meta_info of its variable)``."""
        loop = asyncio.get_running_loop()
        seen = 0
        while True:
            chunks, is_ended = await loop.run_in_executor(None, self._ex.wait_chunks, seen)
            seen += len(chunks)
            for text, var in chunks:
                if var_name is None or var == var_name:
                    yield (text, self._ex.meta_info.get(var)) if return_meta_data else text
            if is_ended and not chunks:
                break
        if self._ex.error is not None:
            raise self._ex.error

    def sync(self) -> None:
        self._ex.sync()

    def error(self) -> BaseException | None:
        return self._ex.error

    def __repr__(self) -> str:
        return f"ProgramState(text={self._ex.text[-60:]!r}, variables={sorted(self._ex.variables)})"


class ProgramStateGroup:
    """Branches made by ``fork``: index or iterate them, ``+=`` appends to every branch (a list
    appends one item per branch), ``join()`` brings their variables back to the parent."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent
        self.is_joined = False

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        if state is not self.states[i]:  # `forks[i] += ...` stores the same state back
            raise ValueError("the branches of a fork cannot be replaced")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} items for {len(self.states)} branches")
            for state, item in zip(self.states, other, strict=True):
                state += item
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. ``gather_variable``: each variable set in a branch becomes,
        in the parent, the list of its values per branch (None where a branch did not set it).
        ``concate_join``: also append each branch's new text to the parent, in order."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {list(JOIN_MODES)}, got {mode!r}")
        if self.is_joined:
            raise ValueError("these branches were already joined")
        executors = [s._ex for s in self.states]
        for ex in executors:
            ex.sync()
        names: list[str] = []
        for ex in executors:
            names.extend(n for n in ex.assigned if n not in names)
        for name in names:
            self.parent.set_var(
                name, [ex.variables.get(name) if name in ex.assigned else None for ex in executors]
            )
        if mode == "concate_join":
            for ex in executors:
                self.parent += Text(ex.text[ex.fork_start :])
        for ex in executors:
            ex.end()
        self.is_joined = True
