"""Triton and FlashInfer attention against the torch reference on fresh random paged batches.

Without CUDA the Triton kernels run on CPU tensors under the Triton interpreter (fp32, plus one
bf16 case through the interpreter's upcast path); with CUDA the same tests run compiled, and the
``gpu`` tests add bf16/fp16, FlashInfer and CUDA-graph capture.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from radixlm.kernels.attention.base import AttentionBackend, attention_variant  # noqa: E402
from radixlm.kernels.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixlm.kernels.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.srt.executor.memory_pool import (  # noqa: E402
    KVPool,
    ReqToTokenPool,
    TokenSlotAllocator,
)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@dataclass
class Layer:
    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None
    logit_cap: float = 0.0
    sinks: torch.Tensor | None = None  # [num_heads] sink logits (gpt-oss)


@dataclass
class Case:
    fb: ForwardBatch
    layer: Layer
    q: torch.Tensor  # [T, H * d]
    k: torch.Tensor  # [T, kv_heads * d]
    v: torch.Tensor


def _alloc_slots(prefix_lens, extend_lens, page_size, pool_tokens, gen):
    """Prefix slots for every request first, then their new tokens' slots, interleaved so that
    requests' pages are scattered; a few pages are taken and freed first to shuffle the pool."""
    alloc = TokenSlotAllocator(pool_tokens, page_size, torch.device("cpu"))
    junk = [alloc.alloc(int(n)) for n in torch.randint(1, 3 * page_size, (3,), generator=gen)]
    prefix = [alloc.alloc(p) for p in prefix_lens]
    alloc.free(junk[1])
    new = []
    for pre, p, e in zip(prefix, prefix_lens, extend_lens, strict=True):
        last = int(pre[-1]) if p else 0
        new.append(alloc.alloc_for(e, last_slot=last, used_len=p))
    return prefix, new


def decode_lens(seq_lens: list[int]) -> tuple[list[int], list[int]]:
    """(prefix lengths, extend lengths) of decode rows reaching ``seq_lens`` tokens."""
    return [n - 1 for n in seq_lens], [1] * len(seq_lens)


LLAMA_8B_HEADS = dict(heads=32, kv_heads=8, head_dim=128)


