"""EBNF grammars (Lark and GBNF syntax) through llguidance."""

from __future__ import annotations

import ast
import json
import random
import re

import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.testing import random_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

ARITHMETIC = r"""
start: expr
expr: term (OP term)*
term: NUMBER | "(" expr ")"
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""
NESTED_LISTS = r"""
start: list
list: "[" [item ("," item)*] "]"
item: INT | list
INT: /-?(0|[1-9][0-9]?)/
"""
GBNF_GREETING = r"""
root ::= greeting " " name ("!" | ".")
greeting ::= "hello" | "hi"
name ::= [a-z] [a-z]? [a-z]? [a-z]?
"""


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


@pytest.fixture(scope="module")
def backend(vocab):
    return LLGuidanceBackend(vocab)


def _texts(backend, vocab, grammar_text, num_walks, seed):
    grammar = backend.compile(GrammarSpec.ebnf(grammar_text))
    rng = random.Random(seed)
    texts = []
    for _ in range(num_walks):
        matcher = grammar.new_matcher()
        ids, finished = random_walk(
            matcher, vocab, rng, max_tokens=1500, eos_probability=0.5, check_rejections=False
        )
        assert finished, f"no EOS after {vocab.decode_bytes(ids)!r}"
        texts.append(vocab.decode_bytes(ids).decode("utf-8"))
    return texts


def _is_arithmetic(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp):
        ops = (ast.Add, ast.Sub, ast.Mult)
        return isinstance(node.op, ops) and _is_arithmetic(node.left) and _is_arithmetic(node.right)
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def test_lark_arithmetic_grammar(backend, vocab):
    texts = _texts(backend, vocab, ARITHMETIC, num_walks=12, seed=1)
    for text in texts:
        assert re.fullmatch(r"[0-9+\-*()]+", text), text
        stripped = re.sub(r"\b0+(\d)", r"\1", text)  # Python rejects leading zeros
        assert _is_arithmetic(ast.parse(stripped, mode="eval").body), text
    assert any("(" in t for t in texts) or len(set(texts)) > 3


def test_lark_recursive_lists(backend, vocab):
    texts = _texts(backend, vocab, NESTED_LISTS, num_walks=12, seed=2)

    def well_formed(value) -> bool:
        if isinstance(value, list):
            return all(well_formed(v) for v in value)
        return isinstance(value, int) and -99 <= value <= 99

    for text in texts:
        assert well_formed(json.loads(text)), text
    assert any(text.count("[") > 1 for text in texts)  # the recursion is exercised


def test_gbnf_grammar(backend, vocab):
    for text in _texts(backend, vocab, GBNF_GREETING, num_walks=12, seed=3):
        assert re.fullmatch(r"(hello|hi) [a-z]{1,4}[!.]", text), text


@pytest.mark.parametrize(
    "grammar_text",
    ["start: foo", 'start: "a" (', 'root ::= "a" | (', "start: /a(/"],
)
def test_invalid_ebnf_raises_compile_error(backend, grammar_text):
    with pytest.raises(GrammarCompileError, match=r"^Failed to compile ebnf grammar: "):
        backend.compile(GrammarSpec.ebnf(grammar_text))


def test_outlines_rejects_ebnf_with_advice(vocab):
    with pytest.raises(GrammarCompileError, match="llguidance"):
        OutlinesBackend(vocab).compile(GrammarSpec.ebnf(ARITHMETIC))
