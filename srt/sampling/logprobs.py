"""Log-probabilities returned to users.

They are ``log_softmax`` of the model's raw logits: before temperature, penalties, bias and
filtering, so they describe the model, not the sampler. All functions are pure.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

# Rows of logits turned into float32 log-probabilities at a time: a prompt chunk of 8,192 rows
# over a 128k vocabulary would otherwise take two [rows, vocab] float32 copies (~8 GB).
ROW_BLOCK = 512


def _log_softmax_blocks(logits: Tensor) -> Iterator[tuple[int, Tensor]]:
    """``(first row, float32 log_softmax of the next ROW_BLOCK rows)`` over ``logits [N, V]``."""
    for lo in range(0, logits.shape[0], ROW_BLOCK):
        yield lo, torch.log_softmax(logits[lo : lo + ROW_BLOCK].float(), dim=-1)


def token_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """``[N]`` float32: logprob of ``token_ids[i]`` under ``logits[i]`` (``[N, V]``)."""
    assert logits.dim() == 2 and token_ids.shape == logits.shape[:1], (
        logits.shape,
        token_ids.shape,
    )
    index = token_ids.to(device=logits.device, dtype=torch.int64).unsqueeze(1)
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for lo, lp in _log_softmax_blocks(logits):
        out[lo : lo + lp.shape[0]] = lp.gather(1, index[lo : lo + lp.shape[0]]).squeeze(1)
    return out


def top_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely tokens per row: ``(values [N, k] float32, ids [N, k] int64)``,
    most likely first. ``k`` is capped at the vocabulary size; ``k == 0`` gives empty tensors."""
    assert k >= 0, k
    k = min(k, logits.shape[-1])
    n = logits.shape[0]
    values = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    for lo, lp in _log_softmax_blocks(logits):
        values[lo : lo + lp.shape[0]], ids[lo : lo + lp.shape[0]] = lp.topk(k, dim=-1)
    return values, ids


def top_logprob_rows(logits: Tensor, k: int) -> list[list[list[float]]]:
    """:func:`top_logprobs` as lists: per row, ``[logprob, token_id]`` pairs, best first."""
    values, ids = top_logprobs(logits, k)
    return [
        [[v, t] for v, t in zip(vals, tids, strict=True)]
        for vals, tids in zip(values.tolist(), ids.tolist(), strict=True)
    ]


def token_ids_logprob_rows(logits: Tensor, token_ids: Sequence[int]) -> list[list[list[float]]]:
    """SGLang's ``token_ids_logprob``: per row of ``logits`` (``[N, V]``), the
    ``[logprob, token_id]`` pair of each of ``token_ids``, in the order given."""
    ids = list(token_ids)
    index = torch.tensor(ids, dtype=torch.int64, device=logits.device)
    values = torch.empty(logits.shape[0], len(ids), dtype=torch.float32, device=logits.device)
    for lo, lp in _log_softmax_blocks(logits):
        values[lo : lo + lp.shape[0]] = lp.index_select(1, index)
    return [[[v, t] for v, t in zip(row, ids, strict=True)] for row in values.tolist()]


def input_token_logprobs(
    prompt_logits: Tensor, prompt_ids: Sequence[int] | Tensor, start: int = 0, logits_start: int = 0
) -> list[float | None]:
    """Logprobs of prompt tokens ``prompt_ids[start:]``, each given the tokens before it.

    ``prompt_logits[j]`` are the logits computed at prompt position ``logits_start + j`` (they
    predict the token at position ``logits_start + j + 1``). Token 0 has no logprob: when
    ``start == 0`` the first entry is ``None`` (as SGLang returns it). The result has
    ``len(prompt_ids) - start`` entries.
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.int64)
    n = ids.shape[0]
    assert 0 <= start <= n, (start, n)
    first = max(start, 1)  # first position that has a logprob
    head: list[float | None] = [None] if start == 0 and n > 0 else []
    if first >= n:
        return head
    rows = torch.arange(first - 1, n - 1) - logits_start
    assert rows[0] >= 0 and rows[-1] < prompt_logits.shape[0], (
        f"logits cover positions [{logits_start}, {logits_start + prompt_logits.shape[0]}), "
        f"need [{first - 1}, {n - 1})"
    )
    rows = rows.to(prompt_logits.device)
    values = token_logprobs(prompt_logits[rows], ids[first:].to(prompt_logits.device))
    return head + values.tolist()
