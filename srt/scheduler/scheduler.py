"""The scheduler: admits requests, builds one batch per step, runs it, and reports outputs.

Each ``step()`` picks a prefill batch when waiting requests fit (prefill first, as SGLang;
with chunked prefill it also carries every running request's decode token, see ``prefill.py``),
otherwise a decode batch of every running request; one forward; sampling; finish checks.
With ``--tpot-target-ms`` a prefill beside running requests is paced (``pacing.py``): it takes
only what their time per output token can spare, else the step decodes.
The I/O around it (ZMQ in the scheduler process, queues in the in-process Engine) calls
``handle`` for incoming messages and ``step`` while ``wants_step()``.

Control messages (queries, pause, weight updates, profiling) are handled in ``control.py``;
while paused (``self.paused``) no batch runs, and aborts are still reported.

Overlap scheduling (on a GPU, unless ``--disable-overlap-schedule``): a decode step of plain
requests is launched without waiting for its tokens (``launch_decode``); the next step builds
and launches the following decode batch, whose input ids are the previous step's sampled ids
still on the device, and only then reads the previous tokens back and checks them
(``_resolve_inflight``), so the CPU work of a step runs while the GPU computes. While a step is
in flight each of its requests carries a ``PENDING_TOKEN`` as its last output id (the token
exists on the device; its KV is written by the next step). A request that finishes when its
token is read back already has one more token computed: that token is dropped. Prefill steps,
grammar-constrained or logprob requests, retraction and messages other than new requests first
resolve the step in flight and run synchronously, as do decode steps while a request that
may speculate runs (its draft needs its last token on the host: speculative_step.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from radixlm.srt.config import ServerConfig, torch_profiler_dir
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.executor.model_runner import ModelRunner
from radixlm.srt.messages import (
    AbortReq,
    BatchTokenOut,
    ControlMessage,
    ControlReply,
    ReleaseSessionReq,
    TokenizedGenerateReq,
)
from radixlm.srt.observability.tracing import SchedulerTraces, TraceSettings, make_tracer
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.cache_factory import make_kv_manager
from radixlm.srt.scheduler.control import handle_control
from radixlm.srt.scheduler.disaggregation import make_role
from radixlm.srt.scheduler.failures import check_fits, internal_error, reject_unembeddable
from radixlm.srt.scheduler.grammar_manager import GrammarManager
from radixlm.srt.scheduler.grammar_queue import grammar_spec
from radixlm.srt.scheduler.output import (
    build_batch_output,
    record_input_logprobs,
    record_prefill_only_logprobs,
)
from radixlm.srt.scheduler.overlap import InflightDecode, launch_decode
from radixlm.srt.scheduler.pacing import PrefillPacer
from radixlm.srt.scheduler.policy import make_policy
from radixlm.srt.scheduler.prefill import PrefillAdmission, PrefillRate, mixed_batch
from radixlm.srt.scheduler.profiling import StepProfiler
from radixlm.srt.scheduler.queue_gate import PUSHED_OUT, QueueGate, overloaded
from radixlm.srt.scheduler.queue_order import PriorityRule, RankedPolicy
from radixlm.srt.scheduler.reports import LoadStats, ready_info, server_info
from radixlm.srt.scheduler.req import PENDING_TOKEN, Req, ReqStatus
from radixlm.srt.scheduler.retention import make_retention
from radixlm.srt.scheduler.sampling_step import SamplingStep, is_overlappable
from radixlm.srt.scheduler.speculative_step import SpeculativeStep
from radixlm.srt.scheduler.stop import StopChecker
from radixlm.srt.scheduler.timeline import StepTimeline
from radixlm.srt.speculative import make_drafter

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.01  # idle wait for a compiling grammar before looking at new messages


class Scheduler:
    def __init__(self, cfg: ServerConfig, runner: ModelRunner | None = None):
        self.cfg = cfg
        self.runner = runner or ModelRunner(cfg)
        r = self.runner
        self.kv = make_kv_manager(r.cfg, r)  # the runner's config is resolved (page size)
        self.cache = self.kv.cache
        self.retention = make_retention(cfg, self.kv)  # session prefixes held between turns
        eos = set(r.model_config.eos_token_ids)
        if r.tokenizer.eos_token_id is not None:
            eos.add(r.tokenizer.eos_token_id)
        self.stop_checker = StopChecker(r.tokenizer, eos, r.context_length)
        self.sampling = SamplingStep(r.vocab_size, r.device, cfg.random_seed)
        self.policy = make_policy(cfg.schedule_policy, cfg.random_seed)
        self.rule = PriorityRule.from_config(cfg)  # priority, fairness, preemption
        if self.rule.reorders:
            self.policy = RankedPolicy(self.policy, self.rule)
        self.prefill_rate = PrefillRate()  # for the TTFT target and the mixed-step target
        self.gate = QueueGate.from_config(cfg, self.rule, self.prefill_rate)  # queue bound, TTFT
        self.num_arrivals = 0
        self.num_preemptions = 0
        self.num_parked_chunks = 0  # prompts sent back between two chunks for a higher priority
        self.grammars = GrammarManager(cfg, r.tokenizer, eos, r.vocab_size, r.cfg.page_size)
        # mask rows filled on a worker thread during the forward pass pay off when the forward
        # runs on a GPU; on a CPU the forward uses every core and the worker slowed it down
        # (constrained decode 5-6 points slower with it on 2 cores)
        self.grammars.prefetch_enabled = r.device.type == "cuda"
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a request between two chunks of its prefill
        self.finished_outside_step: list[Req] = []  # aborted or rejected between steps
        self.live: set[Req] = set()  # every request admitted and not yet reported finished
        self.num_forward_steps = 0
        self.decode_streak = 0  # decode-only steps since the last prefill
        self.num_retractions = 0
        self.weight_version = "default"  # SGLang's label of the loaded weights
        self.paused: str | None = None  # "in_place" | "retract" while paused (see above)
        self.stats = LoadStats()
        self.spec = SpeculativeStep(  # speculative decoding (a null drafter when off)
            make_drafter(cfg, r, self.cache),
            cfg.speculative_num_draft_tokens,
            r.vocab_size,
            self.kv,
            self.stop_checker,
            self.grammars,
            self.sampling.default_generator,
            self.stats.count_token,
        )
        self.admission = PrefillAdmission(r.cfg, self.kv, self.stats, self.prefill_rate)
        target = cfg.tpot_target_ms  # prefill paced for the running requests (pacing.py)
        self.pacer = PrefillPacer(
            None if target is None else target / 1000,
            self.admission.chunk_size,
            self.prefill_rate,
        )
        self.overlap = r.device.type == "cuda" and not cfg.disable_overlap_schedule
        self.inflight: InflightDecode | None = None
        self.traces = SchedulerTraces(make_tracer(TraceSettings.from_config(cfg), "scheduler"))
        self.profiler = StepProfiler(r.device.type == "cuda", torch_profiler_dir(cfg))
        self.timeline = StepTimeline.from_env()  # RADIXLM_STEP_TIMELINE: a record per step
        # prefill-decode disaggregation: NullRole on a whole server (disaggregation.py)
        self.disagg = make_role(cfg, r, self.kv)

    # ---------------------------------------------------------------- messages
    def handle(self, msg: Any) -> ControlReply | None:
        if isinstance(msg, TokenizedGenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid, msg.abort_all)
        elif isinstance(msg, ReleaseSessionReq):
            self.retention.release(msg.key)
        elif isinstance(msg, ControlMessage):
            return handle_control(self, msg)  # control.py: one handler per verb
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")
        return None

    def settle(self) -> None:
        """Reads the step in flight back; its requests are reported by the next step."""
        if self.inflight is not None:
            self.finished_outside_step += self._resolve_inflight()

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        """Queues the request (or finishes it: 400 for invalid parameters, 500 when admitting
        it fails); it is reported by the next step either way."""
        req = Req(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            params=SamplingParams(),
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=msg.token_ids_logprob,
            stream=msg.stream,
            priority=msg.priority,
            caller=msg.caller,
            arrival=self.num_arrivals,
            arrival_time=time.monotonic(),
            cache_salt=msg.cache_salt,
            routing_key=msg.routing_key,
            retain_key=msg.retain_key,
            bootstrap_host=msg.bootstrap_host,
            bootstrap_port=msg.bootstrap_port,
            bootstrap_room=msg.bootstrap_room,
        )
        self.num_arrivals += 1
        self.live.add(req)
        self.traces.on_arrival(req, msg.trace_context)
        try:
            self._queue(req, msg)
        except Exception as e:  # a bug met by this request: it alone ends
            logger.exception("admitting request %s failed", req.rid)
            self.grammars.queue.remove(lambda r: r is req)
            if req in self.waiting:
                self.waiting.remove(req)
            self._finish_between_steps(req, internal_error(e))
        if req.is_finished:  # refused: a prefill worker tells the decode worker at once
            self.disagg.on_retire(req)

    def _queue(self, req: Req, msg: TokenizedGenerateReq) -> None:
        try:
            # parsed and validated by the front door (srt/managers/front_door.py); only the
            # check that needs the KV pool's size is left here
            req.params = SamplingParams.from_wire(msg.sampling_params)
            check_fits(req, self.runner.context_length, self.kv.max_total_tokens)
            spec = grammar_spec(req.params, msg.grammar_kind)
        except ValueError as e:
            req.finish({"type": "abort", "message": str(e), "status_code": 400})
            self.finished_outside_step.append(req)
            return
        if not self._passes_gate(req):
            return
        if req.params.seed is not None:
            req.generator = torch.Generator(device=self.runner.device).manual_seed(req.params.seed)
        if spec is not None:
            self.grammars.queue.submit(req, spec)  # joins self.waiting once compiled
        else:
            self._enqueue(req)
        # a disk tier starts reading
        req.prefetch = self.cache.prefetch(req.prompt_ids, req.cache_salt)

    def _enqueue(self, req: Req) -> None:
        """A request ready for admission waits in ``waiting``, or with the disaggregation role
        (a decode worker receives its prompt's KV instead of prefilling it)."""
        if self.disagg.on_queued(req):
            return
        if req.is_finished:  # refused by the role
            self.finished_outside_step.append(req)
        else:
            self.waiting.append(req)

    def _passes_gate(self, req: Req) -> bool:
        """Whether ``req`` may wait for admission (queue_gate.py); a refused request, or a
        waiting one it pushes out, finishes with 503 and is reported by the next step."""
        if req.priority is not None and not self.rule.enabled:
            if self.cfg.abort_on_priority_when_disabled:
                req.finish(
                    overloaded(
                        "Using priority is disabled for this server. Please send a new request "
                        "without a priority."
                    )
                )
                self.finished_outside_step.append(req)
                return False
            req.priority = None  # SGLang: ignored when priority scheduling is off
        chunk_left = (
            0 if self.chunked is None else self.chunked.fill_len - self.chunked.num_kv_tokens
        )
        refusal, victim = self.gate.check(
            req, self.waiting, len(self.grammars.queue.pending), chunk_left
        )
        if refusal is not None:
            req.finish(overloaded(refusal))
            self.finished_outside_step.append(req)
            return False
        if victim is not None:
            self.waiting.remove(victim)
            self._finish_between_steps(victim, overloaded(PUSHED_OUT))
        return True

    def abort(self, rid: str, abort_all: bool = False) -> None:
        """Ends the request whose rid is exactly ``rid`` (every request with ``abort_all``).
        The senders hold the rid of every sample of a batch or ``n > 1`` request and abort each
        one: a prefix match would let a client naming its request ``2`` abort ``20``, ``2a``..."""

        def hit(r: Req) -> bool:
            return abort_all or r.rid == rid

        self.settle()
        reason = {"type": "abort", "message": "aborted by request"}
        for req in self.grammars.queue.remove(hit):
            self._finish_between_steps(req, reason)
        for req in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(req)
            self._finish_between_steps(req, reason)
        for req in [r for r in self.running if hit(r)]:
            self._finish_between_steps(req, reason)
        if self.chunked is not None and hit(self.chunked):
            req, self.chunked = self.chunked, None
            self._finish_between_steps(req, reason)
        for req in self.disagg.abort(hit):  # the role frees (or drains) their slots
            req.finish(reason)
            self.finished_outside_step.append(req)

    def _finish_between_steps(self, req: Req, reason: dict) -> None:
        """Finishes ``req`` outside a batch (abort, the last retracted request); the next
        step reports it."""
        req.finish(reason)
        self._retire([req])
        self.finished_outside_step.append(req)

    # ---------------------------------------------------------------- state
    def wants_step(self) -> bool:
        """Whether the loop should call ``step`` now: work to do, and not paused (a paused
        scheduler still steps to report requests that ended meanwhile)."""
        if self.paused is not None:
            return bool(self.finished_outside_step)
        return self.has_work()

    def has_work(self) -> bool:
        return bool(self.finished_outside_step) or self.holds_requests()

    def holds_requests(self) -> bool:
        """Whether a request is queued, running, compiling its grammar or in the step in flight:
        ``has_work`` less the finished requests that only wait to be reported (they hold no KV).
        What flushing the cache or loading weights must wait for; a control message settles
        the step in flight first, which leaves the requests it finished in that report list."""
        return bool(
            self.waiting
            or self.running
            or self.chunked
            or any(not r.is_finished for r in self.finished_outside_step)
            or self.grammars.queue.has_pending()
            or self.inflight is not None
            or self.disagg.has_work()
        )

    def ready_info(self) -> dict[str, Any]:
        return ready_info(self)

    def server_info(self) -> dict[str, Any]:
        return server_info(self)

    def close(self) -> None:
        """Stops the prefix cache's background work (a disk tier's writers flush first)."""
        self.settle()
        self.cache.close()
        self.spec.close()
        self.disagg.close()

    def check_idle(self) -> bool:
        """The leak invariant, and no request state left; only meaningful when nothing runs."""
        ok = self.kv.check_idle_invariant()
        if self.live:
            logger.error("request state left when idle: %s", sorted(r.rid for r in self.live)[:5])
        return self.spec.is_idle() and ok and not self.live

    # ---------------------------------------------------------------- the step
    def step(self) -> BatchTokenOut | None:
        self.timeline.begin(self)
        self.pacer.begin_step(time.monotonic(), len(self.running))
        self._admit_compiled_grammars()
        self.retention.expire()
        touched: list[Req] = self._poll_disaggregation()
        if self.inflight is not None and not self._can_chain_decode():
            touched += self._resolve_inflight()
        batch, is_prefill = None, False
        if self.paused is None:
            if self.inflight is None:
                self._park_outranked_chunk()
                self._preempt_for_priority()
                batch, is_prefill = self._schedule_prefill()
            batch = batch or self._schedule_decode()
        if batch is not None and self.pacer.is_on:
            self.pacer.on_step(not is_prefill or self._mixes_decode(batch), is_prefill)
        if batch is not None:
            self.decode_streak = 0 if is_prefill else self.decode_streak + 1
        self.timeline.batch(self, batch)
        if batch is not None and not is_prefill and self._overlappable(batch):
            launched = launch_decode(self.runner, self.sampling, batch, self.inflight)
            self.num_forward_steps += 1
            if self.inflight is not None:
                touched += (
                    self._resolve_inflight()
                )  # the previous step's tokens, while this one runs
            self.inflight = launched
        elif batch is not None:
            touched += self._run(batch, is_prefill=is_prefill)
        elif not self.finished_outside_step and not touched and self.paused is None:
            self.grammars.queue.wait(GRAMMAR_WAIT_S)  # only compilations are pending
        touched += self.finished_outside_step
        self.stats.end_step()
        self.profiler.step()
        out = build_batch_output(touched, self.cfg.stream_interval, self.stop_checker)
        self.traces.on_output(touched, out)
        self.finished_outside_step = []  # after the output: a failed step still reports them
        self.live.difference_update(r for r in touched if r.is_finished)
        if self.inflight is not None:  # launched this step: their next token is on the device
            for req in self.inflight.reqs:
                if not req.is_finished:
                    req.output_ids.append(PENDING_TOKEN)
        if not self.has_work():
            self.check_idle()
        self.timeline.end(self)
        return out

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue; failed ones
        finish with their 400 error."""
        ready, failed = self.grammars.queue.poll()
        self.grammars.prefetch_first_rows(ready)
        for req in ready:
            self._enqueue(req)
        self.finished_outside_step += self._retire(failed)  # only disk reads, if any

    def _poll_disaggregation(self) -> list[Req]:
        """KV transfers that completed or failed since the last step (disaggregation.py): a
        decode worker's request whose prompt KV arrived takes its first token and runs."""
        arrived, failed = self.disagg.poll()  # the failed ones hold nothing of the pool
        touched = []
        for req, tok in arrived:
            self.settle()
            self._take_token(req, tok)
            if not req.is_finished:
                self.kv.cache_chunk(req)  # the prompt is shared with later requests here too
                self.running.append(req)
            touched.append(req)
        return self._retire(touched) + failed

    def _schedule_prefill(self) -> tuple[ScheduledBatch | None, bool]:
        """The step's batch when it prefills (``prefill.py``), and whether it does. A mixed step
        schedules the running requests' decode first; when that retracts a request, or nothing
        can be admitted, that decode batch alone is returned, with False."""
        if self.chunked is None and not self.waiting:
            return None, False
        if self.running and self.decode_streak < self.cfg.num_continuous_decode_steps - 1:
            return None, False  # --num-continuous-decode-steps: the running requests' turn
        decode = None
        if self.admission.mixes and self.running:
            retractions = self.num_retractions
            decode = self._schedule_decode()
            if decode is None or self.num_retractions > retractions:
                return decode, False  # the pool is full: no admission this step
        num_decode_tokens = sum(decode.extend_lens) if decode is not None else 0
        budget = self.pacer.budget(self.admission.budget(num_decode_tokens), len(self.running))
        if budget <= 0:
            return decode, False  # the running requests' turn: the credit is spent
        prefill = self.admission.schedule(
            self.waiting, self.chunked, self.running, self.policy, budget, self.rule.rank
        )
        if prefill is None:
            return decode, False
        for req in prefill.reqs:
            self.rule.note_served(req)  # fair scheduling's round robin
        self.chunked = None  # its piece is in the batch; _run sets it again until it completes
        return (prefill if decode is None else mixed_batch(prefill, decode)), True

    def _mixes_decode(self, batch: ScheduledBatch) -> bool:
        """Whether a prefill batch also computes the running requests' next tokens."""
        running = {id(r) for r in self.running}
        return any(id(r) in running for r in batch.reqs)

    def _schedule_decode(self) -> ScheduledBatch | None:
        """One new token per running request; requests with jump-forward tokens pending
        compute those too, and drafted requests their draft (speculative_step.py): then the
        batch runs as an extend."""
        if not self.running:
            return None
        self._make_room_for_decode()
        if not self.running:  # the last one could not get a slot
            return None
        drafts = self.spec.plan(self.running, self._decode_slots_needed())
        pending = [
            req.fill_len - req.num_kv_tokens + len(d)
            for req, d in zip(self.running, drafts, strict=True)
        ]
        mode = ForwardMode.DECODE if max(pending) == 1 else ForwardMode.EXTEND
        batch = ScheduledBatch(mode)
        starts = [req.num_kv_tokens for req in self.running]
        all_slots = self.kv.alloc_for_batch(self.running, pending)
        assert all_slots is not None, "decode slots were reserved"
        for req, start, num_new, slots, draft in zip(
            self.running, starts, pending, all_slots, drafts, strict=True
        ):
            batch.add(req, start, num_new, slots, draft)
        self.admission.on_decode_step()
        return batch

    def _decode_slots_needed(self) -> int:
        forced = sum(req.fill_len - req.num_kv_tokens - 1 for req in self.running)
        return len(self.running) * self.kv.page_size + forced

    def _make_room_for_decode(self) -> None:
        """Evicts cached prefixes, then retracts requests (a prompt between two chunks first:
        it has no output to lose), until every running one gets a slot."""
        while not self.kv.ensure_available(self._decode_slots_needed()):
            if self.chunked is not None:
                victim, self.chunked = self.chunked, None
            elif len(self.running) == 1:
                victim = self.running[0]
                logger.warning(
                    "KV pool full: request %s (%d tokens) ends with no slot for its next token "
                    "(pool %s)",
                    victim.rid,
                    victim.seq_len,
                    self.kv.usage(),
                )
                self._finish_between_steps(
                    victim, {"type": "length", "length": len(victim.output_ids)}
                )
                return
            else:
                victim = self.running.pop()
                self.spec.release(victim)
            self.admission.on_retract()
            self.num_retractions += 1
            logger.warning(
                "KV pool full: retracting request %s (%d tokens; new_token_ratio now %.3f)",
                victim.rid,
                victim.seq_len,
                self.admission.reserve_ratio,
            )
            self._requeue(victim)

    def _requeue(self, victim: Req) -> None:
        """A retracted request gives its KV back and waits again (its output is kept; its
        tokens are recomputed when it is admitted again)."""
        self.kv.release(victim)
        victim.status = ReqStatus.WAITING
        self.waiting.appendleft(victim)

    # ---------------------------------------------------------------- priority preemption
    def _park_outranked_chunk(self) -> None:
        """A prompt between two chunks waits again when a waiting request outranks it, so the
        higher-priority prompt is not queued behind the rest of the lower one's prefill (each
        step takes at most one unfinished prompt). What it prefilled so far goes into the
        prefix cache, where its next admission finds it."""
        if self.chunked is None or not self.rule.enabled or not self.waiting:
            return
        head = self.rule.first(self.waiting)
        if self.rule.rank(head) >= self.rule.rank(self.chunked):
            return
        parked, self.chunked = self.chunked, None
        self.num_parked_chunks += 1
        logger.info(
            "request %s (priority %s) waits between two chunks for request %s (priority %s)",
            parked.rid,
            parked.priority,
            head.rid,
            head.priority,
        )
        self._requeue(parked)

    def _preempt_for_priority(self) -> None:
        """Retracts lower-priority running requests so that the first waiting request fits
        (queue_order.py); nothing when it fits or when no allowed retraction makes it fit."""
        if not self.rule.may_preempt(self.waiting, self.running) or self.chunked is not None:
            return
        head = self.rule.first(self.waiting)
        adm = self.admission
        # what the admission will ask of the pool (prefill.py), less what the retracted give
        # back: their KV, and the share of their output the admission keeps free
        short = adm.need(head) - self.kv.room() + adm.reserve(self.running)
        free_slots = self.kv.free_req_slots()

        def fits(gone: list[Req]) -> bool:
            if len(self.running) - len(gone) >= adm.max_running_requests:
                return False
            if free_slots + len(gone) < 1:
                return False
            freed = sum(r.num_kv_tokens + adm.reserve([r]) for r in gone)
            return short <= freed

        victims = self.rule.plan_preemption(head, self.running, fits)
        for victim in victims:
            self.running.remove(victim)
            self.spec.release(victim)
            self.num_retractions += 1
            self.num_preemptions += 1
            logger.info(
                "retracting request %s (priority %s) for request %s (priority %s)",
                victim.rid,
                victim.priority,
                head.rid,
                head.priority,
            )
            self._requeue(victim)

    # ---------------------------------------------------------------- overlap scheduling
    def _overlappable(self, batch: ScheduledBatch) -> bool:
        return (
            self.overlap
            and batch.mode is ForwardMode.DECODE
            and all(is_overlappable(r) for r in batch.reqs)
        )

    def _can_chain_decode(self) -> bool:
        """Whether the next step can be launched before the one in flight is read back: a
        decode of requests that are all in flight (nothing that could be admitted, no
        retraction)."""
        if self.chunked is not None or not self.running:
            return False
        if self.waiting and not self.admission.blocked(self.waiting, self.running):
            paced_out = self.pacer.is_on and not self.pacer.budget(
                self.admission.budget(), len(self.running)
            )
            if not paced_out:
                return False  # resolve first: the next step may admit some
        if self.rule.may_preempt(self.waiting, self.running):
            return False  # resolve first: the next step may retract some for a waiting one
        if self.spec.enabled and any(self.spec.is_candidate(r) for r in self.running):
            return False  # their next step may speculate: it needs their tokens on the host
        in_flight = {id(r) for r in self.inflight.reqs}
        if not all(id(r) in in_flight and is_overlappable(r) for r in self.running):
            return False
        return self.kv.ensure_available(self._decode_slots_needed())

    def _resolve_inflight(self) -> list[Req]:
        """Reads the in-flight step's tokens back, appends them and runs the finish checks."""
        step, self.inflight = self.inflight, None
        touched = []
        for req, tok in zip(step.reqs, step.read_back(), strict=True):
            if req.is_finished:  # finished one step earlier: drop this token
                continue
            assert req.output_ids[-1] == PENDING_TOKEN
            req.output_ids[-1] = tok
            self.stats.count_token()
            self.stop_checker.check(req)
            touched.append(req)
        return self._retire(touched)

    def _run(self, batch: ScheduledBatch, is_prefill: bool) -> list[Req]:
        """Forward, sampling and finish checks of one batch. Whatever one request's values
        break (a token id the model cannot embed, its grammar, its sampling row) ends that
        request with an error and leaves the others running."""
        rejected = self._retire(
            reject_unembeddable(batch, self.runner.vocab_size), keep_in_cache=False
        )
        if rejected and not batch.reqs:
            return rejected
        rows, per_req = batch.logit_rows()
        started = time.perf_counter()
        try:
            logits = self.runner.forward(batch, rows)
        except Exception as e:  # one bad batch must not take the scheduler down
            return rejected + self._forward_failed(batch, is_prefill, e)
        self.num_forward_steps += 1
        self.traces.on_forward(batch, started)
        record_input_logprobs(batch, logits, per_req)
        samplers = []
        for i, req in enumerate(batch.reqs):
            if batch.completes_fill(i) and req.params.max_new_tokens == 0:
                record_prefill_only_logprobs(req, logits[per_req[i][-1]])
                req.finish({"type": "length", "length": 0})  # prefill-only request
            elif batch.completes_fill(i):
                samplers.append(i)
        verified = self.spec.verify(batch, logits, per_req)  # drafted requests take their run
        samplers = [i for i in samplers if i not in verified]
        sample_reqs = [batch.reqs[i] for i in samplers]
        sample_rows = [per_req[i][-1] for i in samplers]
        masks = self.grammars.fill_masks(sample_reqs)
        next_ids = self.sampling.run(logits, sample_rows, sample_reqs, self.stop_checker, masks)
        running = {id(r) for r in self.running} if is_prefill else set()
        if is_prefill:  # what recomputing costs, for a tiered cache's load-or-recompute choice
            elapsed = time.perf_counter() - started
            self.cache.observe_prefill(sum(batch.extend_lens), elapsed)
            new_tokens = sum(  # prompt tokens: not a mixed step's decode rows
                e
                for r, e in zip(batch.reqs, batch.extend_lens, strict=True)
                if id(r) not in running
            )
            self.prefill_rate.observe(new_tokens, elapsed)
        for req, tok in zip(sample_reqs, next_ids, strict=True):
            if not req.is_finished:  # else its mask row or its sampling failed
                self._take_token(req, tok)
        for i, req in enumerate(batch.reqs):
            joins = is_prefill and id(req) not in running  # not a decode row of a mixed batch
            if joins and not req.is_finished:
                self.kv.cache_chunk(req)  # share the prefilled tokens with later requests now
            if not batch.completes_fill(i):
                self.chunked = req
            elif joins and not req.is_finished:
                self.running.append(req)
        return rejected + self._retire(batch.reqs)

    def _take_token(self, req: Req, tok: int) -> None:
        """Appends a sampled token and runs the request's finish checks and grammar."""
        try:
            req.output_ids.append(tok)
            self.stats.count_token()
            if req.grammar is not None:
                self.grammars.accept_sampled(req)  # may end it with an error
            if not req.is_finished:
                self.stop_checker.check(req)
            if req.grammar is not None:
                self.grammars.advance(req, self.kv, self.stop_checker)
        except Exception as e:  # a bug met by this request's values: it alone ends
            logger.exception("request %s failed after sampling", req.rid)
            req.finish(internal_error(e))

    def _forward_failed(self, batch: ScheduledBatch, is_prefill: bool, e: Exception) -> list[Req]:
        """A batch whose forward raised: its requests run again one by one, so the failure
        ends only the request it comes from (every one of them if it comes from none)."""
        if len(batch.reqs) > 1:
            logger.warning(
                "forward of %d requests failed (%s); running them one by one", len(batch.reqs), e
            )
            return [
                r for i in range(len(batch.reqs)) for r in self._run(batch.single(i), is_prefill)
            ]
        logger.exception("forward failed for request %s", batch.reqs[0].rid)
        batch.reqs[0].finish(internal_error(e))
        return self._retire(batch.reqs, keep_in_cache=False)

    def _retire(self, reqs: list[Req], keep_in_cache: bool = True) -> list[Req]:
        """The one release path: every finished request of ``reqs`` leaves the running list
        and gives its KV back, and the disk reads started for its prompt. Idempotent (a
        released request holds nothing), so the requests of a batch can be passed whether or
        not an earlier path released them."""
        for req in reqs:
            if req.is_finished:
                if req in self.running:
                    self.running.remove(req)
                self.spec.release(req)
                if not self.disagg.on_retire(req):  # a prefill worker holds KV until sent
                    self.kv.release(req, keep_in_cache)
                self.kv.drop_prefetch(req)
                if req.retain_key is not None and keep_in_cache and req.is_normal_finish:
                    self.retention.hold(req.retain_key, req.fill_ids, req.cache_salt)
        return reqs
