"""A scheduled batch: which requests run, how many new tokens each, and the model inputs.

The model runner turns it into the executor's ``ForwardBatch`` (``ForwardBatch.from_scheduled``);
there is no intermediate layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.scheduler.req import Req


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req] = field(default_factory=list)
    # tokens already in the KV cache before this step
    starts: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    completes: list[bool] = field(default_factory=list)  # fill complete after this step: samples
    # draft tokens computed after the request's fill (speculative decoding): they are counted in
    # extend_lens and hold slots, but are not in the request's tokens until verified
    drafts: list[list[int]] = field(default_factory=list)
    # input_ids() of the current requests: the scheduler's embedding check and the forward batch
    # both read it in the same step, so it is built once (add and remove reset it)
    _input_ids: list[int] | None = field(default=None, repr=False, compare=False)

    def add(
        self,
        req: Req,
        start: int,
        extend_len: int,
        slots: torch.Tensor,
        draft: list[int] | None = None,
    ) -> None:
        """``extend_len`` new tokens from position ``start``: the request's own tokens, then
        ``draft`` (which needs the fill completed: drafts continue after its last token)."""
        draft = draft or []
        self.reqs.append(req)
        self.starts.append(start)
        self.extend_lens.append(extend_len)
        self.slots.append(slots)
        self.completes.append(start + extend_len - len(draft) == req.fill_len)
        assert not draft or self.completes[-1], "a draft continues a complete fill"
        self.drafts.append(draft)
        self._input_ids = None

    def all_complete(self) -> bool:
        return all(self.completes)

    def completes_fill(self, i: int) -> bool:
        """Whether request i has all its tokens cached after this step (it samples next)."""
        return self.completes[i]

    def new_tokens(self, i: int) -> list[int]:
        """The token ids request i computes in this step (its draft last)."""
        own = self.extend_lens[i] - len(self.drafts[i])
        return self.reqs[i].fill_slice(self.starts[i], self.starts[i] + own) + self.drafts[i]

    def single(self, i: int) -> ScheduledBatch:
        """A batch of request i alone (same positions and slots)."""
        one = ScheduledBatch(self.mode)
        one.reqs, one.starts, one.extend_lens = (
            [self.reqs[i]],
            [self.starts[i]],
            [self.extend_lens[i]],
        )
        one.slots, one.completes = [self.slots[i]], [self.completes[i]]
        one.drafts = [self.drafts[i]]
        return one

    def remove(self, indices: list[int]) -> list[Req]:
        """Takes requests out of the batch; returns them."""
        drop = set(indices)
        removed = [r for i, r in enumerate(self.reqs) if i in drop]
        for name in ("reqs", "starts", "extend_lens", "slots", "completes", "drafts"):
            setattr(self, name, [x for i, x in enumerate(getattr(self, name)) if i not in drop])
        self._input_ids = None
        return removed

    def input_ids(self) -> list[int]:
        """Every request's new token ids, request by request (``ForwardBatch.from_scheduled``
        and the scheduler's embedding check read them)."""
        if self._input_ids is None:
            ids: list[int] = []
            for i in range(len(self.reqs)):
                ids += self.new_tokens(i)
            self._input_ids = ids
        return self._input_ids

    def positions(self) -> list[int]:
        """The new tokens' positions, request by request: ``starts[i] .. starts[i] + ext - 1``."""
        out: list[int] = []
        for start, ext in zip(self.starts, self.extend_lens, strict=True):
            out += range(start, start + ext)
        return out

    def logit_rows(self) -> tuple[list[int], list[list[int]]]:
        """Rows of the batch's tokens that need logits, and per request the indices (into the
        returned row list) of its rows: input-logprob positions first, the sampling row last
        (a request with a draft of k tokens: its last k + 1 rows, the verification rows)."""
        rows: list[int] = []
        per_req: list[list[int]] = []
        offset = 0
        for i, (req, start, ext) in enumerate(
            zip(self.reqs, self.starts, self.extend_lens, strict=True)
        ):
            mine: list[int] = []
            if req.wants_input_logprobs:
                first = max(req.logprob_start_len - 1, 0)
                for pos in range(max(first, start), min(start + ext, len(req.prompt_ids) - 1)):
                    mine.append(len(rows))
                    rows.append(offset + pos - start)
            if self.completes_fill(i):
                for pos in range(ext - 1 - len(self.drafts[i]), ext):
                    mine.append(len(rows))
                    rows.append(offset + pos)
            per_req.append(mine)
            offset += ext
        return rows, per_req
