"""The request lifecycle both fronts share: the server's tokenizer manager (asyncio, ZMQ) and the
in-process Engine (an inbox, steps driven by the caller that waits). Synchronous, no I/O of its
own: a front gives it ``send`` (how a message reaches the scheduler) and its own waiting.

- ``prepare_all``: the checked scheduler message of each sequence (generate_call.py splits a
  call into them; the front door checks each one), a session turn's history put first. Text is
  tokenized by the front beforehand (:func:`texts_to_tokenize`), on its own thread or pool.
- ``open`` / ``release``: the rid registry. Every request has a fresh internal rid (what the
  scheduler knows it by); its client rid (or the internal one) and its ``abort_keys`` name it
  for ``abort``, in the namespace of its caller (caller_scope.py: another caller can neither
  abort it nor hold its rid). A client rid already running in that namespace is refused.
  Releasing a call's requests (its end, an error, the caller gone) removes every one and
  aborts the unfinished ones, on every path; their session turns leave their sessions.
- ``fold``: detokenizer outputs into each request's RequestResult; a finished turn ends.
- control calls: a fresh ``req_id`` per message, the waiter its reply goes to, the last answer
  to each read-only query, and :func:`is_busy` (a weight update resent while requests run).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from radixlm.srt.managers.caller_scope import client_name, scoped
from radixlm.srt.managers.front_door import FrontDoor
from radixlm.srt.managers.generate_input import GenerateInput, PreparedReq
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.request_log import RequestLog
from radixlm.srt.managers.results import RequestResult
from radixlm.srt.managers.sessions import SessionManager
from radixlm.srt.messages import (
    AbortReq,
    BatchStrOut,
    ControlMessage,
    ControlReply,
    ReleaseSessionReq,
)

__all__ = ["ReqState", "RequestFront", "is_busy", "texts_to_tokenize"]
# GenerateInput fields that are keywords of FrontDoor.admit go into the scheduler's message
_ADMIT_KEYWORDS = tuple(
    name
    for name, p in inspect.signature(FrontDoor.admit).parameters.items()
    if p.kind is p.KEYWORD_ONLY
)
assert set(_ADMIT_KEYWORDS) <= {f.name for f in dataclasses.fields(GenerateInput)}


@dataclass
class ReqState:
    """One request in flight. ``waiter`` is what its front wakes on an update: the group's
    asyncio.Event (server), the request's queue (Engine)."""

    req: PreparedReq
    result: RequestResult
    waiter: Any
    created_s: float = dataclasses.field(default_factory=time.perf_counter)
    error: GenerateError | None = None
    last_token_s: float | None = None
    has_update: bool = False
    is_done: bool = False  # the final output was handed out

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return self.result.finish_reason


def texts_to_tokenize(inputs: Iterable[GenerateInput]) -> list[tuple[str, bool]]:
    """The distinct ``(text, add_special_tokens)`` the inputs need tokenized (``n`` samples of
    one text share it; a later session turn's text gets no special tokens)."""
    keys = (_text_key(inp) for inp in inputs if inp.text is not None and inp.input_ids is None)
    return list(dict.fromkeys(keys))


def _text_key(inp: GenerateInput) -> tuple[str, bool]:
    return inp.text or "", not inp.continues_session


def is_busy(reply: ControlReply) -> bool:
    """A weight update the scheduler put off while requests run: send it again after them."""
    return not reply.ok and bool(reply.data.get("busy"))


