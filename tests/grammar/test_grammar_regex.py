"""Regex and choice constraints: random walks over the mask always produce matching text."""

from __future__ import annotations

import random
import re

import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.testing import random_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

BACKENDS = {"outlines": OutlinesBackend, "llguidance": LLGuidanceBackend}
REGEXES = {
    "email": r"[a-z]{1,8}(\.[a-z]{1,5})?@[a-z]{1,8}\.(com|org|net)",
    "alternation": r"(cat|dog|bird)s?( and (cat|dog|fox))?",
    "three_digits": r"\d{3}",
    "date": r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "hex_colour": r"#[0-9a-fA-F]{6}",
    "decimal": r"-?\d{1,4}(\.\d{1,3})?",
}


@pytest.fixture(scope="module")
def vocab():
    tokenizer = train_byte_level_tokenizer()
    return build_vocab(tokenizer, vocab_size=len(tokenizer) + 12)  # a padded logits width


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request, vocab):
    return BACKENDS[request.param](vocab)


def _walk_texts(backend, vocab, spec, num_walks, seed):
    grammar = backend.compile(spec)
    rng = random.Random(seed)
    exact = backend.name == "outlines"  # llguidance masks some valid non-canonical tokens
    texts = []
    for _ in range(num_walks):
        ids, finished = random_walk(grammar.new_matcher(), vocab, rng, check_rejections=exact)
        assert finished, f"no EOS after {vocab.decode_bytes(ids)!r}"
        texts.append(vocab.decode_bytes(ids).decode("utf-8"))
    return texts


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_random_walks_match_the_regex(backend, vocab, name):
    pattern = REGEXES[name]
    texts = _walk_texts(backend, vocab, GrammarSpec.regex(pattern), num_walks=12, seed=len(name))
    for text in texts:
        assert re.fullmatch(pattern, text, re.ASCII), (backend.name, pattern, text)
    assert len(set(texts)) > 1  # the walks explore, they do not repeat one string


def test_choices_produce_exactly_one_choice(backend, vocab):
    options = ["yes", "no", "maybe so", "cat", "category", "a.b*c"]
    texts = _walk_texts(backend, vocab, GrammarSpec.choices(options), num_walks=40, seed=3)
    assert set(texts) <= set(options)
    assert {"cat", "category"} <= set(texts)  # a choice that prefixes another stays reachable


def test_optional_suffix_after_an_accepting_state(backend, vocab):
    # A regex that may end early must still allow its longer continuations.
    grammar = backend.compile(GrammarSpec.regex(r"\d+(\.\d+)?"))
    for text in ["12.5", "0.25", "7"]:
        matcher = grammar.new_matcher()
        assert matcher.accept_tokens(vocab.encode(text)), text
        assert matcher.accept_token(vocab.eos_token_ids[0])


def test_leading_caret_and_trailing_dollar_are_accepted(backend, vocab):
    grammar = backend.compile(GrammarSpec.regex(r"^ab(c)?$"))
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens(vocab.encode("abc"))
    assert matcher.accept_token(vocab.eos_token_ids[0])


@pytest.mark.parametrize("pattern", [r"a(", r"[z-a]", r"a{3,1}"])
def test_invalid_regex_raises_compile_error(backend, pattern):
    with pytest.raises(GrammarCompileError, match=r"^Failed to compile regex grammar: "):
        backend.compile(GrammarSpec.regex(pattern))


def test_choices_spec_validation():
    with pytest.raises(ValueError, match="non-empty"):
        GrammarSpec.choices([])
    with pytest.raises(ValueError, match="kind"):
        GrammarSpec("xml", "<a/>")
    assert GrammarSpec.choices(["a", "b"]).canonical() == '["a", "b"]'
