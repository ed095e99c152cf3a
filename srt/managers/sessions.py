"""Sessions: requests that continue from an earlier request's tokens (SGLang's ``/open_session``,
``/close_session`` and the ``session_params`` of ``/generate``).

A session is state a client creates in the HTTP process; the scheduler never sees it. A turn
sent with ``session_params`` becomes an ordinary request whose input ids are the tokens of an
earlier turn of the session (its input and its output) followed by the new ones, so the radix
cache matches the whole history exactly and only the new tokens are prefilled.

Each turn of a session is a node of a tree, named by the request's rid (``meta_info.id``):

- ``session_params.rid`` names the turn to continue from: any earlier turn of the session that
  finished normally (``stop`` or ``length``), so a conversation can branch. Without it the turn
  starts a new branch with no history.
- ``replace``: the turns below the named one (without ``rid``: every turn) are dropped first;
  those still running are aborted.
- ``offset``: the history is cut to its first ``offset`` tokens (negative: all but the last
  ``-offset``) before the new ones; it must lie within the history.
- ``drop_previous_output``: the history is the earlier turn's input only.

A continuing turn's text is tokenized without special tokens (no BOS inside a conversation);
token ids are used as sent.

A turn that ends otherwise (aborted, failed, client gone) leaves the session, and so does every
turn of a closed session; turns still running when their session closes are aborted.

Session ids live in the namespace of their caller (caller_scope.py): the key of a session is
its id scoped by the caller's namespace, so another caller can neither continue, close nor
probe it (its id "does not exist" for them), nor take its id.

Limits (each refusal is a 400 naming the problem): ``capacity_of_str_len`` bounds, in tokens,
a turn's input plus its ``max_new_tokens``; a server holds at most ``max_sessions`` open
sessions, one caller (a non-empty namespace) at most ``max_sessions_per_caller`` of them, a
session at most ``max_turns`` turns and all sessions together ``max_tokens``
stored tokens (a running turn reserves its new tokens and ``max_new_tokens``). A session opened
with ``timeout`` is closed once it has been idle (no turn running) that many
seconds (looked for at most once a second, at the next session operation). When a new session
or turn would pass the session or token limit, the sessions idle for at least
``min_idle_evict_s`` (60 s) are closed, least recently used first, until it fits: clients that
open sessions and never close them cannot lock the others out for good.

Retention: each turn's request carries its session's key (``retain_key``); with
``--session-retention-ttl`` the scheduler holds the prefix a finished turn leaves in the KV cache
until the next turn, the session's close or expiry, or the TTL (scheduler/retention.py).

Each turn stores only what it adds (the tokens after the kept part of its parent's sequence,
and its output), as 32-bit arrays; a turn's input is rebuilt from the chain of its ancestors.
"""

from __future__ import annotations

import time
import uuid
from array import array
from collections.abc import Callable
from typing import Any

from radixlm.srt.managers.caller_scope import client_name, scoped
from radixlm.srt.managers.session_state import (
    Session,
    SessionParams,
    Turn,
    TurnPlan,
    bad,
    kept_len,
    replaced_turns,
)
from radixlm.srt.sampling.params import UP_TO_CONTEXT

__all__ = ["SessionManager", "SessionParams", "Turn", "TurnPlan"]

MAX_OPEN_SESSIONS = 1024
MAX_TURNS_PER_SESSION = 256
MAX_STORED_TOKENS = 16 * 2**20  # 64 MiB of token ids over all sessions
MAX_SESSION_ID_CHARS = 256
SWEEP_INTERVAL_S = 1.0  # expired sessions are looked for at most this often
MIN_IDLE_EVICT_S = 60.0  # under pressure, sessions idle this long are closed (LRU first)
NORMAL_FINISH_TYPES = frozenset({"stop", "length"})


