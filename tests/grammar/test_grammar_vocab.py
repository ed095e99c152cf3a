"""The grammar vocabulary decodes every token to the bytes the tokenizer would produce."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixlm.grammar.llguidance_backend import build_lltokenizer
from radixlm.grammar.testing import EOS_TOKEN, train_byte_level_tokenizer
from radixlm.grammar.vocab import _sentencepiece_bytes, build_vocab


@pytest.fixture(scope="module")
def tokenizer():
    return train_byte_level_tokenizer()


def test_byte_level_tokens_decode_like_the_tokenizer(tokenizer):
    vocab = build_vocab(tokenizer)
    rng = random.Random(0)
    text_ids = [i for i, data in enumerate(vocab.token_bytes) if data]
    assert len(text_ids) == len(tokenizer) - 1  # all but <|endoftext|>
    for _ in range(200):
        ids = [rng.choice(text_ids) for _ in range(rng.randint(1, 12))]
        expected = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        assert vocab.decode_bytes(ids).decode("utf-8", errors="replace") == expected
    for text in ['{"name": "Alice", "age": 30}', " leading space", "naïve 日本 \n\t#ff00aa"]:
        assert vocab.decode_bytes(vocab.encode(text)).decode("utf-8") == text


def test_special_tokens_are_outside_the_alphabet(tokenizer):
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    vocab = build_vocab(tokenizer)
    assert vocab.eos_token_ids == (eos,)
    assert vocab.token_bytes[eos] is None
    assert eos in vocab.special_token_ids
    assert all(eos not in ids for ids in vocab.ids_by_bytes.values())


def test_padded_vocab_size_and_explicit_eos_ids(tokenizer):
    vocab = build_vocab(tokenizer, eos_token_ids=[0, 5], vocab_size=len(tokenizer) + 30)
    assert vocab.vocab_size == len(tokenizer) + 30
    assert vocab.eos_token_ids == (0, 5)
    assert vocab.token_bytes[5] is None  # an EOS id leaves the alphabet
    assert all(data is None for data in vocab.token_bytes[len(tokenizer) :])
    assert vocab.fingerprint != build_vocab(tokenizer).fingerprint
    with pytest.raises(ValueError, match="smaller than"):
        build_vocab(tokenizer, vocab_size=len(tokenizer) - 1)
    with pytest.raises(ValueError, match="eos_token_ids"):
        build_vocab(tokenizer, eos_token_ids=[10_000])


def test_fingerprint_is_stable_and_vocab_specific(tokenizer):
    assert build_vocab(tokenizer).fingerprint == build_vocab(tokenizer).fingerprint
    other = train_byte_level_tokenizer(vocab_size=400)
    assert build_vocab(other).fingerprint != build_vocab(tokenizer).fingerprint


def test_llguidance_tokenizer_sees_the_same_bytes(tokenizer):
    vocab = build_vocab(tokenizer, vocab_size=len(tokenizer) + 7)
    for use_hf_json in (True, False):
        lltok = build_lltokenizer(vocab, use_hf_json=use_hf_json)
        for token_id, data in enumerate(vocab.token_bytes):
            # llguidance reserves a leading 0xFF byte (never valid UTF-8) to mark special tokens
            if data and data[0] != 0xFF:
                assert lltok.decode_bytes([token_id]) == data, token_id


def test_sentencepiece_pieces():
    assert _sentencepiece_bytes("<0x0A>") == b"\n"
    assert _sentencepiece_bytes("<0xE6>") == b"\xe6"
    assert _sentencepiece_bytes("\u2581hello") == b" hello"
    assert _sentencepiece_bytes("wor") == b"wor"


def test_metaspace_tokenizer_maps_word_boundaries_to_spaces():
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    backend.train_from_iterator(["hello world foo bar hello there world"] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    vocab = build_vocab(tokenizer)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert vocab.decode_bytes(ids) == b" hello world"  # the dummy prefix space is kept
    assert vocab.token_bytes[tokenizer.convert_tokens_to_ids("</s>")] is None


def test_text_added_tokens_can_be_generated_by_a_grammar():
    """A non-special added token (Qwen's ``<tool_call>``) is text a grammar may produce; read as
    special, a grammar forcing it would accept nothing."""
    from radixlm.grammar.base import GrammarSpec
    from radixlm.grammar.llguidance_backend import LLGuidanceBackend, has_text_added_tokens

    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_byte_level_tokenizer()._tokenizer, eos_token=EOS_TOKEN
    )
    assert not has_text_added_tokens(tok)
    tok.add_tokens(["<tool_call>"])  # special=False
    assert has_text_added_tokens(tok)
    tool_call_id = tok.convert_tokens_to_ids("<tool_call>")
    vocab = build_vocab(tok)
    assert vocab.token_bytes[tool_call_id] == b"<tool_call>"
    matcher = LLGuidanceBackend(vocab).compile(GrammarSpec.regex("<tool_call>x")).new_matcher()
    assert matcher.accept_token(tool_call_id)
    assert matcher.accept_tokens(tok.encode("x", add_special_tokens=False))
    assert matcher.is_terminated() or not matcher.error()
