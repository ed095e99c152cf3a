"""llguidance backend: Lark / GBNF grammars, JSON schemas, regexes, choices and structural
tags (structural_tag.py; only this backend compiles them).

llguidance parses lazily (an Earley parser over a lexer), so compiling is cheap even for schemas
outlines-core cannot turn into a DFA in time. A compiled grammar keeps one validated template
``LLMatcher``; each request gets a deep copy of it.

JSON schema options: ``oneOf`` is compiled as ``anyOf`` (``coerce_one_of``; outlines-core does
the same), so a document matching several branches is possible. A ``lenient`` backend (the last
resort of ``auto``) also ignores keywords and formats llguidance does not implement (``not``,
``uniqueItems``, ``propertyNames``, ``dependencies``, unknown ``format`` values) instead of
rejecting the schema.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

import llguidance
import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from radixlm.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarMatcher,
    GrammarSpec,
)
from radixlm.grammar.bitmask import BitmaskBuffer, bitmask_width, pack_token_ids
from radixlm.grammar.lark_json import bound_json_whitespace
from radixlm.grammar.limits import GrammarLimits
from radixlm.grammar.outlines_backend import ANY_JSON_OBJECT_SCHEMA, DEFAULT_WHITESPACE_PATTERN
from radixlm.grammar.regex_text import ascii_digit_classes, choices_regex
from radixlm.grammar.schema_checks import (
    check_compilable,
    optional_property_counts,
    unsatisfiable_reason,
)
from radixlm.grammar.schema_keywords import unenforced_keywords
from radixlm.grammar.schema_rewrite import rewrite_schema
from radixlm.grammar.structural_tag import (
    parse_structural_tag,
    structural_tag_grammar,
    structural_tag_schemas,
)
from radixlm.grammar.vocab import TokenizerVocab

logger = logging.getLogger(__name__)

# Parser limits (llguidance's defaults except where noted). Each bounds the work and memory of
# one step, so a grammar too complex for them fails with a parser error instead of allocating
# without bound; ``_probe`` meets the common cases at compile time.
# * max_items_in_row 8,000 (default 2,000): an object of n optional properties puts about
#   4n Earley items in the row after ``{``; the default failed schemas of 500+ optional
#   properties on their first token ("row has 4007 items" for 1,000).
# * step_max_items 50,000 (items per mask step, about 20k per ms), max_lexer_states 250,000
#   (1-2 kB each: at most about 500 MB of lexer states per grammar), max_grammar_size
#   500,000 symbols, lexer fuel 1,000,000 initial / 200,000 per step.
MAX_ITEMS_IN_ROW = 8_000
# Words of llguidance errors that mean a resource limit (else: nothing can be produced).
_LIMIT_WORDS = ("limit", "max is", "Too many", "too many", "fuel", "too complex")
PROBE_STEPS = 4
# The row after "{" holds about 4n + 7 items for n optional properties (4,007 for 1,000), and
# building the matcher takes seconds beyond a few thousand: larger objects are refused before.
MAX_OPTIONAL_PROPERTIES = (MAX_ITEMS_IN_ROW - 8) // 4


class GrammarTooComplexError(GrammarCompileError):
    """A grammar past a parser limit (``auto`` does not retry it on lenient llguidance)."""


class InvalidSchemaError(GrammarCompileError):
    """A JSON schema that is invalid or matches no document (``minimum`` above ``maximum``,
    ``multipleOf`` 0, a bound that is not a number): ``auto`` does not retry it elsewhere, since
    outlines-core and lenient llguidance ignore the very keyword at fault."""


# Starts of llguidance errors that mean the schema itself is wrong, not merely unsupported.
_INVALID_SCHEMA_ERROR = re.compile(
    r"^(Unsatisfiable schema|invalid multiple of|Expected \S+ for '|"
    r"Invalid schema|Invalid value for)",
    re.IGNORECASE,
)


# A bound llguidance cannot turn into a regex (integers past +-2^63, huge floats): the other
# engines would ignore the bound (output 9223372036854775807 for "minimum": 1e20), so a 400.
_UNENFORCEABLE_RANGE = re.compile(r"^Failed to generate regex for (integer|float) range")


def compile_error(kind: str, message: str) -> GrammarCompileError:
    """The error for llguidance's ``message``: ``InvalidSchemaError`` for a wrong schema or a
    numeric bound no engine here enforces."""
    message = message.strip()
    if _INVALID_SCHEMA_ERROR.match(message):
        return InvalidSchemaError(kind, message)
    if _UNENFORCEABLE_RANGE.match(message):
        return InvalidSchemaError(
            kind,
            "a minimum / maximum outside the range the grammar engine enforces (integers "
            f"within +-2^63, numbers of moderate size): {message}",
        )
    return GrammarCompileError(kind, message)


# llguidance's error for an allOf whose intersection nests past its stack bound (128 levels)
_INTERSECTION_DEPTH = "intersection stack level exceeded"
# tokens consumed at compile time to meet "too complex" before requests do


def parser_limits() -> LLParserLimits:
    return LLParserLimits(
        max_items_in_row=MAX_ITEMS_IN_ROW,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        verbose_errors=False,
    )


class _VocabTokenizerView:
    """Presents a ``TokenizerVocab`` the way ``llguidance.TokenizerWrapper`` expects."""

    def __init__(self, vocab: TokenizerVocab) -> None:
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = getattr(vocab.tokenizer, "bos_token_id", None)
        self.special_token_ids = sorted(vocab.special_token_ids)
        self.tokens = [
            data if data else b"\xff<|special_%d|>" % i for i, data in enumerate(vocab.token_bytes)
        ]
        self._vocab = vocab

    def __call__(self, text: str) -> list[int]:
        return self._vocab.encode(text)


def has_text_added_tokens(tokenizer: Any) -> bool:
    """Whether the tokenizer adds tokens that are ordinary text (``special=False``, such as
    Qwen's ``<tool_call>``): llguidance's HF-JSON reader treats every added token as special,
    so a grammar could never produce them."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return any(not getattr(token, "special", True) for token in added.values())


def build_lltokenizer(vocab: TokenizerVocab, use_hf_json: bool = True) -> LLTokenizer:
    """llguidance's tokenizer: from the HF tokenizer JSON, else (or when added tokens are
    ordinary text) from the decoded vocabulary."""
    eos = list(vocab.eos_token_ids)
    if use_hf_json and vocab.tokenizer is not None and not has_text_added_tokens(vocab.tokenizer):
        try:
            from llguidance.hf import from_tokenizer  # imports transformers; only needed here

            return from_tokenizer(vocab.tokenizer, n_vocab=vocab.vocab_size, eos_token=eos)
        except Exception as exc:  # unusual tokenizers: fall back to the decoded vocabulary
            logger.info("llguidance cannot read the tokenizer JSON (%s); using decoded bytes", exc)
    wrapper = llguidance.TokenizerWrapper(_VocabTokenizerView(vocab))
    return LLTokenizer(wrapper, n_vocab=vocab.vocab_size, eos_token=eos)


class LLGuidanceGrammar(CompiledGrammar):
    backend_name = "llguidance"

    def __init__(
        self, spec: GrammarSpec, grammar_text: str, template: LLMatcher, vocab: TokenizerVocab
    ) -> None:
        self.spec = spec
        self.grammar_text = grammar_text
        self.vocab = vocab
        self.eos_ids = frozenset(vocab.eos_token_ids)
        self.eos_row = pack_token_ids(vocab.eos_token_ids, vocab.vocab_size).numpy().tobytes()
        self._template = template
        self._lock = threading.Lock()

    def new_matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            return LLGuidanceMatcher(self, self._template.deep_copy())

    def size_bytes(self) -> int:
        # The grammar and its lazily built lexer states: small next to an outlines-core index.
        return (64 << 10) + 16 * len(self.grammar_text)

    def probe(self) -> None:
        """Computes the first mask and follows up to ``PROBE_STEPS`` tokens (the lowest allowed
        id each time) on a scratch copy; raises ``GrammarCompileError`` when the grammar accepts
        nothing (no text token and no end at the start) or hits a parser limit on the way.

        On the compile thread, so "too complex" shows up as a compile error rather than in the
        middle of a request (``root ::= "a" root`` fails on its first token, an object of
        thousands of optional properties right after ``{``). It also warms the first mask:
        llguidance builds lexer states on first use and shares them among the template's
        copies, so the first request's first row does not pay for them on the scheduler thread
        (60 us to 1.6 ms on jsonschemabench schemas, about 20 us for later copies)."""
        scratch = np.zeros(bitmask_width(self.vocab.vocab_size), dtype=np.int32)
        eos = np.array(self.vocab.eos_token_ids, dtype=np.int64)
        with self._lock:
            matcher = self._template.deep_copy()
        for step in range(PROBE_STEPS + 1):
            matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            self._raise_on_error(matcher)
            bits = np.unpackbits(scratch.view(np.uint8), bitorder="little")[: self.vocab.vocab_size]
            text = np.setdiff1d(np.flatnonzero(bits), eos)
            if step == 0 and not text.size and not matcher.is_accepting():
                raise GrammarCompileError(
                    self.spec.kind,
                    "the grammar accepts no string (at "
                    "its start it can neither produce text nor end)",
                )
            if not text.size or step == PROBE_STEPS:
                return
            matcher.consume_token(int(text[0]))
            self._raise_on_error(matcher)

    def _raise_on_error(self, matcher: LLMatcher) -> None:
        if not matcher.is_error():
            return
        error = _first_line(matcher.get_error())
        if any(word in error for word in _LIMIT_WORDS):
            raise GrammarTooComplexError(
                self.spec.kind, f"the grammar is too complex for the parser's limits ({error})"
            )
        raise GrammarCompileError(self.spec.kind, f"the grammar accepts no string ({error})")

    def serialize(self) -> bytes:
        return self.grammar_text.encode("utf-8")


class LLGuidanceMatcher(GrammarMatcher):
    """Wraps an ``LLMatcher``, testing tokens before consuming them (a rejected token would put
    the ``LLMatcher`` into a permanent error state)."""

    def __init__(self, grammar: LLGuidanceGrammar, matcher: LLMatcher) -> None:
        self._grammar = grammar
        self._matcher = matcher
        self._terminated = False
        self._num_accepted = 0
        self._repeated_eos = 0  # EOS tokens accepted after termination (not given to llguidance)

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted

    def fill_row(self, buffer: BitmaskBuffer, row: int) -> None:
        if self._terminated:
            buffer.write(row, self._grammar.eos_row)
        else:  # llguidance writes the row in place (with the GIL released)
            self._matcher.unsafe_compute_mask_ptr(buffer.row_address(row), buffer.row_bytes)

    def accept_token(self, token_id: int) -> bool:
        if token_id in self._grammar.eos_ids:
            return self._accept_eos(token_id)
        if self._terminated or not 0 <= token_id < self._grammar.vocab.vocab_size:
            return False
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        accepted = self._matcher.consume_token(token_id)
        assert accepted, self._matcher.get_error()
        self._num_accepted += 1
        return True

    def _accept_eos(self, token_id: int) -> bool:
        if self._terminated:
            self._repeated_eos += 1
        elif self._matcher.is_accepting():
            accepted = self._matcher.consume_token(token_id)
            assert accepted, self._matcher.get_error()
            self._terminated = True
        else:
            return False
        self._num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {self._num_accepted} are accepted"
            )
        repeated = min(num_tokens, self._repeated_eos)
        self._repeated_eos -= repeated
        real = num_tokens - repeated
        if real:
            assert self._matcher.rollback(real), self._matcher.get_error()
            self._terminated = False
        self._num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_tokens(self, max_tokens: int | None = None) -> list[int]:
        if self._terminated or max_tokens == 0:
            return []
        eos = self._grammar.eos_ids
        forced = [t for t in self._matcher.compute_ff_tokens() if t not in eos]
        return forced if max_tokens is None else forced[:max_tokens]

    def forced_bytes(self) -> bytes:
        return b"" if self._terminated else bytes(self._matcher.compute_ff_bytes())

    def error(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return _first_line(self._matcher.get_error())

    def copy(self) -> LLGuidanceMatcher:
        clone = LLGuidanceMatcher(self._grammar, self._matcher.deep_copy())
        clone._terminated = self._terminated
        clone._num_accepted = self._num_accepted
        clone._repeated_eos = self._repeated_eos
        return clone


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["unknown parser error"])[0]


