"""A speculative verify (1 + k new tokens per request) recast as one decode row per token
(``ForwardBatch.as_decode_rows``) computes the same logits and KV as the causal extend, so that
verify batches can replay the decode CUDA graphs.

CPU: the torch backend's extend against its decode over the rows. GPU (``gpu``): the model
runner's graph replay of a verify batch against the eager extend, on triton and flashinfer.
"""

from __future__ import annotations

import os

import pytest
import torch

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.srt.executor.model_runner import ModelRunner

PREFIX = [9, 5]  # cached tokens per request before the verify
VERIFY = [5, 1]  # new tokens per request: a draft of 4, and a plain decode row in the same batch


def _fill(runner: ModelRunner, seed: int = 0):
    """Two requests' sequences with their KV slots in the request-to-token table; returns
    ``(req_slots, token ids, kv slots)`` per request."""
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for p, v in zip(PREFIX, VERIFY, strict=True):
        slot = runner.req_to_token_pool.alloc()
        kv = runner.allocator.alloc(p + v)
        assert slot is not None and kv is not None
        runner.req_to_token_pool.write(slot, 0, kv[: p + v])
        ids = torch.randint(3, runner.vocab_size, (p + v,), generator=gen).tolist()
        reqs.append((slot, ids, kv[: p + v]))
    return reqs


def _batch(runner: ModelRunner, reqs, starts: list[int], lens: list[int]) -> ForwardBatch:
    ids, pos, slots = [], [], []
    for (_, toks, kv), s, n in zip(reqs, starts, lens, strict=True):
        ids += toks[s : s + n]
        pos += list(range(s, s + n))
        slots.append(kv[s : s + n])
    return ForwardBatch.from_host(
        ForwardMode.EXTEND,
        ids,
        pos,
        torch.cat(slots),
        [r[0] for r in reqs],
        starts,
        lens,
        req_to_token_pool=runner.req_to_token_pool,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
    )


def _eager(runner: ModelRunner, fb: ForwardBatch) -> torch.Tensor:
    with torch.inference_mode():
        runner.attn_backend.plan(fb)
        return runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb))


def test_decode_rows_layout(tiny_llama_dir):
    runner = ModelRunner(
        config_from_kwargs(
            model_path=str(tiny_llama_dir), max_total_tokens=256, log_level="warning"
        )
    )
    reqs = _fill(runner)
    fb = _batch(runner, reqs, PREFIX, VERIFY)
    rows = fb.as_decode_rows()
    assert rows.mode is ForwardMode.DECODE
    assert rows.req_slots_cpu == rows.req_slots.tolist() == [reqs[0][0]] * 5 + [reqs[1][0]]
    assert rows.seq_lens_cpu == rows.seq_lens.tolist() == [10, 11, 12, 13, 14, 6]
    assert rows.extend_lens_cpu == [1] * 6 and rows.prefix_lens_cpu == [9, 10, 11, 12, 13, 5]
    assert rows.input_ids is fb.input_ids and rows.out_kv_slots is fb.out_kv_slots
    assert rows.as_decode_rows() is rows


def test_verify_takes_the_graphs_within_the_read_and_size_bounds(tiny_llama_dir):
    """The runner's decision from host lists alone: the rows' extra KV reads (counted here
    from the rows themselves) against ``max_extra_verify_reads``, the rows against the graphs'
    largest batch and KV-read capacity; prefills (no cached prefix) never."""
    from types import SimpleNamespace

    runner = ModelRunner(
        config_from_kwargs(
            model_path=str(tiny_llama_dir),
            max_total_tokens=256,
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=4,
            log_level="warning",
        )
    )
    reqs = _fill(runner)
    verify = _batch(runner, reqs, PREFIX, VERIFY)
    rows = verify.as_decode_rows()
    reads = sum(rows.seq_lens_cpu)
    extra = reads - sum(verify.seq_lens_cpu)
    runner.graph_runner = SimpleNamespace(max_bs=rows.batch_size, max_kv_reads=reads)
    runner.max_extra_verify_reads = extra
    assert runner._verify_fits_graphs(verify)
    runner.max_extra_verify_reads = extra - 1
    assert not runner._verify_fits_graphs(verify)
    runner.max_extra_verify_reads = extra
    runner.graph_runner = SimpleNamespace(max_bs=rows.batch_size - 1, max_kv_reads=reads)
    assert not runner._verify_fits_graphs(verify)
    runner.graph_runner = SimpleNamespace(max_bs=rows.batch_size, max_kv_reads=reads - 1)
    assert not runner._verify_fits_graphs(verify)
    runner.graph_runner = SimpleNamespace(max_bs=64, max_kv_reads=10**6)
    assert not runner._verify_fits_graphs(_batch(runner, reqs, [0, 0], PREFIX))  # prefills
    runner.max_verify_rows = 4  # a 5-token extend is longer than any verify
    assert not runner._verify_fits_graphs(verify)


def test_decode_rows_compute_the_causal_extend(tiny_llama_dir):
    runner = ModelRunner(
        config_from_kwargs(
            model_path=str(tiny_llama_dir), max_total_tokens=256, log_level="warning"
        )
    )
    reqs = _fill(runner)
    _eager(runner, _batch(runner, reqs, [0, 0], PREFIX))  # the prefixes' KV
    verify = _batch(runner, reqs, PREFIX, VERIFY)
    want = _eager(runner, verify)
    k_want = runner.kv_pool.get_kv(0)[0][verify.out_kv_slots].clone()
    got = _eager(runner, verify.as_decode_rows())
    assert got.shape == want.shape == (6, runner.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(runner.kv_pool.get_kv(0)[0][verify.out_kv_slots], k_want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_verify_batches_replay_the_decode_graphs(tmp_path, backend):
    from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder

    if backend not in os.environ.get("RADIXLM_GPU_TEST_BACKENDS", "triton,flashinfer"):
        pytest.skip(f"{backend} not in RADIXLM_GPU_TEST_BACKENDS")
    folder = make_model_folder(tmp_path, TINY_LLAMA)
    runner = ModelRunner(
        config_from_kwargs(
            model_path=str(folder),
            load_format="dummy",
            attention_backend=backend,
            dtype="float32" if backend == "triton" else "float16",
            max_total_tokens=4096,
            max_running_requests=16,
            speculative_algorithm="ngram",
            speculative_num_draft_tokens=4,
            log_level="warning",
        )
    )
    assert runner.graph_runner is not None and runner.max_verify_rows == 5
    reqs = _fill(runner)
    _eager(runner, _batch(runner, reqs, [0, 0], PREFIX))
    verify = _batch(runner, reqs, PREFIX, VERIFY)
    want = _eager(runner, verify)
    replays = []
    original = runner.graph_runner.replay
    runner.graph_runner.replay = lambda fb: replays.append(fb.batch_size) or original(fb)
    with torch.inference_mode():
        got = runner._run(verify, list(range(6)))
    assert replays == [6]  # one graph replay of six decode rows
    tol = 2e-4 if backend == "triton" else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # a prefill-length extend never takes the graphs
    replays.clear()
    with torch.inference_mode():
        runner._run(_batch(runner, reqs, [0, 0], PREFIX), [8, 13])
    assert replays == []
