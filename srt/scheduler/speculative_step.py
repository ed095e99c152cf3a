"""Speculative decoding inside the scheduler: drafts ride in the decode batch, one forward
verifies them.

Per decode step, with a drafter configured (``--speculative-algorithm``):

    plan(running, base_slots)        each candidate's longest useful draft (its remaining token
                                     budget and context, at most ``num_draft_tokens``); nothing
                                     when the KV pool cannot hold every draft beside the plain
                                     decode slots (speculation never retracts); Drafter.propose;
                                     a constrained request walks its matcher through its draft,
                                     cuts it at the first token the grammar rejects, fills one
                                     mask row per verify position and rolls the matcher back
    the batch (an EXTEND)            a drafted request computes 1 + k tokens, its last token and
                                     the draft, each with a KV slot; its last k + 1 logits rows
    verify(batch, logits, per_req)   the acceptance rule of srt/sampling/speculative.py (greedy:
                                     token-identical to plain decoding, every greedy request of
                                     the step in one argmax and one read-back; sampled:
                                     rejection sampling with the request's generator, one
                                     request at a time); the accepted tokens
                                     are taken one by one with the plain finish checks (a stop,
                                     EOS or length inside the run cuts it there), the KV of
                                     rejected draft tokens is freed (KVManager.truncate: only
                                     accepted tokens ever reach the prefix cache), jump-forward
                                     runs once after the run, Drafter.observe

Which requests speculate (``is_candidate``): those whose sampling reads nothing of their
output (no penalties, no logit bias, no ``min_new_tokens``); the others decode one token per
step in the same batch. Speculating requests are never overlapped (their draft needs their last
token on the host), so while any running request is a candidate the scheduler does not chain
overlapped decode steps; a decode batch in which nothing was drafted still launches overlapped.

Every request the drafter saw gets ``Drafter.release`` exactly once (finish, abort, retraction,
a failed step), through ``release``; ``is_idle`` is part of the scheduler's leak invariant.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.grammar.bitmask import BitmaskBuffer, bitmask_width
from radixlm.kernels.bitmask import apply_token_bitmask_inplace
from radixlm.srt.sampling.logprobs import (
    token_ids_logprob_rows,
    token_logprobs,
    top_logprob_rows,
)
from radixlm.srt.sampling.speculative import accept_draft, accept_greedy_batch
from radixlm.srt.scheduler.batch import ScheduledBatch
from radixlm.srt.scheduler.failures import internal_error
from radixlm.srt.scheduler.grammar_manager import GrammarManager
from radixlm.srt.scheduler.kv_manager import KVManager
from radixlm.srt.scheduler.req import PENDING_TOKEN, Req
from radixlm.srt.scheduler.sampling_step import _reads_no_outputs as reads_no_outputs
from radixlm.srt.scheduler.stop import StopChecker
from radixlm.srt.speculative import Draft, Drafter, NullDrafter

logger = logging.getLogger(__name__)


@dataclass
class DraftPlan:
    """One request's draft as it runs in the batch."""

    token_ids: list[int]  # the verified part: the drafter's proposal, cut to what may run
    probs: torch.Tensor | None  # [len(token_ids), V] float32 draft distributions; None: one-hot
    num_proposed: int  # tokens the drafter proposed (what Drafter.observe counts against)
    mask_rows: torch.Tensor | None  # [len(token_ids) + 1, W] int32 CPU grammar rows, or None


@dataclass
class SpecStats:
    num_verify_steps: int = 0  # (request, step) pairs that verified a draft
    num_proposed: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, accepted
    num_tokens: int = 0  # tokens verification appended (accepted drafts, bonus, cut by stops)

    def as_dict(self) -> dict[str, float]:
        steps = self.num_verify_steps
        return {
            "num_verify_steps": steps,
            "num_proposed_tokens": self.num_proposed,
            "num_accepted_tokens": self.num_accepted,
            "acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            "mean_accept_length": self.num_tokens / steps if steps else 0.0,
        }