def _tag_schemas(spec: GrammarSpec, limits: GrammarLimits) -> list:
    """The JSON schemas of a structural tag; ``GrammarCompileError`` when one admits no finite
    document (as ``check_compilable`` does for the json_schema kind)."""
    try:
        schemas = structural_tag_schemas(parse_structural_tag(str(spec.value), limits))
    except ValueError as exc:
        raise GrammarCompileError(spec.kind, str(exc)) from None
    for schema in schemas:
        reason = unsatisfiable_reason(schema)
        if reason is not None:
            raise GrammarCompileError(spec.kind, f"a tag's JSON schema: {reason}")
    return schemas


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(
        self,
        vocab: TokenizerVocab,
        whitespace_pattern: str = DEFAULT_WHITESPACE_PATTERN,
        lenient: bool = False,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.vocab = vocab
        self.limits = limits or GrammarLimits()
        self.whitespace_pattern = whitespace_pattern
        self.lenient = lenient  # JSON schemas: ignore unimplemented keywords, do not reject
        self._tokenizer: LLTokenizer | None = None  # built on first use (about 1 s for 128k)
        self._tokenizer_owner: LLGuidanceBackend = self  # a twin uses its origin's tokenizer
        self._lock = threading.Lock()

    def cache_tag(self) -> str:
        lenient = ",lenient" if self.lenient else ""
        version_tag = f"v={llguidance.__version__},rw=5"  # rw: rewrites (one_of, closed objects, %json ws, false)
        return f"llguidance(ws={self.whitespace_pattern!r}{lenient},{version_tag})"

    def lenient_twin(self) -> LLGuidanceBackend:
        """A lenient backend sharing this one's tokenizer."""
        twin = LLGuidanceBackend(
            self.vocab, self.whitespace_pattern, lenient=True, limits=self.limits
        )
        twin._tokenizer_owner = self
        return twin

    def lltokenizer(self) -> LLTokenizer:
        if self._tokenizer_owner is not self:
            return self._tokenizer_owner.lltokenizer()
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = build_lltokenizer(self.vocab)
            return self._tokenizer

    def grammar_text(self, spec: GrammarSpec, intersect_objects: bool = False) -> str:
        """The llguidance grammar for ``spec``; raises ``GrammarCompileError``. With
        ``intersect_objects``, ``allOf``s of object schemas are merged first
        (``schema_forbid.intersect_all_of``)."""
        try:
            if spec.kind == "ebnf":
                lark = bound_json_whitespace(str(spec.value), self.whitespace_pattern)
                return llguidance.grammar_from("ebnf", lark)
            if spec.kind == "regex":
                return LLMatcher.grammar_from_regex(ascii_digit_classes(str(spec.value)))
            if spec.kind == "choices":
                return LLMatcher.grammar_from_regex(choices_regex(spec.value))
            if spec.kind == "structural_tag":
                tag = parse_structural_tag(str(spec.value), self.limits)
                return structural_tag_grammar(tag, self.whitespace_pattern, lenient=self.lenient)
            if spec.kind == "json_object":
                schema = ANY_JSON_OBJECT_SCHEMA
            else:
                schema = rewrite_schema(str(spec.value), intersect_objects=intersect_objects)
            options = {
                "whitespace_pattern": self.whitespace_pattern,
                "coerce_one_of": True,
                "lenient": self.lenient,
            }
            return LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except (ValueError, TypeError) as exc:
            raise compile_error(spec.kind, str(exc)) from exc

    def compile(self, spec: GrammarSpec) -> LLGuidanceGrammar:
        schemas = [check_compilable(spec, self.limits)]
        if spec.kind == "structural_tag":  # the schemas inside its tags
            schemas = _tag_schemas(spec, self.limits)
        counts = [n for s in schemas if s is not None for n in optional_property_counts(s)]
        most = max(counts, default=0)
        if most > MAX_OPTIONAL_PROPERTIES:  # fail in microseconds, not after a long build
            raise GrammarTooComplexError(
                spec.kind,
                f"an object has {most:,} optional "
                f"properties; at most {MAX_OPTIONAL_PROPERTIES:,} are "
                "supported (mark some as required)",
            )
        try:
            grammar = self._build(spec, self.grammar_text(spec))
        except GrammarCompileError as error:
            if spec.kind != "json_schema" or _INTERSECTION_DEPTH not in error.reason:
                raise
            # llguidance intersects allOf branches recursively: merge the objects here
            grammar = self._build(spec, self.grammar_text(spec, intersect_objects=True))
        if spec.kind == "json_schema":
            engine = "llguidance-lenient" if self.lenient else "llguidance"
            rewritten = json.loads(rewrite_schema(str(spec.value)))
            grammar.unenforced = unenforced_keywords(rewritten, engine, schemas[0])
        return grammar

    def deserialize(self, spec: GrammarSpec, backend_name: str, data: bytes) -> LLGuidanceGrammar:
        if backend_name != self.name:
            raise GrammarCompileError(spec.kind, f"cannot load a {backend_name} grammar")
        return self._build(spec, data.decode("utf-8"))

    def _build(self, spec: GrammarSpec, grammar_text: str) -> LLGuidanceGrammar:
        template = LLMatcher(self.lltokenizer(), grammar_text, log_level=0, limits=parser_limits())
        if template.is_error():
            raise compile_error(spec.kind, template.get_error())
        grammar = LLGuidanceGrammar(spec, grammar_text, template, self.vocab)
        grammar.probe()  # on the compile thread, not the scheduler's
        return grammar
