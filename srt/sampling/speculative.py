"""Acceptance of speculative drafts: which draft tokens the target keeps, and its own next token.

For one request with ``k`` draft tokens the target computes ``k + 1`` rows of logits: row ``i``
scores the token after the sequence extended by draft tokens ``0..i-1`` (row ``k`` is the
bonus row after the whole draft). Masks (grammar, penalties, suppression) are applied to them
by the caller first, as for plain decoding.

- Greedy (:func:`accept_greedy`): keep the longest prefix of the draft that equals the row-wise
  argmax, then the argmax at the first mismatch (or of the bonus row). The result is the same
  token sequence plain greedy decoding produces.
- Sampled (:func:`accept_sampled`), the rule of speculative sampling (Leviathan et al. 2023,
  Chen et al. 2023): with ``p`` the target's processed distribution (:func:`target_probs`:
  temperature, top-k, top-p, min-p exactly as ``sampler.py``) and ``q`` the distribution the
  draft token was drawn from (one-hot for a deterministic draft), accept draft token ``x_i``
  with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection draw from
  ``normalize(max(p_i - q_i, 0))`` and stop; after ``k`` acceptances draw the bonus token from
  ``p_k``. Every emitted token is then distributed exactly as plain sampling from ``p``.

Draws come from the given generator (the request's own when it has a seed, else the step's),
which must live on the tensors' device. Each call reads back once from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.sampler import filtered_probs


def accept_greedy(logits: Tensor, draft_ids: Sequence[int]) -> list[int]:
    """Accepted tokens (1..k+1) for target ``logits`` ``[k+1, V]`` and ``k`` draft ids."""
    return accept_greedy_batch(logits, [draft_ids])[0]


def accept_greedy_batch(logits: Tensor, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """:func:`accept_greedy` for several requests whose rows are stacked in ``logits``
    ``[sum(len(d) + 1), V]``, request by request; one argmax and one read-back in all."""
    num_rows = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"need {num_rows} logit rows for these drafts, got {tuple(logits.shape)}")
    target = logits.argmax(dim=-1).tolist()
    out: list[list[int]] = []
    row = 0
    for draft in drafts:
        n = 0
        while n < len(draft) and int(draft[n]) == target[row + n]:
            n += 1
        out.append([int(t) for t in draft[:n]] + [target[row + n]])
        row += len(draft) + 1
    return out


@dataclass(frozen=True)
class _RowFilters:
    """The per-row filter inputs ``sampler.filtered_probs`` reads, for rows of one request."""

    temperatures: Tensor  # [n, 1] float32
    top_ks: Tensor  # [n] int64
    top_ps: Tensor  # [n] float32
    min_ps: Tensor  # [n] float32
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """``[n, V]`` float32 probabilities (rows sum to 1) that plain sampling with ``params``
    draws from, for logits ``[n, V]`` of one request (masks already applied): softmax at the
    request's temperature, then its top-k, top-p and min-p, renormalized."""
    if params.is_greedy:
        raise ValueError("target_probs is for sampled requests; greedy ones use accept_greedy")
    n, vocab = logits.shape
    dev = logits.device
    top_k = vocab if params.top_k < 0 else min(params.top_k, vocab)

    def full(value: float, dtype: torch.dtype) -> Tensor:
        return torch.full((n,), value, dtype=dtype, device=dev)

    filters = _RowFilters(
        temperatures=full(params.temperature, torch.float32).unsqueeze(1),
        top_ks=full(top_k, torch.int64),
        top_ps=full(params.top_p, torch.float32),
        min_ps=full(params.min_p, torch.float32),
        need_top_k=top_k < vocab,
        need_top_p=params.top_p < 1.0,
        need_min_p=params.min_p > 0.0,
    )
    probs = filtered_probs(logits.to(torch.float32), filters)  # type: ignore[arg-type]
    return probs / probs.sum(dim=-1, keepdim=True)


def accept_sampled(
    probs: Tensor,
    draft_ids: Sequence[int],
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Accepted tokens (1..k+1) for target probabilities ``probs`` ``[k+1, V]`` (rows sum to
    1), ``k`` draft ids and the draft's distributions ``[k, V]`` (None: one-hot, a
    deterministic draft). Draws use ``generator`` (None: torch's default for the device)."""
    k = len(draft_ids)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} probability rows for {k} draft tokens, got {probs.shape}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, probs.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, {probs.shape[1]}], got {draft_probs.shape}")
    dev = probs.device
    probs = probs.to(torch.float32)
    ids = torch.tensor([int(t) for t in draft_ids], dtype=torch.int64, device=dev)
    rows = torch.arange(k, device=dev)
    if draft_probs is None:
        q_rows = torch.zeros((k, probs.shape[1]), dtype=torch.float32, device=dev)
        q_rows[rows, ids] = 1.0
    else:
        q_rows = draft_probs.to(device=dev, dtype=torch.float32)
    # x_i is kept when u_i < p_i(x_i) / q_i(x_i), i.e. u_i * q_i(x_i) < p_i(x_i)
    uniforms = torch.rand(k, generator=generator, device=dev)
    accepted = uniforms * q_rows[rows, ids] < probs[rows, ids]
    # one candidate per row, drawn at once: the residual after a rejection at row i, and p_k
    residual = (probs[:k] - q_rows).clamp_min_(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q: a rejection cannot happen there
    residual = torch.where(empty, probs[:k], residual)
    candidates = _draw(torch.cat([residual, probs[k:]]), generator)
    flags_and_draws = torch.cat([accepted.to(torch.int64), candidates]).tolist()
    num_accepted = next((i for i in range(k) if not flags_and_draws[i]), k)
    return [int(t) for t in draft_ids[:num_accepted]] + [flags_and_draws[k + num_accepted]]


def _draw(weights: Tensor, generator: torch.Generator | None) -> Tensor:
    """One draw per row from unnormalized ``weights`` ``[n, V]``: the exponential race."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # an Exp(1) draw can be 0 in float32
    return (weights / noise).argmax(dim=-1)


def accept_draft(
    logits: Tensor,
    draft_ids: Sequence[int],
    draft_probs: Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The accepted tokens of one request's draft from its target logits ``[k+1, V]`` (masks
    applied): :func:`accept_greedy` for greedy params, else :func:`accept_sampled` on
    :func:`target_probs`."""
    if params.is_greedy:
        return accept_greedy(logits, draft_ids)
    return accept_sampled(target_probs(logits, params), draft_ids, draft_probs, generator)