class RequestFront:
    """The rid registry, session turns, result folding and control bookkeeping of one front.
    ``send(msg)`` delivers a message to the scheduler; ``send_abort(rid)`` an abort (a front
    that has stopped serving may drop it). Thread-safe (the Engine's callers may be threads)."""

    def __init__(
        self,
        door: Callable[[], FrontDoor],
        send: Callable[[Any], None],
        send_abort: Callable[[str], None] | None = None,
        max_sessions_per_caller: int | None = None,
        request_log: RequestLog | None = None,
    ) -> None:
        self.door = door
        self.request_log = request_log  # --log-requests: a record per finished request
        self.send = send
        self.send_abort = send_abort or (lambda rid: send(AbortReq(rid=rid)))
        self.states: dict[str, ReqState] = {}  # internal rid -> state
        self.client_rids: dict[str, list[str]] = {}  # client rid or abort key -> internal rids
        self.sessions = SessionManager(
            abort=self.abort,
            max_sessions_per_caller=max_sessions_per_caller,
            release=lambda key: send(ReleaseSessionReq(key)),  # its held prefix goes
        )
        self.pending: dict[str, Any] = {}  # control req_id -> the waiter of its reply
        self._last_read: dict[type, tuple[float, ControlReply]] = {}  # read-only verb -> answer
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ requests
    def prepare_all(
        self, inputs: list[GenerateInput], ids_of: dict[tuple[str, bool], list[int]]
    ) -> list[PreparedReq]:
        """Each input checked into its scheduler message (nothing registered yet); ``ids_of``
        holds the tokens of :func:`texts_to_tokenize`. Raises GenerateError (400)."""
        return [self.prepare(inp, ids_of) for inp in inputs]

    def prepare(
        self, inp: GenerateInput, ids_of: dict[tuple[str, bool], list[int]] | None = None
    ) -> PreparedReq:
        door = self.door()
        params = door.parse_params(inp.sampling_params)
        if (inp.text is None) == (inp.input_ids is None):
            raise GenerateError("send exactly one of text and input_ids", 400)
        if inp.input_ids is not None:
            input_ids = door.check_input_ids(inp.input_ids)
        else:
            key = _text_key(inp)
            input_ids = (ids_of or {}).get(key)
            if input_ids is None:
                input_ids = door.tokenize(*key, param="text")
        plan = None
        if inp.session_params is not None:
            with self.lock:
                plan = self.sessions.plan(
                    inp.session_params, input_ids, params.max_new_tokens, door.limits.context_length
                )
            input_ids = plan.input_ids
            params = params.replace(max_new_tokens=plan.max_new_tokens)  # null: resolved
        rid = uuid.uuid4().hex
        options = {name: getattr(inp, name) for name in _ADMIT_KEYWORDS}
        msg = door.admit(rid, input_ids, params, **options)
        return PreparedReq(inp, params, msg, inp.rid if inp.rid is not None else rid, plan)

    def open(
        self, prepared: list[PreparedReq], waiter: Callable[[], Any], namespace: str = ""
    ) -> tuple[list[ReqState], list[str]]:
        """Registers the requests under their client rids and abort keys (in ``namespace``,
        the caller's), adds their session turns, and sends them; their states and keys (give
        both to :meth:`release`). Raises GenerateError 400, registering nothing, when one of
        those rids is already running. ``waiter()`` makes each state's waiter."""
        keys_of = [
            tuple(scoped(namespace, k) for k in (p.client_rid, *p.inp.abort_keys)) for p in prepared
        ]
        keys = list(dict.fromkeys(k for ks in keys_of for k in ks))
        states: list[ReqState] = []
        with self.lock:
            taken = [k for k in keys if k in self.client_rids]
            if taken:
                raise GenerateError(
                    f"a request with rid {client_name(taken[0])!r} is already running; "
                    "rids must be unique among running requests",
                    400,
                    "rid",
                )
            self._add_turns(prepared)
            for key in keys:
                self.client_rids[key] = []
            try:
                for p, p_keys in zip(prepared, keys_of, strict=True):
                    p.msg.caller = namespace  # fair scheduling's caller (queue_order.py)
                    states.append(self._register(p, p_keys, waiter()))
                    self.send(p.msg)
            except BaseException:
                self.release(states, keys)
                for p in prepared[len(states) :]:  # turns whose request was never registered
                    if p.session_turn is not None and p.inp.session_params is not None:
                        self.sessions.discard(p.inp.session_params.id, p.session_turn)
                raise
        return states, keys

    def _add_turns(self, prepared: list[PreparedReq]) -> None:
        """Adds the session turns among ``prepared`` to their sessions (all or none)."""
        with_plan = [p for p in prepared if p.session_plan is not None]
        if with_plan:
            plans = [p.session_plan for p in with_plan]
            turns = self.sessions.commit(plans, [p.client_rid for p in with_plan])  # type: ignore[arg-type]
            for p, turn in zip(with_plan, turns, strict=True):
                p.session_turn = turn
                p.msg.retain_key = p.session_plan.params.id  # type: ignore[union-attr]

    def _register(self, p: PreparedReq, keys: tuple[str, ...], waiter: Any) -> ReqState:
        result = RequestResult(
            p.client_rid,
            p.inp.return_logprob,
            p.inp.return_text_in_logprobs,
            return_token_ids_logprob=p.msg.token_ids_logprob is not None,
        )
        state = ReqState(p, result, waiter)
        assert p.rid not in self.states, "internal rids are unique"
        self.states[p.rid] = state
        for key in dict.fromkeys(keys):
            self.client_rids[key].append(p.rid)
        return state

    def release(self, states: list[ReqState], keys: list[str]) -> None:
        """Removes the requests of one call; the unfinished ones are aborted and their session
        turns leave their sessions."""
        with self.lock:
            for state in states:
                self.states.pop(state.rid, None)
                if state.finish_reason is None:
                    self.send_abort(state.rid)
                    self._end_turn(state)
            for key in keys:
                self.client_rids.pop(key, None)

    def _end_turn(self, state: ReqState) -> None:
        p = state.req
        if p.session_turn is not None and p.inp.session_params is not None:
            self.sessions.end(
                p.inp.session_params.id, p.session_turn, state.finish_reason, state.result
            )

    def abort(self, client_rid: str) -> int:
        """Aborts the running requests registered under ``client_rid`` (exact match; a key of
        caller_scope.scoped for a caller's rid); returns how many."""
        with self.lock:
            rids = [r for r in self.client_rids.get(client_rid, []) if r in self.states]
        for rid in rids:
            self.send_abort(rid)
        return len(rids)

    def abort_all(self) -> None:
        self.send(AbortReq(rid="", abort_all=True))

    def check_integrity(self) -> None:
        """Every registered client rid points at live states (internal invariant)."""
        for key, rids in self.client_rids.items():
            assert all(r in self.states for r in rids), f"client rid {key!r} outlived its states"
        self.sessions.check_integrity()

    def assert_no_requests(self) -> None:
        """For tests: no request state and no client rid is left."""
        self.check_integrity()
        assert not self.states, f"request states left: {sorted(self.states)[:5]}"
        assert not self.client_rids, f"client rids left: {sorted(self.client_rids)[:5]}"

    # ------------------------------------------------------------------ outputs
    def fold(self, out: BatchStrOut) -> list[tuple[ReqState, int]]:
        """Folds the detokenizer's output into each request's result (a finished session turn
        ends); the states it updated, each with its number of new tokens."""
        t = out.token_out
        updated = []
        with self.lock:
            for i, rid in enumerate(t.rids):
                state = self.states.get(rid)
                if state is None:  # released on this side already
                    continue
                state.result.update(out, i)
                if state.finish_reason is not None:
                    self._end_turn(state)
                    if self.request_log is not None:
                        self._log_finished(state)
                updated.append((state, len(t.new_token_ids[i])))
        return updated

    def _log_finished(self, state: ReqState) -> None:
        req, r = state.req, state.result
        log = self.request_log
        prompt = None
        if log.level >= 2:  # the text, or the ids a request sent instead
            prompt = req.inp.text if req.inp.text is not None else list(req.msg.input_ids)
        log.write(
            log.record(
                req.client_rid,
                r.finish_reason,
                r.prompt_tokens or len(req.msg.input_ids),
                r.cached_tokens,
                r.completion_tokens,
                time.perf_counter() - state.created_s,
                params=req.params,
                prompt=prompt,
                output=r.text,
            )
        )

    # ------------------------------------------------------------------ control calls
    def send_control(self, msg: ControlMessage, waiter: Any, timeout_s: float | None = None) -> str:
        """Sends a control message under a fresh ``req_id`` (given ``timeout_s``, it expires
        unread after that long); its reply goes to ``waiter`` (:meth:`reply_waiter`). The
        req_id, for :meth:`forget`."""
        req_id = uuid.uuid4().hex
        expires = {} if timeout_s is None else {"expires_at": time.time() + timeout_s}
        self.pending[req_id] = waiter
        try:
            self.send(dataclasses.replace(msg, req_id=req_id, **expires))
        except BaseException:
            self.forget(req_id)
            raise
        return req_id

    def reply_waiter(self, reply: ControlReply) -> Any:
        """The waiter of a reply (None when nobody waits for it any more)."""
        return self.pending.pop(reply.req_id, None)

    def forget(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def remember(self, msg: ControlMessage, reply: ControlReply) -> None:
        """Keeps a read-only query's answer (see :meth:`last_answer`)."""
        if msg.read_only and reply.ok:
            self._last_read[type(msg)] = (time.time(), reply)

    def last_answer(self, msg: ControlMessage) -> ControlReply | None:
        """The last answer to a read-only query like ``msg`` (``ControlMessage.read_only``),
        its ``data["age_s"]`` how old; None for an action or a query not answered yet."""
        last = self._last_read.get(type(msg)) if msg.read_only else None
        if last is None:
            return None
        at, reply = last
        return ControlReply(reply.req_id, reply.ok, {**reply.data, "age_s": time.time() - at})
