"""Mixture-of-Experts expert compute: tokens grouped by expert, one matmul pair per expert.

The contract every expert kernel honours (this torch path is its reference):

``grouped_experts(x, gate_up, down, topk_ids, topk_weights)``
  ``x`` ``[T, hidden]``; ``gate_up`` ``[E, 2 * inter, hidden]`` (gate rows, then up rows);
  ``down`` ``[E, hidden, inter]``; ``topk_ids`` ``[T, k]`` integer expert indices into this
  stack, or ``-1`` for a choice whose expert lives elsewhere (expert parallelism);
  ``topk_weights`` ``[T, k]`` float32. Returns ``[T, hidden]`` in ``x``'s dtype:
  ``sum_j topk_weights[t, j] * down[e](silu(gate[e] x_t) * up[e] x_t)`` over the choices
  ``e = topk_ids[t, j] >= 0`` (rows with no local choice are zeros).

Only the experts that received tokens are computed, each on its own tokens (no dense
all-experts matmul); the weighted sum is accumulated in float32.

Options of the torch path (gpt-oss; the fused kernels do not take them): ``gate_up_bias``
``[E, 2 * inter]`` and ``down_bias`` ``[E, hidden]`` are added to the projections (the routing
weight scales ``down(...) + down_bias``), and ``activation(gate, up)`` replaces
``silu(gate) * up``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: Activation = silu_mul,
) -> torch.Tensor:
    """See the module docstring. On a CPU the per-expert counts are read on the host (one
    sync); each expert's rows are one ``[n, hidden] x [hidden, 2 * inter]`` matmul and one
    ``[n, inter] x [inter, hidden]`` matmul."""
    num_tokens, k = topk_ids.shape
    num_experts = gate_up.shape[0]
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, num_experts, flat)  # elsewhere: sorted after every local expert
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    rows = x.index_select(0, order // k)  # each sorted choice's token row
    sorted_out = torch.zeros(flat.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        gu_bias = None if gate_up_bias is None else gate_up_bias[expert]
        gate, up = F.linear(rows[start : start + n], gate_up[expert], gu_bias).chunk(2, dim=-1)
        d_bias = None if down_bias is None else down_bias[expert]
        sorted_out[start : start + n] = F.linear(activation(gate, up), down[expert], d_bias)
        start += n
    # back to choice order (a gather: CPU index_add_ is far slower), weighted, summed per token
    per_choice = sorted_out.index_select(0, torch.argsort(order))
    weighted = per_choice.view(num_tokens, k, x.shape[1]) * topk_weights.float().unsqueeze(-1)
    return weighted.sum(1).to(x.dtype)


def dense_experts_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """Every expert on every token, then the chosen ones picked per token: the slow, obviously
    correct form of the contract (tests only)."""
    x32 = x.float()
    gate, up = torch.einsum("th,eoh->teo", x32, gate_up.float()).chunk(2, dim=-1)
    per_expert = torch.einsum("tei,ehi->teh", F.silu(gate) * up, down.float())  # [T, E, H]
    out = torch.zeros_like(x32)
    for j in range(topk_ids.shape[1]):
        ids = topk_ids[:, j].long()
        local = ids >= 0
        picked = per_expert[torch.arange(x.shape[0]), ids.clamp(min=0)]
        out += torch.where(local[:, None], picked * topk_weights[:, j, None].float(), 0.0)
    return out.to(x.dtype)
