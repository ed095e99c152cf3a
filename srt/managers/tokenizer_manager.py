"""The tokenizer manager: the asyncio side of the server, in the HTTP process.

It tokenizes and validates a request (``prepare``; a ``GenerateError`` carries the HTTP status),
sends it to the scheduler, and collects the detokenizer's ``BatchStrOut`` per rid into the
request's state; ``generate`` yields SGLang-shaped outputs ``{text, output_ids, meta_info}``
(cumulative text; each update when streaming, the final one otherwise). A request whose consumer
goes away (client disconnect, cancelled task) is aborted in the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio

from radixlm.srt.config import ServerConfig
from radixlm.srt.messages import (
    AbortReq,
    BatchStrOut,
    ControlReply,
    ControlReq,
    TokenizedGenerateReq,
    decode,
    encode,
)
from radixlm.srt.managers.results import RequestResult
from radixlm.srt.managers.scheduler_process import IpcEndpoints
from radixlm.srt.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
MAX_TOP_LOGPROBS = 20


class GenerateError(Exception):
    """A request that cannot be served; ``status_code`` is the HTTP status to answer with."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


class ClientDisconnected(Exception):
    """The HTTP client went away; the request has been aborted."""


class DisconnectProbe(Protocol):
    async def is_disconnected(self) -> bool: ...


class RequestObserver(Protocol):
    """Receives per-request timings (the server's Prometheus metrics implement it)."""

    def on_first_token(self, ttft_s: float) -> None: ...
    def on_tokens(self, per_token_s: float) -> None: ...
    def on_finish(self, e2e_s: float, prompt: int, completion: int, cached: int) -> None: ...


