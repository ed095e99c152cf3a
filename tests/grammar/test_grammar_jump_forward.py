"""Jump-forward: forced tokens and boundary re-tokenization."""

from __future__ import annotations

import dataclasses
import random

import pytest

from radixlm.grammar.base import GrammarSpec
from radixlm.grammar.jump_forward import (
    JumpForwardEdit,
    apply_edit,
    forced_continuation,
    retokenize_forced,
)
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.testing import random_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

BACKENDS = {"outlines": OutlinesBackend, "llguidance": LLGuidanceBackend}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend_name(request):
    return request.param


def _matcher(backend_name, vocab, spec, whitespace_pattern=""):
    backend = BACKENDS[backend_name](vocab, whitespace_pattern=whitespace_pattern)
    return backend.compile(spec).new_matcher()


def test_fixed_keys_are_forced_at_the_start_of_the_object(backend_name, vocab):
    matcher = _matcher(backend_name, vocab, GrammarSpec.json_schema(PERSON))
    forced = forced_continuation(matcher, vocab)
    assert forced.token_ids, "the opening of the object is forced"
    assert forced.text is not None and forced.text.startswith('{"name":')
    assert forced.text.startswith(vocab.decode_bytes(list(forced.token_ids)).decode())
    assert matcher.copy().accept_tokens(list(forced.token_ids))


def test_forced_tokens_with_optional_whitespace(backend_name, vocab):
    matcher = _matcher(backend_name, vocab, GrammarSpec.json_schema(PERSON), r"[ ]?")
    assert forced_continuation(matcher, vocab).text == "{"  # a space may follow the brace
    assert _matcher(backend_name, vocab, GrammarSpec.regex("[ab]+")).forced_tokens() == []


def test_forced_text_between_fields(backend_name, vocab):
    matcher = _matcher(backend_name, vocab, GrammarSpec.json_schema(PERSON))
    assert matcher.accept_tokens(vocab.encode('{"name":"bob"'))
    forced = forced_continuation(matcher, vocab)
    assert forced.text == ',"age":'
    assert vocab.decode_bytes(list(forced.token_ids)) == b',"age":'


def test_retokenization_merges_across_the_boundary(backend_name, vocab):
    matcher = _matcher(backend_name, vocab, GrammarSpec.json_schema(PERSON))
    generated = vocab.encode('{"name":"bob"')
    assert matcher.accept_tokens(generated)
    forced = forced_continuation(matcher, vocab).text
    edit = retokenize_forced(matcher, vocab, generated, forced)
    kept = generated[: len(generated) - edit.num_rollback]
    result = kept + list(edit.token_ids)
    assert vocab.decode_bytes(result) == b'{"name":"bob","age":'
    assert result == vocab.encode('{"name":"bob","age":')  # what the tokenizer itself produces
    assert edit.num_rollback == 1  # the closing quote merged with the comma
    assert apply_edit(matcher, edit)
    assert matcher.num_accepted_tokens == len(result)
    ids, finished = random_walk(matcher, vocab, random.Random(0), check_rejections=False)
    assert finished and vocab.decode_bytes(result + ids).endswith(b"}")


def test_retokenization_falls_back_to_forced_tokens(backend_name, vocab):
    class Garbling:
        def encode(self, text, add_special_tokens=False):
            return [vocab.ids_by_bytes[b"x"][0]] * len(text)

    matcher = _matcher(backend_name, vocab, GrammarSpec.json_schema(PERSON))
    generated = vocab.encode('{"name":"al"')
    assert matcher.accept_tokens(generated)
    garbling_vocab = dataclasses.replace(vocab, tokenizer=Garbling())
    edit = retokenize_forced(matcher, garbling_vocab, generated, ',"age":')
    assert edit == JumpForwardEdit(0, tuple(matcher.forced_tokens()))
    assert retokenize_forced(matcher, vocab, generated, "").is_empty


def test_apply_edit_refuses_what_the_grammar_rejects(backend_name, vocab):
    matcher = _matcher(backend_name, vocab, GrammarSpec.regex("ab"))
    bad = JumpForwardEdit(0, tuple(vocab.encode("ba")))
    assert not apply_edit(matcher, bad)
    assert matcher.num_accepted_tokens == 0
