"""Constrained decoding: grammar specs, backends (outlines-core, llguidance), compile cache,
packed token bitmasks and jump-forward. A library: it never imports the serving runtime."""

from radixlm.grammar.base import (
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarMatcher,
    GrammarSpec,
    NullGrammarBackend,
)
from radixlm.grammar.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_all_allowed,
)
from radixlm.grammar.cache import GrammarCompileCache
from radixlm.grammar.jump_forward import (
    ForcedContinuation,
    JumpForwardEdit,
    apply_edit,
    forced_continuation,
    retokenize_forced,
)
from radixlm.grammar.registry import (
    GRAMMAR_BACKEND_NAMES,
    GrammarConfig,
    create_compile_cache,
    create_grammar_backend,
)
from radixlm.grammar.vocab import TokenizerVocab, build_vocab

__all__ = [
    "GRAMMAR_BACKEND_NAMES",
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "ForcedContinuation",
    "GrammarBackend",
    "GrammarCompileCache",
    "GrammarCompileError",
    "GrammarConfig",
    "GrammarMatcher",
    "GrammarSpec",
    "JumpForwardEdit",
    "NullGrammarBackend",
    "TokenizerVocab",
    "allocate_token_bitmask",
    "apply_edit",
    "apply_token_bitmask_inplace",
    "build_vocab",
    "create_compile_cache",
    "create_grammar_backend",
    "fill_all_allowed",
    "forced_continuation",
    "retokenize_forced",
]
