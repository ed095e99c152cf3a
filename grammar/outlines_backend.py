"""outlines-core backend: regex, choices, JSON schema and any-JSON-object as token-level DFAs.

A JSON schema becomes a regex (``outlines_core.json_schema.build_regex_from_schema``), the regex
becomes an ``Index`` over the vocabulary. Recursive structures are unrolled to a fixed depth, so
``json_object`` works but compiles slowly on large vocabularies (the auto backend sends it to
llguidance). EBNF grammars are not regular and are rejected.
"""

from __future__ import annotations

import json
import threading
from importlib.metadata import version

import outlines_core

from radixlm.grammar.base import GrammarBackend, GrammarCompileError, GrammarSpec
from radixlm.grammar.limits import GrammarLimits
from radixlm.grammar.outlines_grammar import OutlinesGrammar
from radixlm.grammar.outlines_worker import IndexJob, IndexWorkerPool
from radixlm.grammar.regex_text import anchor_regex, ascii_digit_classes, choices_regex
from radixlm.grammar.schema_checks import check_compilable, schema_nodes
from radixlm.grammar.schema_keywords import unenforced_keywords
from radixlm.grammar.schema_rewrite import rewrite_schema
from radixlm.grammar.vocab import TokenizerVocab

# JSON whitespace allowed between tokens: at most one space. Unbounded whitespace lets a model
# loop on blanks and makes the automata larger.
DEFAULT_WHITESPACE_PATTERN = r"[ ]?"
ANY_JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _failure_reason(error: BaseException) -> str:
    return str(error).strip() or type(error).__name__


def spec_to_regex(spec: GrammarSpec, whitespace_pattern: str, max_chars: int | None = None) -> str:
    """The (end-anchored) regex outlines-core compiles for ``spec``; raises
    ``GrammarCompileError`` when the source regex has more than ``max_chars`` characters. The
    length is checked before the ``\\d`` rewrite, which takes seconds on the 23 M-character
    regexes of some jsonschemabench schemas."""
    regex = _source_regex(spec, whitespace_pattern)
    if max_chars is not None and len(regex) > max_chars:
        raise GrammarCompileError(
            spec.kind,
            f"its regex has {len(regex):,} characters, over the {max_chars:,} allowed for "
            "outlines-core",
        )
    if spec.kind != "choices":  # regexes and schema patterns read \d as [0-9]
        regex = ascii_digit_classes(regex)
    return anchor_regex(regex)


def _source_regex(spec: GrammarSpec, whitespace_pattern: str) -> str:
    if spec.kind == "regex":
        return str(spec.value)
    if spec.kind == "choices":
        return choices_regex(spec.value)
    if spec.kind in ("ebnf", "structural_tag"):
        raise GrammarCompileError(
            spec.kind,
            "the outlines backend handles regular grammars only; use llguidance or auto",
        )
    schema = schema_text_for(spec)
    try:
        return outlines_core.json_schema.build_regex_from_schema(schema, whitespace_pattern)
    except BaseException as exc:  # pyo3 panics derive from BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        raise GrammarCompileError(spec.kind, _failure_reason(exc)) from exc


# outlines-core's own regexes for these formats admit a raw quote, backslash or control
# character inside the JSON string (email's quoted local part, uri's [^\s]+, time's "\\."), so
# its output could stop being JSON; these patterns keep to characters a JSON string holds as
# they are (email: dot-atom local parts only; time: RFC 3339, offset required)
_NO_ESCAPES = r'[^\s"\\\x00-\x1f\x7f]'
_NO_ESCAPES_BUT = r'[^\s{}"\\\x00-\x1f\x7f]'
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
JSON_SAFE_FORMATS = {
    "email": rf"{_ATEXT}(\.{_ATEXT})*@({_LABEL}\.)+{_LABEL}",
    "uri": (
        rf"(((https?|ftp)://({_NO_ESCAPES_BUT.format(':@')}+(:{_NO_ESCAPES_BUT.format(':@')}*)?@)?"
        r"([A-Za-z0-9.-]+\.[A-Za-z]{2,}|localhost)(:[0-9]+)?"
        rf"(/{_NO_ESCAPES_BUT.format('?#')}*)?(\?{_NO_ESCAPES_BUT.format('#')}*)?(#{_NO_ESCAPES}*)?)"
        rf"|(urn:[A-Za-z0-9][A-Za-z0-9-]{{0,31}}:{_NO_ESCAPES}+))"
    ),
    "time": r"(2[0-3]|[01][0-9]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-](2[0-3]|[01][0-9]):[0-5][0-9])",
}


