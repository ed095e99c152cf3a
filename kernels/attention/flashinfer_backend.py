"""Attention on FlashInfer's paged kernels (GPU only; flashinfer-python 0.6.x).

FlashInfer reads K/V as pages ``[num_pages, page_size, kv_heads, head_dim]`` ("NHD"). Our
per-layer buffers are ``[1 + max_total_tokens, kv_heads, head_dim]`` with slot 0 as padding and
page ``p`` covering slots ``1 + p * page_size ... (p + 1) * page_size``, so the paged view is
``buf[1 : 1 + num_pages * page_size]`` and a slot's page is ``(slot - 1) // page_size``. Slot 0
(the padding slot, used by padded rows of a CUDA-graph batch) is mapped to page 0; those rows'
outputs are discarded, so what they read does not matter.

Requirement: position ``j`` of every request lives at offset ``j % page_size`` of its page (the
slot allocator guarantees this by continuing a request's partly filled last page). Only the
first slot of each page is looked up; the kernels address the rest by offset.

``plan`` builds the page table once per batch and calls the wrappers' ``plan``; ``forward`` runs
one wrapper per layer: decode for decode batches (tensor cores when the GQA group is >= 4), and
paged prefill with a causal mask for extend batches (the new tokens' K/V are written to the pool
first, so one paged pass covers prefix and new tokens; FlashInfer aligns the causal mask to the
end of the sequence, which is exactly ``kv_pos <= prefix_len + row``).

FP8 KV: the wrappers are planned with the pool's storage dtype as ``kv_data_type`` and its
compute dtype as ``q_data_type``; the kernels load fp8 pages and convert them on the fly. A
layer's static ``k_scale``/``v_scale`` (Python floats) go to ``run``: FlashInfer folds
``k_scale`` into the softmax scale and multiplies the output by ``v_scale``; with scales of
1.0 (the default) nothing extra runs. Scales never change, so captured graphs stay valid.

Sliding windows and soft-caps (``base.attention_window``/``logit_cap``) are plan arguments
(``window_left = W - 1``, ``logits_soft_cap``), as is the softmax scale: the backend is built
with the model's ``variants`` (``base.attention_variants``) and plans one wrapper per variant
and batch (Gemma: a sliding and a global one), each layer running its variant's wrapper. The
wrappers share the workspace; they run one after another on the stream.

Mixed steps: an extend batch's trailing one-token rows (the running requests' decode rows of a
mixed chunked-prefill step) are planned on the decode wrapper and the rows before them on the
prefill wrapper, each writing its rows of one output; the prefill kernel would give every decode
row a tile of query rows (on an H100, 32 decode rows of 2,048 tokens beside an 8,000-token
chunk of the 8B shape added 9 ms of attention a step that way).

CUDA graphs: call ``init_cuda_graph_state`` once, then ``plan_for_capture(fb)`` on the static
batch before capture and ``plan_for_replay(fb)`` before every replay; each batch size gets its
own decode wrapper over slices of fixed index buffers.

Planning ahead of the device: a wrapper's ``plan`` writes its work split into a page-locked
host buffer that belongs to the wrapper and queues an asynchronous copy of it to the device.
The scheduler plans the next batch while the device still runs earlier ones (overlapped decode
steps, a long prompt's chunks queued one after another), so a second plan of the same wrapper
could overwrite that host buffer before the first copy has run: the earlier batch then reads
the later batch's split (kernels indexing past their page tables). Each plan therefore records
an event after its copy, and the next plan of that wrapper waits for it (the device has by then
at most started the batch planned before: the CPU stays up to one batch ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.attention.base import (
    AttentionBackend,
    AttentionLayer,
    AttentionVariant,
    attention_variant,
)

WORKSPACE_BYTES = 256 * 1024 * 1024


def import_flashinfer():
    """Imports flashinfer or raises a ValueError that says how to get it."""
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ValueError(
            "the flashinfer attention backend needs flashinfer-python on a CUDA machine "
            "(pip install flashinfer-python); use --attention-backend triton or torch instead"
        ) from exc
    return flashinfer


@dataclass
class _PageTable:
    kv_indptr: torch.Tensor  # [B + 1] int32, cpu: prefix sums of pages per request
    kv_indices: torch.Tensor  # [total_pages] int32, device: page ids in request order
    last_page_len: torch.Tensor  # [B] int32, cpu: tokens in each request's last page


@dataclass
class _GraphBuffers:
    kv_indptr: torch.Tensor  # [max_bs + 1] int32, device
    kv_indices: torch.Tensor  # [max_num_pages] int32, device
    last_page_len: torch.Tensor  # [max_bs] int32, device


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(
        self,
        device: torch.device,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = 1,
        scaling: float | None = None,
        dtype: torch.dtype | None = None,
        variants: list[AttentionVariant] | None = None,
        use_tensor_cores: bool | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
    ):
        from radixlm.kernels.attention.registry import FLASHINFER_DTYPES, FLASHINFER_HEAD_DIMS

        if dtype is not None and dtype not in FLASHINFER_DTYPES:
            raise ValueError(
                f"the flashinfer attention backend has no {dtype} kernels (float16 "
                "and bfloat16 only); use --attention-backend triton or another --dtype"
            )

        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"the flashinfer attention backend supports head_dim "
                f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}, the model has "
                f"{head_dim}; use --attention-backend triton"
            )
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, got {device}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._fi = import_flashinfer()
        self.device = device
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.scaling = head_dim**-0.5 if scaling is None else scaling
        # (window, soft-cap, scale) of the model's layers: one wrapper each per batch
        self.variants = list(variants or [(0, 0.0, self.scaling)])
        group = num_heads // num_kv_heads
        self._tensor_cores = group >= 4 if use_tensor_cores is None else use_tensor_cores
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._decode_wrappers = {
            v: self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self._tensor_cores
            )
            for v in self.variants
        }
        self._prefill_wrappers = {
            v: self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            for v in self.variants
        }
        self._graph: _GraphBuffers | None = None
        self._graph_wrappers: dict[tuple[int, AttentionVariant], object] = {}
        # planned for the current batch: per variant its wrappers, one, or the extend rows'
        # and the decode tail's (split after ``self._cut`` query rows)
        self._active: dict[AttentionVariant, list] = {}
        self._cut: int | None = None
        # per wrapper: an event after its last plan's host-to-device copy (see the module doc)
        self._planned: dict[int, torch.cuda.Event] = {}
        self._is_decode = False

    def init_cuda_graph_state(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Preallocates the fixed index buffers that graph-captured decode steps read.
        ``max_num_tokens`` bounds the cached tokens of one captured batch (e.g. the pool size)."""
        max_pages = -(-max_num_tokens // self.page_size) + max_batch_size
        dev = self.device
        self._graph = _GraphBuffers(
            kv_indptr=torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev),
            kv_indices=torch.zeros(max_pages, dtype=torch.int32, device=dev),
            last_page_len=torch.ones(max_batch_size, dtype=torch.int32, device=dev),
        )
        self._graph_wrappers.clear()

    def plan(self, fb) -> None:
        self._plan(fb, for_cuda_graph=False)

    def plan_for_capture(self, fb) -> None:
        self._plan(fb, for_cuda_graph=True)

    def plan_for_replay(self, fb) -> None:
        # the graph wrapper of this batch size copies the new page table into the fixed
        # buffers the captured kernels read
        self._plan(fb, for_cuda_graph=True)

    def _plan(self, fb, for_cuda_graph: bool) -> None:
        if for_cuda_graph and not fb.mode.is_decode:
            raise ValueError("only decode batches can be captured in a CUDA graph")
        table = self._page_table(fb)
        pool = fb.kv_pool
        dims = (self.num_heads, self.num_kv_heads, self.head_dim, self.page_size)
        self._is_decode = fb.mode.is_decode
        # an extend batch's trailing one-token rows (a mixed step's decode rows) go to the
        # decode kernel, the rows before them to the prefill kernel (which would give each of
        # them a tile of query rows)
        n = fb.batch_size
        if not fb.mode.is_decode:
            lens = fb.extend_lens_cpu
            while n > 0 and lens[n - 1] == 1:
                n -= 1
        self._cut = sum(fb.extend_lens_cpu[:n]) if 0 < n < fb.batch_size else None
        head, tail = (table, None) if n == fb.batch_size else _split(table, n)
        self._active = {}
        for variant in self.variants:
            window, cap, scale = variant
            common = dict(q_data_type=pool.dtype, kv_data_type=pool.storage_dtype, sm_scale=scale)
            if window:
                common["window_left"] = window - 1  # FlashInfer counts the keys left of the query
            if cap:
                common["logits_soft_cap"] = cap
            parts = []
            if n and fb.mode.is_decode:
                wrapper = (
                    self._graph_wrapper(fb.batch_size, variant)
                    if for_cuda_graph
                    else self._decode_wrappers[variant]
                )
                parts.append(self._plan_on(wrapper, head, *dims, **common))
            elif n:
                qo_indptr = _indptr(fb.extend_lens_cpu[:n])
                wrapper = self._prefill_wrappers[variant]
                parts.append(self._plan_on(wrapper, head, *dims, qo=qo_indptr, **common))
            if tail is not None:
                parts.append(self._plan_on(self._decode_wrappers[variant], tail, *dims, **common))
            self._active[variant] = parts

    def _plan_on(self, wrapper, table: _PageTable, *dims, qo: torch.Tensor | None = None, **kw):
        """Plans ``wrapper`` (prefill when ``qo`` gives the query rows' indptr, else decode)
        over ``table``, once the device has copied its previous plan out of the host buffer
        this one overwrites; records the event the next plan of it waits for."""
        event = self._planned.get(id(wrapper))
        if event is not None:
            event.synchronize()
        pages = (table.kv_indptr, table.kv_indices, table.last_page_len)
        if qo is None:
            wrapper.plan(*pages, *dims, **kw)
        else:
            wrapper.plan(qo, *pages, *dims, causal=True, **kw)
        if not torch.cuda.is_current_stream_capturing():  # plans run outside graphs anyway
            if event is None:
                event = self._planned[id(wrapper)] = torch.cuda.Event()
            event.record()
        return wrapper

    def forward(self, q, k, v, layer: AttentionLayer, fb) -> torch.Tensor:
        self._check_layer(layer)
        self.store_kv(k, v, layer, fb)
        k_buf, v_buf = fb.kv_pool.get_kv(layer.layer_id)
        assert self._active, "plan(fb) must run before forward"
        parts = self._active[attention_variant(layer)]
        q3 = q.view(-1, layer.num_heads, layer.head_dim)
        if q3.dtype != fb.kv_pool.dtype:
            q3 = q3.to(fb.kv_pool.dtype)
        paged = (self._paged(k_buf), self._paged(v_buf))
        k_scale, v_scale = fb.kv_pool.get_scales(layer.layer_id)
        # Python floats: folded into the softmax scale / output, no host read
        scales = {} if k_scale == 1.0 and v_scale == 1.0 else dict(k_scale=k_scale, v_scale=v_scale)
        if len(parts) == 1:
            out = parts[0].run(q3, paged, **scales)
        else:  # extend rows, then the decode tail, each into its rows of one output
            out = torch.empty_like(q3)
            cut = self._cut
            parts[0].run(q3[:cut], paged, out=out[:cut], **scales)
            parts[1].run(q3[cut:], paged, out=out[cut:], **scales)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim).to(q.dtype)

    def _paged(self, buf: torch.Tensor) -> torch.Tensor:
        """``[1 + slots, kv_heads, d]`` -> ``[num_pages, page_size, kv_heads, d]`` (a view)."""
        num_pages = (buf.shape[0] - 1) // self.page_size
        usable = buf[1 : 1 + num_pages * self.page_size]
        return usable.view(num_pages, self.page_size, buf.shape[1], buf.shape[2])

    def _page_table(self, fb) -> _PageTable:
        ps = self.page_size
        if min(fb.seq_lens_cpu, default=1) < 1:
            raise ValueError("every request of a batch needs at least one token")
        pages = [-(-n // ps) for n in fb.seq_lens_cpu]
        last = [n - (p - 1) * ps for n, p in zip(fb.seq_lens_cpu, pages, strict=True)]
        kv_indptr = _indptr(pages)
        total = int(kv_indptr[-1])
        dev = fb.req_slots.device
        pages_dev = torch.tensor(pages, dtype=torch.int64).to(dev, non_blocking=True)
        req_of = torch.repeat_interleave(
            torch.arange(len(pages), device=dev), pages_dev, output_size=total
        )
        first_page = torch.cumsum(pages_dev, 0) - pages_dev  # [B] first page row per request
        page_in_req = torch.arange(total, device=dev) - first_page[req_of]
        table = fb.req_to_token_pool.req_to_token
        slots = table[fb.req_slots[req_of], page_in_req * ps]
        kv_indices = (torch.clamp(slots - 1, min=0) // ps).to(torch.int32)
        return _PageTable(kv_indptr, kv_indices, torch.tensor(last, dtype=torch.int32))

    def _graph_wrapper(self, batch_size: int, variant: AttentionVariant):
        if self._graph is None:
            raise ValueError("call init_cuda_graph_state before planning for a CUDA graph")
        wrapper = self._graph_wrappers.get((batch_size, variant))
        if wrapper is None:
            g = self._graph
            if batch_size + 1 > g.kv_indptr.shape[0]:
                raise ValueError(
                    f"batch size {batch_size} exceeds the CUDA-graph maximum "
                    f"{g.kv_indptr.shape[0] - 1}"
                )
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=g.kv_indptr[: batch_size + 1],
                paged_kv_indices_buffer=g.kv_indices,
                paged_kv_last_page_len_buffer=g.last_page_len[:batch_size],
            )
            self._graph_wrappers[batch_size, variant] = wrapper
        return wrapper

    def _check_layer(self, layer: AttentionLayer) -> None:
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        ):
            raise ValueError(
                f"layer {layer.layer_id} has heads/kv_heads/head_dim {layer.num_heads}/"
                f"{layer.num_kv_heads}/{layer.head_dim}, the backend was built for "
                f"{self.num_heads}/{self.num_kv_heads}/{self.head_dim}"
            )
        if attention_variant(layer) not in self._decode_wrappers:
            window, cap, scale = attention_variant(layer)
            raise ValueError(
                f"layer {layer.layer_id} has sliding window {window}, soft-cap {cap} and "
                f"attention scaling {scale}; the backend was built for (window, soft-cap, "
                f"scaling) {self.variants} (pass the model's attention_variants)"
            )


def _split(table: _PageTable, n: int) -> tuple[_PageTable, _PageTable]:
    """The page tables of requests ``[:n]`` and ``[n:]``."""
    cut = int(table.kv_indptr[n])
    head = _PageTable(table.kv_indptr[: n + 1], table.kv_indices[:cut], table.last_page_len[:n])
    tail = _PageTable(table.kv_indptr[n:] - cut, table.kv_indices[cut:], table.last_page_len[n:])
    return head, tail


def _indptr(lengths: list[int]) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as an int32 CPU tensor."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out
