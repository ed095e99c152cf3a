"""Overlap scheduling on a GPU: the same greedy outputs as the synchronous scheduler, and decode
steps launched ahead never wait for the device (no host-device synchronization)."""

from __future__ import annotations

import random
import traceback
import warnings

import pytest
import torch

from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder
from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler

pytestmark = pytest.mark.gpu

TINY = TINY_LLAMA
LENGTHS = (5, 37, 200, 64)
MAX_NEW = (40, 12, 25, 1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model_folder(tmp_path_factory.mktemp("tiny-gpu-overlap"), TINY)


def _scheduler(folder, overlap: bool, backend: str) -> Scheduler:
    torch.manual_seed(0)
    cfg = config_from_kwargs(
        model_path=str(folder),
        load_format="dummy",
        attention_backend=backend,
        dtype="float32" if backend != "flashinfer" else "float16",
        max_total_tokens=8192,
        log_level="warning",
        disable_overlap_schedule=not overlap,
    )
    return Scheduler(cfg)


def _submit_all(s: Scheduler) -> None:
    rng = random.Random(0)
    for i, (n, m) in enumerate(zip(LENGTHS, MAX_NEW, strict=True)):
        ids = [rng.randrange(2, TINY["vocab_size"]) for _ in range(n)]
        s.handle(
            TokenizedGenerateReq(
                rid=f"r{i}",
                input_ids=ids,
                sampling_params={"temperature": 0, "max_new_tokens": m, "ignore_eos": True},
            )
        )


def _drain(s: Scheduler, on_step=None) -> dict:
    out: dict = {}
    while s.has_work():
        res = s.step()
        if on_step is not None:
            on_step(s)
        for i, rid in enumerate(res.rids if res else []):
            out.setdefault(rid, []).extend(res.new_token_ids[i])
    assert s.check_idle()
    return out


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_overlap_matches_synchronous_scheduler(folder, backend):
    results = []
    for overlap in (False, True):
        s = _scheduler(folder, overlap, backend)
        assert s.overlap is overlap
        _submit_all(s)
        results.append(_drain(s))
    assert results[0] == results[1]
    assert [len(results[1][f"r{i}"]) for i in range(len(MAX_NEW))] == list(MAX_NEW)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_chained_decode_steps_do_not_synchronize(folder, backend):
    """Neither steady decode steps nor steps where requests finish and free their KV wait for
    the GPU (freed slots reach the allocator through an asynchronous copy)."""
    s = _scheduler(folder, True, backend)
    _submit_all(s)
    while s.inflight is None:  # prefill, then the first decode launched ahead
        s.step()
    syncs: list[str] = []

    def record(message, *args, **kwargs):
        if "prototype feature" in str(message):
            return
        syncs.append(f"{message}\n" + "".join(traceback.format_stack(limit=12)[:-1]))

    old = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            while s.has_work():  # decode to the end: requests finish at different steps
                s.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    # each step reads the previous step's tokens back once (an event wait, which is no warning)
    assert not syncs, "\n\n".join(syncs[:6])
    _drain(s)
