"""The constrained-decoding contract: grammar specs, backends, compiled grammars and matchers.

Layers (each backend implements the three classes below):

    GrammarSpec ──GrammarBackend.compile()──> CompiledGrammar ──new_matcher()──> GrammarMatcher
    (what the user asked for)                 (shared, immutable,   (one per request; mutable
                                               cached by spec)       decoding state)

Token masks are packed int32 bitmasks of shape ``[batch, ceil(V / 32)]``: token ``t`` is allowed
in row ``r`` when bit ``t % 32`` of ``bitmask[r, t // 32]`` is set (the layout shared by
outlines-core, llguidance and XGrammar). ``V`` is the model's logits width, which may exceed the
tokenizer's length; ids without a token are never allowed.

EOS contract: an EOS id is allowed only where the grammar may end; accepting it terminates the
matcher; a terminated matcher allows EOS only and rejects every other token.

Threads: ``GrammarBackend.compile`` may run on any thread (the compile cache runs it on worker
threads). A ``CompiledGrammar`` is shared by many matchers and must tolerate concurrent
``new_matcher`` calls. A ``GrammarMatcher`` belongs to one request and is used by one thread at
a time (a caller may hand it to a worker thread between steps, with a happens-before edge such
as a queue or an event); matchers of one grammar may run on different threads at once.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.grammar.bitmask import BitmaskBuffer

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "choices", "json_object", "structural_tag")
_MAX_REASON_CHARS = 600


class GrammarCompileError(ValueError):
    """A grammar that cannot be compiled; the message starts with ``Failed to compile``."""

    def __init__(self, kind: str, reason: str) -> None:
        reason = reason.strip() or "unknown error"
        if len(reason) > _MAX_REASON_CHARS:
            reason = reason[: _MAX_REASON_CHARS - 3] + "..."
        self.kind = kind
        self.reason = reason
        super().__init__(f"Failed to compile {kind} grammar: {reason}")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to.

    ``value`` is the JSON schema text (``json_schema``), the pattern (``regex``), the grammar
    text (``ebnf``: Lark or GBNF), the tuple of allowed strings (``choices``), ``""``
    (``json_object``: any JSON object) or the structural tag as JSON text (``structural_tag``:
    free text with tagged, constrained sections; see structural_tag.py). Build one with the
    class methods.
    """

    kind: str
    value: str | tuple[str, ...]

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(
                f"grammar kind must be one of {list(GRAMMAR_KINDS)}, got {self.kind!r}"
            )
        if self.kind == "choices":
            if not isinstance(self.value, tuple) or not self.value:
                raise ValueError("choices must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.value):
                raise ValueError("every choice must be a string")
        elif not isinstance(self.value, str):
            raise ValueError(f"a {self.kind} grammar must be given as a string")

    @classmethod
    def json_schema(cls, schema: str | dict[str, Any] | bool) -> GrammarSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def choices(cls, options: list[str] | tuple[str, ...]) -> GrammarSpec:
        return cls("choices", tuple(options))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object", "")

    @classmethod
    def structural_tag(cls, text: str | dict[str, Any]) -> GrammarSpec:
        """A structural tag (JSON text or its parsed dict), stored as canonical JSON text:
        no insignificant whitespace, key order kept. Text that does not parse is kept as
        given (``limits.check_spec`` and the compiler report it)."""
        if isinstance(text, dict):
            return cls("structural_tag", _compact_json(text))
        return cls("structural_tag", _canonical_json(text) if isinstance(text, str) else text)

    def canonical(self) -> str:
        """A normal form for cache keys: equal for specs that compile to the same grammar.

        JSON schemas are re-serialized without insignificant whitespace but with their key
        order kept (property order decides the generated field order). Unparsable schemas keep
        their text, so they still get a stable key (and a cached failure).
        """
        if self.kind == "choices":
            return json.dumps(list(self.value), ensure_ascii=False)
        if self.kind in ("json_schema", "structural_tag"):
            return _canonical_json(str(self.value))
        return str(self.value)

    def describe(self, max_chars: int = 80) -> str:
        text = self.canonical()
        short = text if len(text) <= max_chars else text[: max_chars - 3] + "..."
        return f"{self.kind}:{short}"


def _canonical_json(text: str) -> str:
    """``text`` re-serialized compactly with key order kept; unparsable text as it is."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return _compact_json(parsed)


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class GrammarMatcher(ABC):
    """Per-request decoding state over one compiled grammar."""

    @abstractmethod
    def fill_row(self, buffer: BitmaskBuffer, row: int) -> None:
        """Writes the allowed next tokens into row ``row`` of ``buffer`` (the scheduler's path:
        it keeps one ``BitmaskBuffer`` per allocated bitmask)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (CPU int32 ``[B, ceil(V/32)]``,
        contiguous)."""
        self.fill_row(BitmaskBuffer(bitmask), row)

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; returns False (and leaves the state unchanged) if disallowed."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens (EOS included)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once an EOS token has been accepted."""

    @abstractmethod
    def forced_tokens(self, max_tokens: int | None = None) -> list[int]:
        """Tokens the grammar forces next (for jump-forward), at most ``max_tokens`` of them
        (None: as many as the backend computes, which it bounds itself); may be empty; never
        EOS. A grammar may force text forever (``root ::= "a" root``): callers pass the
        request's remaining token budget."""

    def forced_bytes(self) -> bytes:
        """The text the grammar forces next, as UTF-8 bytes, where the backend knows it."""
        return b""

    def error(self) -> str | None:
        """Why the matcher cannot go on (a parser limit hit while decoding), or None. A
        matcher whose mask allows no token while it is not terminated has an error; callers
        finish the request with it rather than sampling from an empty mask."""
        return None

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state."""

    @property
    @abstractmethod
    def num_accepted_tokens(self) -> int:
        """How many tokens are currently accepted (what ``rollback`` can undo)."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Accepts all tokens or none: on a rejection the accepted prefix is rolled back."""
        for i, token_id in enumerate(token_ids):
            if not self.accept_token(token_id):
                self.rollback(i)
                return False
        return True


class CompiledGrammar(ABC):
    """An immutable compiled grammar; cheap to turn into matchers."""

    spec: GrammarSpec
    backend_name: str
    # JSON schemas: keywords the engine compiled without enforcing them (``schema_keywords``),
    # ``format:<name>`` for unknown formats; set by the backend that compiled the grammar
    unenforced: tuple[str, ...] = ()

    @abstractmethod
    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start state."""

    def serialize(self) -> bytes | None:
        """Bytes the owning backend's ``deserialize`` turns back into this grammar, or None."""
        return None

    def size_bytes(self) -> int:
        """Estimated memory the grammar holds (the compile cache's byte bound counts it)."""
        return 0


class CompileControl:
    """What the compile cache tells a running compilation; a backend that waits on work it
    can stop (``auto``'s outlines-core child) asks while it waits. This default never stops."""

    def is_cancelled(self) -> bool:
        """True when nobody wants the result any more (requests aborted, deadline passed):
        the backend stops its work and raises ``GrammarCompileError``."""
        return False

    def should_yield(self) -> bool:
        """True when other specs wait for this worker: the backend may give up slow work
        and raise ``CompileDeferred``; the cache then retries it on its slow lane."""
        return False


class CompileDeferred(Exception):
    """A compilation gave up its worker to waiting specs (``CompileControl.should_yield``)."""


class GrammarBackend(ABC):
    """Compiles grammar specs against one tokenizer vocabulary."""

    name: str

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compiles ``spec``; raises ``GrammarCompileError`` for grammars it cannot compile."""

    def compile_controlled(self, spec: GrammarSpec, control: CompileControl) -> CompiledGrammar:
        """``compile`` as the compile cache runs it: a backend whose compilations can be slow
        polls ``control`` while it waits (may raise ``CompileDeferred``). Default: ``compile``."""
        return self.compile(spec)

    def cache_tag(self) -> str:
        """Names everything besides the spec and vocabulary that shapes compiled grammars
        (backend, options, library version): part of compile-cache keys."""
        return self.name

    def deserialize(self, spec: GrammarSpec, backend_name: str, data: bytes) -> CompiledGrammar:
        """Rebuilds a grammar from ``CompiledGrammar.serialize()`` output of ``backend_name``."""
        raise GrammarCompileError(spec.kind, f"backend {self.name} cannot load cached grammars")

    def shutdown(self) -> None:  # noqa: B027  (optional: most backends hold nothing)
        """Releases what the backend holds besides memory (child processes)."""


class NullGrammarBackend(GrammarBackend):
    """The backend used when constrained decoding is turned off: every spec is rejected."""

    name = "none"

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        raise GrammarCompileError(
            spec.kind, "constrained decoding is disabled; start the server with a grammar backend"
        )
