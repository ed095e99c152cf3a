"""Mask rows prefetched on the worker thread: equal to inline fills, and never used stale."""

from __future__ import annotations

import pytest
import torch

from radixlm.grammar import GrammarSpec, allocate_token_bitmask
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.mask_prefetch import MaskPrefetcher
from radixlm.srt.scheduler.req import Req

BACKENDS = {"outlines": OutlinesBackend, "llguidance": LLGuidanceBackend}


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


@pytest.fixture(params=sorted(BACKENDS))
def req(request, vocab):
    grammar = BACKENDS[request.param](vocab).compile(GrammarSpec.regex(r"(ab|cd)[0-9]{2}"))
    req = Req("r", [1, 2, 3], SamplingParams.from_dict({"regex": "x"}))
    req.grammar = grammar.new_matcher()
    return req


def _inline_row(req, vocab) -> torch.Tensor:
    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    req.grammar.fill_bitmask(bitmask, 0)
    return bitmask[0]


def _accept(req, text: str, vocab) -> None:
    for token in vocab.encode(text):
        assert req.grammar.accept_token(token)
        req.output_ids.append(token)


def test_prefetched_rows_equal_inline_rows(req, vocab):
    prefetcher = MaskPrefetcher(allocate_token_bitmask(1, vocab.vocab_size).shape[1])
    try:
        for text in ("", "ab", "1"):
            _accept(req, text, vocab)
            prefetcher.submit(req)
            row, compute_s = prefetcher.take(req)
            assert bytes(row) == _inline_row(req, vocab).numpy().tobytes() and compute_s >= 0
            assert prefetcher.take(req) is None  # a row is taken once
    finally:
        prefetcher.shutdown()


def test_a_row_for_an_older_output_is_not_used(req, vocab):
    prefetcher = MaskPrefetcher(allocate_token_bitmask(1, vocab.vocab_size).shape[1])
    try:
        prefetcher.submit(req)
        prefetcher._jobs[req].done.wait(10)  # filled for the empty output ...
        _accept(req, "cd", vocab)  # ... which has moved on since
        assert prefetcher.take(req) is None
        prefetcher.submit(req)
        req.finish({"type": "abort"})
        prefetcher.forget_finished()
        assert prefetcher.take(req) is None
    finally:
        prefetcher.shutdown()
