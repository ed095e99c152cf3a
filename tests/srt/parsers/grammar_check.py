"""Whether a constraint fragment's grammar accepts a text: compiled by the llguidance backend
for a tiny byte-level tokenizer, the text's tokens fed to a matcher, then EOS."""

from __future__ import annotations

import json
from functools import lru_cache

from radixlm.grammar.base import GrammarSpec
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab


@lru_cache(maxsize=1)
def _backend() -> LLGuidanceBackend:
    return LLGuidanceBackend(build_vocab(train_byte_level_tokenizer()))


def spec_of(fragment: dict) -> GrammarSpec:
    ((kind, value),) = fragment.items()
    if kind == "json_schema":
        return GrammarSpec.json_schema(value)
    return GrammarSpec(kind, value if isinstance(value, str) else json.dumps(value))


class Checker:
    """One compiled fragment; ``accepts(text)`` for any number of texts."""

    def __init__(self, fragment: dict) -> None:
        self.grammar = _backend().compile(spec_of(fragment))

    def accepts(self, text: str) -> bool:
        backend = _backend()
        matcher = self.grammar.new_matcher()
        for token in backend.vocab.encode(text):
            if not matcher.accept_token(token):
                return False
        return matcher.accept_token(backend.vocab.eos_token_ids[0])
