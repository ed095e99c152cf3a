"""The detokenizer's decode-only copy of a tokenizer (``export_decoder`` / ``IdDecoder``) decodes
exactly as the transformers tokenizer does, or is not made; the detokenizer process then starts
without torch or transformers."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixlm.srt.models.tokenizer import IdDecoder, export_decoder

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Isn't it? It's fine, they're here!",
    "ünïcode 字 🙂 tabs\tand\nnew lines , spaced . punctuation 'quoted' don't",
    '{"name": "x", "values": [1, 2.5, -3e4], "ok": true}',
]


def byte_bpe(clean_up: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<tool>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<tool>"],
        clean_up_tokenization_spaces=clean_up,
    )


def word_piece(clean_up: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[SEP]"])
    tok.train_from_iterator(TEXTS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=clean_up,
    )


def assert_decodes_alike(tokenizer, decoder: IdDecoder, seed: int = 0) -> None:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    cases = [tokenizer.encode(t) for t in TEXTS]
    cases += [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    cases += [[i] for i in range(0, vocab, max(1, vocab // 2048))]
    for ids in cases:
        for skip in (False, True):
            assert decoder.decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("clean_up", [False, True])
def test_byte_level_bpe_exports_an_equal_decoder(clean_up: bool) -> None:
    tokenizer = byte_bpe(clean_up)
    exported = export_decoder(tokenizer)
    assert exported is not None
    assert_decodes_alike(tokenizer, IdDecoder(exported))


def test_word_level_exports_an_equal_decoder(word_tokenizer) -> None:
    exported = export_decoder(word_tokenizer)
    assert exported is not None
    assert_decodes_alike(word_tokenizer, IdDecoder(exported))


def test_python_side_clean_up_is_not_exported() -> None:
    # WordPiece with transformers' clean-up of spaces before punctuation: that step is Python,
    # not the backend's, so the copy would differ ("a ." vs "a.")
    tokenizer = word_piece(clean_up=True)
    assert tokenizer.decode(tokenizer.encode("a . b", add_special_tokens=False)) == "a. b"
    assert export_decoder(tokenizer) is None
    plain = word_piece(clean_up=False)
    exported = export_decoder(plain)
    assert exported is not None
    assert_decodes_alike(plain, IdDecoder(exported))


def test_a_class_that_decodes_its_own_way_is_not_exported() -> None:
    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    base = byte_bpe(False)
    tokenizer = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="</s>")
    assert export_decoder(tokenizer) is None
    assert export_decoder(object()) is None


def test_the_detokenizer_process_imports_neither_torch_nor_transformers(tmp_path) -> None:
    exported = export_decoder(byte_bpe(False))
    path = tmp_path / "decoder.json"
    path.write_text(exported)
    code = (
        "import sys\n"
        "from radixlm.srt.managers.detokenizer_process import run_detokenizer_process\n"
        "from radixlm.srt.managers.detokenizer import Detokenizer\n"
        "from radixlm.srt.models.tokenizer import IdDecoder\n"
        f"d = IdDecoder(open({str(path)!r}).read())\n"
        "assert d.decode([0, 1, 2]) is not None\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_default_models_tokenizer_exports_an_equal_decoder(default_model_dir) -> None:
    from radixlm.srt.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    exported = export_decoder(tokenizer)
    assert exported is not None
    assert_decodes_alike(tokenizer, IdDecoder(exported), seed=1)