@dataclass
class GenerateInput:
    """One (non-batched) generate request in SGLang's native field names."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


@dataclass
class PreparedReq:
    inp: GenerateInput
    params: SamplingParams
    msg: TokenizedGenerateReq

    @property
    def rid(self) -> str:
        return self.msg.rid


@dataclass
class ReqState:
    req: PreparedReq
    created_s: float
    result: RequestResult
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: GenerateError | None = None
    last_token_s: float | None = None

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return self.result.finish_reason


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
        self.states: dict[str, ReqState] = {}
        self.pending_control: dict[str, asyncio.Future[ControlReply]] = {}
        self.dead_reason: str | None = None
        self._token_text: dict[int, str] = {}
        self._ctx = zmq.Context()
        self._send_sock = self._ctx.socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)
        self._send_sock.setsockopt(zmq.LINGER, 0)
        self._send_sock.connect(endpoints.scheduler)
        self._actx: zmq.asyncio.Context | None = None
        self._recv_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Binds the reply socket and starts the receive loop (call inside the event loop)."""
        self._actx = zmq.asyncio.Context()
        sock = self._actx.socket(zmq.PULL)
        sock.bind(self.endpoints.tokenizer)
        self._recv_task = asyncio.create_task(self._recv_loop(sock), name="tokenizer-recv")

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
        if self._actx is not None:
            self._actx.destroy(linger=0)
        self._ctx.destroy(linger=0)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    def mark_dead(self, reason: str) -> None:
        """A child process died: fail every waiting request now and every new one at once."""
        if self.dead_reason is not None:
            return
        logger.error("serving stopped: %s", reason)
        self.dead_reason = reason
        for state in self.states.values():
            state.error = GenerateError(f"server unavailable: {reason}", 503)
            state.event.set()
        for fut in self.pending_control.values():
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

    # ------------------------------------------------------------------ requests
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def prepare(self, inp: GenerateInput) -> PreparedReq:
        """Tokenizes and validates one request; raises GenerateError (400) naming the problem."""
        self._check_alive()
        try:
            params = SamplingParams.from_dict(inp.sampling_params)
            params.validate(self.vocab_size)
        except ValueError as e:
            raise GenerateError(str(e), 400) from None
        input_ids = self._input_ids(inp)
        self._check_lengths(len(input_ids), params)
        self._check_logprob_args(inp, len(input_ids))
        rid = inp.rid or uuid.uuid4().hex
        if rid in self.states:
            raise GenerateError(f"a request with rid {rid!r} is already running", 400, "rid")
        msg = TokenizedGenerateReq(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params.replace(n=1).to_dict(),
            return_logprob=inp.return_logprob,
            logprob_start_len=inp.logprob_start_len if inp.return_logprob else -1,
            top_logprobs_num=inp.top_logprobs_num if inp.return_logprob else 0,
            stream=inp.stream,
        )
        return PreparedReq(inp, params, msg)

    def _input_ids(self, inp: GenerateInput) -> list[int]:
        if (inp.text is None) == (inp.input_ids is None):
            raise GenerateError("send exactly one of text and input_ids", 400)
        if inp.input_ids is not None:
            bad = [t for t in inp.input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise GenerateError(
                    f"input_ids must be in [0, {self.vocab_size}), got {bad[:5]}", 400, "input_ids"
                )
            ids = list(inp.input_ids)
        else:
            ids = self.tokenize(inp.text or "")
        if not ids:
            raise GenerateError("the prompt is empty; send at least one token", 400)
        return ids

    def _check_lengths(self, num_input: int, params: SamplingParams) -> None:
        limit = min(self.context_length, self.max_total_tokens)
        if num_input >= limit:
            raise GenerateError(
                f"the prompt has {num_input} tokens, but this server takes at most {limit - 1} "
                f"(context length {self.context_length}, KV pool {self.max_total_tokens} tokens); "
                "shorten the prompt",
                400,
            )
        if num_input + params.max_new_tokens > self.context_length:
            raise GenerateError(
                f"the prompt ({num_input} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length of {self.context_length} tokens; "
                "lower max_new_tokens or shorten the prompt",
                400,
                "max_new_tokens",
            )

    @staticmethod
    def _check_logprob_args(inp: GenerateInput, num_input: int) -> None:
        if not -1 <= inp.logprob_start_len < num_input:
            raise GenerateError(
                f"logprob_start_len must be -1 (none) or in [0, {num_input}) for this "
                f"{num_input}-token prompt, got {inp.logprob_start_len}",
                400,
                "logprob_start_len",
            )
        if not 0 <= inp.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise GenerateError(
                f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {inp.top_logprobs_num}",
                400,
                "top_logprobs_num",
            )

    async def generate(
        self, req: PreparedReq, probe: DisconnectProbe | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Runs one prepared request; yields cumulative outputs (every update when streaming,
        else only the final one). Aborts the request if the consumer stops early."""
        self._check_alive()
        if req.rid in self.states:
            raise GenerateError(f"a request with rid {req.rid!r} is already running", 400, "rid")
        inp = req.inp
        result = RequestResult(req.rid, inp.return_logprob, inp.return_text_in_logprobs)
        state = ReqState(req, time.perf_counter(), result)
        self.states[req.rid] = state
        self._send(req.msg)
        finished = False
        try:
            while True:
                await self._wait(state, probe)
                if state.error is not None:
                    raise state.error
                if state.finish_reason is not None:
                    finished = True
                    _raise_for_error_abort(state.finish_reason)
                    yield self.output(state)
                    return
                if req.inp.stream:
                    yield self.output(state)
        finally:
            self.states.pop(req.rid, None)
            if not finished and self.dead_reason is None:
                self.abort(req.rid)

    async def _wait(self, state: ReqState, probe: DisconnectProbe | None) -> None:
        while not state.event.is_set():
            try:
                await asyncio.wait_for(state.event.wait(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if probe is not None and await probe.is_disconnected():
                    raise ClientDisconnected(state.req.rid) from None
        state.event.clear()

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self._send(AbortReq(rid=rid, abort_all=abort_all))

    async def control(
        self, kind: str, args: dict[str, Any] | None = None, timeout_s: float = 5.0
    ) -> ControlReply:
        self._check_alive()
        req_id = uuid.uuid4().hex
        fut: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self.pending_control[req_id] = fut
        self._send(ControlReq(req_id, kind, args or {}))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise GenerateError(f"the scheduler did not answer {kind!r} in time", 503) from None
        finally:
            self.pending_control.pop(req_id, None)

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
                    fut = self.pending_control.get(msg.req_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                else:
                    logger.error("unexpected message %s", type(msg).__name__)
            except Exception:
                logger.exception("failed to handle a message from the workers")

    def _on_str_out(self, out: BatchStrOut) -> None:
        t = out.token_out
        now = time.perf_counter()
        for i, rid in enumerate(t.rids):
            state = self.states.get(rid)
            if state is None:  # finished or aborted on this side already
                continue
            state.result.update(out, i)
            new_ids = t.new_token_ids[i]
            self._observe(state, len(new_ids), now)
            state.event.set()

    def _observe(self, state: ReqState, num_new: int, now: float) -> None:
        if self.observer is None:
            return
        if num_new and state.req.inp.stream:
            if state.last_token_s is None:
                self.observer.on_first_token(now - state.created_s)
            else:
                self.observer.on_tokens((now - state.last_token_s) / num_new)
            state.last_token_s = now
        if state.finish_reason is not None:
            self.observer.on_finish(
                now - state.created_s, state.result.prompt_tokens,
                state.result.completion_tokens, state.result.cached_tokens,
            )

    def output(self, state: ReqState) -> dict[str, Any]:
        """The SGLang-shaped response for the request so far."""
        out = state.result.to_dict(self.token_text)
        meta = out["meta_info"]
        meta["prompt_tokens"] = meta["prompt_tokens"] or len(state.req.msg.input_ids)
        meta["e2e_latency"] = time.perf_counter() - state.created_s
        return out


def _raise_for_error_abort(finish_reason: dict[str, Any]) -> None:
    """An abort that carries an HTTP status (a rejected request) becomes a GenerateError; other
    aborts (asked for by a client) are reported as ``finish_reason.type == "abort"``."""
    if finish_reason.get("type") == "abort" and "status_code" in finish_reason:
        raise GenerateError(str(finish_reason.get("message", "aborted")),
                            int(finish_reason["status_code"]))