class SessionManager:
    """The open sessions of one server. ``abort(rid)`` is called for each running turn that a
    close, a ``replace`` or an expiry drops (the request is aborted by its client rid);
    ``release(key)`` for each session closed (by its client, expiry or for room): the
    scheduler lets go of the prefix it held for the session's next turn."""

    def __init__(
        self,
        abort: Callable[[str], object] = lambda rid: None,
        max_sessions: int = MAX_OPEN_SESSIONS,
        max_turns: int = MAX_TURNS_PER_SESSION,
        max_tokens: int = MAX_STORED_TOKENS,
        clock: Callable[[], float] = time.monotonic,
        min_idle_evict_s: float = MIN_IDLE_EVICT_S,
        max_sessions_per_caller: int | None = None,
        release: Callable[[str], object] = lambda key: None,
    ) -> None:
        self.abort = abort
        self.release = release
        self.max_sessions_per_caller = max_sessions_per_caller
        self._num_by_caller: dict[str, int] = {}  # namespace -> open sessions
        self.max_sessions = max_sessions
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.min_idle_evict_s = min_idle_evict_s
        self.num_evicted = 0
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.num_stored_tokens = 0
        self._last_sweep_s = float("-inf")

    # ------------------------------------------------------------------ open and close
    def open(
        self,
        capacity: int,
        session_id: str | None = None,
        timeout_s: float | None = None,
        namespace: str = "",
    ) -> str:
        """Opens a session of the caller of ``namespace``; returns its id (a fresh one when
        ``session_id`` is None), as the caller names it."""
        self.sweep()
        if type(capacity) is not int or capacity < 1:
            raise bad(
                f"capacity_of_str_len must be a positive integer (the tokens one turn may hold: "
                f"its input and max_new_tokens), got {capacity!r}",
                "capacity_of_str_len",
            )
        if timeout_s is not None and not timeout_s > 0:
            raise bad(f"timeout must be a positive number of seconds, got {timeout_s}", "timeout")
        if session_id is None:
            session_id = uuid.uuid4().hex
        elif not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
            raise bad(f"session_id must have 1 to {MAX_SESSION_ID_CHARS} characters", "session_id")
        key = scoped(namespace, session_id)
        if key in self.sessions:
            raise bad(
                f"session id {session_id} already exists, cannot open it again; close it first "
                "or open the session without a session_id",
                "session_id",
            )
        self._check_caller_quota(namespace)
        if len(self.sessions) >= self.max_sessions:
            self._evict_idle(lambda: len(self.sessions) < self.max_sessions)
        if len(self.sessions) >= self.max_sessions:
            raise bad(
                f"{len(self.sessions)} sessions are open, the most this server keeps, and none "
                f"has been idle for {self.min_idle_evict_s:g} s; close the sessions you no "
                "longer use",
                "session_id",
            )
        self.sessions[key] = Session(key, capacity, timeout_s, self.clock(), namespace)
        self._num_by_caller[namespace] = self._num_by_caller.get(namespace, 0) + 1
        return session_id

    def _check_caller_quota(self, namespace: str) -> None:
        """A caller (a non-empty namespace) keeps at most ``max_sessions_per_caller`` open:
        its own sessions idle for ``min_idle_evict_s`` are closed first (LRU)."""
        quota = self.max_sessions_per_caller
        if not namespace or quota is None:
            return
        if self._num_by_caller.get(namespace, 0) >= quota:
            others = frozenset(k for k, s in self.sessions.items() if s.namespace != namespace)
            self._evict_idle(lambda: self._num_by_caller.get(namespace, 0) < quota, others)
        if self._num_by_caller.get(namespace, 0) >= quota:
            raise bad(
                f"you have {quota} sessions open, the most one caller keeps "
                "(--max-sessions-per-caller), and none has been idle for "
                f"{self.min_idle_evict_s:g} s; close the sessions you no longer use",
                "session_id",
            )

    def close(self, session_id: str, namespace: str = "") -> None:
        """Closes the caller's session: its turns are dropped, running ones aborted."""
        self._drop_session(self._get(scoped(namespace, session_id), "session_id"))

    def clear(self) -> None:
        """Drops every session without aborting anything (the server is shutting down)."""
        self.sessions.clear()
        self._num_by_caller.clear()
        self.num_stored_tokens = 0

    def sweep(self) -> None:
        """Closes the sessions idle for longer than their timeout (at most once a second)."""
        now = self.clock()
        if now - self._last_sweep_s < SWEEP_INTERVAL_S:
            return
        self._last_sweep_s = now
        for session in [s for s in self.sessions.values() if s.is_expired(now)]:
            self._drop_session(session)

    def _evict_idle(self, fits: Callable[[], bool], keep: frozenset[str] = frozenset()) -> None:
        """Closes sessions idle (no turn running) for at least ``min_idle_evict_s``, least
        recently used first and never those in ``keep``, until ``fits()``."""
        now = self.clock()
        idle = sorted(
            (
                s
                for s in self.sessions.values()
                if not s.num_running
                and s.session_id not in keep
                and now - s.last_used_s >= self.min_idle_evict_s
            ),
            key=lambda s: s.last_used_s,
        )
        for session in idle:
            if fits():
                return
            self._drop_session(session)
            self.num_evicted += 1

    def _drop_session(self, session: Session) -> None:
        del self.sessions[session.session_id]
        left = self._num_by_caller[session.namespace] - 1
        if left:
            self._num_by_caller[session.namespace] = left
        else:
            del self._num_by_caller[session.namespace]
        self.num_stored_tokens -= session.num_stored_tokens
        for turn in session.turns.values():
            if turn.is_running:
                self.abort(session.turn_key(turn))
        self.release(session.session_id)

    def _get(self, session_id: str, param: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise bad(
                f"Invalid request: session id {client_name(session_id)} does not exist (it was "
                "never opened, was closed, timed out, or was closed for room after "
                f"{self.min_idle_evict_s:g} s idle); open a session with /open_session first",
                param,
            )
        return session

    # ------------------------------------------------------------------ turns
    def plan(
        self,
        params: SessionParams,
        new_ids: list[int],
        max_new_tokens: int,
        context_length: int | None = None,
    ) -> TurnPlan:
        """The input of a new turn (its history, then ``new_ids``), checked against the
        session; nothing changes until :meth:`commit`. ``UP_TO_CONTEXT`` (``max_new_tokens:
        null``) becomes what the session's capacity and ``context_length`` leave (the plan's
        ``max_new_tokens``)."""
        self.sweep()
        session = self._get(params.id, "session_params.id")
        parent = self._parent(session, params)
        if parent is None:
            history: list[int] = []
        else:
            history = parent.input_ids()
            if not params.drop_previous_output:
                history.extend(parent.output_ids or ())
        base_len = kept_len(params.offset, len(history))
        input_ids = history[:base_len] + list(new_ids)
        if max_new_tokens == UP_TO_CONTEXT:  # max_new_tokens: null = what is left
            limit = min(session.capacity, context_length or session.capacity)
            max_new_tokens = max(limit - len(input_ids), 1)
        needed = len(input_ids) + max_new_tokens
        if needed > session.capacity:
            raise bad(
                f"this turn needs {needed} tokens ({len(input_ids)} of input, max_new_tokens "
                f"{max_new_tokens}), more than the session's capacity_of_str_len of "
                f"{session.capacity}; open a session with a larger capacity, keep less history "
                "(session_params.offset) or lower max_new_tokens"
            )
        return TurnPlan(params, parent, base_len, list(new_ids), input_ids, max_new_tokens)

    def _parent(self, session: Session, params: SessionParams) -> Turn | None:
        if params.rid is None:
            return None
        parent = session.turns.get(params.rid)
        if parent is None:
            raise bad(
                f"session {session.name} has no request with rid {params.rid!r} to "
                "continue from (a turn that did not finish normally, or one dropped by "
                "replace, leaves the session)",
                "session_params.rid",
            )
        if parent.is_running:
            raise bad(
                f"request {params.rid!r} of session {session.name} is still running; "
                "continue from it once it has finished",
                "session_params.rid",
            )
        return parent

    def commit(self, plans: list[TurnPlan], rids: list[str]) -> list[Turn]:
        """Adds the planned turns (one request each, named by ``rids``) to their sessions, all
        or none: the limits and the planned parents are checked again, then the turns a
        ``replace`` drops are removed (running ones aborted)."""
        if len(plans) > 1 and any(p.params.replace for p in plans):
            raise bad(
                "session_params.replace applies to a single request; send one prompt with n = 1",
                "session_params.replace",
            )
        sessions = [self._get(p.params.id, "session_params.id") for p in plans]
        dropped = self._check_commit(plans, rids, sessions)
        for turn in dropped:
            self._remove_turn(sessions[0], turn)
        now = self.clock()
        turns = []
        for plan, rid, session in zip(plans, rids, sessions, strict=True):
            turn = Turn(rid, plan.parent, plan.base_len, array("i", plan.new_ids), plan.reserved)
            if plan.parent is not None:
                plan.parent.children.append(turn)
            session.turns[rid] = turn
            session.num_running += 1
            session.last_used_s = now
            self.num_stored_tokens += turn.reserved
            turns.append(turn)
        return turns

    def _check_commit(
        self, plans: list[TurnPlan], rids: list[str], sessions: list[Session]
    ) -> list[Turn]:
        """Raises the 400 of a group that cannot be added; returns the turns its replace drops."""
        dropped: list[Turn] = []
        added: dict[str, int] = {}
        for plan, rid, session in zip(plans, rids, sessions, strict=True):
            if plan.parent is not None and session.turns.get(plan.parent.rid) is not plan.parent:
                raise bad(
                    f"turn {plan.parent.rid!r} of session {session.name} was dropped while "
                    "this request was being prepared; send it again"
                )
            if plan.params.replace:
                dropped = replaced_turns(session, plan.parent)
            if rid in session.turns and session.turns[rid] not in dropped:
                raise bad(
                    f"rid {rid!r} already names a request of session {session.name}; give "
                    "each turn its own rid",
                    "rid",
                )
            added[session.session_id] = added.get(session.session_id, 0) + 1
            num_turns = len(session.turns) - len(dropped) + added[session.session_id]
            if num_turns > self.max_turns:
                raise bad(
                    f"session {session.name} would hold {num_turns} requests, more than "
                    f"the {self.max_turns} a session keeps; drop branches with "
                    "session_params.replace or open a new session"
                )
        change = sum(p.reserved for p in plans) - sum(t.reserved for t in dropped)
        if self.num_stored_tokens + change > self.max_tokens:
            keep = frozenset(s.session_id for s in sessions)
            self._evict_idle(lambda: self.num_stored_tokens + change <= self.max_tokens, keep)
        stored = self.num_stored_tokens + change
        if stored > self.max_tokens:
            raise bad(
                f"the open sessions would store {stored} tokens, more than the {self.max_tokens} "
                "this server keeps for sessions; close sessions you no longer use or lower "
                "max_new_tokens"
            )
        return dropped

    def end(self, session_id: str, turn: Turn, finish_reason: dict | None, result: Any) -> None:
        """A turn's request ended: with a normal finish its output (``result.output_ids``)
        joins the history it offers (:meth:`finish`), else it leaves the session."""
        if finish_reason is not None and finish_reason.get("type") in NORMAL_FINISH_TYPES:
            self.finish(session_id, turn, result.output_ids)
        else:
            self.discard(session_id, turn)

    def finish(self, session_id: str, turn: Turn, output_ids: list[int]) -> None:
        """A turn finished normally: its output becomes part of the history it offers."""
        session = self.sessions.get(session_id)
        if session is None or session.turns.get(turn.rid) is not turn or not turn.is_running:
            return  # its session closed or a replace dropped it meanwhile
        turn.output_ids = array("i", output_ids)
        stored = len(turn.new_ids) + len(turn.output_ids)
        self.num_stored_tokens += stored - turn.reserved
        turn.reserved = stored
        session.num_running -= 1
        session.last_used_s = self.clock()

    def discard(self, session_id: str, turn: Turn) -> None:
        """A turn that did not finish normally leaves its session (if it is still there)."""
        session = self.sessions.get(session_id)
        if session is not None and session.turns.get(turn.rid) is turn and turn.is_running:
            self._remove_turn(session, turn)

    def _remove_turn(self, session: Session, turn: Turn) -> None:
        del session.turns[turn.rid]
        if turn.parent is not None and turn.parent.rid in session.turns:
            turn.parent.children.remove(turn)
        self.num_stored_tokens -= turn.reserved
        if turn.is_running:
            session.num_running -= 1
            self.abort(session.turn_key(turn))

    # ------------------------------------------------------------------ state
    def info(self) -> dict[str, int]:
        return {
            "num_open_sessions": len(self.sessions),
            "num_session_turns": sum(len(s.turns) for s in self.sessions.values()),
            "num_session_tokens": self.num_stored_tokens,
            "max_open_sessions": self.max_sessions,
            "num_sessions_evicted": self.num_evicted,
            "max_turns_per_session": self.max_turns,
            "max_session_tokens": self.max_tokens,
        }

    def check_integrity(self) -> None:
        """Token counts add up, every turn's tree links stay inside its session and the
        sessions per caller are counted right."""
        callers: dict[str, int] = {}
        for session in self.sessions.values():
            callers[session.namespace] = callers.get(session.namespace, 0) + 1
        assert callers == self._num_by_caller, (callers, self._num_by_caller)
        total = 0
        for session in self.sessions.values():
            turns = session.turns
            assert session.num_running == sum(t.is_running for t in turns.values())
            for rid, turn in turns.items():
                assert turn.rid == rid
                assert turn.parent is None or turns.get(turn.parent.rid) is turn.parent
                assert all(turns.get(c.rid) is c for c in turn.children)
                assert not (turn.is_running and turn.children), "a running turn has no children"
            total += session.num_stored_tokens
        assert total == self.num_stored_tokens, (total, self.num_stored_tokens)
