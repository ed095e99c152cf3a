"""Executes a program's expressions, one state at a time, on a worker thread per state.

``s += expr`` only queues ``expr``; the state's worker runs the queue in order, so the program
body keeps going while a generation runs, and forked branches (each with its own worker) run
concurrently; the backend batches their requests. Reading a variable or the text waits for the
queue to drain. The first failing expression stores a :class:`ProgramError`; the rest of the
queue is skipped and every later read raises it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from radixlm.lang.backend_base import BaseBackend, Prompt
from radixlm.lang.errors import ProgramError
from radixlm.lang.ir import (
    CommitPrefix,
    Expr,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Text,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
)
from radixlm.srt.parsers.reasoning import ReasoningParser

_END = object()


def _describe(expr: Expr) -> tuple[str, str | None]:
    """(primitive, variable) for error messages."""
    if isinstance(expr, Gen):
        return "gen", expr.name
    if isinstance(expr, Select):
        return "select", expr.name
    if isinstance(expr, (RoleBegin, RoleEnd)):
        suffix = "_begin" if isinstance(expr, RoleBegin) else "_end"
        return expr.role + suffix, None
    if isinstance(expr, (VarScopeBegin, VarScopeEnd)):
        return "var_scope", expr.name
    if isinstance(expr, CommitPrefix):
        return "fork", None
    return "text", None


def convert(text: str, dtype: type | None, name: str | None) -> Any:
    if dtype is None:
        return text
    try:
        return dtype(text.strip())
    except ValueError:
        raise ValueError(
            f"the generated text {text!r} is not a valid {dtype.__name__} (is the "
            f"backend applying the regex constraint?)"
        ) from None


class StreamExecutor:
    """The text, variables and messages of one program state, and the worker that fills them."""

    def __init__(self, backend: BaseBackend, defaults: GenParams, stream: bool = False) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.role: str | None = None
        self.role_start = 0
        self.scopes: dict[str, int] = {}
        self.assigned: list[str] = []  # variables set since the fork that made this state
        self.fork_start = 0
        self.chunks: list[tuple[str, str | None]] = []  # (text piece, variable it belongs to)
        self.error: ProgramError | None = None
        self.is_ended = False
        self.is_closed = False  # end() was called
        self.children: list[StreamExecutor] = []
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="radixlm-program", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    def submit(self, expr: Expr) -> None:
        if self.is_closed:
            raise RuntimeError("this program state has finished; it takes no more text")
        for item in flatten(expr):
            self._queue.put(item)

    def sync(self) -> None:
        """Wait until everything submitted ran; raise the program's error if there is one."""
        self._queue.join()
        if self.error is not None:
            raise self.error

    def end(self) -> None:
        """No more expressions: the worker exits once the queue is done (children too)."""
        for child in self.children:
            child.end()
        if not self.is_closed:
            self.is_closed = True
            self._queue.put(_END)
            self._queue.join()

    def fail(self, error: ProgramError) -> None:
        """Record an error raised outside the worker (in the program body)."""
        with self._cond:
            self.error = self.error or error
            self._cond.notify_all()

    def fork(self, n: int) -> list[StreamExecutor]:
        """``n`` copies of this state after sending its text as a prefill-only request."""
        self.submit(CommitPrefix())
        self.sync()
        children = [self._copy() for _ in range(n)]
        self.children.extend(children)
        return children

    def _copy(self) -> StreamExecutor:
        child = StreamExecutor(self.backend, self.defaults, self.stream)
        child.text, child.fork_start = self.text, len(self.text)
        child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
        child.messages = [dict(m) for m in self.messages]
        child.role, child.role_start, child.scopes = self.role, self.role_start, dict(self.scopes)
        return child

    def check_integrity(self) -> bool:
        """The state's bookkeeping agrees with its text (call when idle, after sync)."""
        assert self.text[self.fork_start :] == "".join(c for c, _ in self.chunks), (
            "the streamed chunks do not add up to the text"
        )
        assert self.fork_start <= len(self.text)
        assert self.role is None or self.role_start <= len(self.text), "role starts past the end"
        assert all(m["role"] in ("system", "user", "assistant") for m in self.messages)
        assert all(pos <= len(self.text) for pos in self.scopes.values()), "scope past the end"
        assert set(self.assigned) <= set(self.variables), "an assigned variable is missing"
        return True

    def wait_chunks(self, start: int) -> tuple[list[tuple[str, str | None]], bool]:
        """The chunks from index ``start`` once there are some (or the state ended), and
        whether the state has ended."""
        with self._cond:
            while len(self.chunks) <= start and not self.is_ended and self.error is None:
                self._cond.wait()
            return self.chunks[start:], self.is_ended or self.error is not None

    # ------------------------------------------------------------------ worker side
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _END:
                    with self._cond:
                        self.is_ended = True
                        self._cond.notify_all()
                    return
                if self.error is None:
                    self._run_guarded(item)
            finally:
                self._queue.task_done()

    def _run_guarded(self, expr: Expr) -> None:
        try:
            self._execute(expr)
        except Exception as e:
            primitive, name = _describe(expr)
            err = e if isinstance(e, ProgramError) else ProgramError(primitive, name, str(e))
            if err is not e:
                err.__cause__ = e
            self.fail(err)

    def _append(self, text: str, var: str | None = None) -> None:
        if not text:
            return
        with self._cond:
            self.text += text
            self.chunks.append((text, var))
            self._cond.notify_all()

    def _set(self, name: str | None, value: Any, meta: Any = None) -> None:
        if name is None:
            return
        self.variables[name] = value
        if meta is not None:
            self.meta_info[name] = meta
        if name not in self.assigned:
            self.assigned.append(name)

    def _prompt(self) -> Prompt:
        role_text = self.text[self.role_start :] if self.role else ""
        return Prompt(self.text, tuple(dict(m) for m in self.messages), self.role, role_text)

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.scopes[expr.name] = len(self.text)
        elif isinstance(expr, VarScopeEnd):
            if expr.name not in self.scopes:
                raise ValueError(f"var_scope {expr.name!r} ends without having begun")
            self._set(expr.name, self.text[self.scopes.pop(expr.name) :])
        elif isinstance(expr, CommitPrefix):
            self.backend.cache_prefix(self._prompt())
        elif isinstance(expr, SeparateReasoning):
            self._separate_reasoning(expr)
        else:
            raise TypeError(f"cannot execute {type(expr).__name__}")

    def _check_prompt(self) -> Prompt:
        prompt = self._prompt()
        if not prompt.text and not prompt.messages and prompt.role is None:
            raise ValueError("the prompt is empty; append some text first")
        return prompt

    def _gen(self, expr: Gen) -> None:
        prompt = self._check_prompt()
        params = expr.params.merged_over(self.defaults)
        if self.stream:
            pieces: list[str] = []
            for piece, piece_meta in self.backend.generate_stream(prompt, params):
                pieces.append(piece)
                self._append(piece, expr.name)
                meta = piece_meta
            text = "".join(pieces)
        else:
            text, meta = self.backend.generate(prompt, params)
            self._append(text, expr.name)
        self._set(expr.name, convert(text, expr.dtype, expr.name), meta)

    def _select(self, expr: Select) -> None:
        prompt = self._check_prompt()
        result = self.backend.select(prompt, list(expr.choices), expr.method)
        self._append(result.decision, expr.name)
        self._set(expr.name, result.decision, {**result.meta_info, "scores": result.scores})

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        for name in expr.names:
            value = self.variables.get(name)
            if not isinstance(value, str):
                raise ValueError(f"variable {name!r} holds no generated text to separate")
            reasoning, content = ReasoningParser(expr.model_type, False).split(value)
            self._set(name, content)
            self._set(f"{name}_reasoning_content", reasoning or "")
            start = self.text.rfind(value)
            if not self.stream and value and start >= self.fork_start:
                self._replace(start, len(value), content, name)
                for message in reversed(self.messages):  # the role may have ended already
                    at = message["content"].rfind(value)
                    if at >= 0:
                        text = message["content"]
                        message["content"] = text[:at] + content + text[at + len(value) :]
                        break

    def _replace(self, start: int, length: int, new: str, var: str) -> None:
        """The text's ``[start, start + length)`` becomes ``new``; the chunks follow suit."""
        end = start + length
        chunks: list[tuple[str, str | None]] = []
        inserted = False
        pos = self.fork_start
        for piece, owner in self.chunks:
            a, b = pos, pos + len(piece)
            pos = b
            if a < start:
                chunks.append((piece[: min(b, start) - a], owner))
            if b > start and not inserted:  # the first piece reaching the replaced span
                chunks.append((new, var))
                inserted = True
            if b > end:
                chunks.append((piece[max(end, a) - a :], owner))
        if not inserted:
            chunks.append((new, var))
        with self._cond:
            self.text = self.text[:start] + new + self.text[end:]
            self.chunks = [c for c in chunks if c[0]]
            self._cond.notify_all()

    def _role_begin(self, role: str) -> None:
        if self.role is not None:
            raise ValueError(
                f"role {role!r} begins inside the open role {self.role!r}; "
                f"end it first ({self.role}_end())"
            )
        is_first = not self.messages
        self._append(self.backend.chat_template.prefix(role, is_first))
        self.role, self.role_start = role, len(self.text)

    def _role_end(self, role: str) -> None:
        if self.role != role:
            raise ValueError(
                f"{role}_end() without a matching {role}_begin() (the open role is {self.role!r})"
            )
        self.messages.append({"role": role, "content": self.text[self.role_start :]})
        self.role = None
        self._append(self.backend.chat_template.suffix(role))
