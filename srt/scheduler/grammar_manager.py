"""Constrained decoding inside the scheduler, per step: masks, accepting tokens, jump-forward.

Requests get here from the compile queue (grammar_queue.py, ``GrammarManager.queue``) with a
matcher attached.

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
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.grammar import GrammarCompileCache, JumpForwardEdit, apply_edit
from radixlm.grammar.bitmask import BitmaskBuffer, bitmask_width
from radixlm.srt.config import ServerConfig
from radixlm.srt.scheduler.grammar_queue import (
    GrammarQueue,
    GrammarStats,
    grammar_config,
    grammar_spec,
)
from radixlm.srt.scheduler.jump_forward import bounded_forced_edit, edit_output, max_rollback
from radixlm.srt.scheduler.kv_manager import KVManager
from radixlm.srt.scheduler.mask_prefetch import MaskPrefetcher
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.stop import StopChecker

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarMasks:
    bitmask: torch.Tensor  # [num sampling rows, ceil(V/32)] int32, CPU; only `rows` are valid
    rows: list[int]  # sampling rows of constrained requests


class GrammarManager:
    def __init__(
        self,
        cfg: ServerConfig,
        tokenizer: Any,
        eos_token_ids: set[int],
        vocab_size: int,
        page_size: int,
    ) -> None:
        self.jump_forward_enabled = not cfg.disable_jump_forward
        self.prefetch_enabled = (
            True  # fill next steps' mask rows during the forward (the scheduler sets it per device)
        )
        self.page_size = page_size
        self.stats = GrammarStats()
        self.queue = GrammarQueue(
            grammar_config(cfg), tokenizer, eos_token_ids, vocab_size, self.stats
        )
        self._bitmask = torch.zeros((0, bitmask_width(vocab_size)), dtype=torch.int32)
        self._buffer = BitmaskBuffer(self._bitmask)  # row access for fills, rebuilt on growth
        self._prefetcher = MaskPrefetcher(bitmask_width(vocab_size))
        self.mask_times_s: list[float] | None = None  # set to a list to record each row's fill
        self.mask_compute_times_s: list[float] | None = None  # ... and its compute time

    @property
    def compile_cache(self) -> GrammarCompileCache | None:
        return self.queue.compile_cache

    def prefetch_first_rows(self, reqs: list[Req]) -> None:
        """Starts filling the first mask row of requests just out of the queue (during their
        prefill)."""
        if self.prefetch_enabled:
            for req in reqs:
                self._prefetcher.submit(req)

    # ------------------------------------------------------------------ per step
    def fill_masks(self, reqs: list[Req]) -> GrammarMasks | None:
        """Masks for the sampling rows of ``reqs`` (None when none is constrained). A request
        whose row cannot be filled is finished here (the caller skips its sampled token)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(reqs):
            self._bitmask = torch.zeros(
                (max(len(reqs), 2 * self._bitmask.shape[0]), self._bitmask.shape[1]),
                dtype=torch.int32,
            )
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
            req.finish(
                {
                    "type": "abort",
                    "message": f"internal error: the grammar rejected sampled token {token}",
                    "status_code": 500,
                }
            )

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
        req.finish(
            {
                "type": "abort",
                "status_code": 400,
                "message": f"the {kind} grammar failed while decoding (simplify it): {reason}",
                "param": kind if spec is not None else None,
            }
        )
        self.stats.num_failed += 1

    def _advance(self, req: Req, kv: KVManager, stop: StopChecker) -> None:
        if req.is_finished:
            return
        if req.grammar.is_terminated():
            last = req.output_ids[-1] if req.output_ids else None
            req.finish({"type": "stop", "matched": last if last in stop.eos_token_ids else None})
            return
        if self.jump_forward_enabled and not req.return_logprob and self.queue.vocab is not None:
            if self._jump_forward(req, kv, stop.context_length):
                stop.check(req)

    def _jump_forward(self, req: Req, kv: KVManager, context_length: int) -> bool:
        room = min(req.params.max_new_tokens - len(req.output_ids), context_length - req.seq_len)
        if room <= 0:
            return False
        rollback = max_rollback(req, self.page_size)
        edit = bounded_forced_edit(req.grammar, self.queue.vocab, req.output_ids, room, rollback)
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
        return {
            "backend": self.queue.config.backend,
            "jump_forward": self.jump_forward_enabled,
            "mask_prefetch": self.prefetch_enabled,
            "num_queued": len(self.queue.pending),
            **self.queue.backlog(),
            **self.stats.as_dict(),
        }

    def check_integrity(self, reqs: list[Req]) -> None:
        """Every matcher has accepted exactly its request's output tokens."""
        for req in reqs:
            if req.grammar is not None:
                n = req.grammar.num_accepted_tokens
                assert n == len(req.output_ids), (req.rid, n, len(req.output_ids))
        self.queue.check_integrity()

    def shutdown(self) -> None:
        """Stops the worker threads and the backends' child processes. A later constrained
        request builds the vocabulary and the compile cache again."""
        self._prefetcher.shutdown()
        self.queue.shutdown()