class SpeculativeStep:
    def __init__(
        self,
        drafter: Drafter,
        num_draft_tokens: int,
        vocab_size: int,
        kv: KVManager,
        stop: StopChecker,
        grammars: GrammarManager,
        default_generator: torch.Generator,
        count_token: Any,
    ) -> None:
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.vocab_size = vocab_size
        self.kv = kv
        self.stop = stop
        self.grammars = grammars
        self.default_generator = default_generator
        self.count_token = count_token  # the scheduler's per-token throughput counter
        self.stats = SpecStats()
        self.plans: dict[Req, DraftPlan] = {}  # this step's drafts, until verified
        self._seen: set[Req] = set()  # requests the drafter may hold state for
        self.enabled = not isinstance(drafter, NullDrafter)  # off: every hook returns at once

    def is_candidate(self, req: Req) -> bool:
        """Whether the request may speculate: its sampling reads nothing of its output."""
        p = req.params
        return self.enabled and p.min_new_tokens == 0 and reads_no_outputs(p)

    def max_draft_len(self, req: Req) -> int:
        """The longest draft worth verifying: one token less than the request may still add
        (verification always adds the target's own token after the accepted drafts)."""
        if req.is_finished or not self.is_candidate(req):
            return 0
        if req.output_ids and req.output_ids[-1] == PENDING_TOKEN:
            return 0  # its last token is still on the device (an overlapped step)
        room = min(
            req.params.max_new_tokens - len(req.output_ids),
            self.stop.context_length - req.seq_len,
        )
        return max(0, min(self.num_draft_tokens, room - 1))

    # ------------------------------------------------------------------ before the forward
    def plan(self, reqs: list[Req], base_slots: int) -> list[list[int]]:
        """The draft of each request of ``reqs`` (empty: it decodes one token). ``base_slots``
        is what the batch needs without drafts; drafts are only proposed when the pool holds
        them too (evicting cached prefixes, never retracting)."""
        self.plans.clear()
        out: list[list[int]] = [[] for _ in reqs]
        if not self.enabled:
            return out
        limits = [self.max_draft_len(r) for r in reqs]
        if not any(limits) or not self.kv.ensure_available(base_slots + sum(limits)):
            return out
        chosen = [i for i, n in enumerate(limits) if n > 0]
        try:
            drafts = self.drafter.propose([reqs[i] for i in chosen], [limits[i] for i in chosen])
            assert len(drafts) == len(chosen), (len(drafts), len(chosen))
        except Exception:  # a drafter's bug costs speculation, never the requests
            logger.exception("the %s drafter failed; decoding without drafts", self.drafter.name)
            return out
        for i, draft in zip(chosen, drafts, strict=True):
            req = reqs[i]
            self._seen.add(req)
            if len(draft) == 0:
                continue
            try:
                plan = self._make_plan(req, draft, limits[i])
            except Exception as e:  # its matcher could not be walked back: it alone ends
                logger.exception("preparing the draft of %s failed", req.rid)
                req.finish(internal_error(e))
                continue
            self.plans[req] = plan
            out[i] = plan.token_ids
        return out

    def _make_plan(self, req: Req, draft: Draft, limit: int) -> DraftPlan:
        ids = list(draft.token_ids[:limit])
        bad = [j for j, t in enumerate(ids) if not 0 <= t < self.vocab_size]
        if bad:
            ids = ids[: bad[0]]
        mask_rows = None
        if req.grammar is not None:
            ids, mask_rows = self._walk_grammar(req, ids)
        probs = draft.probs[: len(ids)] if draft.probs is not None else None
        return DraftPlan(ids, probs, len(draft), mask_rows)

    def _walk_grammar(self, req: Req, ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """The draft cut where the grammar stops allowing it, and the mask row of each verify
        position (row j: the grammar after ``ids[:j]``); the matcher ends where it started. An
        EOS draft token ends the walk without being accepted (the run ends there anyway, and a
        matcher is never rolled back over its termination); the row after it is unused."""
        rows = torch.full((len(ids) + 1, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)
        first = self.grammars.fill_masks([req])  # waits for a row prefetched for this state
        if req.is_finished:  # its matcher failed: the step skips it
            return [], rows[:1]
        rows[0] = first.bitmask[0]
        matcher, buffer = req.grammar, BitmaskBuffer(rows)
        accepted = good = 0
        try:
            for tok in ids:
                if tok in self.stop.eos_token_ids:  # ends the run: checked, never walked
                    good += _allows(rows[good], tok)
                    break
                if not matcher.accept_token(tok):
                    break
                accepted += 1
                matcher.fill_row(buffer, accepted)
                good = accepted
        except Exception as e:  # the draft stops here; the plain path meets the error later
            logger.debug("grammar walk of %s's draft stopped: %s", req.rid, e)
        finally:
            matcher.rollback(accepted)
        return ids[:good], rows[: good + 1].clone()

    # ------------------------------------------------------------------ after the forward
    def verify(self, batch: ScheduledBatch, logits: torch.Tensor, per_req: list[list[int]]):
        """Verifies and takes the tokens of every drafted request of ``batch`` (``logits`` rows
        as ``batch.logit_rows()`` laid them out); returns their batch indices (the caller
        samples the others)."""
        handled: set[int] = set()
        if not self.plans:
            return handled
        todo: list[tuple[Req, DraftPlan, list[int]]] = []  # (request, plan, its k + 1 rows)
        for i, req in enumerate(batch.reqs):
            plan = self.plans.pop(req, None)
            if plan is None:
                continue
            handled.add(i)
            if req.is_finished:
                continue
            k = len(batch.drafts[i])
            assert k == len(plan.token_ids) and batch.completes_fill(i), (req.rid, k)
            todo.append((req, plan, per_req[i][-(k + 1) :]))
        greedy = self._accept_greedy_together(logits, todo)
        for req, plan, rows in todo:
            try:
                self._verify_one(req, plan, logits, rows, greedy.get(req))
            except Exception as e:  # a bug met by this request's values: it alone ends
                logger.exception("verifying the draft of %s failed", req.rid)
                req.finish(internal_error(e))
        return handled

    def _accept_greedy_together(
        self, logits: torch.Tensor, todo: list[tuple[Req, DraftPlan, list[int]]]
    ) -> dict[Req, list[int]]:
        """The accepted tokens of every greedy request of ``todo`` from one masked gather, one
        argmax and one read-back (``accept_greedy_batch``); empty if that fails (each request
        is then verified on its own, and alone meets its error)."""
        group = [(req, plan, rows) for req, plan, rows in todo if req.params.is_greedy]
        if not group:
            return {}
        try:
            index = torch.tensor([r for _, _, rows in group for r in rows], dtype=torch.int64)
            gathered = logits[index.to(logits.device, non_blocking=True)]
            start = 0
            for _, plan, rows in group:
                if plan.mask_rows is not None:
                    apply_token_bitmask_inplace(gathered[start : start + len(rows)], plan.mask_rows)
                start += len(rows)
            tokens = accept_greedy_batch(gathered, [plan.token_ids for _, plan, _ in group])
        except Exception:
            logger.exception("batched greedy verification failed; verifying one by one")
            return {}
        return {req: t for (req, _, _), t in zip(group, tokens, strict=True)}

    def _verify_one(
        self,
        req: Req,
        plan: DraftPlan,
        logits: torch.Tensor,
        rows: list[int],
        tokens: list[int] | None,
    ) -> None:
        """Takes the request's verified run: ``tokens`` when already accepted (greedy, batched),
        else the acceptance rule on its ``rows`` of ``logits``."""
        # gathered by index: a copy, which masking may change unless logprobs need it raw
        raw = logits[rows] if tokens is None or req.return_logprob else None
        if tokens is None:
            masked = raw
            if plan.mask_rows is not None:
                masked = raw.clone() if req.return_logprob else raw
                apply_token_bitmask_inplace(masked, plan.mask_rows)
            gen = req.generator if req.generator is not None else self.default_generator
            tokens = accept_draft(masked, plan.token_ids, plan.probs, req.params, gen)
        num_accepted = len(tokens) - 1
        try:
            self.drafter.observe(req, plan.num_proposed, num_accepted)
        except Exception:  # a drafter's bug costs its adaptation, never the request
            logger.exception("the %s drafter failed to observe %s", self.drafter.name, req.rid)
        before = len(req.output_ids)
        self._take_run(req, tokens)
        appended = len(req.output_ids) - before
        s = self.stats
        s.num_verify_steps += 1
        s.num_proposed += len(plan.token_ids)
        s.num_accepted += num_accepted
        s.num_tokens += appended
        if req.return_logprob and appended:
            record_logprobs(req, raw[:appended], req.output_ids[before:])
        target = min(req.num_kv_tokens, req.fill_len - 1)  # the last token's KV comes next step
        if target < req.num_kv_tokens:
            self.kv.truncate(req, target)
        if req.grammar is not None:
            self.grammars.advance(req, self.kv, self.stop)  # termination, then jump-forward

    def _take_run(self, req: Req, tokens: list[int]) -> None:
        """Appends the accepted tokens one by one with the plain finish checks; the first that
        ends the request (or terminates its grammar) drops the rest."""
        for tok in tokens:
            req.output_ids.append(tok)
            self.count_token()
            if req.grammar is not None:
                self.grammars.accept_sampled(req)  # may end it (and take the token back)
            if not req.is_finished:
                self.stop.check(req)
            if req.is_finished or (req.grammar is not None and req.grammar.is_terminated()):
                return

    # ------------------------------------------------------------------ state
    def release(self, req: Req) -> None:
        """The request finished or was retracted: the drafter drops its state (once)."""
        self.plans.pop(req, None)
        if req in self._seen:
            self._seen.discard(req)
            try:
                self.drafter.release(req)
            except Exception:
                logger.exception("the %s drafter failed to release %s", self.drafter.name, req.rid)

    def is_idle(self) -> bool:
        """No draft pending and no request state left in the drafter (when nothing runs)."""
        if self.plans or self._seen:
            logger.error(
                "speculative state left when idle: %d plans, %d requests",
                len(self.plans),
                len(self._seen),
            )
            return False
        return True

    def info(self) -> dict[str, Any]:
        return {
            "algorithm": self.drafter.name,
            "num_draft_tokens": self.num_draft_tokens,
            **self.stats.as_dict(),
            "drafter": self.drafter.stats(),
        }

    def close(self) -> None:
        self.drafter.close()


def _allows(row: torch.Tensor, token_id: int) -> bool:
    """Whether the bitmask row (int32 words, bit ``t % 32`` of word ``t // 32``) allows it."""
    return bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)


def record_logprobs(req: Req, raw: torch.Tensor, ids: list[int]) -> None:
    """Output logprobs of the tokens ``ids`` taken from the unmasked rows ``raw``, as the
    sampling step records them."""
    index = torch.tensor(ids, dtype=torch.int64, device=raw.device)
    for lp, tok in zip(token_logprobs(raw, index).tolist(), ids, strict=True):
        req.output_token_logprobs.append([lp, tok])
    if req.top_logprobs_num > 0:
        req.output_top_logprobs += top_logprob_rows(raw, req.top_logprobs_num)
    if req.token_ids_logprob:
        req.output_token_ids_logprobs += token_ids_logprob_rows(raw, req.token_ids_logprob)
