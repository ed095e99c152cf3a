"""Builds ForwardBatches over real KV pools for model tests (torch attention backend, CPU)."""

from __future__ import annotations

import torch

from radixlm.kernels.attention.torch_backend import TorchAttentionBackend
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.memory_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from radixlm.srt.models.model_config import ModelConfig


class KVSession:
    """Pools for a few requests; tracks each request's cached length."""

    def __init__(
        self,
        config: ModelConfig,
        max_total_tokens: int = 512,
        num_req_slots: int = 4,
        max_context_len: int = 256,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        backend=None,
    ):
        self.device = torch.device(device)
        self.req_pool = ReqToTokenPool(num_req_slots, max_context_len, self.device)
        self.kv_pool = KVPool(
            max_total_tokens,
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            self.device,
        )
        self.allocator = TokenSlotAllocator(max_total_tokens, 1, self.device)
        self.backend = backend or TorchAttentionBackend()
        self.cached_lens: dict[int, int] = {}

    def new_request(self) -> int:
        req_slot = self.req_pool.alloc()
        assert req_slot is not None
        self.cached_lens[req_slot] = 0
        return req_slot

    def batch(self, mode: ForwardMode, new_tokens: list[tuple[int, list[int]]]) -> ForwardBatch:
        """A batch holding ``new_tokens[i][1]`` for request slot ``new_tokens[i][0]``."""
        ids, positions, slots, prefix_lens, extend_lens = [], [], [], [], []
        for req_slot, tokens in new_tokens:
            prefix = self.cached_lens[req_slot]
            kv_slots = self.allocator.alloc(len(tokens))
            assert kv_slots is not None
            self.req_pool.write(req_slot, prefix, kv_slots)
            ids += tokens
            positions += range(prefix, prefix + len(tokens))
            slots.append(kv_slots)
            prefix_lens.append(prefix)
            extend_lens.append(len(tokens))
            self.cached_lens[req_slot] = prefix + len(tokens)
        fb = ForwardBatch.from_host(
            mode,
            ids,
            positions,
            torch.cat(slots),
            [r for r, _ in new_tokens],
            prefix_lens,
            extend_lens,
            req_to_token_pool=self.req_pool,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )
        self.backend.plan(fb)
        return fb


@torch.inference_mode()
def run_logits(
    model, session: KVSession, mode: ForwardMode, new_tokens: list[tuple[int, list[int]]]
) -> torch.Tensor:
    """Logits ``[T, vocab]`` float32 for every new token of the batch."""
    fb = session.batch(mode, new_tokens)
    hidden = model(fb.input_ids, fb.positions, fb)
    return model.compute_logits(hidden)


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest absolute reference value."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())
