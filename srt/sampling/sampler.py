"""Batched sampling of the next token from logits ``[B, V]``.

Per step the scheduler builds a :class:`SamplingBatchInfo` from the running requests and calls
:meth:`Sampler.sample`. The pipeline, per row:

1. logit bias, repetition penalty, frequency / presence penalties, suppression of token ids
   (see :mod:`radixlm.srt.sampling.penalties`);
2. greedy rows take the argmax of these logits;
3. other rows: softmax(logits / temperature), then top-k, top-p and min-p are applied to these
   probabilities (all three judge the same unfiltered distribution, so their order does not
   matter: the kept set is the intersection), then one token is drawn with the exponential
   race ``argmax(probs / E)``, ``E ~ Exp(1)`` i.i.d. per vocabulary entry.

On the CPU, step 3 avoids both full-vocabulary costs (at batch 16 over SmolLM2's 49,152 tokens
the sort took 36 ms and the exponential noise 11 ms, against about 67 ms per greedy decode
step): rows with top-k / top-p take their 256 most likely tokens (``topk``, sorted) and apply
the filters there; a row whose cut-off falls beyond them (top-k above that count, or top-p
mass the candidates do not reach) tries 4,096 (:data:`CPU_CANDIDATES`), and beyond those goes
through the full sort. The kept set is the sort's (up to the order of exactly tied
probabilities). The token is then drawn by inverse CDF: one uniform per row against the
cumulative kept mass; the same distribution, with one random number per row instead of V. :func:`filtered_probs` (the whole filtered
distribution, which speculative acceptance reads) finds its cut the same way on the CPU. GPU
rows keep the branch-free sort + exponential race: the CPU path decides per row on the host,
which a GPU step must not wait for.

Seeds: a row with its own ``torch.Generator`` draws its noise (one ``[V]`` draw per step on a
GPU, one uniform on the CPU) from that generator only, and everything else is row-local, so a
seeded request samples the same tokens whatever else is in the batch and wherever its row is.
Greedy rows draw nothing. Generators must live on the logits' device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.penalties import (
    LogitBias,
    PenaltyInputs,
    sparse_rows,
    suppress_tokens,
)

# CPU: candidates per row for top-k / top-p, tried in turn (a row whose cut-off lies beyond the
# last falls back to the sort); per row, topk costs 0.09 / 0.28 ms and the sort 1.55 ms over
# 49,152 tokens (AMD EPYC). On SmolLM2 at T = 1, top_p = 0.95, 22-25% of rows kept more than
# 256 tokens and 2-6% more than 4,096 (srt/bench/bench_sampler.py).
CPU_CANDIDATES = (256, 4096)
CDF_BLOCK = 1024  # inverse-CDF draws over wider rows go block first (see _inverse_cdf)


@dataclass
class SamplingBatchInfo:
    """Per-row sampling inputs of one step, on the logits' device."""

    vocab_size: int
    temperatures: Tensor  # [B, 1] float32; 1.0 on greedy rows
    top_ps: Tensor  # [B] float32
    top_ks: Tensor  # [B] int64; vocab_size where top-k is off
    min_ps: Tensor  # [B] float32
    is_greedy: Tensor  # [B] bool
    is_all_greedy: bool
    need_top_k: bool  # some row restricts top-k
    need_top_p: bool
    need_min_p: bool
    penalties: PenaltyInputs | None
    logit_bias: LogitBias | None
    min_tokens_suppress: tuple[Tensor, Tensor] | None  # (rows, ids) set to -inf
    generators: list[torch.Generator | None]  # per row; None: use default_generator
    default_generator: torch.Generator
    sampled_rows: list[int]  # rows that are not greedy

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
        default_generator: torch.Generator,
        *,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> SamplingBatchInfo:
        """Inputs for rows ``params[i]`` whose outputs so far are ``output_ids[i]``.

        ``prompt_ids`` (optional) makes the repetition penalty count prompt tokens too (HF
        semantics); without it only output tokens are penalized. With ``eos_token_ids`` given,
        rows that have fewer than ``min_new_tokens`` outputs get those ids and their own
        ``stop_token_ids`` suppressed (``Sampler.sample`` can also be handed ids to suppress).
        """
        assert len(params) == len(output_ids) == len(generators)
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        active = [params[i] for i in sampled_rows]  # only non-greedy rows need the filters
        return cls(
            vocab_size=vocab_size,
            temperatures=_floats(
                [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device
            ).unsqueeze(1),
            top_ps=_floats([p.top_p for p in params], device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            min_ps=_floats([p.min_p for p in params], device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            is_all_greedy=not sampled_rows,
            need_top_k=any(top_ks[i] < vocab_size for i in sampled_rows),
            need_top_p=any(p.top_p < 1.0 for p in active),
            need_min_p=any(p.min_p > 0.0 for p in active),
            penalties=PenaltyInputs.build(params, output_ids, vocab_size, device, prompt_ids),
            logit_bias=LogitBias.build(params, device),
            min_tokens_suppress=_min_tokens_suppress(params, output_ids, eos_token_ids, device),
            generators=list(generators),
            default_generator=default_generator,
            sampled_rows=sampled_rows,
        )

    @property
    def batch_size(self) -> int:
        return len(self.generators)

    @property
    def has_logit_edits(self) -> bool:
        return (
            self.penalties is not None
            or self.logit_bias is not None
            or self.min_tokens_suppress is not None
        )


def _floats(values: list[float], device: torch.device | str) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _min_tokens_suppress(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int] | None,
    device: torch.device | str,
) -> tuple[Tensor, Tensor] | None:
    if eos_token_ids is None:
        return None
    per_row = [
        sorted(set(eos_token_ids) | set(p.stop_token_ids or ()))
        if len(out) < p.min_new_tokens
        else []
        for p, out in zip(params, output_ids, strict=True)
    ]
    return sparse_rows(per_row, device)


class Sampler:
    """Stateless: all per-step state lives in :class:`SamplingBatchInfo`."""

    def sample(
        self,
        logits: Tensor,
        info: SamplingBatchInfo,
        suppress_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> Tensor:
        """Next token per row, ``[B]`` int64. ``logits`` [B, V] is never written to.

        ``suppress_token_ids[i]`` are token ids row ``i`` may not produce this step (the
        scheduler passes EOS / stop token ids until ``min_new_tokens`` is reached).
        """
        assert logits.dim() == 2 and logits.shape[0] == info.batch_size, logits.shape
        suppress = (
            None if suppress_token_ids is None else sparse_rows(suppress_token_ids, logits.device)
        )
        if info.is_all_greedy and not info.has_logit_edits and suppress is None:
            return logits.argmax(dim=-1)
        processed = self.process_logits(logits, info, suppress)
        if info.is_all_greedy:
            return processed.argmax(dim=-1)
        if processed.device.type == "cpu":
            sampled = sample_on_cpu(processed, info)
        else:
            sampled = exponential_race(filtered_probs(processed, info), info)
        if not info.sampled_rows or len(info.sampled_rows) == info.batch_size:
            return sampled
        return torch.where(info.is_greedy, processed.argmax(dim=-1), sampled)

    def process_logits(
        self, logits: Tensor, info: SamplingBatchInfo, suppress: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """A float32 copy of ``logits`` with bias, penalties and suppression applied."""
        out = logits.to(torch.float32, copy=True)
        if info.logit_bias is not None:
            info.logit_bias.apply(out)
        if info.penalties is not None:
            info.penalties.apply(out)
        for index in (info.min_tokens_suppress, suppress):
            if index is not None:
                suppress_tokens(out, index)
        return out


def filtered_probs(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """softmax(logits / T) with entries outside top-k / top-p / min-p set to 0 (not
    renormalized: the exponential race does not need it). The most likely token is always
    kept. Top-p keeps a token when the probability mass of more likely tokens is <= top_p.
    On the CPU the cut is found among candidates first, as in :func:`sample_on_cpu`."""
    probs = _tempered_probs(logits, info)
    if not (info.need_top_k or info.need_top_p):
        return probs
    if probs.device.type != "cpu":
        return _filter_sorted(probs, info.top_ks, info.top_ps)
    out = probs.clone()
    rows, _ = _split_filtered(info, range(probs.shape[0]), probs.shape[1])
    for done, kept, ids in _candidate_cuts(probs, info, rows):
        if ids is None:  # beyond the candidates: sorted
            out[done] = _filter_sorted(probs[done], info.top_ks[done], info.top_ps[done])
        else:
            out[done] = torch.zeros_like(probs[done]).scatter_(1, ids, kept)
    return out


def _tempered_probs(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """softmax(logits / T) with min-p applied (entries below min_p * max set to 0)."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_min_p:
        threshold = probs.amax(dim=-1, keepdim=True) * info.min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _split_filtered(
    info: SamplingBatchInfo, rows: Sequence[int], vocab: int
) -> tuple[Tensor, Tensor]:
    """``rows`` split into those with a top-k or top-p filter and those without (int64)."""
    top_ks, top_ps = info.top_ks.tolist(), info.top_ps.tolist()
    filtered = [i for i in rows if top_ks[i] < vocab or top_ps[i] < 1.0]
    plain = [i for i in rows if not (top_ks[i] < vocab or top_ps[i] < 1.0)]
    return torch.tensor(filtered, dtype=torch.int64), torch.tensor(plain, dtype=torch.int64)


def _filter_sorted(probs: Tensor, top_ks: Tensor, top_ps: Tensor) -> Tensor:
    """``probs`` ``[n, V]`` with the entries outside each row's top-k / top-p set to 0, by one
    full sort (branch-free: what GPU rows use). A top_p of 1.0 keeps everything."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    drop = ranks.unsqueeze(0) >= top_ks.unsqueeze(1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (mass_before > top_ps.unsqueeze(1)) & (top_ps < 1.0).unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _candidate_cuts(probs: Tensor, info: SamplingBatchInfo, rows: Tensor):
    """CPU: yields ``(rows_done, kept, ids)`` per tier of :data:`CPU_CANDIDATES`: for the rows
    whose top-k / top-p cut-off lies among their ``count`` most likely tokens, those tokens'
    ids ``[n, count]`` (most likely first) and probabilities with the dropped ones zeroed;
    last, ``(rows_left, None, None)`` for the rows beyond every tier (if any)."""
    vocab = probs.shape[1]
    for candidates in CPU_CANDIDATES:
        if not rows.numel():
            return
        count = min(vocab, candidates)
        values, ids = probs[rows].topk(count, dim=-1)  # sorted, most likely first
        keep_k = info.top_ks[rows].unsqueeze(1)
        top_p = info.top_ps[rows].unsqueeze(1)
        keep_p = torch.where(top_p < 1.0, top_p, torch.inf)  # 1.0: off (sums round above 1)
        mass_before = values.cumsum(dim=-1) - values
        keep = (torch.arange(count) < keep_k) & (mass_before <= keep_p)
        # the cut-off lies among the candidates: the next token (rank `count`) is dropped
        inside = (keep_k.squeeze(1) <= count) | (values.sum(dim=-1) > keep_p.squeeze(1))
        if inside.any():
            yield rows[inside], values[inside].masked_fill(~keep[inside], 0.0), ids[inside]
        rows = rows[~inside]
    if rows.numel():
        yield rows, None, None


def exponential_race(probs: Tensor, info: SamplingBatchInfo) -> Tensor:
    """One draw per row from (unnormalized) ``probs``: ``argmax(probs / E)``. Seeded rows draw
    their noise from their own generator; the other sampled rows share one draw from the
    default generator; greedy rows draw nothing (their result is discarded)."""
    noise = torch.ones_like(probs)
    unseeded = [i for i in info.sampled_rows if info.generators[i] is None]
    if len(unseeded) == info.batch_size:
        noise.exponential_(generator=info.default_generator)
    elif unseeded:
        rows = torch.tensor(unseeded, dtype=torch.int64, device=probs.device)
        draw = torch.empty((len(unseeded), probs.shape[-1]), dtype=probs.dtype, device=probs.device)
        noise[rows] = draw.exponential_(generator=info.default_generator)
    for i in info.sampled_rows:
        generator = info.generators[i]
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # Exp(1) draws can be exactly 0 in float32; 0 / 0 would be NaN.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def sample_on_cpu(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
    """The CPU path of step 3 (see the module docstring): one token per row of ``logits``
    ``[B, V]`` float32, drawn from softmax(logits / T) restricted by top-k / top-p / min-p,
    with one uniform per sampled row. Greedy rows get an arbitrary token (the caller discards
    it)."""
    probs = _tempered_probs(logits, info)
    uniforms = _uniforms(info)
    out = torch.zeros(logits.shape[0], dtype=torch.int64)
    filtered, plain = _split_filtered(info, info.sampled_rows, logits.shape[1])
    if plain.numel():
        out[plain] = _inverse_cdf(probs[plain], uniforms[plain])
    for done, kept, ids in _candidate_cuts(probs, info, filtered):
        if ids is None:  # flat distributions: the exact sort over the whole vocabulary
            full = _filter_sorted(probs[done], info.top_ks[done], info.top_ps[done])
            out[done] = _inverse_cdf(full, uniforms[done])
        else:
            picked = _inverse_cdf(kept, uniforms[done])
            out[done] = ids.gather(1, picked.unsqueeze(1)).squeeze(1)
    return out


def _uniforms(info: SamplingBatchInfo) -> Tensor:
    """One U[0, 1) draw per row: seeded rows from their own generator, the other sampled rows
    from one draw of the default generator; greedy rows 0."""
    uniforms = torch.zeros(info.batch_size, dtype=torch.float64)
    unseeded = [i for i in info.sampled_rows if info.generators[i] is None]
    if unseeded:
        draw = torch.rand(len(unseeded), dtype=torch.float64, generator=info.default_generator)
        uniforms[torch.tensor(unseeded)] = draw
    for i in info.sampled_rows:
        generator = info.generators[i]
        if generator is not None:
            uniforms[i] = torch.rand(1, dtype=torch.float64, generator=generator)[0]
    return uniforms


def _inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Per row of ``weights`` ``[n, K]`` (>= 0, unnormalised, each row with some mass), the
    first index whose cumulative weight exceeds ``uniform * total``, with float64 sums. Wide
    rows go in two levels: a block of :data:`CDF_BLOCK` entries by the blocks' sums, then the
    entry inside it by the remainder (at batch 64 x 49,152, 22 -> 7 ms on the CPU: one
    float64 pass over the row instead of a float64 copy and a full cumsum)."""
    n, k = weights.shape
    if k <= 2 * CDF_BLOCK:
        return _pick(weights, uniforms * weights.sum(dim=-1, dtype=torch.float64))
    num_blocks = -(-k // CDF_BLOCK)
    padded = torch.nn.functional.pad(weights, (0, num_blocks * CDF_BLOCK - k))
    blocks = padded.view(n, num_blocks, CDF_BLOCK)
    block_sums = blocks.sum(dim=-1, dtype=torch.float64)
    cumulative = block_sums.cumsum(dim=-1)
    target = uniforms * cumulative[:, -1]
    block = _pick(block_sums, target)
    before = cumulative.gather(1, block.unsqueeze(1)).squeeze(1)
    before = before - block_sums.gather(1, block.unsqueeze(1)).squeeze(1)
    rows = torch.arange(n)
    inner = _pick(blocks[rows, block], (target - before).clamp_min(0.0))
    return block * CDF_BLOCK + inner


def _pick(weights: Tensor, target: Tensor) -> Tensor:
    """Per row, the first index whose float64 cumulative weight exceeds ``target``; an index
    of zero weight (rounding at the very end) is replaced by the row's largest weight."""
    cumulative = weights.to(torch.float64).cumsum(dim=-1)
    index = torch.searchsorted(cumulative, target.unsqueeze(1), right=True).squeeze(1)
    index = index.clamp_max(weights.shape[1] - 1)
    chosen = weights.gather(1, index.unsqueeze(1)).squeeze(1)
    return torch.where(chosen > 0, index, weights.argmax(dim=-1))