def schema_text_for(spec: GrammarSpec) -> str:
    """The schema text outlines-core turns into a regex (``json_schema``, ``json_object``):
    the shared rewrites, then ``JSON_SAFE_FORMATS`` as patterns where no pattern is given;
    raises ``GrammarCompileError`` when it does not parse."""
    schema = ANY_JSON_OBJECT_SCHEMA if spec.kind == "json_object" else str(spec.value)
    try:
        json.loads(schema)
        rewritten = rewrite_schema(schema)
        parsed = json.loads(rewritten)
    except (ValueError, RecursionError) as exc:
        raise GrammarCompileError(spec.kind, f"the schema is not valid JSON ({exc})") from exc
    changed = False
    for node in schema_nodes(parsed):
        pattern = JSON_SAFE_FORMATS.get(node.get("format"))  # type: ignore[arg-type]
        if pattern is not None and "pattern" not in node:
            del node["format"]
            node["pattern"] = pattern
            changed = True
    return json.dumps(parsed) if changed else rewritten


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(
        self,
        vocab: TokenizerVocab,
        whitespace_pattern: str = DEFAULT_WHITESPACE_PATTERN,
        max_regex_chars: int | None = None,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.vocab = vocab
        self.limits = limits or GrammarLimits()
        self.whitespace_pattern = whitespace_pattern
        # Longer regexes are rejected before building an index: their DFAs take tens of
        # seconds and gigabytes (auto sets this and sends such specs to llguidance).
        self.max_regex_chars = max_regex_chars
        self._vocabulary = None  # outlines_core.Vocabulary, built on first use
        self._lock = threading.Lock()

    def cache_tag(self) -> str:
        limit = f",max={self.max_regex_chars}" if self.max_regex_chars else ""
        version_tag = f"v={version('outlines_core')},rw=4"  # rw: schema_rewrite's revision
        return f"outlines(ws={self.whitespace_pattern!r}{limit},{version_tag})"

    def outlines_vocabulary(self):
        """The ``outlines_core.Vocabulary`` of this backend's tokenizer (built once)."""
        with self._lock:
            if self._vocabulary is None:
                eos = self.vocab.eos_token_ids[0]
                self._vocabulary = outlines_core.Vocabulary(eos, self.vocab.ids_by_bytes)
            return self._vocabulary

    def compile(self, spec: GrammarSpec) -> OutlinesGrammar:
        check_compilable(spec, self.limits)
        regex = self.regex_for(spec)
        vocabulary = self.outlines_vocabulary()
        try:
            index = outlines_core.Index(regex, vocabulary)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise GrammarCompileError(spec.kind, _failure_reason(exc)) from exc
        return self.grammar_from_index(spec, index)

    def regex_for(self, spec: GrammarSpec) -> str:
        """The regex outlines-core builds an index for; raises ``GrammarCompileError``."""
        return spec_to_regex(spec, self.whitespace_pattern, self.max_regex_chars)

    def deserialize(self, spec: GrammarSpec, backend_name: str, data: bytes) -> OutlinesGrammar:
        if backend_name != self.name:
            raise GrammarCompileError(spec.kind, f"cannot load a {backend_name} grammar")
        index = outlines_core.Index.from_binary(data)
        return self.grammar_from_index(spec, index, len(data))

    def start_build(self, pool: IndexWorkerPool, spec: GrammarSpec) -> IndexJob:
        """Starts building ``spec``'s index in one of ``pool``'s child processes (a JSON
        schema's regex is built there too: it can take gigabytes)."""
        if spec.kind in ("json_schema", "json_object"):
            return pool.start_schema(
                schema_text_for(spec), self.whitespace_pattern, self.max_regex_chars, spec.kind
            )
        return pool.start(self.regex_for(spec), spec.kind)

    def grammar_from_index(
        self, spec: GrammarSpec, index, serialized_bytes: int | None = None
    ) -> OutlinesGrammar:
        """``index``'s grammar; ``serialized_bytes``, when known, sizes it for the cache."""
        grammar = OutlinesGrammar(spec, index, self.vocab, serialized_bytes)
        if (
            not grammar.is_final(grammar.initial_state)
            and not grammar.text_token_ids(grammar.initial_state).size
        ):
            raise GrammarCompileError(
                spec.kind, "the grammar accepts no string (no token of the vocabulary can start it)"
            )
        grammar.warm_rows()  # every row now if the DFA is small; else on first visits
        if spec.kind == "json_schema":
            compiled = json.loads(schema_text_for(spec))
            grammar.unenforced = unenforced_keywords(compiled, "outlines", json.loads(spec.value))
        return grammar
