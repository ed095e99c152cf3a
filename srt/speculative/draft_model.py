"""Draft-model drafts: a small model with the target's tokenizer proposes k tokens per step.

Per request the drafter keeps a row of the draft runner's request table and the tokens whose
K/V that row holds (``kv_tokens``). ``propose`` first cuts that KV back to the longest prefix
that still matches the request's sequence (rejected drafts, edits), catches it up with the
new tokens in one batched extend (the last token's logits give draft token 1), then runs
``k - 1`` batched decode steps. Greedy requests draft greedily (a deterministic proposal,
``probs`` None); sampled ones draw from their own temperature / top-k / top-p / min-p
transform of the draft logits, with their own generator when seeded, and return those
distributions for the acceptance rule. ``observe`` frees the KV of rejected draft tokens at
once; ``release`` frees the row. Requests that find no room (table row, KV slots, the draft's
context length) simply get no draft.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.srt.config import ServerConfig
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.sampling.speculative import target_probs
from radixlm.srt.speculative.adaptive import AdaptiveLength, DraftCounters, DraftLength
from radixlm.srt.speculative.base import Draft, Drafter
from radixlm.srt.speculative.draft_runner import DraftBatch, build_draft_runner, to_vocab

logger = logging.getLogger(__name__)

MAX_CATCHUP_TOKENS = 8192  # draft-prefill tokens per propose (long prompts catch up over steps)


@dataclass
class _DraftState:
    req_slot: int  # row of the draft runner's request table
    length: DraftLength
    kv_tokens: list[int]  # tokens whose K/V the draft pool holds, positions 0..len-1
    num_slots: int = 0  # KV slots written in the row (== len(kv_tokens) between calls)
    base_len: int = 0  # the request's length at the last propose; its draft follows it


@dataclass
class _Work:
    """One request drafting in this propose call."""

    index: int  # into the call's requests
    req: Any
    state: _DraftState
    num_tokens: int  # draft tokens to produce
    decode_slots: torch.Tensor  # [num_tokens - 1] KV slots of draft tokens 1..k-1


@dataclass
class _CallPlan:
    """What one ``propose`` call computes."""

    budget: int  # catch-up tokens left for this call
    extend: DraftBatch = field(default_factory=lambda: DraftBatch(ForwardMode.EXTEND))
    rows: list[int] = field(default_factory=list)  # extend rows whose logits start a draft
    work: list[_Work] = field(default_factory=list)
    touched: list[Any] = field(default_factory=list)  # requests whose draft KV changed


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(
        self,
        runner: Any,
        vocab_size: int,
        max_draft_tokens: int,
        adaptive: bool = True,
        seed: int = 0,
        max_catchup_tokens: int = MAX_CATCHUP_TOKENS,
    ) -> None:
        self.runner = runner  # the draft's ModelRunner (its KV pool is this drafter's alone)
        self.vocab_size = vocab_size  # the target's: draft probs are [k, vocab_size]
        self.allocator = runner.allocator
        self.table = runner.req_to_token_pool
        self.context_length = runner.context_length
        self.lengths = AdaptiveLength(max_draft_tokens, enabled=adaptive)
        self.counters = DraftCounters()
        self.max_catchup_tokens = max_catchup_tokens
        self.generator = torch.Generator(device=runner.device).manual_seed(seed)
        self._states: dict[Any, _DraftState] = {}

    @classmethod
    def from_config(cls, cfg: ServerConfig, target_runner: Any) -> DraftModelDrafter:
        runner = build_draft_runner(cfg, target_runner)
        return cls(
            runner,
            target_runner.vocab_size,
            cfg.speculative_num_draft_tokens,
            adaptive=not cfg.speculative_disable_adaptive,
            seed=cfg.random_seed,
        )

    # ------------------------------------------------------------------ accounting
    def num_tracked(self) -> int:
        return len(self._states)

    def num_held_slots(self) -> int:
        """Draft KV slots held for requests (0 once all were released)."""
        return sum(s.num_slots for s in self._states.values())

    def _state(self, req: Any) -> _DraftState | None:
        state = self._states.get(req.rid)
        if state is None:
            row = self.table.alloc()
            if row is None:
                return None
            state = self._states[req.rid] = _DraftState(row, self.lengths.new_state(), [])
        return state

    def _truncate(self, state: _DraftState, keep: int) -> None:
        if keep < state.num_slots:
            slots = self.table.read(state.req_slot, state.num_slots, start=keep).clone()
            self.allocator.free(slots)
            state.num_slots = keep
        del state.kv_tokens[keep:]

    def _alloc(self, state: _DraftState, num_tokens: int) -> torch.Tensor | None:
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            self.allocator.collect_freed()
            slots = self.allocator.alloc(num_tokens)
        if slots is not None:
            self.table.write(state.req_slot, state.num_slots, slots)
            state.num_slots += num_tokens
        return slots

    def _sync(self, state: _DraftState, seq: list[int]) -> None:
        """Cut the draft KV to its longest prefix that matches ``seq``, leaving at least the
        last token of ``seq`` to compute (its logits propose the first draft token)."""
        kv = state.kv_tokens
        limit = min(len(kv), len(seq) - 1)
        known = min(state.base_len, limit)  # matched at the last propose, unless edited since
        i = known if kv[:known] == seq[:known] else 0
        while i < limit and kv[i] == seq[i]:
            i += 1
        self._truncate(state, i)

    # ------------------------------------------------------------------ the contract
    def propose(self, reqs: Sequence[Any], max_tokens: Sequence[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in reqs]
        plan = _CallPlan(self.max_catchup_tokens)
        for i, (req, limit) in enumerate(zip(reqs, max_tokens, strict=True)):
            if limit > 0 and plan.budget > 0:
                self._plan_one(plan, i, req, limit)
        try:
            if plan.work:
                self._run_drafts(plan, drafts)
            elif plan.extend.reqs:
                self.runner.forward(plan.extend, plan.extend.last_rows())  # catch-up only
        except Exception:
            for req in plan.touched:  # their draft KV is in an unknown state: start again
                self.release(req)
            raise
        return drafts

    def _plan_one(self, plan: _CallPlan, index: int, req: Any, limit: int) -> None:
        """Adds the request's catch-up tokens to the extend batch and, when it is caught up,
        its draft to the work list (nothing when it has no room)."""
        state = self._state(req)
        if state is None:
            return
        k = min(limit, self.lengths.limit(state.length))
        seq = req.prompt_ids + req.output_ids
        if k <= 0 or len(seq) + k > self.context_length:
            return
        self._sync(state, seq)
        start = len(state.kv_tokens)
        new = seq[start : start + plan.budget]
        complete = start + len(new) == len(seq)
        slots = self._alloc(state, len(new) + (k - 1 if complete else 0))
        if slots is None:
            return
        plan.budget -= len(new)
        plan.extend.add(state.req_slot, start, slots[: len(new)], new)
        plan.touched.append(req)
        state.kv_tokens += new
        if complete:
            state.base_len = len(seq)
            plan.rows.append(len(plan.extend.reqs) - 1)
            plan.work.append(_Work(index, req, state, k, slots[len(new) :]))

    def _run_drafts(self, plan: _CallPlan, drafts: list[Draft]) -> None:
        """The extend, then decode steps; fills ``drafts`` and the states' ``kv_tokens``."""
        work = plan.work
        logits = self.runner.forward(plan.extend, plan.extend.last_rows())
        logits = logits[torch.tensor(plan.rows, device=logits.device)]
        tokens: list[list[torch.Tensor]] = [[] for _ in work]  # per work item, [1] device ids
        probs: list[list[torch.Tensor]] = [[] for _ in work]
        active = list(range(len(work)))
        for step in range(max(w.num_tokens for w in work)):
            sampled, rows_probs = self._sample(to_vocab(logits, self.vocab_size), work, active)
            for j, w_index in enumerate(active):
                tokens[w_index].append(sampled[j : j + 1])
                if rows_probs[j] is not None:
                    probs[w_index].append(rows_probs[j])
            keep = [j for j, w_index in enumerate(active) if work[w_index].num_tokens > step + 1]
            if not keep:
                break
            active = [active[j] for j in keep]
            logits = self._decode_step(work, active, step, sampled[keep])
        host = torch.cat([torch.cat(t) for t in tokens]).tolist()
        offset = 0
        for w_index, w in enumerate(work):
            ids = host[offset : offset + w.num_tokens]
            offset += w.num_tokens
            draft_probs = torch.stack(probs[w_index]) if probs[w_index] else None
            drafts[w.index] = Draft(ids, draft_probs)
            w.state.kv_tokens += ids[:-1]

    def _decode_step(
        self, work: list[_Work], active: list[int], step: int, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """Feeds draft token ``step`` of each active request; logits for the next one."""
        batch = DraftBatch(ForwardMode.DECODE)
        for w_index in active:
            w = work[w_index]
            position = w.state.base_len + step
            batch.add(w.state.req_slot, position, w.decode_slots[step : step + 1], [])
        rows = list(range(len(active)))
        return self.runner.forward(batch, rows, input_ids_on_device=input_ids)

    def _sample(
        self, logits: torch.Tensor, work: list[_Work], active: list[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One draft token per active request (``[m]`` on the device) and, for sampled
        requests, the ``[V]`` distribution it was drawn from."""
        tokens = logits.argmax(dim=-1)
        row_probs: list[torch.Tensor | None] = [None] * len(active)
        for j, w_index in enumerate(active):
            req = work[w_index].req
            if req.params.is_greedy:
                continue
            p = target_probs(logits[j : j + 1], req.params)[0]
            gen = req.generator if req.generator is not None else self.generator
            noise = torch.empty_like(p).exponential_(generator=gen).clamp_min_(1e-30)
            tokens[j] = (p / noise).argmax()
            row_probs[j] = p
        return tokens, row_probs

    def observe(self, req: Any, num_proposed: int, num_accepted: int) -> None:
        state = self._states.get(req.rid)
        if state is None:
            return
        self.counters.add(num_proposed, num_accepted)
        self.lengths.update(state.length, num_proposed, num_accepted)
        self._truncate(state, min(len(state.kv_tokens), state.base_len + num_accepted))

    def release(self, req: Any) -> None:
        state = self._states.pop(req.rid, None)
        if state is None:
            return
        self._truncate(state, 0)
        self.table.free(state.req_slot)

    def stats(self) -> dict[str, float]:
        return {
            **self.counters.as_dict(),
            "draft_kv_tokens": float(self.num_held_slots()),
            "draft_pool_tokens": float(self.allocator.max_total_tokens),
        }

    def close(self) -> None:
        for rid in list(self._states):
            state = self._states.pop(rid)
            self._truncate(state, 0)
            self.table.free(state.req_slot)
        self.runner = None  # the draft model and its pool go with the last reference
