"""Token bytes for OpenAI chat logprobs (srt/server/chat/token_bytes.py) and the logprob formatters of
chat/plan.py: ``bytes`` are each token's raw bytes, so that joined they rebuild the text even
where a token holds part of a character (its display text is then U+FFFD)."""

from __future__ import annotations

import gc
import weakref

import pytest
from fake_stack import make_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from radixlm.srt.server.chat.plan import chat_logprobs
from radixlm.srt.server.chat.token_bytes import TEXT_BYTES, byte_level_alphabet, token_bytes_for
from radixlm.srt.server.openai.completions import completion_logprobs

REPLACEMENT = list("\ufffd".encode())  # [239, 191, 189]
TEXTS = [
    "Repeat exactly: 😀😀😀 你好",
    "café naïve Ångström",
    "Привет, мир",
    "𠮷野家 🇯🇵 👩‍👩‍👧 ok",
    "tabs\tand\nnewlines  ",
    "a real \ufffd stays",
]


def joined_bytes(tokenizer, ids: list[int]) -> bytes:
    table = token_bytes_for(tokenizer)
    return b"".join(bytes(table.of(i, tokenizer.decode([i]))) for i in ids)


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style SentencePiece BPE with byte fallback: few pieces, so most characters
    fall back to ``<0xHH>`` byte pieces."""
    pieces = ["<unk>", "<s>", "▁", "h", "e", "l", "o", "é", "▁h"]
    vocab = {p: i for i, p in enumerate(pieces + [f"<0x{b:02X}>" for b in range(256)])}
    model = models.BPE(vocab=vocab, merges=[("▁", "h")], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


# ---------------------------------------------------------------------- the table
def test_byte_level_alphabet_covers_every_byte_once() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == 65 and alphabet["Ġ"] == 32 and alphabet["Ċ"] == 10


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bytes_rebuild_the_text(text: str) -> None:
    tok = make_tokenizer()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert joined_bytes(tok, ids) == text.encode()


def test_fragment_tokens_get_their_own_bytes_not_u_fffd() -> None:
    tok = make_tokenizer()
    ids = tok.encode("😀")
    assert len(ids) > 1 and all(tok.decode([i]) == "\ufffd" for i in ids)  # fragments only
    table = token_bytes_for(tok)
    assert [table.of(i, "\ufffd") for i in ids] != [REPLACEMENT] * len(ids)
    assert joined_bytes(tok, ids) == "😀".encode()


def test_special_tokens_are_their_text() -> None:
    tok = make_tokenizer()
    eos = tok.convert_tokens_to_ids("<eos>")
    assert token_bytes_for(tok).of(eos, "<eos>") == list(b"<eos>")


def test_sentencepiece_byte_fallback_pieces_are_bytes() -> None:
    tok = sentencepiece_tokenizer()
    text = "hello héllo 😀 ü"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    pieces = tok.convert_ids_to_tokens(ids)
    assert "<0xF0>" in pieces and "<0xC3>" in pieces
    table = token_bytes_for(tok)
    assert table.of(tok.convert_tokens_to_ids("<0xF0>"), "\ufffd") == [0xF0]
    assert table.of(tok.convert_tokens_to_ids("▁h"), "h") == list(b" h")
    assert table.of(tok.convert_tokens_to_ids("<s>"), "<s>") == list(b"<s>")
    # the leading space is the first piece's own "▁", which whole-text decoding strips
    assert joined_bytes(tok, ids) == b" " + text.encode()


def test_table_is_one_per_tokenizer_lazy_and_bounded() -> None:
    tok = make_tokenizer()
    table = token_bytes_for(tok)
    assert token_bytes_for(tok) is table and table.num_cached == 0
    assert token_bytes_for(make_tokenizer()) is not table
    ids = tok.encode("Hello 你好 🎉")
    first = [table.of(i, tok.decode([i])) for i in ids]
    assert table.num_cached == len(set(ids))
    assert [table.of(i, "ignored once cached") for i in ids] == first
    outside = len(tok) + 7  # e.g. a padded embedding row: its text, and nothing kept
    assert table.of(outside, "x") == list(b"x") and table.num_cached == len(set(ids))


def test_table_does_not_keep_its_tokenizer_alive() -> None:
    tok = make_tokenizer()
    token_bytes_for(tok).of(5, None)
    alive = weakref.ref(tok)
    del tok
    gc.collect()
    assert alive() is None


def test_without_a_tokenizer_bytes_are_the_display_text() -> None:
    assert TEXT_BYTES.of(5, "é") == list("é".encode()) and TEXT_BYTES.of(5, None) == []


# ---------------------------------------------------------------------- chat formatter
def test_chat_logprobs_bytes_rebuild_the_reply_and_tokens_stay_display_text() -> None:
    tok = make_tokenizer()
    text = "Hello 你好 🎉 café"
    ids = tok.encode(text)
    eos = tok.convert_tokens_to_ids("<eos>")
    entries = [[-0.5, i, tok.decode([i])] for i in ids]
    tops = [[[-0.5, i, tok.decode([i])], [-3.0, eos, "<eos>"]] for i in ids]
    content = chat_logprobs(entries, tops, token_bytes_for(tok))["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode()
    assert [c["token"] for c in content] == [e[2] for e in entries]
    assert any(c["token"] == "\ufffd" and c["bytes"] != REPLACEMENT for c in content)
    for c in content:
        first, second = c["top_logprobs"]
        assert first == {"token": c["token"], "logprob": -0.5, "bytes": c["bytes"]}
        assert second == {"token": "<eos>", "logprob": -3.0, "bytes": list(b"<eos>")}


# ---------------------------------------------------------------------- legacy formatter
ECHOED = [[None, 5, "Hi"], [-1.0, 6, " there"], [-0.5, 7, "!"]]


def test_completion_first_prompt_token_has_null_top_logprobs() -> None:
    tops = [None, [[-0.9, 8, " all"]], [[-0.5, 7, "!"]]]
    lp = completion_logprobs(ECHOED, tops, True, 0)
    assert lp["tokens"] == ["Hi", " there", "!"] and lp["text_offset"] == [0, 2, 8]
    assert lp["token_logprobs"] == [None, -1.0, -0.5]
    # the sampled token is always there, after the top ones (up to logprobs + 1 keys)
    assert lp["top_logprobs"] == [None, {" all": -0.9, " there": -1.0}, {"!": -0.5}]


def test_completion_logprobs_zero_lists_the_sampled_token_alone() -> None:
    lp = completion_logprobs(ECHOED, [None, [], []], False, 3)
    assert lp["top_logprobs"] == [None, {" there": -1.0}, {"!": -0.5}]
    assert lp["text_offset"] == [3, 5, 11]
    lp = completion_logprobs(ECHOED[1:], [], False, 0)
    assert lp["top_logprobs"] == [{" there": -1.0}, {"!": -0.5}]


# ---------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    from radixlm.srt.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("text", [*TEXTS, "<|im_start|>assistant\nhi 😀<|im_end|>"])
def test_default_tokenizer_bytes_rebuild_the_text(default_tokenizer, text: str) -> None:
    tok = default_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert joined_bytes(tok, ids) == text.encode()


@pytest.mark.slow
def test_default_tokenizer_emoji_fragments_and_special_tokens(default_tokenizer) -> None:
    tok = default_tokenizer
    table = token_bytes_for(tok)
    ids = tok.encode("😀😀😀", add_special_tokens=False)
    displays = [tok.decode([i]) for i in ids]
    assert "\ufffd" in displays  # the emoji is split inside its UTF-8 sequence
    assert all(table.of(i, d) != REPLACEMENT for i, d in zip(ids, displays, strict=True))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert table.of(im_end, tok.decode([im_end])) == list(b"<|im_end|>")
