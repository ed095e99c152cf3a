"""CPU attention: decode through the C++ kernel of ``kernels/cpu_decode.py``, extend as torch.

Decode is one call per layer for the whole batch: it writes the new tokens' K/V into the pool and
reads every request's cached K/V in place through its ``req_to_token`` row (no gather copy, no
per-request loop). ``plan`` only wraps the batch's index tensors (no per-step tensor work).

Layers or pools the kernel does not take (an fp8 pool, a soft-cap, attention sinks, dtypes other
than float32/bfloat16) and every extend batch run the torch backend's paths, which this class
inherits; the torch backend is the reference the kernel is tested against.
"""

from __future__ import annotations

from radixlm.kernels import cpu_decode
from radixlm.kernels.attention.base import (
    AttentionLayer,
    attention_sinks,
    attention_window,
    logit_cap,
)
from radixlm.kernels.attention.torch_backend import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self):
        super().__init__()
        self._batch: cpu_decode.DecodeBatch | None = None  # decode: the kernel's index tensors
        self._torch_planned = False  # the inherited plan ran for this batch

    def plan(self, fb) -> None:
        self._batch, self._torch_planned = None, False
        if fb.mode.is_decode and fb.seq_lens.device.type == "cpu":
            self._batch = cpu_decode.DecodeBatch(
                fb.req_to_token_pool.req_to_token, fb.req_slots, fb.seq_lens, fb.out_kv_slots
            )
            return
        super().plan(fb)
        self._torch_planned = True

    def decode_batch(self, fb, dtype) -> cpu_decode.DecodeBatch | None:
        """The planned decode batch's indices when the kernel reads this pool for queries of
        ``dtype`` (for callers that run the kernel themselves: ``kernels/cpu_step.py``)."""
        pool = fb.kv_pool
        if self._batch is None or pool.is_quantized or pool.dtype != dtype:
            return None
        return self._batch

    def serves(self, q, layer: AttentionLayer, fb) -> bool:
        """Whether the kernel takes this decode layer (else the torch path runs)."""
        pool = fb.kv_pool
        return (
            self._batch is not None
            and not pool.is_quantized
            and pool.dtype == q.dtype
            and q.dim() == 2
            and cpu_decode.serves(q)
            and not logit_cap(layer)
            and attention_sinks(layer) is None
        )

    def forward(self, q, k, v, layer: AttentionLayer, fb):
        if not fb.mode.is_decode or not self.serves(q, layer, fb):
            if not self._torch_planned:
                super().plan(fb)
                self._torch_planned = True
            return super().forward(q, k, v, layer, fb)
        if k is not None and any(
            x.dtype != q.dtype or x.dim() != 2 or x.stride(-1) != 1 for x in (k, v)
        ):  # the kernel copies rows as they are: anything else is written by set_kv
            self.store_kv(k, v, layer, fb)
            k = v = None
        if k is not None and fb.kv_pool.direct_write_target(layer.layer_id) is None:
            self.store_kv(k, v, layer, fb)  # the pool is recording |K|/|V| (calibration)
            k = v = None
        elif k is None and v is not None:
            raise ValueError("k and v are both given or both already written")
        k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        return cpu_decode.decode_attention(
            self._batch,
            q,
            k,
            v,
            k_buf,
            v_buf,
            layer.num_heads,
            layer.scaling,
            attention_window(layer),
        )