def make_case(
    prefix_lens,
    extend_lens,
    *,
    heads=4,
    kv_heads=4,
    head_dim=64,
    page_size=1,
    dtype=torch.float32,
    decode=False,
    seed=0,
    device=DEVICE,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pool_tokens = 4 * (sum(seq_lens) + 8 * page_size * (len(seq_lens) + 3))
    prefix, new = _alloc_slots(prefix_lens, extend_lens, page_size, pool_tokens, gen)
    kv_pool = KVPool(pool_tokens, 1, kv_heads, head_dim, dtype, device)
    for buf in (*kv_pool.k_buffers, *kv_pool.v_buffers):
        buf.copy_(torch.randn(buf.shape, generator=gen))  # slot 0 too: it must never be read
    r2t = ReqToTokenPool(len(seq_lens) + 4, max(seq_lens) + 5, device)
    req_slots = torch.randperm(r2t.num_req_slots, generator=gen)[: len(seq_lens)].tolist()
    for slot, pre, nw in zip(req_slots, prefix, new, strict=True):
        r2t.write(slot, 0, torch.cat([pre, nw]).to(device))
    num_tokens = sum(extend_lens)
    new_ranges = zip(prefix_lens, seq_lens, strict=True)
    fb = ForwardBatch.from_host(
        ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        torch.zeros(num_tokens, dtype=torch.int64, device=device),
        [i for p, n in new_ranges for i in range(p, n)],
        torch.cat(new).to(device),
        req_slots,
        list(prefix_lens),
        list(extend_lens),
        req_to_token_pool=r2t,
        kv_pool=kv_pool,
        attn_backend=None,
    )
    layer = Layer(0, heads, kv_heads, head_dim, head_dim**-0.5)

    def rand(n):
        return torch.randn((num_tokens, n * head_dim), generator=gen).to(device, dtype)

    return Case(fb, layer, rand(heads), rand(kv_heads), rand(kv_heads))


def run_backend(backend, case: Case) -> torch.Tensor:
    backend.plan(case.fb)
    return backend.forward(case.q, case.k, case.v, case.layer, case.fb)


def reference(case: Case) -> torch.Tensor:
    return run_backend(TorchAttentionBackend(), case).float()


def assert_close(out, ref, tol):
    assert out.shape == ref.shape and torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= tol, f"max abs error {err} > {tol}"


EXTEND_SHAPES = [
    # (prefix_lens, extend_lens): no prefix, a prefix, a single new token, a long one
    ([0, 0], [5, 37]),
    ([7, 0, 19, 33], [13, 9, 1, 40]),
    # a mixed chunked-prefill step: prefill pieces, then decode rows (decode kernel); the row
    # of one token amid the pieces stays in the extend kernel
    ([0, 12, 1, 70, 9, 0], [21, 1, 30, 1, 1, 1]),
    ([3, 50], [1, 1]),  # only single-token rows: the decode kernel alone
]


HEADS = [(4, 4), (8, 2)]  # one KV head per query head; grouped queries


def _grid(first: list, first_ids: list[str], inner: set[tuple[int, int, int]]):
    """``first`` x ``HEADS`` x page sizes 1 and 4, ids as stacked parametrizes write them. The
    interpreter spends seconds on each point, so the inner loop runs the points in ``inner``
    (indices into the three axes: every pair of values of any two axes appears once) and the
    full suite the whole grid."""
    for i, (value, value_id) in enumerate(zip(first, first_ids, strict=True)):
        for j, (heads, kv_heads) in enumerate(HEADS):
            for k, page_size in enumerate([1, 4]):
                marks = [] if (i, j, k) in inner else [pytest.mark.slow]
                yield pytest.param(
                    value,
                    heads,
                    kv_heads,
                    page_size,
                    marks=marks,
                    id=f"{value_id}-{heads}-{kv_heads}-{page_size}",
                )


# each shape with both head layouts and both page sizes, each head layout with each page size
EXTEND_INNER = {(i, j, (i + j) % 2) for i in range(len(EXTEND_SHAPES)) for j in range(2)}


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "page_size"),
    list(_grid(EXTEND_SHAPES, [f"lens{i}" for i in range(len(EXTEND_SHAPES))], EXTEND_INNER)),
)
def test_extend_matches_torch(lens, heads, kv_heads, page_size):
    case = make_case(*lens, heads=heads, kv_heads=kv_heads, page_size=page_size, seed=len(lens[0]))
    out = run_backend(TritonAttentionBackend(), case)
    assert_close(out, reference(case), 1e-4)


def test_mixed_step_plans_a_decode_tail():
    case = make_case([0, 12, 1, 70, 9], [21, 1, 30, 1, 1], heads=8, kv_heads=2, seed=3)
    backend = TritonAttentionBackend()
    backend.plan(case.fb)
    plan = backend._extend
    assert plan.num_extend_tokens == 52 and plan.req_slots.shape[0] == 3
    assert plan.decode_tail.seq_lens.tolist() == [71, 10]
    assert_close(
        backend.forward(case.q, case.k, case.v, case.layer, case.fb), reference(case), 1e-4
    )
    backend.plan(make_case([4], [6], heads=8, kv_heads=2, seed=1).fb)
    assert backend._extend.decode_tail is None


SPLITS = [None, 1, 3]
# each split count with both head layouts and both page sizes, each head layout with each page
DECODE_INNER = {(i, j, (i + j) % 2) for i in range(len(SPLITS)) for j in range(2)}


