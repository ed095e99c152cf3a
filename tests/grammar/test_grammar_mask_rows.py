"""Mask rows on the scheduler's path: BitmaskBuffer, fill_row against fill_bitmask, and the
outlines rows built at compile time against rows built on first visit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixlm.grammar.base import GrammarSpec
from radixlm.grammar.bitmask import BitmaskBuffer, allowed_token_ids, bitmask_width
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.outlines_grammar import OutlinesGrammar
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

SMALL_REGEX = r"(ab|a'c)[0-9]{1,2}'?|x{2,5}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}


@pytest.fixture(scope="module")
def vocab():
    tokenizer = train_byte_level_tokenizer()
    eos = tokenizer.eos_token_id
    return build_vocab(tokenizer, eos_token_ids=[eos, 7], vocab_size=len(tokenizer) + 5)


def test_buffer_rows_bytes_and_bits():
    bitmask = torch.zeros((3, 2), dtype=torch.int32)
    buffer = BitmaskBuffer(bitmask)
    assert buffer.row_bytes == 8 and buffer.address == bitmask.data_ptr()
    buffer.set_bits(1, [0, 31, 33])
    assert allowed_token_ids(bitmask, 1, 64) == [0, 31, 33]
    buffer.write(2, buffer.read(1))
    assert torch.equal(bitmask[2], bitmask[1]) and not bitmask[0].any()
    assert buffer.row_address(2) == bitmask[2].data_ptr()
    with pytest.raises(ValueError):
        buffer.write(0, b"\x00" * 4)  # a row of another width
    assert len(BitmaskBuffer(torch.zeros((0, 2), dtype=torch.int32)).data) == 0


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros((2, 4), dtype=torch.int64),
        torch.zeros((4, 2), dtype=torch.int32).t(),
        torch.zeros(4, dtype=torch.int32),
    ],
)
def test_buffer_rejects_other_layouts(bad):
    with pytest.raises(ValueError, match="contiguous CPU int32"):
        BitmaskBuffer(bad)


@pytest.mark.parametrize("backend_cls", [OutlinesBackend, LLGuidanceBackend])
def test_fill_row_equals_fill_bitmask_along_a_walk(vocab, backend_cls):
    """The buffer path writes exactly the row the tensor path writes, and no other row."""
    grammar = backend_cls(vocab).compile(GrammarSpec.json_schema(SCHEMA))
    rng = random.Random(0)
    for _ in range(5):
        matcher = grammar.new_matcher()
        bitmask = torch.full((3, bitmask_width(vocab.vocab_size)), 7, dtype=torch.int32)
        buffer = BitmaskBuffer(bitmask)
        for _ in range(60):
            reference = torch.zeros((1, bitmask.shape[1]), dtype=torch.int32)
            matcher.fill_bitmask(reference, 0)
            matcher.fill_row(buffer, 1)
            assert torch.equal(bitmask[1], reference[0])
            assert (bitmask[0] == 7).all() and (bitmask[2] == 7).all()
            allowed = allowed_token_ids(reference, 0, vocab.vocab_size)
            text = [t for t in allowed if t not in vocab.eos_token_ids]
            if not text:
                break
            assert matcher.accept_token(rng.choice(text))


def _walk_states(grammar: OutlinesGrammar, vocab, seed: int, walks: int) -> set[int]:
    """States visited by random walks whose rows come from the matchers' guides."""
    rng = random.Random(seed)
    bitmask = torch.zeros((1, bitmask_width(vocab.vocab_size)), dtype=torch.int32)
    seen = set()
    for _ in range(walks):
        matcher = grammar.new_matcher()
        while not matcher.is_terminated():
            seen.add(matcher.state)
            matcher.fill_bitmask(bitmask, 0)
            matcher.accept_token(rng.choice(allowed_token_ids(bitmask, 0, vocab.vocab_size)))
    return seen


def test_warm_rows_equal_rows_built_on_first_visit(vocab):
    """Every state of a small DFA gets its row at compile time, equal to the row a matcher's
    guide writes natively when it first meets the state (EOS ids included where it may end)."""
    warmed = OutlinesBackend(vocab).compile(GrammarSpec.regex(SMALL_REGEX))
    lazy = OutlinesGrammar(warmed.spec, warmed.index, vocab)  # the same DFA, no rows yet
    assert not lazy._rows
    visited = _walk_states(lazy, vocab, seed=1, walks=200)
    assert set(lazy._rows) == visited
    assert visited <= set(warmed._rows) and len(warmed._rows) >= 8
    for state in warmed._rows:
        assert warmed._rows[state] == lazy.mask_row(state), state
    for state in visited:  # rows written by guides into the batch bitmask, then memoized
        assert lazy._rows[state] == warmed._rows[state]
    finals = [s for s in warmed._rows if warmed.is_final(s)]
    row = np.frombuffer(warmed._rows[finals[0]], dtype=np.uint32)
    assert all(row[t // 32] >> (t % 32) & 1 for t in vocab.eos_token_ids)


def test_warm_rows_share_equal_rows(vocab):
    grammar = OutlinesBackend(vocab).compile(GrammarSpec.choices(["ab", "cb"]))
    rows = list(grammar._rows.values())
    assert len(set(rows)) < len(rows)  # after "a" and after "c" only "b" may follow
    assert len({id(r) for r in rows}) == len(set(rows))  # one copy of each distinct row


def test_warm_rows_give_up_past_their_budget(vocab):
    """Past its transition or state budget the walk stores no row (the matchers then build each
    row on its first visit, as for JSON string states over a real vocabulary)."""
    grammar = OutlinesBackend(vocab).compile(GrammarSpec.json_schema(SCHEMA))
    num_transitions = sum(len(t) for t in grammar.index.get_transitions().values())
    num_states = len(grammar._rows)
    assert num_states > 20
    fresh = OutlinesGrammar(grammar.spec, grammar.index, vocab)
    assert not fresh.warm_rows(max_transitions=num_transitions // 2) and not fresh._rows
    assert not fresh.warm_rows(max_states=num_states - 1) and not fresh._rows
    assert fresh.warm_rows(max_transitions=num_transitions + 10, max_states=num_states)
    assert fresh._rows == grammar._rows


def test_llguidance_warm_up_leaves_the_template_at_its_start(vocab):
    """Compiling computes the first mask once on a copy of the template; the template's
    matchers still start at the beginning and give the same rows as an unwarmed grammar."""
    from llguidance import LLMatcher

    from radixlm.grammar.llguidance_backend import LLGuidanceGrammar

    backend = LLGuidanceBackend(vocab)
    spec = GrammarSpec.json_schema(SCHEMA)
    warmed = backend.compile(spec)
    text = backend.grammar_text(spec)
    cold = LLGuidanceGrammar(spec, text, LLMatcher(backend.lltokenizer(), text), vocab)
    bitmask = torch.zeros((2, bitmask_width(vocab.vocab_size)), dtype=torch.int32)
    buffer = BitmaskBuffer(bitmask)
    doc = vocab.encode('{"name": "x", "ok": true}')
    a, b = warmed.new_matcher(), cold.new_matcher()
    for token in doc:
        a.fill_row(buffer, 0)
        b.fill_row(buffer, 1)
        assert torch.equal(bitmask[0], bitmask[1])
        assert a.accept_token(token) and b.accept_token(token)
    assert a.accept_token(vocab.eos_token_ids[0]) and a.is_terminated()
