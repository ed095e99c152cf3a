"""Constrained decoding inside the scheduler: the grammar queue, per-step masks, jump-forward.

A request with ``json_schema``, ``regex``, ``ebnf`` or ``choices`` enters the grammar queue
(not ``Scheduler.waiting``) while its grammar compiles on the compile cache's worker threads;
``poll`` hands it to the waiting queue with a matcher attached once the compilation is done, or
finishes it with a 400 abort ("Failed to compile <kind> grammar: <reason>"). Other requests keep
flowing meanwhile. The grammar vocabulary and the compile cache are built on first use, off the
scheduler loop, so servers that never see a grammar pay nothing.

Per step (only when a batch holds constrained requests):

    fill_masks(sampling reqs) -> GrammarMasks      rows of constrained requests, after forward
    SamplingStep.run(..., masks)                   disallowed logits -> -inf, then sampling
    accept_sampled(req)                            the matcher takes the sampled token
    advance(req, ...)                              finish on termination; jump-forward; then
                                                   the next row is prefetched on a worker
                                                   thread during the next forward pass

Mask timing: ``mask_times_s`` records the time each row costs the scheduler thread (waiting for
a prefetched row and copying it, or filling it), ``mask_compute_times_s`` the time the fill
itself took (on the worker or inline).

Invariant (``check_integrity``): a request's matcher has accepted exactly its ``output_ids``.
Retraction keeps ``output_ids`` (the request re-prefills them), so the matcher needs no rollback.

Jump-forward: when the grammar forces a continuation, it is re-tokenized together with the
last few output tokens (``retokenize_forced``), the request's output is edited accordingly
(dropped tokens lose their KV slots), and the new tokens are computed by the next step as a
short extend instead of one decode step each. Requests that return logprobs are not jumped
(forced tokens have no logprobs). The forced text is bounded by the request's remaining budget
and computed on a matcher copy (jump_forward.py).

A matcher that raises (fill, accept, jump-forward: a grammar too complex for the backend) ends
its own request with a 400 (``fail_request``); the batch goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.grammar import (
    GrammarCompileCache,
    GrammarCompileError,
    GrammarConfig,
    GrammarSpec,
    JumpForwardEdit,
    TokenizerVocab,
    apply_edit,
    build_vocab,
    create_compile_cache,
)
from radixlm.grammar.bitmask import BitmaskBuffer, bitmask_width
from radixlm.srt.config import ServerConfig
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.jump_forward import bounded_forced_edit, edit_output, max_rollback
from radixlm.srt.scheduler.kv_manager import KVManager
from radixlm.srt.scheduler.mask_prefetch import MaskPrefetcher
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)



def grammar_spec(params: SamplingParams, kind: str | None = None) -> GrammarSpec | None:
    """The request's output constraint, or None; ValueError for an unusable one. ``kind`` is
    the message's ``grammar_kind``, decided by the front door (``json_object`` has no text);
    without it, the kind of the grammar field that is set."""
    if kind == "json_object":
        return GrammarSpec.json_object()  # same language as {"type": "object"}; compiles fast
    if params.json_schema is not None:
        return GrammarSpec.json_schema(params.json_schema)
    if params.regex is not None:
        return GrammarSpec.regex(params.regex)
    if params.ebnf is not None:
        return GrammarSpec.ebnf(params.ebnf)
    if params.choices is not None:
        return GrammarSpec.choices(params.choices)
    return None


def grammar_config(cfg: ServerConfig) -> GrammarConfig:
    extra: dict[str, Any] = {}
    if cfg.grammar_whitespace_pattern is not None:
        extra["whitespace_pattern"] = cfg.grammar_whitespace_pattern
    return GrammarConfig(backend=cfg.grammar_backend, cache_dir=cfg.grammar_cache_dir,
                         compile_timeout_s=cfg.grammar_compile_timeout_s, **extra)


@dataclass
class PendingGrammar:
    req: Req
    spec: GrammarSpec
    future: Future | None = None  # the compile cache's future, once the cache exists


@dataclass(frozen=True)
class GrammarMasks:
    bitmask: torch.Tensor  # [num sampling rows, ceil(V/32)] int32, CPU; only `rows` are valid
    rows: list[int]  # sampling rows of constrained requests


@dataclass
class GrammarStats:
    num_compiled: int = 0  # requests that got a matcher
    num_failed: int = 0  # requests finished by a compile error
    num_mask_rows: int = 0  # mask rows filled
    num_prefetched_rows: int = 0  # ... of which a worker thread filled during the forward
    mask_fill_s: float = 0.0  # scheduler-thread time spent on mask rows
    num_jump_forwards: int = 0  # edits applied
    num_forced_tokens: int = 0  # output tokens appended net of rolled-back ones

    def as_dict(self) -> dict[str, Any]:
        per_row_us = 1e6 * self.mask_fill_s / self.num_mask_rows if self.num_mask_rows else 0.0
        return {**self.__dict__, "mask_fill_us_per_row": per_row_us}


class GrammarManager:
    def __init__(self, cfg: ServerConfig, tokenizer: Any, eos_token_ids: set[int],
                 vocab_size: int, page_size: int) -> None:
        self.config = grammar_config(cfg)
        self.jump_forward_enabled = not cfg.disable_jump_forward
        self.prefetch_enabled = True  # fill next steps' mask rows during the forward (the scheduler sets it per device)
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self.page_size = page_size
        self.queue: list[PendingGrammar] = []
        self.stats = GrammarStats()
        self.vocab: TokenizerVocab | None = None
        self._setup: Future[GrammarCompileCache] | None = None  # vocab + cache, built once
        self._setup_pool: ThreadPoolExecutor | None = None
        self._bitmask = torch.zeros((0, bitmask_width(vocab_size)), dtype=torch.int32)
        self._buffer = BitmaskBuffer(self._bitmask)  # row access for fills, rebuilt on growth
        self._prefetcher = MaskPrefetcher(bitmask_width(vocab_size))
        self.mask_times_s: list[float] | None = None  # set to a list to record each row's fill
        self.mask_compute_times_s: list[float] | None = None  # ... and its compute time

    # ------------------------------------------------------------------ compile queue
    def submit(self, req: Req, spec: GrammarSpec) -> None:
        """Starts compiling ``spec`` for ``req``; the request waits in the grammar queue."""
        if self._setup is None:
            self._setup_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-setup")
            self._setup = self._setup_pool.submit(self._build_cache)
        self.queue.append(PendingGrammar(req, spec))
        self._start_compiles()

    def has_pending(self) -> bool:
        return bool(self.queue)

    def poll(self) -> tuple[list[Req], list[Req]]:
        """Requests whose grammar is ready (matcher attached) and requests whose grammar
        failed (finished with a 400 abort), both in arrival order."""
        if not self.queue:
            return [], []
        self._start_compiles()
        ready: list[Req] = []
        failed: list[Req] = []
        still: list[PendingGrammar] = []
        for item in self.queue:
            future = item.future if item.future is not None else self._failed_setup()
            if future is None or not future.done():
                still.append(item)
            elif self._attach(item, future):
                ready.append(item.req)
            else:
                failed.append(item.req)
        self.queue = still
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Blocks until some pending compilation finishes (or ``timeout_s``): the loop calls
        this instead of spinning when nothing but compilations is left to do."""
        futures = [p.future for p in self.queue if p.future is not None]
        if self._setup is not None and not self._setup.done():
            futures.append(self._setup)
        if futures:
            wait_futures(futures, timeout=timeout_s, return_when="FIRST_COMPLETED")

    def remove(self, hit: Callable[[Req], bool]) -> list[Req]:
        """Takes the queued requests ``hit`` selects out of the queue (aborts)."""
        gone = [p.req for p in self.queue if hit(p.req)]
        self.queue = [p for p in self.queue if not hit(p.req)]
        return gone

    def _build_cache(self) -> GrammarCompileCache:
        start = time.perf_counter()
        self.vocab = build_vocab(self.tokenizer, self.eos_token_ids, self.vocab_size)
        cache = create_compile_cache(self.config, self.vocab)
        logger.info("grammar backend %s ready in %.2f s", self.config.backend,
                    time.perf_counter() - start)
        return cache

    @property
    def compile_cache(self) -> GrammarCompileCache | None:
        """The compile cache, once the first constrained request has built it."""
        if self._setup is None or not self._setup.done() or self._setup.exception() is not None:
            return None
        return self._setup.result()

    def _failed_setup(self) -> Future | None:
        """The setup future when building the vocabulary or backend failed (its error then
        fails every queued request), else None."""
        if self._setup is not None and self._setup.done() and self._setup.exception() is not None:
            return self._setup
        return None

    def _start_compiles(self) -> None:
        cache = self.compile_cache
        if cache is None:
            return
        for item in self.queue:
            if item.future is None:
                item.future = cache.get_or_compile(item.spec)

    def _attach(self, item: PendingGrammar, future: Future) -> bool:
        try:
            item.req.grammar = future.result().new_matcher()
        except GrammarCompileError as e:
            return self._fail(item.req, str(e))
        except Exception as e:  # a failed set-up (vocabulary, backend) fails the request too
            logger.exception("grammar set-up failed for %s", item.req.rid)
            return self._fail(item.req, str(GrammarCompileError(item.spec.kind, str(e))))
        self.stats.num_compiled += 1
        if self.prefetch_enabled:
            self._prefetcher.submit(item.req)  # its first row, during its prefill
        return True

    def _fail(self, req: Req, message: str) -> bool:
        req.finish({"type": "abort", "message": message, "status_code": 400})
        self.stats.num_failed += 1
        return False

    # ------------------------------------------------------------------ per step
    def fill_masks(self, reqs: list[Req]) -> GrammarMasks | None:
        """Masks for the sampling rows of ``reqs`` (None when none is constrained). A request
        whose row cannot be filled is finished here (the caller skips its sampled token)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(reqs):
            self._bitmask = torch.zeros((max(len(reqs), 2 * self._bitmask.shape[0]),
                                         self._bitmask.shape[1]), dtype=torch.int32)
            self._buffer = BitmaskBuffer(self._bitmask)
        bitmask = self._bitmask[: len(reqs)]
        for i in rows:
            try:
                self._fill_row(reqs[i], i)
            except Exception as e:  # only this request ends; its row allows every token
                self.fail_request(reqs[i], e)
                bitmask[i].fill_(-1)
        self.stats.num_mask_rows += len(rows)
        self._prefetcher.forget_finished()
        return GrammarMasks(bitmask, rows)

    def _fill_row(self, req: Req, i: int) -> None:
        start = time.perf_counter()
        prefetched = self._prefetcher.take(req)
        if prefetched is not None:
            self._buffer.write(i, prefetched[0])
            self.stats.num_prefetched_rows += 1
        else:
            req.grammar.fill_row(self._buffer, i)
        elapsed = time.perf_counter() - start
        self.stats.mask_fill_s += elapsed
        if self.mask_times_s is not None:
            self.mask_times_s.append(elapsed)
        if self.mask_compute_times_s is not None:
            self.mask_compute_times_s.append(elapsed if prefetched is None else prefetched[1])

    def accept_sampled(self, req: Req) -> None:
        """Feeds the token just appended to ``req.output_ids`` to the request's matcher. A
        token the grammar rejects (only possible when no token was allowed) is taken back and
        the request ends with an error; so does a matcher that fails."""
        token = req.output_ids[-1]
        try:
            accepted = req.grammar.accept_token(token)
        except Exception as e:
            req.output_ids.pop()  # the matcher's state no longer matters: the request ends
            self.fail_request(req, e)
            return
        if not accepted:
            req.output_ids.pop()
            req.finish({"type": "abort", "message": f"internal error: the grammar rejected "
                        f"sampled token {token}", "status_code": 500})

    def advance(self, req: Req, kv: KVManager, stop: StopChecker) -> None:
        """After the stop check of a sampled token: a terminated grammar finishes the request
        (``stop``: the EOS id, or None if it ended without one); otherwise forced text is
        appended (jump-forward), then the stop check runs again (length, stop strings). A
        request that goes on gets its next mask row prefetched."""
        try:
            self._advance(req, kv, stop)
        except Exception as e:
            self.fail_request(req, e)
        if self.prefetch_enabled and not req.is_finished:
            self._prefetcher.submit(req)

    def fail_request(self, req: Req, error: Exception) -> None:
        """Ends ``req`` because its matcher raised (a grammar too complex for the backend, such
        as llguidance's "row has N items"): a 400 naming the reason, for this request only."""
        logger.warning("grammar of %s failed while decoding: %s", req.rid, error)
        spec = grammar_spec(req.params)
        kind = spec.kind if spec is not None else "grammar"
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        req.finish({"type": "abort", "status_code": 400, "message": f"the {kind} grammar "
                    f"failed while decoding (simplify it): {reason}"})
        self.stats.num_failed += 1

    def _advance(self, req: Req, kv: KVManager, stop: StopChecker) -> None:
        if req.is_finished:
            return
        if req.grammar.is_terminated():
            last = req.output_ids[-1] if req.output_ids else None
            req.finish({"type": "stop", "matched": last if last in stop.eos_token_ids else None})
            return
        if self.jump_forward_enabled and not req.return_logprob and self.vocab is not None:
            if self._jump_forward(req, kv, stop.context_length):
                stop.check(req)

    def _jump_forward(self, req: Req, kv: KVManager, context_length: int) -> bool:
        room = min(req.params.max_new_tokens - len(req.output_ids), context_length - req.seq_len)
        if room <= 0:
            return False
        rollback = max_rollback(req, self.page_size)
        edit = bounded_forced_edit(req.grammar, self.vocab, req.output_ids, room, rollback)
        if edit is None:
            return False
        # The last forced token is left to the model: it may merge with the text after it
        # (``"name"`` then ``:`` is naturally ``"name`` + ``":``).
        num_new = min(len(edit.token_ids) - 1, room + edit.num_rollback)
        edit = JumpForwardEdit(edit.num_rollback, edit.token_ids[:num_new])
        if num_new <= edit.num_rollback or edit.num_rollback > rollback:
            return False  # no net progress, or an edit reaching into fixed tokens
        if not apply_edit(req.grammar, edit):
            return False
        net = edit_output(req, edit, kv)
        self.stats.num_jump_forwards += 1
        self.stats.num_forced_tokens += net
        return True

    # ------------------------------------------------------------------ state
    def info(self) -> dict[str, Any]:
        return {"backend": self.config.backend, "jump_forward": self.jump_forward_enabled,
                "mask_prefetch": self.prefetch_enabled, "num_queued": len(self.queue),
                **self.stats.as_dict()}

    def check_integrity(self, reqs: list[Req]) -> None:
        """Every matcher has accepted exactly its request's output tokens."""
        for req in reqs:
            if req.grammar is not None:
                n = req.grammar.num_accepted_tokens
                assert n == len(req.output_ids), (req.rid, n, len(req.output_ids))
        for item in self.queue:
            assert item.req.grammar is None and not item.req.output_ids, item.req.rid

    def shutdown(self) -> None:
        """Stops the worker threads and the backends' child processes. A later constrained
        request builds the vocabulary and the compile cache again."""
        self._prefetcher.shutdown()
        cache = self.compile_cache
        if cache is not None:
            cache.shutdown()
        if self._setup_pool is not None:
            self._setup_pool.shutdown(wait=False, cancel_futures=True)
        self._setup = self._setup_pool = None

