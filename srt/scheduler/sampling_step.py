"""Samples the next token of every request that finished its fill this step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from radixlm.kernels.bitmask import apply_token_bitmask_inplace
from radixlm.srt.sampling.logprobs import token_ids_logprob_rows, token_logprobs, top_logprobs
from radixlm.srt.sampling.sampler import Sampler, SamplingBatchInfo
from radixlm.srt.scheduler.req import Req
from radixlm.srt.scheduler.stop import StopChecker

if TYPE_CHECKING:
    from radixlm.srt.scheduler.grammar_manager import GrammarMasks

logger = logging.getLogger(__name__)


def _reads_no_outputs(p) -> bool:
    """No penalty or bias: sampling does not depend on the tokens generated so far."""
    return (
        not p.logit_bias
        and p.frequency_penalty == 0
        and p.presence_penalty == 0
        and p.repetition_penalty == 1
    )


def is_overlappable(req: Req) -> bool:
    """Whether the request's next token can be sampled before its last one is known on the host
    (overlap scheduling): nothing in its sampling reads its output tokens, and no logprobs or
    grammar state are needed."""
    return (
        req.grammar is None
        and not req.return_logprob
        and req.params.min_new_tokens == 0
        and _reads_no_outputs(req.params)
    )


def _is_plain_greedy(p) -> bool:
    return p.is_greedy and _reads_no_outputs(p)


class SamplingStep:
    def __init__(self, vocab_size: int, device: torch.device, seed: int):
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        self.default_generator = torch.Generator(device=device).manual_seed(seed)

    def run(
        self,
        logits: torch.Tensor,
        rows: list[int],
        reqs: list[Req],
        stop: StopChecker,
        masks: GrammarMasks | None = None,
    ) -> list[int]:
        """``logits[rows[i]]`` belongs to ``reqs[i]``; returns the sampled ids and records the
        output logprobs of requests that asked for them (from the unmasked logits). ``masks``
        (row ``i`` for ``reqs[i]``) restricts constrained requests to the tokens their grammar
        allows; their EOS is never suppressed (the grammar decides where output may end)."""
        if not reqs:
            return []
        lp_rows = [i for i, r in enumerate(reqs) if r.return_logprob]
        suppress = [[] if r.grammar is not None else stop.suppressed_ids(r) for r in reqs]
        argmax_only = masks is None and not lp_rows and not any(suppress)
        argmax_only = argmax_only and all(_is_plain_greedy(r.params) for r in reqs)
        # the gather copies (the other paths update their rows in place); a greedy decode batch
        # reads its rows where they are: on a busy CPU the copy's thread pool wake-up cost ms
        if not argmax_only or rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
        raw_lp = logits[lp_rows].clone() if lp_rows else None
        if masks is not None:
            every_row = len(masks.rows) == len(reqs)  # skips gathering rows
            apply_token_bitmask_inplace(logits, masks.bitmask, None if every_row else masks.rows)
        try:
            next_ids = self._sample(logits, reqs, suppress if any(suppress) else None)
        except Exception:
            logger.exception("sampling a batch of %d failed; sampling its rows apart", len(reqs))
            next_ids = self._sample_apart(logits, reqs, suppress)
        if raw_lp is not None:
            self._record(raw_lp, next_ids[lp_rows], [reqs[i] for i in lp_rows])
        return next_ids.tolist()

    def _sample_apart(
        self, logits: torch.Tensor, reqs: list[Req], suppress: list[list[int]]
    ) -> torch.Tensor:
        """Samples each row on its own, so a row whose values break sampling (NaN or infinite
        logits, say) ends only its own request (with a 500); its id is a placeholder that the
        caller skips, as it skips every finished request."""
        ids = []
        for i, req in enumerate(reqs):
            try:
                ids.append(
                    self._sample(logits[i : i + 1], [req], [suppress[i]] if suppress[i] else None)
                )
            except Exception as e:
                req.finish(
                    {
                        "type": "abort",
                        "status_code": 500,
                        "message": f"internal error while sampling: {e}",
                    }
                )
                ids.append(torch.zeros(1, dtype=torch.int64, device=logits.device))
        return torch.cat(ids)

    def sample_on_device(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Next ids ``[len(reqs)]`` on the logits' device, nothing read back to the host: for
        plain requests (see ``is_overlappable``) whose logits rows are ``logits[i]``."""
        return self._sample(logits, reqs, None)

    def _sample(
        self, logits: torch.Tensor, reqs: list[Req], suppress: list[list[int]] | None
    ) -> torch.Tensor:
        if suppress is None and all(_is_plain_greedy(r.params) for r in reqs):
            return logits.argmax(dim=-1)  # the common greedy batch (masks already applied)
        info = SamplingBatchInfo.build(
            [r.params for r in reqs],
            [r.output_ids for r in reqs],
            [r.generator for r in reqs],
            self.vocab_size,
            self.device,
            self.default_generator,
            prompt_ids=[r.prompt_ids for r in reqs],
        )
        return self.sampler.sample(logits, info, suppress)

    @staticmethod
    def _record(raw: torch.Tensor, ids: torch.Tensor, reqs: list[Req]) -> None:
        lps = token_logprobs(raw, ids).tolist()
        k = max(r.top_logprobs_num for r in reqs)
        tops = top_logprobs(raw, k) if k > 0 else None
        for i, (req, lp, tok) in enumerate(zip(reqs, lps, ids.tolist(), strict=True)):
            req.output_token_logprobs.append([lp, tok])
            if req.top_logprobs_num > 0:
                vals, top_ids = (
                    tops[0][i, : req.top_logprobs_num],
                    tops[1][i, : req.top_logprobs_num],
                )
                req.output_top_logprobs.append(
                    [[v, t] for v, t in zip(vals.tolist(), top_ids.tolist(), strict=True)]
                )
            if req.token_ids_logprob:
                req.output_token_ids_logprobs += token_ids_logprob_rows(
                    raw[i : i + 1], req.token_ids_logprob
                )
