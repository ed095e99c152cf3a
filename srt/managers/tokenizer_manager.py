"""The tokenizer manager: the asyncio side of the server, in the HTTP process.

It is the request front shared with the Engine (request_front.py: the checks through the front
door, the rid registry, session turns, folding outputs, control bookkeeping) plus asyncio and
ZMQ: it tokenizes on a small thread pool (the tokenizers release the GIL), so a long prompt
never stalls the event loop, sends messages to the scheduler over a socket, and wakes the
waiting requests when the detokenizer's ``BatchStrOut`` comes in. A ``GenerateError`` carries
the HTTP status.

The requests of one HTTP call form a :class:`RequestGroup`, the one owner of their states (see
request_group.py): ``open`` registers and sends them, closing the group releases them (every
state removed, what has not finished aborted), on every path. While weights are updated or
generation is paused, new requests wait in ``prepare_all``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.caller_scope import scoped
from radixlm.srt.managers.front_door import FrontDoor, ModelLimits
from radixlm.srt.managers.generate_input import GenerateInput, PreparedReq, RequestObserver
from radixlm.srt.managers.request_checks import sample_seed
from radixlm.srt.managers.request_front import (
    ReqState,
    RequestFront,
    is_busy,
    texts_to_tokenize,
)
from radixlm.srt.managers.request_group import (
    ClientDisconnected,
    DisconnectProbe,
    GenerateError,
    RequestGroup,
)
from radixlm.srt.managers.request_log import RequestLog
from radixlm.srt.managers.scheduler_process import IpcEndpoints
from radixlm.srt.messages import (
    READ_ONLY_QUERIES,
    AbortReq,
    BatchStrOut,
    ContinueReq,
    ControlMessage,
    ControlReply,
    LoadReq,
    PauseReq,
    UpdateWeightsFromDiskReq,
    decode,
    encode,
)
from radixlm.srt.observability.http_call import observe_prepared

__all__ = [
    "ClientDisconnected",
    "DisconnectProbe",
    "GenerateError",
    "GenerateInput",
    "PreparedReq",
    "RequestGroup",
    "TokenizerManager",
    "sample_seed",
]

logger = logging.getLogger(__name__)

TOKENIZER_THREADS = 4
CONTROL_TIMEOUT_S = 5.0  # how long a query or action waits for the scheduler by default
PAUSE_TIMEOUT_S = 120.0  # a pause waits for the step running now
WEIGHT_LOAD_TIMEOUT_S = 600.0  # reading an 8B checkpoint from a slow disk
DRAIN_TIMEOUT_S = 300.0  # longest wait for the requests in flight before a weight update
T = TypeVar("T")


class TokenizerManager:
    def __init__(
        self,
        cfg: ServerConfig,
        tokenizer: Any,
        endpoints: IpcEndpoints,
        observer: RequestObserver | None = None,
    ) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.endpoints = endpoints
        self.observer = observer
        self.info: dict[str, Any] = {}  # the scheduler's ready_info()
        self.front = RequestFront(
            lambda: self.door,
            self._send,
            self._send_abort,
            max_sessions_per_caller=cfg.max_sessions_per_caller,
            request_log=RequestLog.from_config(cfg),
        )
        self.sessions = self.front.sessions
        self.control_timeout_s = CONTROL_TIMEOUT_S
        self._load_query: asyncio.Task[ControlReply] | None = None
        self.dead_reason: str | None = None
        self._token_text: dict[int, str] = {}
        self._door: FrontDoor | None = None
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="radixlm-tok")
        self._ctx = zmq.Context()
        self._send_sock = self._ctx.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.setsockopt(zmq.LINGER, 0)
        self._send_sock.connect(endpoints.scheduler)
        self._actx: zmq.asyncio.Context | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self._prime_task: asyncio.Task[None] | None = None
        self._updating = False  # a weight update is waiting or loading
        self.paused_by_request = False  # /pause_generation until /continue_generation
        self._resumed = asyncio.Event()  # set unless one of those two holds new requests
        self._resumed.set()
        self.num_paused = 0  # requests waiting for that update to end
        self._pause_watchdog: asyncio.Task[None] | None = None  # ends requests held too long
        self._num_paused_in_update = 0  # requests that waited during the current update

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Binds the reply socket and starts the receive loop (call inside the event loop)."""
        self._actx = zmq.asyncio.Context()
        sock = self._actx.socket(zmq.PULL)
        sock.bind(self.endpoints.tokenizer)
        self._recv_task = asyncio.create_task(self._recv_loop(sock), name="tokenizer-recv")
        # a first answer to each read-only query, so a long first step cannot make them 503s
        self._prime_task = asyncio.create_task(self._prime_reads(), name="tokenizer-prime")

    async def _prime_reads(self) -> None:
        for query in READ_ONLY_QUERIES:
            try:
                await self.control(query())
            except GenerateError:
                pass  # the scheduler was busy or gone: the next query tries again

    async def close(self) -> None:
        self._stop_pause_watchdog()
        if self._prime_task is not None:
            self._prime_task.cancel()
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        if self._actx is not None:
            self._actx.destroy(linger=0)
        self._ctx.destroy(linger=0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sessions.clear()
        if self.front.request_log is not None:
            self.front.request_log.close()

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    def mark_dead(self, reason: str) -> None:
        """A child process died: fail every waiting request now and every new one at once."""
        if self.dead_reason is not None:
            return
        logger.error("serving stopped: %s", reason)
        self.dead_reason = reason
        for state in self.front.states.values():
            state.error = GenerateError(f"server unavailable: {reason}", 503)
            state.waiter.set()
        for fut in self.front.pending.values():
            if not fut.done():
                fut.set_exception(GenerateError(f"server unavailable: {reason}", 503))

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise GenerateError(f"server unavailable: {self.dead_reason}", 503)

    # ------------------------------------------------------------------ model facts
    @property
    def context_length(self) -> int:
        return int(self.info["context_length"])

    @property
    def vocab_size(self) -> int:
        return int(self.info["vocab_size"])

    @property
    def max_total_tokens(self) -> int:
        return int(self.info["max_total_tokens"])

    @property
    def door(self) -> FrontDoor:
        """The request checks for the scheduler's model (built once its ready info is in)."""
        limits = ModelLimits.from_info(self.info)
        if self._door is None or self._door.limits != limits:
            self._door = FrontDoor(self.tokenizer, limits)
        return self._door

    @property
    def max_prompt_chars(self) -> int:
        """Any text longer than this has more tokens than the context holds."""
        return self.door.max_prompt_chars

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        self.door.check_prompt_chars(num_chars, param)

    # ------------------------------------------------------------------ tokenizer
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Blocking; in the server use :meth:`tokenize_async`."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizer thread pool (off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def tokenize_async(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """Checks the size first, then tokenizes on the pool."""
        self.door.check_prompt_chars(len(text), param)
        return await self.run_blocking(self.tokenize, text, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.check_token_ids(ids, "tokens")
        return await self.run_blocking(self.decode, ids, skip_special_tokens)

    async def decode_rows_async(
        self, rows: list[list[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """Each row's text, decoded in one call on the tokenizer pool (not one per row)."""
        for row in rows:
            self.check_token_ids(row, "tokens")
        return await self.run_blocking(
            lambda: [self.decode(row, skip_special_tokens) for row in rows]
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_token_ids(self, ids: list[Any], param: str) -> None:
        self.door.check_token_ids(ids, param)

    # ------------------------------------------------------------------ requests
    async def prepare(self, inp: GenerateInput) -> PreparedReq:
        """Tokenizes and validates one request (front_door.py); raises GenerateError (400)
        naming the problem. Nothing is registered yet (see :meth:`open`)."""
        return (await self.prepare_all([inp]))[0]

    async def prepare_all(self, inputs: list[GenerateInput]) -> list[PreparedReq]:
        """:meth:`prepare` for each input (a text shared by several inputs, ``n`` samples, is
        tokenized once). While weights are being updated or generation is paused, new requests
        wait for the update or the pause to end."""
        if not self._resumed.is_set():
            self.num_paused += 1
            self._num_paused_in_update += 1
            try:
                await asyncio.wait_for(self._resumed.wait(), self.cfg.paused_request_timeout_s)
            except asyncio.TimeoutError:
                raise self._held_too_long() from None
            finally:
                self.num_paused -= 1
        self._check_alive()
        started_ns = time.time_ns()
        ids_of = {}
        for key in texts_to_tokenize(inputs):
            ids_of[key] = await self.tokenize_async(*key, param="text")
        prepared = self.front.prepare_all(inputs, ids_of)
        observe_prepared(prepared, started_ns)  # tracing and the request dump, when on
        return prepared

    # ------------------------------------------------------------------ request lifecycle
    def open(
        self,
        prepared: list[PreparedReq],
        probe: DisconnectProbe | None = None,
        namespace: str = "",
    ) -> RequestGroup:
        """Registers the requests under their client rids (and ``inp.abort_keys``, such as the
        rid of all ``n`` samples) in the caller's ``namespace`` (caller_scope.py) and sends
        them. Use the group as a ``with`` block: its end removes every state. Raises
        GenerateError 400, registering nothing, when one of those rids is already in flight."""
        self._check_alive()
        event = asyncio.Event()
        states, keys = self.front.open(prepared, lambda: event, namespace)
        return RequestGroup(self.front, self.output, states, keys, probe, event)

    @property
    def num_request_states(self) -> int:
        return len(self.front.states)

    def check_integrity(self) -> None:
        """Every registered client rid points at live states (internal invariant)."""
        self.front.check_integrity()

    def assert_no_requests(self) -> None:
        """For tests: no request state and no client rid is left."""
        self.front.assert_no_requests()

    def abort(self, client_rid: str, namespace: str = "") -> int:
        """Aborts the running requests registered under ``client_rid`` (exact match) in the
        caller's ``namespace``; returns how many."""
        return self.front.abort(scoped(namespace, client_rid))

    def abort_all(self) -> None:
        self.front.abort_all()

    def _send_abort(self, rid: str) -> None:
        if self.dead_reason is not None:
            return
        try:
            self._send(AbortReq(rid=rid))
        except zmq.ZMQError:  # shutting down: nothing left to abort
            logger.warning("could not send the abort of %s", rid)

    async def control(self, msg: ControlMessage, timeout_s: float | None = None) -> ControlReply:
        """One control message (its ``req_id`` is set here), answered by the scheduler between
        two steps. A step can take longer than ``timeout_s`` (a long prompt on a CPU): a
        read-only query (``ControlMessage.read_only``) then gets the last answer the scheduler gave
        (its ``data["age_s"]`` says how old); an action is a 503 and expires unread, so it is
        not carried out after the caller gave up."""
        self._check_alive()
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        req_id = self.front.send_control(msg, fut, timeout_s)
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            last = self.front.last_answer(msg)
            if last is None:
                raise GenerateError(
                    f"the scheduler did not answer {msg.verb!r} in time (a step is running); retry",
                    503,
                ) from None
            return last
        finally:
            self.front.forget(req_id)
        self.front.remember(msg, reply)
        return reply

    async def update_weights_from_disk(
        self,
        req: UpdateWeightsFromDiskReq,
        abort_all: bool = False,
        drain_timeout_s: float = DRAIN_TIMEOUT_S,
    ) -> tuple[bool, str, int]:
        """SGLang's: new requests wait (``num_paused``), the ones in flight finish (or are
        aborted with ``abort_all``), the scheduler loads the checkpoint, then requests flow
        again. ``(success, message, number of requests that waited)``."""
        if self._updating:
            raise GenerateError("a weight update is already running; retry after it", 409)
        self._updating = True
        self._update_gate()
        self._num_paused_in_update = 0
        try:
            if abort_all:
                self.abort_all()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + drain_timeout_s
            while True:
                reply = await self.control(req, timeout_s=WEIGHT_LOAD_TIMEOUT_S)
                if not is_busy(reply):
                    return reply.ok, str(reply.data.get("message", "")), self._num_paused_in_update
                if loop.time() > deadline:
                    return (
                        False,
                        f"requests were still running after {drain_timeout_s:.0f} s; retry, or "
                        "send abort_all_requests: true",
                        self._num_paused_in_update,
                    )
                await asyncio.sleep(0.02)
        finally:
            self._updating = False
            self._update_gate()

    async def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's ``/pause_generation``: new requests wait until :meth:`continue_generation`;
        the ones in flight are aborted (``abort``), or stay in the paused scheduler with their
        KV (``in_place``) or back in its waiting queue without it (``retract``)."""
        self.paused_by_request = True
        self._update_gate()
        self._start_pause_watchdog()
        if mode == "abort":
            self.abort_all()
            return
        try:  # the scheduler pauses after the step it runs now, however long that is
            reply = await self.control(PauseReq(mode), timeout_s=PAUSE_TIMEOUT_S)
        except GenerateError:
            self.paused_by_request = False
            self._update_gate()
            self._stop_pause_watchdog()
            raise
        if not reply.ok:
            raise GenerateError(str(reply.data.get("message")), 400, "mode")

    async def continue_generation(self) -> None:
        await self.control(ContinueReq(), timeout_s=PAUSE_TIMEOUT_S)  # the scheduler runs again
        self.paused_by_request = False
        self._update_gate()
        self._stop_pause_watchdog()

    def _held_too_long(self) -> GenerateError:
        limit = self.cfg.paused_request_timeout_s
        return GenerateError(
            f"{self.pause_reason or 'generation was paused'}: this request was held for "
            f"{limit:g} s (--paused-request-timeout-s); retry once the server is ready (/ready)",
            503,
            code="paused_timeout",
        )

    def _start_pause_watchdog(self) -> None:
        """The requests the paused scheduler holds (``in_place``, ``retract``) end with a 503
        once the pause lasted ``paused_request_timeout_s``; new ones time out in the gate."""
        if self._pause_watchdog is None or self._pause_watchdog.done():
            self._pause_watchdog = asyncio.create_task(self._end_held_requests())

    def _stop_pause_watchdog(self) -> None:
        if self._pause_watchdog is not None:
            self._pause_watchdog.cancel()
            self._pause_watchdog = None

    async def _end_held_requests(self) -> None:
        await asyncio.sleep(self.cfg.paused_request_timeout_s)
        if not self.paused_by_request:
            return
        held = list(self.front.states.values())
        if held:
            logger.warning("ending %d request(s) held by a pause past its limit", len(held))
        for state in held:  # their groups abort them in the scheduler as they close
            state.error = self._held_too_long()
            state.waiter.set()

    @property
    def pause_reason(self) -> str | None:
        """Why requests wait now (None: they do not): a pause, or a weight update."""
        if self.paused_by_request:
            return "generation is paused (/pause_generation); /continue_generation resumes it"
        if self._updating:
            return "the weights are being updated (/update_weights_from_disk)"
        return None

    def _update_gate(self) -> None:
        if self._updating or self.paused_by_request:
            self._resumed.clear()
        else:
            self._resumed.set()

    @property
    def weight_update_pending(self) -> bool:
        return self._updating

    async def load(self) -> dict[str, Any]:
        """The scheduler's load figures (``Scheduler.load_info``), answered between two steps
        without waiting for the step in flight; concurrent callers share one query, so load
        polling costs the scheduler at most one answer at a time."""
        if self._load_query is None or self._load_query.done():
            query = asyncio.ensure_future(self.control(LoadReq()))
            query.add_done_callback(lambda q: q.cancelled() or q.exception())  # seen if unread
            self._load_query = query
        reply = await asyncio.shield(self._load_query)
        if not reply.ok:
            raise GenerateError(f"no load figures: {reply.data.get('message')}", 503)
        return reply.data

    def _send(self, msg: Any) -> None:
        self._send_sock.send(encode(msg))

    # ------------------------------------------------------------------ outputs
    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            raw = await sock.recv()
            try:
                msg = decode(raw)
                if isinstance(msg, BatchStrOut):
                    self._on_str_out(msg)
                elif isinstance(msg, ControlReply):
                    fut = self.front.reply_waiter(msg)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    logger.error("unexpected message %s", type(msg).__name__)
            except Exception:
                logger.exception("failed to handle a message from the workers")

    def _on_str_out(self, out: BatchStrOut) -> None:
        now = time.perf_counter()
        for state, num_new in self.front.fold(out):
            self._observe(state, num_new, now)
            state.has_update = True
            state.waiter.set()

    def _observe(self, state: ReqState, num_new: int, now: float) -> None:
        if state.req.observer is not None:  # tracing or the request dump is on
            state.req.observer.on_update(state, num_new, now)
        if self.observer is None or not state.req.inp.log_metrics:
            return
        if num_new and state.req.inp.stream:
            if state.last_token_s is None:
                self.observer.on_first_token(now - state.created_s)
            else:
                self.observer.on_tokens((now - state.last_token_s) / num_new)
            state.last_token_s = now
        if state.finish_reason is not None:
            self.observer.on_finish(
                now - state.created_s,
                state.result.prompt_tokens,
                state.result.completion_tokens,
                state.result.cached_tokens,
            )

    def output(self, state: ReqState) -> dict[str, Any]:
        """The SGLang-shaped response for the request so far."""
        out = state.result.to_dict(self.token_text)
        meta = out["meta_info"]
        meta["prompt_tokens"] = meta["prompt_tokens"] or len(state.req.msg.input_ids)
        meta["e2e_latency"] = time.perf_counter() - state.created_s
        inp = state.req.inp
        if inp.return_prompt_token_ids and (not inp.stream or state.finish_reason is not None):
            out["prompt_token_ids"] = list(state.req.msg.input_ids)  # streamed: the last event
        return out
