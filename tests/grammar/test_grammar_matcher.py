"""The matcher contract, on both backends: EOS placement, termination, rollback, copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlm.grammar.base import GrammarSpec
from radixlm.grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

BACKENDS = {"outlines": OutlinesBackend, "llguidance": LLGuidanceBackend}
SECOND_EOS = 7  # an extra EOS id (the "'" token) given by the caller


@pytest.fixture(scope="module")
def vocab():
    tokenizer = train_byte_level_tokenizer()
    eos = tokenizer.eos_token_id
    return build_vocab(tokenizer, eos_token_ids=[eos, SECOND_EOS], vocab_size=len(tokenizer) + 5)


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request, vocab):
    return BACKENDS[request.param](vocab)


def _byte_token(vocab, text: str) -> int:
    return vocab.ids_by_bytes[text.encode()][0]


def _allowed(matcher, vocab) -> set[int]:
    bitmask = allocate_token_bitmask(2, vocab.vocab_size)
    bitmask.zero_()
    matcher.fill_bitmask(bitmask, 1)
    assert bitmask[0].eq(0).all()  # only the requested row is written
    return set(allowed_token_ids(bitmask, 1, vocab.vocab_size))


def test_eos_only_where_the_grammar_may_end(backend, vocab):
    eos = set(vocab.eos_token_ids)
    matcher = backend.compile(GrammarSpec.regex("ab(cd)?")).new_matcher()
    a, b, c, d = (_byte_token(vocab, ch) for ch in "abcd")
    assert not _allowed(matcher, vocab) & eos
    assert not matcher.accept_token(vocab.eos_token_ids[0])
    assert matcher.accept_tokens([a, b])
    assert eos <= _allowed(matcher, vocab)  # may end here (every EOS id) ...
    assert c in _allowed(matcher, vocab)  # ... or go on
    assert matcher.accept_token(c)
    assert not _allowed(matcher, vocab) & eos  # "abc" cannot end
    assert matcher.accept_token(d)
    assert _allowed(matcher, vocab) == eos  # nothing but EOS after "abcd"
    assert not matcher.is_terminated()
    assert matcher.accept_token(SECOND_EOS)
    assert matcher.is_terminated()


def test_terminated_matcher_allows_only_eos(backend, vocab):
    matcher = backend.compile(GrammarSpec.regex("x+")).new_matcher()
    x = _byte_token(vocab, "x")
    assert matcher.accept_tokens([x, x])
    assert matcher.accept_token(vocab.eos_token_ids[0])
    assert matcher.is_terminated()
    assert _allowed(matcher, vocab) == set(vocab.eos_token_ids)
    assert not matcher.accept_token(x)
    assert matcher.forced_tokens() == []
    assert matcher.accept_token(vocab.eos_token_ids[0])  # a repeated EOS is harmless
    assert matcher.num_accepted_tokens == 4
    matcher.rollback(2)
    assert not matcher.is_terminated()
    assert matcher.accept_token(x)


def test_rollback_restores_masks(backend, vocab):
    grammar = backend.compile(GrammarSpec.regex(r"(ab|ac)[0-9]{2}z"))
    matcher = grammar.new_matcher()
    start_mask = _allowed(matcher, vocab)
    tokens = vocab.encode("ab12")
    assert matcher.accept_tokens(tokens)
    mid_mask = _allowed(matcher, vocab)
    assert matcher.accept_token(_byte_token(vocab, "z"))
    matcher.rollback(1)
    assert _allowed(matcher, vocab) == mid_mask
    matcher.rollback(len(tokens))
    assert _allowed(matcher, vocab) == start_mask
    assert matcher.num_accepted_tokens == 0
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(1)


def test_rejected_tokens_leave_the_state_unchanged(backend, vocab):
    matcher = backend.compile(GrammarSpec.regex("[0-9]{3}")).new_matcher()
    assert matcher.accept_token(_byte_token(vocab, "1"))
    before = _allowed(matcher, vocab)
    for bad in (_byte_token(vocab, "a"), vocab.vocab_size - 1, vocab.vocab_size + 10, -1):
        assert not matcher.accept_token(bad)
    assert _allowed(matcher, vocab) == before
    assert not matcher.accept_tokens([_byte_token(vocab, "2"), _byte_token(vocab, "b")])
    assert matcher.num_accepted_tokens == 1  # accept_tokens is all or nothing


def test_copy_is_independent(backend, vocab):
    matcher = backend.compile(GrammarSpec.choices(["alpha", "beta"])).new_matcher()
    assert matcher.accept_token(_byte_token(vocab, "a"))
    clone = matcher.copy()
    assert clone.num_accepted_tokens == 1
    assert clone.accept_tokens(vocab.encode("lpha"))
    assert clone.accept_token(vocab.eos_token_ids[0])
    assert clone.is_terminated() and not matcher.is_terminated()
    assert not _allowed(matcher, vocab) & set(vocab.eos_token_ids)


def test_outlines_mask_rows_are_cached_per_state(vocab):
    grammar = OutlinesBackend(vocab).compile(GrammarSpec.regex("[a-c]{1,3}"))
    first, second = grammar.new_matcher(), grammar.new_matcher()
    bitmask = allocate_token_bitmask(2, vocab.vocab_size)
    first.fill_bitmask(bitmask, 0)
    second.fill_bitmask(bitmask, 1)
    assert torch.equal(bitmask[0], bitmask[1])
    state = first.state
    assert grammar.mask_row(state) is grammar.mask_row(state)  # one row per state, reused
    expected = set(grammar.index.get_allowed_tokens(state)) - set(vocab.eos_token_ids)
    assert set(allowed_token_ids(bitmask, 0, vocab.vocab_size)) == expected
    assert np.all(grammar.text_token_ids(state) < vocab.vocab_size)


def _index_row(grammar, state: int, vocab) -> set[int]:
    """The allowed ids of ``state`` straight from the outlines-core index (the reference)."""
    allowed = set(grammar.index.get_allowed_tokens(state)) - set(vocab.eos_token_ids)
    return allowed | set(vocab.eos_token_ids) if grammar.is_final(state) else allowed


def test_outlines_guide_rows_match_the_index(vocab):
    """Rows built by the matcher's guide (native fill) equal the index's allowed ids, every
    EOS id included exactly where the DFA may end (the index itself knows only the first)."""
    grammar = OutlinesBackend(vocab).compile(GrammarSpec.regex(r"(ab|a'c)[0-9]{1,2}'?"))
    grammar._rows.clear()  # drop the compile-time rows: every row comes from a guide
    rng = np.random.default_rng(0)
    seen = 0
    for _ in range(30):
        matcher = grammar.new_matcher()
        while not matcher.is_terminated():
            allowed = _allowed(matcher, vocab)
            assert allowed == _index_row(grammar, matcher.state, vocab), matcher.state
            seen += 1
            token = int(rng.choice(sorted(allowed)))
            assert matcher.accept_token(token)
    assert seen > 30 and len(grammar._rows) >= 5


def test_outlines_rows_survive_deep_rollbacks(vocab):
    """A rollback deeper than the guide keeps (32 tokens) drops the guide; rows stay exact."""
    grammar = OutlinesBackend(vocab).compile(GrammarSpec.regex(r"[ab]{0,80}c[0-9]"))
    grammar._rows.clear()  # rows through the guide, which then has a history to lose
    matcher = grammar.new_matcher()
    a, b, c = (_byte_token(vocab, ch) for ch in "abc")
    tokens = [a, b] * 20
    for i, token in enumerate(tokens):
        if i % 7 == 0:
            _allowed(matcher, vocab)  # syncs the guide now and then
        assert matcher.accept_token(token)
    matcher.rollback(38)  # deeper than the guide's history
    assert matcher.accept_tokens([b, c])
    grammar._rows.clear()  # force a fresh row through the guide
    assert _allowed(matcher, vocab) == _index_row(grammar, matcher.state, vocab)
    assert _allowed(matcher, vocab) == {_byte_token(vocab, d) for d in "0123456789"}
    matcher.rollback(2)  # within the guide's history, then new tokens before the next row
    assert matcher.accept_tokens([a, a, b])
    grammar._rows.clear()
    assert _allowed(matcher, vocab) == _index_row(grammar, matcher.state, vocab)
    assert c in _allowed(matcher, vocab)
