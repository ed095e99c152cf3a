"""The in-process engine: the real scheduler, no HTTP, no subprocesses.

It is the request front the server shares (managers/request_front.py: checks, rids, sessions,
outputs, control calls) plus an in-process inbox and step driving (managers/step_driver.py):
there is no background thread; a caller waiting for its results runs the scheduler's steps
itself (one caller at a time; the others wait for what it produces).

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

import contextlib
import logging
import queue
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.managers.engine_options import (
    ENGINE_GENERATE_EXTRAS,
    check_score_options,
    check_sglang_options,
    plan_engine_scores,
    score_generate_args,
)
from radixlm.srt.managers.engine_ranks import InProcessRanks
from radixlm.srt.managers.engine_streams import (
    FINISHED,
    AsyncRequestStream,
    RequestStream,
    outcome,
    results_or_first_error,
)
from radixlm.srt.managers.front_door import FrontDoor, ModelLimits
from radixlm.srt.managers.generate_call import GenerateCall, engine_prompts, split_call
from radixlm.srt.managers.generate_input import PreparedReq
from radixlm.srt.managers.model_info import model_info_of, served_model_name
from radixlm.srt.managers.request_front import ReqState, RequestFront, texts_to_tokenize
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.request_log import RequestLog
from radixlm.srt.managers.scoring import ScoreJob, ScoreResult
from radixlm.srt.managers.sessions import SessionParams
from radixlm.srt.managers.step_driver import StepDriver
from radixlm.srt.managers.tp_ranks import with_rendezvous
from radixlm.srt.messages import (
    PROFILE_FIELDS,
    FlushCacheReq,
    GetWeightsByNameReq,
    ServerInfoReq,
    StartProfileReq,
    StopProfileReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromTensorReq,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


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
        self.door = FrontDoor(self.tokenizer, ModelLimits.from_info(self.scheduler.ready_info()))
        inbox: queue.Queue = queue.Queue()  # messages for the scheduler
        # the request lifecycle shared with the server (managers/request_front.py), and the
        # in-process inbox and step driving (managers/step_driver.py)
        self.front = RequestFront(
            lambda: self.door, inbox.put, request_log=RequestLog.from_config(self.config)
        )
        self.driver = StepDriver(self.scheduler, self._ranks, self.front, inbox)
        self.sessions = self.front.sessions  # managers/sessions.py

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
        cache_salt: str | list[str] | None = None,
        **sglang_options: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's ``/generate`` in-process: a dict per prompt (a list for a list of prompts
        or ``n > 1``); with ``stream=True`` an iterator of dicts with the text so far.
        ``session_params`` makes each prompt a turn of a session (:meth:`open_session`).
        ``token_ids_logprob`` (with ``return_logprob``; one list, or one per prompt) adds
        ``input_token_ids_logprobs`` and ``output_token_ids_logprobs`` to ``meta_info``.
        ``cache_salt`` (one, or one per prompt): cached prefixes are shared only between
        requests with the same salt, in every KV tier. SGLang's other keywords (``lora_path``, ``image_data``, ...) are taken at their
        defaults and refused by name otherwise (managers/engine_options.py)."""
        states, keys, is_batch = self._start(locals())
        if stream:
            return RequestStream(self.front, states[0], keys, self.driver.next, self._output)
        with self._opened(states, keys):
            outcomes = []
            for state in states:  # all waited for, even after one failed: none left behind
                try:
                    outcomes.append(self._wait(state))
                except ValueError as e:
                    outcomes.append(e)
        results = results_or_first_error(outcomes)
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
        cache_salt: str | list[str] | None = None,
        **sglang_options: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """:meth:`generate` for asyncio code (SGLang's ``Engine.async_generate``; with
        ``stream=True`` it returns an async iterator). Concurrent calls are batched together:
        while a call waits, it runs one scheduler step at a time on the event loop's thread
        and yields to the other coroutines between steps. A cancelled call aborts its
        requests."""
        states, keys, is_batch = self._start(locals())
        if stream:
            return AsyncRequestStream(self.front, states[0], keys, self.driver.anext, self._output)
        with self._opened(states, keys):  # a cancelled call aborts them
            outcomes = [await outcome(self._await_result(s)) for s in states]
        results = results_or_first_error(outcomes)
        return results if is_batch else results[0]

    def _start(self, args: dict[str, Any]) -> tuple[list[ReqState], list[str], bool]:
        """Checks and sends the requests of :meth:`generate`'s arguments; their states, the
        client rids they are registered under, and whether the answer is a list."""
        check_sglang_options(args["sglang_options"])
        prompt = args["prompt"]
        self._call(engine_prompts, prompt, args["input_ids"], args["sampling_params"])
        session = self._call(SessionParams.from_dict, args["session_params"] or {})
        text = prompt if prompt is None or isinstance(prompt, str) else list(prompt)
        extras = {k: args["sglang_options"].get(k) for k in ENGINE_GENERATE_EXTRAS}
        call = GenerateCall.from_fields({**args, **extras, "text": text, "session_params": session})
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
        at their off values only (managers/engine_options.py)."""
        job, ids = self._score_job(locals())
        outs = self.generate(**score_generate_args(job, ids)) if ids else []
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
        outs = await self.async_generate(**score_generate_args(job, ids)) if ids else []
        return self._call(job.result, outs)

    def _score_job(self, args: dict[str, Any]) -> tuple[ScoreJob, list[list[int]]]:
        check_score_options(args["sglang_options"])
        return self._call(plan_engine_scores, args, self.door, self.vocab_size)

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
        self.driver.deliver_now()

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
        return self.driver.ask(FlushCacheReq()).ok

    def start_profile(self, **args) -> str:
        """Starts a torch.profiler trace of the scheduler steps (SGLang's ProfileReq fields:
        ``output_dir``, ``num_steps``, ``activities``, ``with_stack``, ``record_shapes``,
        ``profile_id``, ``profile_prefix``, ``start_step``); returns the trace's path.
        ValueError for a bad field or a profile already running."""
        unknown = sorted(set(args) - PROFILE_FIELDS)
        if unknown:
            raise ValueError(f"{unknown[0]} is not a field of start_profile")
        reply = self.driver.ask(StartProfileReq(**args))
        if not reply.ok:
            raise ValueError(reply.data.get("message", "cannot start the profile"))
        return reply.data["path"]

    def stop_profile(self) -> str | None:
        """Ends the profile and writes its trace (srt/scheduler/profiling.py); its path."""
        reply = self.driver.ask(StopProfileReq())
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
        reply = self.driver.ask_when_idle(
            UpdateWeightsFromDiskReq(model_path, load_format, flush_cache, weight_version)
        )
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
        reply = self.driver.ask_when_idle(
            UpdateWeightsFromTensorReq(named_tensors, load_format, flush_cache)
        )
        return reply.ok, reply.data["message"]

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's: the running weight of checkpoint tensor ``name`` (Hugging Face names,
        such as ``model.layers.0.mlp.up_proj.weight``) as float32 values, its first
        ``truncate_size`` rows; ValueError for a name the model lacks."""
        reply = self.driver.ask(GetWeightsByNameReq(name, truncate_size))
        if not reply.ok:
            raise ValueError(reply.data["message"])
        return reply.data["parameter"]

    def get_model_info(self) -> dict:
        """SGLang's ``get_model_info``: the same fields as the server's ``/get_model_info``."""
        info = self.scheduler.ready_info()
        return model_info_of(info, self.config.tokenizer_path, served_model_name(self.config, info))

    def get_server_info(self) -> dict:
        return {**self.scheduler.ready_info(), **self.driver.ask(ServerInfoReq()).data}

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
        if self.front.request_log is not None:
            self.front.request_log.close()

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
        while self.driver.next(state.waiter) is not FINISHED:
            pass
        return self._output(state)

    async def _await_result(self, state: ReqState) -> dict:
        while await self.driver.anext(state.waiter) is not FINISHED:
            pass
        return self._output(state)

    def _output(self, state: ReqState) -> dict:
        result = state.result
        out = result.to_dict(lambda t: self.tokenizer.decode([t]))
        reason = result.finish_reason or {}
        if reason.get("type") == "abort" and reason.get("status_code") == 400:
            raise ValueError(reason.get("message", "invalid request"))
        return out
