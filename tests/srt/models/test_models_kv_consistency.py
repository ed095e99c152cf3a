"""Prefill, extend on a cached prefix, decode, and mixed batches all give the full-prompt logits."""

from __future__ import annotations

import pytest
import torch
from model_batches import KVSession, max_rel_err, run_logits
from tiny_checkpoints import VOCAB, write_checkpoint

from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models.loader import load_model

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
TOL = 1e-5


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# the MoE one: routed and shared experts give the same rows however the tokens are batched;
# the sliding-window checkpoints' windows (6 keys) are shorter than the cached prefixes here
@pytest.fixture(
    scope="module",
    params=[
        "llama3_rope_sharded",
        "qwen3_qk_norm",
        "mistral_window",
        "gemma2_softcap",
        "gemma3_local_global",
        "qwen2_moe_shared",
    ],
)
def model(request, tmp_path_factory):
    folder = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(folder, torch.float32, "cpu")


def full_logits(model, ids: list[int]) -> torch.Tensor:
    session = KVSession(model.config)
    return run_logits(model, session, EXTEND, [(session.new_request(), ids)])


@pytest.mark.parametrize("prefix_len", [1, 7, 19])
def test_extend_on_cached_prefix(model, prefix_len):
    ids = tokens(20, seed=3)
    ref = full_logits(model, ids)
    session = KVSession(model.config)
    req = session.new_request()
    first = run_logits(model, session, EXTEND, [(req, ids[:prefix_len])])
    rest = run_logits(model, session, EXTEND, [(req, ids[prefix_len:])])
    assert max_rel_err(first, ref[:prefix_len]) < TOL
    assert max_rel_err(rest, ref[prefix_len:]) < TOL


def test_decode_steps(model):
    ids = tokens(20, seed=4)
    ref = full_logits(model, ids)
    session = KVSession(model.config)
    req = session.new_request()
    run_logits(model, session, EXTEND, [(req, ids[:12])])
    for pos in range(12, 20):
        step = run_logits(model, session, DECODE, [(req, [ids[pos]])])
        assert max_rel_err(step[0], ref[pos]) < TOL, f"decode at position {pos}"


def test_batched_requests_match_each_alone(model):
    lens = [5, 11, 17]  # prompt lengths; each request then gets 6 more tokens
    full = [tokens(n + 6, seed=10 + n) for n in lens]
    refs = [full_logits(model, f) for f in full]
    session = KVSession(model.config)
    reqs = [session.new_request() for _ in lens]
    # 1) one extend batch of three fresh prompts (without their last 3 prompt tokens)
    out = run_logits(
        model, session, EXTEND, [(r, f[: n - 3]) for r, f, n in zip(reqs, full, lens, strict=True)]
    )
    _check_rows(out, refs, [(0, n - 3) for n in lens])
    # 2) one extend batch on top of the cached prefixes, of different lengths
    ext = [3, 4, 5]
    out = run_logits(
        model,
        session,
        EXTEND,
        [(r, f[n - 3 : n - 3 + e]) for r, f, n, e in zip(reqs, full, lens, ext, strict=True)],
    )
    _check_rows(out, refs, [(n - 3, n - 3 + e) for n, e in zip(lens, ext, strict=True)])
    # 3) decode steps of the whole batch (sequences of different lengths)
    pos = [n - 3 + e for n, e in zip(lens, ext, strict=True)]
    for _ in range(3):
        out = run_logits(
            model, session, DECODE, [(r, [f[p]]) for r, f, p in zip(reqs, full, pos, strict=True)]
        )
        _check_rows(out, refs, [(p, p + 1) for p in pos])
        pos = [p + 1 for p in pos]


def _check_rows(out: torch.Tensor, refs: list[torch.Tensor], spans: list[tuple[int, int]]) -> None:
    start = 0
    for i, (lo, hi) in enumerate(spans):
        got = out[start : start + hi - lo]
        assert max_rel_err(got, refs[i][lo:hi]) < TOL, f"request {i}, positions {lo}..{hi - 1}"
        start += hi - lo
    assert start == out.shape[0]


@pytest.mark.slow  # interpreted kernels: 15-25 s per model on a CPU
@pytest.mark.parametrize("name", ["gemma2_softcap", "gemma3_local_global"])
def test_triton_kernels_serve_windowed_models(name, tmp_path):
    """The Triton kernels (interpreted on a CPU) under a Gemma model: a prefill, an extend on
    its cache and a mixed step (an extend with a decode row), against the full-prompt logits."""
    pytest.importorskip("triton")
    from radixlm.kernels.attention.triton_backend import TritonAttentionBackend

    model = load_model(write_checkpoint(name, tmp_path), torch.float32, "cpu")
    a, b = tokens(20, seed=5), tokens(14, seed=6)
    refs = [full_logits(model, a), full_logits(model, b)]
    session = KVSession(model.config, backend=TritonAttentionBackend())
    ra, rb = session.new_request(), session.new_request()
    out = run_logits(model, session, EXTEND, [(ra, a[:9]), (rb, b[:13])])
    _check_rows(out, refs, [(0, 9), (0, 13)])
    out = run_logits(model, session, EXTEND, [(ra, a[9:19]), (rb, b[13:14])])  # decode tail
    _check_rows(out, refs, [(9, 19), (13, 14)])
    out = run_logits(model, session, DECODE, [(ra, a[19:20])])
    assert max_rel_err(out[0], refs[0][19]) < 1e-4
