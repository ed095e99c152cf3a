"""The state of a session (see sessions.py): its parameters as a request gives them, its turns
(a tree of token deltas) and a planned turn. Plain data; the rules live in SessionManager."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixlm.srt.managers.caller_scope import client_name, scoped
from radixlm.srt.managers.request_group import GenerateError


@dataclass(frozen=True)
class SessionParams:
    """``session_params`` of one request (SGLang's fields); ``id`` is the session."""

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SessionParams | None:
        """Strictly checked ``session_params``; None without a session ``id`` (SGLang runs
        such a request as a plain one). Raises GenerateError 400 naming the field."""
        types = {"id": str, "rid": str, "offset": int, "replace": bool}
        types["drop_previous_output"] = bool
        for key, value in d.items():
            if key not in types:
                raise bad(f"session_params.{key} is not a session field", f"session_params.{key}")
            if value is not None and type(value) is not types[key]:
                raise bad(
                    f"session_params.{key} must be {types[key].__name__} or null, got {value!r}",
                    f"session_params.{key}",
                )
        if d.get("id") is None:
            named = [k for k, v in d.items() if v not in (None, False, 0)]
            if named:
                raise bad(
                    f"session_params.{named[0]} needs session_params.id (the session to use)",
                    "session_params.id",
                )
            return None
        return cls(
            d["id"],
            d.get("rid"),
            d.get("offset"),
            bool(d.get("replace")),
            bool(d.get("drop_previous_output")),
        )


@dataclass(eq=False)
class Turn:
    """One request of a session. ``base_len`` tokens of the parent's sequence (its input and
    output) are kept, then ``new_ids`` follow; ``output_ids`` is None while it runs."""

    rid: str
    parent: Turn | None
    base_len: int
    new_ids: array
    reserved: int  # stored tokens it counts for: new ids + max_new_tokens while running
    output_ids: array | None = None
    children: list[Turn] = field(default_factory=list)

    @property
    def input_len(self) -> int:
        return self.base_len + len(self.new_ids)

    @property
    def is_running(self) -> bool:
        return self.output_ids is None

    def input_ids(self) -> list[int]:
        """The turn's whole input: its ancestors' kept tokens, then its own new ones."""
        chain = []
        node: Turn | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        seq: list[int] = []
        for node in reversed(chain):
            del seq[node.base_len :]
            seq.extend(node.new_ids)
            if node is not self:
                assert node.output_ids is not None, "a parent turn has finished"
                seq.extend(node.output_ids)
        return seq

    def subtree(self) -> Iterator[Turn]:
        yield self
        for child in self.children:
            yield from child.subtree()


@dataclass(eq=False)
class Session:
    session_id: str  # its key: the client's id in its caller's namespace (caller_scope.py)
    capacity: int  # capacity_of_str_len: a turn's input + max_new_tokens, in tokens
    timeout_s: float | None
    last_used_s: float
    namespace: str = ""  # its caller's
    turns: dict[str, Turn] = field(default_factory=dict)
    num_running: int = 0

    def is_expired(self, now: float) -> bool:
        """Idle (no turn running) for longer than its timeout."""
        if self.timeout_s is None or self.num_running:
            return False
        return now - self.last_used_s > self.timeout_s

    @property
    def name(self) -> str:
        """The id as its caller sent it."""
        return client_name(self.session_id)

    def turn_key(self, turn: Turn) -> str:
        """The rid-registry key of one of its turns (what aborts it)."""
        return scoped(self.namespace, turn.rid)

    @property
    def num_stored_tokens(self) -> int:
        return sum(t.reserved for t in self.turns.values())


@dataclass(frozen=True)
class TurnPlan:
    """A turn checked against its session (``SessionManager.plan``), not yet added to it."""

    params: SessionParams
    parent: Turn | None
    base_len: int
    new_ids: list[int]
    input_ids: list[int]  # what the request sends to the scheduler
    max_new_tokens: int

    @property
    def reserved(self) -> int:
        """Tokens the turn may store: its own new ids and its output."""
        return len(self.new_ids) + self.max_new_tokens


def bad(message: str, param: str = "session_params") -> GenerateError:
    return GenerateError(message, 400, param)


def kept_len(offset: int | None, history_len: int) -> int:
    """How much of a ``history_len``-token history a turn keeps (``offset`` as SGLang's slice
    ``history[:offset]``; None or 0 keeps it all)."""
    if not offset:
        return history_len
    if not -history_len <= offset <= history_len:
        raise bad(
            f"session_params.offset {offset} is outside the {history_len}-token history it cuts "
            f"(use 1..{history_len}, or a negative offset to drop tokens from the end)",
            "session_params.offset",
        )
    return offset if offset > 0 else history_len + offset


def replaced_turns(session: Session, parent: Turn | None) -> list[Turn]:
    """The turns a ``replace`` drops: the parent's descendants, or every turn without one."""
    if parent is None:
        return list(session.turns.values())
    return [t for child in parent.children for t in child.subtree()]