@pytest.mark.parametrize(
    ("num_splits", "heads", "kv_heads", "page_size"),
    list(_grid(SPLITS, [str(n) for n in SPLITS], DECODE_INNER)),
)
def test_decode_matches_torch(num_splits, heads, kv_heads, page_size):
    seq_lens = [1, 9, 70, 17]  # length 1 leaves most splits empty
    case = make_case(
        *decode_lens(seq_lens),
        heads=heads,
        kv_heads=kv_heads,
        page_size=page_size,
        decode=True,
        seed=heads + page_size,
    )
    out = run_backend(TritonAttentionBackend(num_kv_splits=num_splits), case)
    assert_close(out, reference(case), 1e-4)


@pytest.mark.parametrize("decode", [False, True])
def test_head_dim_128_and_writes_kv(decode):
    lens = ([10, 3], [1, 1]) if decode else ([10, 0], [6, 3])
    case = make_case(*lens, heads=8, kv_heads=2, head_dim=128, page_size=4, decode=decode, seed=5)
    out = run_backend(TritonAttentionBackend(), case)
    k_buf, v_buf = case.fb.kv_pool.get_kv(0)
    slots = case.fb.out_kv_slots
    assert torch.equal(k_buf[slots], case.k.view(-1, 2, 128))
    assert torch.equal(v_buf[slots], case.v.view(-1, 2, 128))
    assert_close(out, reference(case), 1e-4)


def test_bf16_through_upcast_path():
    """bf16 inputs; the interpreter upcasts before tl.dot. Reference: fp32 on the same values."""
    for decode, lens in ((False, ([6, 0], [9, 4])), (True, ([20, 2], [1, 1]))):
        case = make_case(
            *lens, heads=8, kv_heads=2, page_size=2, dtype=torch.bfloat16, decode=decode, seed=11
        )
        out = run_backend(TritonAttentionBackend(), case)
        case.fb.kv_pool.k_buffers[0] = case.fb.kv_pool.k_buffers[0].float()
        case.fb.kv_pool.v_buffers[0] = case.fb.kv_pool.v_buffers[0].float()
        case.fb.kv_pool.dtype = torch.float32
        ref_case = Case(case.fb, case.layer, case.q.float(), case.k.float(), case.v.float())
        assert out.dtype == torch.bfloat16
        assert_close(out, reference(ref_case), 2e-2)


def test_plan_is_per_batch():
    """A decode plan must not leak into the next extend batch and vice versa."""
    backend = TritonAttentionBackend()
    ext = make_case([3], [4], seed=1)
    dec = make_case([9], [1], decode=True, seed=2)
    assert_close(run_backend(backend, ext), reference(ext), 1e-4)
    assert_close(run_backend(backend, dec), reference(dec), 1e-4)
    assert_close(run_backend(backend, ext), reference(ext), 1e-4)


