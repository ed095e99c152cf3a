"""The in-process engine: the real scheduler, no HTTP, no subprocesses.

There is no background thread: a caller waiting for its results runs the scheduler's steps
itself (one caller at a time; the others wait for what it produces, and take over when it is
done). Running the model on the thread that waits, usually the main thread, matters on a CPU:
once a process's main thread has used torch's OpenMP pool, parallel ops issued from a second
thread ran 2-4x slower here (softmax, SDPA, large adds), which made a decode step 25% slower.

    from radixlm.srt import Engine
    with Engine() as engine:                       # the embedded default model
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        print(out["text"])

Tensor parallelism (``tp_size=N``): this process is rank 0 (the scheduler, in-process as
always); ranks 1..N-1 are ``spawn`` children (``managers/tp_ranks.py``) that never outlive it
(a parent-death signal, a parent watch, ``daemon``). Create such an Engine from the main thread
(the parent-death signal follows the creating thread) and under ``if __name__ == "__main__":``
in scripts (``spawn`` imports the main module). One tensor-parallel Engine per process at a
time (torch.distributed's group is per process). If a rank dies or a forward fails, the ranks
are out of step: the followers are killed and every later call raises ``RuntimeError``; create
a new Engine. ``shutdown`` stops the followers and leaves the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TYPE_CHECKING, Any

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.managers.detokenizer import Detokenizer
from radixlm.srt.managers.engine_ranks import InProcessRanks
from radixlm.srt.managers.front_door import FrontDoor, ModelLimits
from radixlm.srt.managers.generate_call import GenerateCall, engine_prompts, split_call
from radixlm.srt.managers.generate_input import PreparedReq
from radixlm.srt.managers.model_info import model_info_of, served_model_name
from radixlm.srt.managers.request_front import ReqState, RequestFront, is_busy, texts_to_tokenize
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.scoring import (
    SCORE_SAMPLING_PARAMS,
    ScoreJob,
    ScoreResult,
    plan_scores,
)
from radixlm.srt.managers.sessions import SessionParams
from radixlm.srt.managers.tp_ranks import with_rendezvous
from radixlm.srt.messages import BatchTokenOut, ControlReply, ControlReq
from radixlm.srt.scheduler.failures import handle_message, run_step

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_FINISHED = object()

# SGLang's Engine.generate keywords this engine has no use for: accepted at these defaults
# (callers pass them explicitly), a ValueError naming them otherwise. A trace header is
# observability only: any value is accepted.
SGLANG_GENERATE_DEFAULTS: dict[str, Any] = {
    **dict.fromkeys(
        (
            "image_data",
            "audio_data",
            "video_data",
            "mm_hashes",
            "mm_content_hashes",
            "lora_path",
            "custom_logit_processor",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "routed_dp_rank",
            "disagg_prefill_dp_rank",
            "kv_hints",
            "data_parallel_rank",
            "priority",
            "session_id",
        )
    ),
    "require_reasoning": False,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
}
_ACCEPTED_ANY = ("external_trace_header",)
# SGLang's Engine.score keywords for what this engine does not do, with their off values
SCORE_OFF_OPTIONS: dict[str, Any] = {
    "embed_override_token_id": None,
    "query_embed_overrides": None,
    "item_embed_overrides": None,
    "stacked_query_item_embed_overrides": None,
    "return_pooled_hidden_states": False,
    "score_extraction_token_id": None,
}


def check_sglang_options(options: dict[str, Any]) -> None:
    for name, value in options.items():
        if name in _ACCEPTED_ANY:
            continue
        if name not in SGLANG_GENERATE_DEFAULTS:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        default = SGLANG_GENERATE_DEFAULTS[name]
        if not (value is default or (type(value) is type(default) and value == default)):
            raise ValueError(
                f"{name} is not supported by this engine (text-only models, no LoRA, no "
                f"disaggregation, no hidden-state output); leave it out or at {default!r}"
            )


class Engine:
    def __init__(self, model_path: str | None = None, **options: Any):
        self.config = with_rendezvous(config_from_kwargs(model_path=model_path, **options))
        logging.basicConfig(
            level=self.config.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s"
        )
        self._ranks = InProcessRanks(self.config)  # tensor parallelism; a shell at tp_size 1
        self.scheduler = self._ranks.start_scheduler()
        self.tokenizer = self.scheduler.runner.tokenizer
        self.vocab_size = self.scheduler.runner.vocab_size
        self._detokenizer = Detokenizer(self.tokenizer)
        self._inbox: queue.Queue = queue.Queue()  # messages for the scheduler
        self.door = FrontDoor(self.tokenizer, ModelLimits.from_info(self.scheduler.ready_info()))
        # the request lifecycle shared with the server (managers/request_front.py)
        self.front = RequestFront(lambda: self.door, self._inbox.put)
        self.sessions = self.front.sessions  # managers/sessions.py
        self._driving = threading.Lock()  # held by the caller that runs scheduler steps

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | None = None,
        session_params: dict | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        **sglang_options: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's ``/generate`` in-process: a dict per prompt (a list for a list of prompts
        or ``n > 1``); with ``stream=True`` an iterator of dicts with the text so far.
        ``session_params`` makes each prompt a turn of a session (:meth:`open_session`).
        ``token_ids_logprob`` (with ``return_logprob``; one list, or one per prompt) adds
        ``input_token_ids_logprobs`` and ``output_token_ids_logprobs`` to ``meta_info``.
        SGLang's other keywords (``lora_path``, ``image_data``, ...) are taken at their
        defaults and refused by name otherwise (:data:`SGLANG_GENERATE_DEFAULTS`)."""
        states, keys, is_batch = self._start(locals())
        if stream:
            return _Stream(self, states[0], keys)
        with self._opened(states, keys):
            outcomes = []
            for state in states:  # all waited for, even after one failed: none left behind
                try:
                    outcomes.append(self._wait(state))
                except ValueError as e:
                    outcomes.append(e)
        results = _results_or_first_error(outcomes)
        return results if is_batch else results[0]

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        rid: str | None = None,
        session_params: dict | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        **sglang_options: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """:meth:`generate` for asyncio code (SGLang's ``Engine.async_generate``; with
        ``stream=True`` it returns an async iterator). Concurrent calls are batched together:
        while a call waits, it runs one scheduler step at a time on the event loop's thread
        and yields to the other coroutines between steps. A cancelled call aborts its
        requests."""
        states, keys, is_batch = self._start(locals())
        if stream:
            return _AsyncStream(self, states[0], keys)
        with self._opened(states, keys):  # a cancelled call aborts them
            outcomes = [await _outcome(self._await_result(s)) for s in states]
        results = _results_or_first_error(outcomes)
        return results if is_batch else results[0]

    def _start(self, args: dict[str, Any]) -> tuple[list[ReqState], list[str], bool]:
        """Checks and sends the requests of :meth:`generate`'s arguments; their states, the
        client rids they are registered under, and whether the answer is a list."""
        check_sglang_options(args["sglang_options"])
        prompt = args["prompt"]
        self._call(engine_prompts, prompt, args["input_ids"], args["sampling_params"])
        session = self._call(SessionParams.from_dict, args["session_params"] or {})
        text = prompt if prompt is None or isinstance(prompt, str) else list(prompt)
        call = GenerateCall.from_fields({**args, "text": text, "session_params": session})
        prepared, is_batch = self._prepare(call)
        if args["stream"] and is_batch:
            raise ValueError("stream=True takes a single prompt with n=1")
        return *self._call(self.front.open, prepared, queue.Queue), is_batch

    def _prepare(self, call: GenerateCall) -> tuple[list[PreparedReq], bool]:
        """One checked message per prompt and sample (front_door.py), before any is queued,
        and whether the answer is a list; the front door's refusals become ValueErrors with
        the same message."""
        inputs, is_batch = self._call(split_call, call, False)
        ids = {k: self._call(self.door.tokenize, *k, "text") for k in texts_to_tokenize(inputs)}
        return self._call(self.front.prepare_all, inputs, ids), is_batch

    @contextlib.contextmanager
    def _opened(self, states: list[ReqState], keys: list[str]) -> Iterator[None]:
        """While waiting for ``states``; on leaving, all are released (the ones nobody waited
        for to the end, after an exception or a cancellation, are aborted)."""
        try:
            yield
        finally:
            self.front.release(states, keys)

    def score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | list[list[int]] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        *,
        temperature: float = 1.0,
        return_token_logprobs: bool = False,
        **sglang_options: Any,
    ) -> ScoreResult:
        """SGLang's ``Engine.score``: for each item, the probability of each label token right
        after ``query + item`` (``item + query`` with ``item_first``), or with
        ``apply_softmax`` their softmax over the labels (managers/scoring.py). SGLang's
        embedding-override, pooled-hidden-state and setwise keywords are accepted (by name)
        at their off values only (:data:`SCORE_OFF_OPTIONS`)."""
        job, ids = self._score_job(locals())
        outs = self.generate(**_score_generate_args(job, ids)) if ids else []
        return self._call(job.result, outs)

    async def async_score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | list[list[int]] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        *,
        temperature: float = 1.0,
        return_token_logprobs: bool = False,
        **sglang_options: Any,
    ) -> ScoreResult:
        """:meth:`score` for asyncio code (SGLang's ``Engine.async_score``)."""
        job, ids = self._score_job(locals())
        outs = await self.async_generate(**_score_generate_args(job, ids)) if ids else []
        return self._call(job.result, outs)

    def _score_job(self, args: dict[str, Any]) -> tuple[ScoreJob, list[list[int]]]:
        """The checked scoring job of :meth:`score`'s arguments and its prompts' token ids."""
        for name, value in args["sglang_options"].items():
            if name not in SCORE_OFF_OPTIONS:
                raise TypeError(f"score() got an unexpected keyword argument {name!r}")
            if value is not None and value is not SCORE_OFF_OPTIONS[name]:
                raise ValueError(f"{name} is not supported by this engine; leave it out")
        keys = ("apply_softmax", "item_first", "temperature", "return_token_logprobs")
        job = self._call(
            lambda: plan_scores(
                args["query"],
                args["items"],
                args["label_token_ids"],
                vocab_size=self.vocab_size,
                **{k: args[k] for k in keys},
            )
        )
        self._call(job.check_text_size, self.door.max_token_chars)
        ids = [
            self._call(self.door.tokenize, p, True, "items") if job.is_text else p
            for p in job.prompts
        ]
        self._call(job.check_size, ids)
        return job, ids

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Aborts the request ``rid`` (exact match; for a batch or ``n > 1`` request given a
        ``rid``, every one of its samples), or every request with ``abort_all``."""
        if abort_all:
            self.front.abort_all()
        else:
            self.front.abort(rid)
        if self._driving.acquire(blocking=False):  # apply it now unless a caller is stepping
            try:
                self._drain_inbox()
            finally:
                self._driving.release()

    def open_session(
        self, capacity_of_str_len: int, session_id: str | None = None, timeout: float | None = None
    ) -> str:
        """Opens a session (SGLang's ``/open_session``); returns its id."""
        with self.front.lock:
            return self._call(self.sessions.open, capacity_of_str_len, session_id, timeout)

    def close_session(self, session_id: str) -> None:
        """Closes a session; its running turns are aborted."""
        with self.front.lock:
            self._call(self.sessions.close, session_id)

    def flush_cache(self) -> bool:
        return self._control("flush_cache").ok

    def start_profile(self, **args) -> str:
        """Starts a torch.profiler trace of the scheduler steps (SGLang's ProfileReq fields:
        ``output_dir``, ``num_steps``, ``activities``, ``with_stack``, ``record_shapes``,
        ``profile_id``, ``profile_prefix``, ``start_step``); returns the trace's path.
        ValueError for a bad field or a profile already running."""
        reply = self._control("start_profile", args)
        if not reply.ok:
            raise ValueError(reply.data.get("message", "cannot start the profile"))
        return reply.data["path"]

    def stop_profile(self) -> str | None:
        """Ends the profile and writes its trace (srt/scheduler/profiling.py); its path."""
        reply = self._control("stop_profile")
        if not reply.ok:
            raise ValueError(reply.data.get("message", "no profile is running"))
        return reply.data["path"]

    def update_weights_from_disk(
        self,
        model_path: str,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> tuple[bool, str, int]:
        """SGLang's: loads another checkpoint of the same architecture and sizes into the
        running model, in place, once the requests in flight have finished (this call runs
        their steps meanwhile); the prefix cache is emptied unless ``flush_cache=False``.
        ``(success, message, 0)``; a failed load leaves the previous weights."""
        args = {
            "model_path": model_path,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        reply = self._when_idle("update_weights_from_disk", args)
        return reply.ok, reply.data["message"], 0

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        """SGLang's: copies ``(checkpoint name, tensor)`` pairs (any subset of the model's
        tensors, e.g. one bucket of a trainer's update) into the running weights, in place,
        once the requests in flight have finished; the prefix cache is emptied unless
        ``flush_cache=False`` (send False for all but the last bucket). ``(success,
        message)``; a refused call (unknown name, other shape) changes nothing."""
        args = {
            "named_tensors": named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        reply = self._when_idle("update_weights_from_tensor", args)
        return reply.ok, reply.data["message"]

    def _when_idle(self, kind: str, args: dict):
        """A weight update's control reply, sent again while the scheduler answers ``busy``
        (requests in flight), running their steps meanwhile."""
        while True:
            reply = self._control(kind, args)
            if not is_busy(reply):
                return reply
            if not self._try_step():  # another caller runs the steps of those requests
                time.sleep(0.002)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's: the running weight of checkpoint tensor ``name`` (Hugging Face names,
        such as ``model.layers.0.mlp.up_proj.weight``) as float32 values, its first
        ``truncate_size`` rows; ValueError for a name the model lacks."""
        reply = self._control("get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        if not reply.ok:
            raise ValueError(reply.data["message"])
        return reply.data["parameter"]

    def _try_step(self) -> bool:
        """Runs one scheduler step unless another caller is running them (then False)."""
        if not self._driving.acquire(blocking=False):
            return False
        try:
            self._run_once()
        finally:
            self._driving.release()
        return True

    def get_model_info(self) -> dict:
        """SGLang's ``get_model_info``: the same fields as the server's ``/get_model_info``."""
        info = self.scheduler.ready_info()
        return model_info_of(info, self.config.tokenizer_path, served_model_name(self.config, info))

    def get_server_info(self) -> dict:
        return {**self.scheduler.ready_info(), **self._control("server_info").data}

    def shutdown(self) -> None:
        """Aborts whatever still runs (no background work is left after this); stops the
        tensor-parallel followers. Idempotent."""
        if self.scheduler is not None and self._ranks.is_running and self.scheduler.has_work():
            self.abort(abort_all=True)
        if self.scheduler is not None:
            self.scheduler.grammars.shutdown()  # compile threads, outlines-core children
            self.scheduler.close()  # a disk KV tier flushes its writes
        self._ranks.shutdown()
        with self.front.lock:
            self.sessions.clear()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _call(fn, *args):
        """``fn(*args)`` with a GenerateError turned into the Engine's ValueError."""
        try:
            return fn(*args)
        except GenerateError as e:
            raise ValueError(e.message) from None

    def _wait(self, state: ReqState) -> dict:
        while self._next(state.waiter) is not _FINISHED:
            pass
        return self._output(state)

    def _next(self, q: queue.Queue, timeout: float | None = None):
        """The next item of ``q``; runs scheduler steps meanwhile unless another caller does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the engine did not answer in time")
            if not self._try_step():
                try:
                    return q.get(timeout=0.002)
                except queue.Empty:
                    pass

    async def _anext(self, q: queue.Queue):
        """``_next`` for coroutines: one scheduler step (or a short sleep while another caller
        steps) between looks at ``q``, yielding to the event loop each time."""
        while True:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
            await asyncio.sleep(0 if self._try_step() else 0.002)

    async def _await_result(self, state: ReqState) -> dict:
        while await self._anext(state.waiter) is not _FINISHED:
            pass
        return self._output(state)

    def _output(self, state: ReqState) -> dict:
        result = state.result
        out = result.to_dict(lambda t: self.tokenizer.decode([t]))
        reason = result.finish_reason or {}
        if reason.get("type") == "abort" and reason.get("status_code") == 400:
            raise ValueError(reason.get("message", "invalid request"))
        return out

    def _control(self, kind: str, args: dict | None = None) -> ControlReply:
        return self._ask(ControlReq("", kind, args or {}))

    def _ask(self, msg: Any, timeout: float = 60) -> ControlReply:
        """The scheduler's reply to one control message (its ``req_id`` is set here)."""
        q: queue.Queue = queue.Queue()
        req_id = self.front.send_control(msg, q)
        try:
            return self._next(q, timeout=timeout)
        finally:
            self.front.forget(req_id)

    def _run_once(self) -> None:
        """Handles queued messages, then runs one scheduler step (caller holds ``_driving``).
        Raises RuntimeError once the tensor-parallel group cannot run."""
        self._ranks.check()
        self._drain_inbox()
        if not self.scheduler.wants_step():
            return
        out = run_step(self.scheduler)  # never raises; a failed step reports what it held
        if out is not None:
            self._dispatch(self._detokenizer.handle(out))
        self._ranks.check()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            reply = handle_message(self.scheduler, msg)  # never raises
            if isinstance(reply, ControlReply):
                waiter = self.front.reply_waiter(reply)
                if waiter is not None:
                    waiter.put(reply)
            elif isinstance(reply, BatchTokenOut):  # a request the scheduler failed to admit
                self._dispatch(self._detokenizer.handle(reply))

    def _dispatch(self, out) -> None:
        for state, _ in self.front.fold(out):
            result = state.result
            state.waiter.put(_FINISHED if result.is_finished else result.to_dict())


def _score_generate_args(job: ScoreJob, ids: list[list[int]]) -> dict[str, Any]:
    """The prefill-only requests that score a job's items (managers/scoring.py)."""
    return dict(
        input_ids=ids,
        sampling_params=SCORE_SAMPLING_PARAMS,
        return_logprob=True,
        token_ids_logprob=job.labels,
    )


async def _outcome(result: Awaitable[dict]) -> dict | ValueError:
    try:
        return await result
    except ValueError as e:
        return e


def _results_or_first_error(outcomes: list[dict | ValueError]) -> list[dict]:
    for outcome in outcomes:
        if isinstance(outcome, ValueError):
            raise outcome
    return outcomes  # type: ignore[return-value]


class _Stream:
    """A streamed request's chunks (dicts with the text so far, then the result). Reading it to
    the end, ``close()``, an error while reading, or dropping it unread or part-read all free
    the request: one not finished is aborted."""

    def __init__(self, engine: Engine, state: ReqState, keys: list[str]) -> None:
        self._engine, self._state, self._keys = engine, state, keys
        self._queue = state.waiter
        self._done = self._released = False

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> dict:
        if self._done:
            raise StopIteration
        try:
            return self._take(self._engine._next(self._queue))
        except BaseException:
            self.close()
            raise

    def _take(self, item: Any) -> dict:
        if item is _FINISHED:
            self._done = True
            try:
                return self._engine._output(self._state)
            finally:
                self.close()
        return item

    def close(self) -> None:
        self._done = True
        if not self._released:
            self._released = True
            self._engine.front.release([self._state], self._keys)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # an engine already shut down: nothing left to free
            pass


class _AsyncStream(_Stream):
    """:class:`_Stream` for ``async for`` (a cancelled read aborts the request too)."""

    def __aiter__(self) -> _AsyncStream:
        return self

    async def __anext__(self) -> dict:
        if self._done:
            raise StopAsyncIteration
        try:
            return self._take(await self._engine._anext(self._queue))
        except BaseException:
            self.close()
            raise

    async def aclose(self) -> None:
        self.close()
