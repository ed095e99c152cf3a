"""Logit edits applied before sampling: penalties, logit bias, token suppression.

Semantics (logits are the model's raw scores for one row):

- frequency / presence (OpenAI): ``logit[t] -= frequency * count[t] + presence * (count[t] > 0)``
  where ``count[t]`` is how often ``t`` occurs in the request's *output* so far.
- repetition (HF ``RepetitionPenaltyLogitsProcessor`` / CTRL): for every token seen in the
  *prompt or the output*, a positive logit is divided by the penalty and a negative one is
  multiplied by it. Without prompt ids only output tokens count.
- logit bias: ``logit[t] += bias[t]``.
- suppression: ``logit[t] = -inf`` (EOS and stop tokens before ``min_new_tokens``).

Every input is rebuilt from token-id lists each step with one scatter-add on the device; rows
without a penalty add nothing to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from radixlm.srt.sampling.params import SamplingParams


def token_counts(
    token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> Tensor:
    """``[B, V]`` float32 counts of each token id per row: the ragged rows are flattened to
    ``row * V + id`` on the host and counted with one scatter-add on the device."""
    batch = len(token_ids)
    counts = torch.zeros(batch * vocab_size, dtype=torch.float32, device=device)
    lengths = np.fromiter((len(row) for row in token_ids), dtype=np.int64, count=batch)
    total = int(lengths.sum())
    if total > 0:
        flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=total)
        assert flat.min() >= 0 and flat.max() < vocab_size, "token id outside the vocabulary"
        flat += np.repeat(np.arange(batch, dtype=np.int64) * vocab_size, lengths)
        index = torch.from_numpy(flat).to(device)
        counts.scatter_add_(0, index, torch.ones(total, dtype=torch.float32, device=device))
    return counts.view(batch, vocab_size)


def apply_frequency_presence(
    logits: Tensor, counts: Tensor, frequency: Tensor, presence: Tensor
) -> None:
    """In place. ``counts`` [B, V]; ``frequency`` and ``presence`` [B, 1]."""
    logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def apply_repetition(logits: Tensor, seen_mask: Tensor, repetition: Tensor) -> None:
    """In place. ``seen_mask`` [B, V] bool; ``repetition`` [B, 1] (1.0 leaves a row as is)."""
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    torch.where(seen_mask, penalized, logits, out=logits)


def sparse_rows(
    per_row: Sequence[Sequence[int] | None], device: torch.device | str
) -> tuple[Tensor, Tensor] | None:
    """``(rows, ids)`` int64 index tensors for a per-row list of token ids (None if empty)."""
    rows = [i for i, ids in enumerate(per_row) for _ in (ids or ())]
    if not rows:
        return None
    ids = [t for row_ids in per_row for t in (row_ids or ())]
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
    )


def suppress_tokens(logits: Tensor, index: tuple[Tensor, Tensor]) -> None:
    """In place: ``logits[rows, ids] = -inf``."""
    logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


@dataclass
class LogitBias:
    """Sparse per-row logit bias: ``logits[rows[j], ids[j]] += values[j]``."""

    rows: Tensor  # [K] int64
    ids: Tensor  # [K] int64
    values: Tensor  # [K] float32

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], device: torch.device | str
    ) -> LogitBias | None:
        biases = [p.logit_bias_by_id for p in params]
        index = sparse_rows([list(b) for b in biases], device)
        if index is None:
            return None
        values = [v for b in biases for v in b.values()]
        return cls(index[0], index[1], torch.tensor(values, dtype=torch.float32, device=device))

    def apply(self, logits: Tensor) -> None:
        logits.index_put_((self.rows, self.ids), self.values.to(logits.dtype), accumulate=True)


def _has_penalty(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1


def _seen_mask(
    params: Sequence[SamplingParams],
    output_counts: Tensor,
    prompt_ids: Sequence[Sequence[int]] | None,
    vocab_size: int,
    device: torch.device | str,
) -> Tensor:
    """``[B, V]`` bool: the token occurs in the output or (for rows with a repetition penalty)
    in the prompt."""
    seen = output_counts > 0
    if prompt_ids is not None:
        prompts = [
            ids if p.repetition_penalty != 1 else ()
            for p, ids in zip(params, prompt_ids, strict=True)
        ]
        seen |= token_counts(prompts, vocab_size, device) > 0
    return seen


@dataclass
class PenaltyInputs:
    """Per-row penalty inputs for one step; a part is None when no row in the batch uses it."""

    frequency: Tensor | None  # [B, 1] float32
    presence: Tensor | None  # [B, 1] float32
    output_counts: Tensor | None  # [B, V] float32: occurrences in the output so far
    repetition: Tensor | None  # [B, 1] float32
    seen_mask: Tensor | None  # [B, V] bool: token occurs in the prompt or the output

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        prompt_ids: Sequence[Sequence[int]] | None = None,
    ) -> PenaltyInputs | None:
        """None when no row has a penalty (the common case costs nothing)."""
        use_linear = any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params)
        use_repetition = any(p.repetition_penalty != 1 for p in params)
        if not (use_linear or use_repetition):
            return None

        def column(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        # Rows without a penalty contribute no ids: their counts are never read.
        out_ids = [
            ids if _has_penalty(p) else () for p, ids in zip(params, output_ids, strict=True)
        ]
        counts = token_counts(out_ids, vocab_size, device)
        frequency = presence = repetition = seen = None
        if use_linear:
            frequency = column([p.frequency_penalty for p in params])
            presence = column([p.presence_penalty for p in params])
        if use_repetition:
            repetition = column([p.repetition_penalty for p in params])
            seen = _seen_mask(params, counts, prompt_ids, vocab_size, device)
        counts = counts if use_linear else None
        return cls(frequency, presence, counts, repetition, seen)

    def apply(self, logits: Tensor) -> None:
        """In place: repetition first, then frequency / presence."""
        if self.repetition is not None and self.seen_mask is not None:
            apply_repetition(logits, self.seen_mask, self.repetition)
        if self.output_counts is not None:
            assert self.frequency is not None and self.presence is not None
            apply_frequency_presence(logits, self.output_counts, self.frequency, self.presence)