def naive_reference(case: Case) -> torch.Tensor:
    """Dense attention written out per request and head (no SDPA, no pool tricks): positions
    ``i - W < j <= i``, the tanh soft-cap and the sink logits as the layer says. Checks the
    torch backend too."""
    fb, layer = case.fb, case.layer
    AttentionBackend.store_kv(case.k, case.v, layer, fb)  # what every backend does first
    k_buf, v_buf = fb.kv_pool.get_kv(0)
    h, d, group = layer.num_heads, layer.head_dim, layer.num_heads // layer.num_kv_heads
    out, row = torch.empty(case.q.shape, dtype=torch.float32), 0
    for i, (p, e) in enumerate(zip(fb.prefix_lens_cpu, fb.extend_lens_cpu, strict=True)):
        slots = fb.req_to_token_pool.req_to_token[fb.req_slots_cpu[i], : p + e]
        k, v = k_buf[slots].float().cpu(), v_buf[slots].float().cpu()
        for t in range(e):
            pos = p + t
            q = case.q[row].float().cpu().view(h, d)
            for head in range(h):
                s = k[:, head // group] @ q[head] * layer.scaling
                if layer.logit_cap:
                    s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
                j = torch.arange(p + e)
                seen = j <= pos
                if layer.sliding_window:
                    seen &= j > pos - layer.sliding_window
                s = s.masked_fill(~seen, float("-inf"))
                if layer.sinks is not None:  # one more logit in the denominator, no value
                    s = torch.cat((s, layer.sinks[head].float().cpu().view(1)))
                w = s.softmax(0)[: p + e]
                out[row, head * d : (head + 1) * d] = w @ v[:, head // group]
            row += 1
    return out.to(DEVICE)


WINDOW_CASES = [
    # (window, soft-cap): a window of one key, one shorter than most sequences, one longer
    # than all, a cap alone, both
    (1, 0.0),
    (5, 0.0),
    (500, 0.0),
    (None, 1.5),
    (7, 2.0),
]


@pytest.mark.parametrize("window,cap", WINDOW_CASES)
@pytest.mark.parametrize("decode", [False, True])
def test_window_and_softcap_match_naive(window, cap, decode):
    """torch and triton backends against the written-out reference, extend (prefixes, a mixed
    step's decode tail) and decode (splits that start inside the window)."""
    lens = decode_lens([1, 9, 40, 17]) if decode else ([0, 12, 3, 30], [70, 9, 1, 1])
    case = make_case(*lens, heads=8, kv_heads=2, head_dim=32, page_size=2, decode=decode, seed=9)
    case.layer.sliding_window, case.layer.logit_cap = window, cap
    case.q.mul_(4.0)  # scores of a few units: the cap and the window change the result
    ref = naive_reference(case)
    assert_close(run_backend(TorchAttentionBackend(), case), ref, 1e-4)
    assert_close(run_backend(TritonAttentionBackend(num_kv_splits=3), case), ref, 1e-4)


SINK_CASES = [
    # (window, soft-cap, decode splits): sinks alone over one split and over several, with a
    # window, with a cap
    (None, 0.0, 1),
    (None, 0.0, 3),
    (5, 0.0, 3),
    (None, 1.5, 2),
]


@pytest.mark.parametrize("window,cap,splits", SINK_CASES)
@pytest.mark.parametrize("decode", [False, True])
def test_sinks_match_naive(window, cap, splits, decode):
    """Attention sinks (gpt-oss: one logit per head in each softmax's denominator) through the
    torch and triton backends against the written-out reference: extend (a mixed step's decode
    tail too) and decode (merged splits, and one split writing the output itself). Sinks of a
    few units against scores of a few units, so that leaving them out fails."""
    lens = decode_lens([1, 9, 40, 17]) if decode else ([0, 12, 3, 30], [70, 9, 1, 1])
    case = make_case(*lens, heads=8, kv_heads=2, head_dim=32, page_size=2, decode=decode, seed=5)
    case.layer.sliding_window, case.layer.logit_cap = window, cap
    case.layer.sinks = torch.linspace(-2.0, 4.0, 8, device=DEVICE)
    case.q.mul_(4.0)
    ref = naive_reference(case)
    assert_close(run_backend(TorchAttentionBackend(), case), ref, 1e-4)
    assert_close(run_backend(TritonAttentionBackend(num_kv_splits=splits), case), ref, 1e-4)
    plain = Layer(**{**case.layer.__dict__, "sinks": None})
    assert (
        run_backend(TorchAttentionBackend(), Case(case.fb, plain, case.q, case.k, case.v)) - ref
    ).abs().max() > 1e-2


# ---------------------------------------------------------------- GPU only ------------------


def _gpu_backends(case: Case, page_size: int):
    backends = {"triton": TritonAttentionBackend()}
    if _has_flashinfer():
        from radixlm.kernels.attention.flashinfer_backend import FlashInferAttentionBackend

        layer = case.layer
        backends["flashinfer"] = FlashInferAttentionBackend(
            DEVICE,
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            page_size=page_size,
            variants=[attention_variant(layer)],
        )
    return backends


def _has_flashinfer() -> bool:
    from radixlm.kernels.attention.registry import flashinfer_available

    return flashinfer_available()


# Every (dtype, head_dim) pair is one more FlashInfer JIT build (about a minute each on first
# use), so fp16 is checked on the Llama-3-8B head layout only.
GPU_SHAPES = [
    (torch.bfloat16, 8, 8, 64),
    (torch.bfloat16, 32, 8, 128),
    (torch.bfloat16, 16, 2, 128),
    (torch.float16, 32, 8, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim", GPU_SHAPES)
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_backends_match_torch(decode, dtype, heads, kv_heads, head_dim, page_size):
    if decode:
        seq_lens = [1, 33, 517, 1200, 64, 250]
        lens = decode_lens(seq_lens)
    else:
        lens = ([0, 100, 37, 0, 600], [300, 1, 77, 5, 129])
    case = make_case(
        *lens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        decode=decode,
        seed=head_dim + page_size,
    )
    ref = reference(case)
    for name, backend in _gpu_backends(case, page_size).items():
        out = run_backend(backend, case)
        assert out.dtype == dtype, name
        assert_close(out, ref, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_triton_one_split_and_mixed_tail(dtype):
    """The compiled kernels' one-split path (the decode kernel writes the output, no merge) and
    a mixed step's decode tail, against the torch reference."""
    seq_lens = [1, 33, 517, 1200, 64, 250]
    decode = make_case(*decode_lens(seq_lens), **LLAMA_8B_HEADS, dtype=dtype, decode=True, seed=11)
    out = run_backend(TritonAttentionBackend(num_kv_splits=1), decode)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert_close(out, reference(decode), tol)
    mixed = make_case([0, 300, 40, 999], [200, 1, 1, 1], **LLAMA_8B_HEADS, dtype=dtype, seed=12)
    assert_close(run_backend(TritonAttentionBackend(), mixed), reference(mixed), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_backends_fp32_are_exact(page_size):
    """fp32 (no tf32 in the Triton kernels): tight agreement, as greedy decoding needs."""
    for decode, lens in ((False, ([0, 50], [70, 9])), (True, ([99, 4, 300], [1, 1, 1]))):
        case = make_case(
            *lens, heads=16, kv_heads=4, head_dim=64, page_size=page_size, decode=decode, seed=3
        )
        assert_close(run_backend(TritonAttentionBackend(), case), reference(case), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_decode_replays_in_cuda_graph(page_size):
    """Capture one decode step, then grow every sequence by one token and replay after
    re-planning on the same static batch tensors: the output must follow the new lengths."""
    seq_lens = [5, 40, 301]
    case = make_case(
        *decode_lens(seq_lens),
        **LLAMA_8B_HEADS,
        page_size=page_size,
        dtype=torch.bfloat16,
        decode=True,
        seed=7,
    )
    fb = case.fb
    for backend in _gpu_backends(case, page_size).values():
        backend.init_cuda_graph_state(max_batch_size=8, max_num_tokens=fb.kv_pool.max_total_tokens)
        backend.plan_for_capture(fb)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            backend.forward(case.q, case.k, case.v, case.layer, fb)  # warm-up (compiles)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = backend.forward(case.q, case.k, case.v, case.layer, fb)
        _grow_by_one(case, page_size)
        backend.plan_for_replay(fb)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(static_out, reference(case), 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_flashinfer_mixed_step_decode_tail(page_size):
    """An extend batch's trailing one-token rows run on FlashInfer's decode wrapper, the rows
    before them on its prefill wrapper; a batch of only one-token rows too."""
    if not _has_flashinfer():
        pytest.skip("flashinfer is not installed")
    for i, lens in enumerate((([0, 300, 40, 999], [200, 1, 1, 1]), ([5, 40, 300], [1, 1, 1]))):
        case = make_case(
            *lens, **LLAMA_8B_HEADS, page_size=page_size, dtype=torch.bfloat16, seed=30 + i
        )
        backend = _gpu_backends(case, page_size)["flashinfer"]
        assert_close(run_backend(backend, case), reference(case), 2e-2)
        assert len(backend._active[attention_variant(case.layer)]) == (2 if i == 0 else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True])
def test_gpu_flashinfer_batches_planned_while_the_device_is_busy(decode):
    """The scheduler plans a batch while the device still runs earlier ones (a long prompt's
    chunks queued one after another, overlapped decode steps). FlashInfer's plan copies its work
    split to the device from a host buffer of the wrapper, asynchronously: three batches planned
    and run behind a second of device sleep must each still get their own output (without the
    backend waiting for the previous plan's copy, the first two ran with the third's split)."""
    if not _has_flashinfer():
        pytest.skip("flashinfer is not installed")
    from radixlm.kernels.attention.flashinfer_backend import FlashInferAttentionBackend

    if decode:
        batches = [decode_lens(n) for n in ([40], [5, 900, 64], [1, 33, 517, 1200, 64, 250])]
    else:
        batches = [
            ([0], [300]),
            ([0, 300], [300, 300]),
            ([0, 100, 37, 0, 600], [300, 1, 77, 5, 129]),
        ]
    cases = [
        make_case(*lens, **LLAMA_8B_HEADS, dtype=torch.bfloat16, decode=decode, seed=20 + i)
        for i, lens in enumerate(batches)
    ]
    refs = [reference(c) for c in cases]
    backend = FlashInferAttentionBackend(
        DEVICE, num_heads=32, num_kv_heads=8, head_dim=128, page_size=1
    )
    for case in cases:  # compiled and warm before the timed part
        run_backend(backend, case)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of device clock cycles ahead of the plans
    outs = [run_backend(backend, case) for case in cases]
    for out, ref in zip(outs, refs, strict=True):
        assert_close(out, ref, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window,cap", WINDOW_CASES)
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("backend_name", ["triton", "flashinfer"])
def test_gpu_window_and_softcap(backend_name, decode, window, cap, page_size):
    """bf16 windows and soft-caps through each GPU backend (FlashInfer: ``window_left``,
    ``logits_soft_cap``), against the written-out reference. Apart, so that a run can select
    the Triton cases alone (``-k "window_and_softcap and triton"``: FlashInfer builds one JIT
    module per variant on a cold machine, about a minute each)."""
    if backend_name == "flashinfer" and not _has_flashinfer():
        pytest.skip("FlashInfer is not installed")
    lens = decode_lens([1, 9, 140, 17]) if decode else ([0, 12, 3, 100], [150, 9, 1, 1])
    case = make_case(
        *lens,
        heads=8,
        kv_heads=2,
        head_dim=128,
        page_size=page_size,
        decode=decode,
        dtype=torch.bfloat16,
        seed=21,
    )
    case.layer.sliding_window, case.layer.logit_cap = window, cap
    case.q.mul_(4.0)
    ref = naive_reference(case)
    if backend_name == "triton":
        backend = TritonAttentionBackend()
    else:
        backend = _gpu_backends(case, page_size)["flashinfer"]
    assert_close(run_backend(backend, case), ref, 3e-2)


def _grow_by_one(case: Case, page_size: int) -> None:
    """Appends one fresh token to every request in place (static tensors keep their storage):
    the next slot of the request's last page, or the first slot of a page nobody uses."""
    fb = case.fb
    table = fb.req_to_token_pool.req_to_token
    used_pages = {(s - 1) // page_size for s in table[fb.req_slots].flatten().tolist() if s}
    free_pages = (p for p in range(fb.kv_pool.max_total_tokens // page_size) if p not in used_pages)
    new_slots = []
    for i, (slot, n) in enumerate(zip(fb.req_slots_cpu, fb.seq_lens_cpu, strict=True)):
        new = int(table[slot, n - 1]) + 1 if n % page_size else 1 + next(free_pages) * page_size
        table[slot, n] = new
        new_slots.append(new)
        fb.seq_lens_cpu[i] = n + 1
        fb.prefix_lens_cpu[i] = n
    fb.seq_lens.copy_(torch.tensor(fb.seq_lens_cpu, device=DEVICE))
    fb.out_kv_slots.copy_(torch.tensor(new_slots, device=DEVICE))
    for t in (case.q, case.k, case.v):
        t.copy_(torch.randn_like(t))
