from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quick import examples
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from radixlm.srt.managers.detokenizer import Detokenizer, held_back_len, trim_stop_str
from radixlm.srt.managers.stop_prefix import StopPrefixes
from radixlm.srt.messages import BatchTokenOut, decode, encode

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there; the end is near",
    "stop here and then STOP again",
] * 20
MIXED_TEXT = "Hi 🎉 世界 and 😀😀 then ünïcödé — ok 日本語のテキスト END tail"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """A small byte-level BPE: characters outside the corpus split into single-byte tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def token_out(
    rids: list[str],
    new_ids: list[list[int]],
    finish: list[dict | None] | None = None,
    *,
    no_stop_trim: bool = False,
    skip_special: bool = True,
    stop_strs: list[list[str]] | None = None,
) -> BatchTokenOut:
    n = len(rids)
    return BatchTokenOut(
        rids=rids,
        new_token_ids=new_ids,
        finish_reason=finish or [None] * n,
        prompt_tokens=[3] * n,
        completion_tokens=[len(x) for x in new_ids],
        cached_tokens=[0] * n,
        no_stop_trim=[no_stop_trim] * n,
        skip_special_tokens=[skip_special] * n,
        output_token_logprobs=[None] * n,
        output_top_logprobs=[None] * n,
        input_token_logprobs=[None] * n,
        input_top_logprobs=[None] * n,
        stop_strs=stop_strs if stop_strs is not None else [],
    )


def stream(detok: Detokenizer, ids: list[int], chunk_sizes: list[int], **kw) -> list[str]:
    """Feeds ``ids`` in chunks; the last chunk finishes with a length reason."""
    deltas, pos = [], 0
    for size in chunk_sizes:
        chunk = ids[pos : pos + size]
        pos += size
        finish = [{"type": "length", "length": pos}] if pos >= len(ids) else None
        deltas.append(detok.handle(token_out(["r"], [chunk], finish, **kw)).text_delta[0])
        if finish:
            break
    return deltas


def test_multibyte_characters_are_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT).ids
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs characters split across tokens"


def test_one_token_at_a_time_never_emits_a_broken_character(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT).ids
    detok = Detokenizer(tok)
    deltas = stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == MIXED_TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert detok.num_active == 0


@pytest.mark.parametrize("seed", range(8))
def test_random_chunks_reassemble_the_text(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = tok.encode(MIXED_TEXT).ids
    sizes = [rng.randint(1, 4) for _ in ids]
    deltas = stream(Detokenizer(tok), ids, sizes)
    assert "".join(deltas) == MIXED_TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_unfinished_character_is_flushed_on_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ab 🎉").ids[:-1]  # ends inside the emoji
    deltas = stream(Detokenizer(tok), ids, [len(ids)])
    assert deltas[-1].endswith("\ufffd")


def run_with_stop(tok: Tokenizer, text: str, stop: str, **kw) -> tuple[list[str], str]:
    """Streams ``text`` token by token the way the scheduler does: finish once ``stop`` appears."""
    ids = tok.encode(text).ids
    detok = Detokenizer(tok)
    deltas, sent_so_far = [], ""
    for n in range(1, len(ids) + 1):
        done = stop in tok.decode(ids[:n])
        finish = [{"type": "stop", "matched": stop}] if done else None
        out = detok.handle(token_out(["r"], [ids[n - 1 : n]], finish, stop_strs=[[stop]], **kw))
        deltas.append(out.text_delta[0])
        sent_so_far += out.text_delta[0]
        if done:
            return deltas, sent_so_far
    raise AssertionError("stop string never matched")


def test_stop_string_spanning_tokens_is_never_streamed(tok: Tokenizer) -> None:
    text = "one two ENDX three"
    stop = "ENDX"
    assert len(tok.encode(stop).ids) > 1
    deltas, full = run_with_stop(tok, text, stop)
    assert full == "one two "
    prefix = ""
    for d in deltas:
        prefix += d
        assert full.startswith(prefix)  # nothing later retracted
        assert "E" not in prefix


def test_stop_string_kept_with_no_stop_trim(tok: Tokenizer) -> None:
    deltas, full = run_with_stop(tok, "one two ENDX three", "ENDX", no_stop_trim=True)
    assert full == "one two ENDX"


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    _, full = run_with_stop(tok, "go 世界 no", "世界")
    assert full == "go "


def test_stop_token_id_trimmed_unless_no_stop_trim(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<eos>")
    ids = tok.encode("hello world").ids + [eos]
    finish = [{"type": "stop", "matched": eos}]
    for no_trim, expected in ((False, "hello world"), (True, "hello world<eos>")):
        detok = Detokenizer(tok)
        out = detok.handle(
            token_out(["r"], [ids], finish, skip_special=False, no_stop_trim=no_trim)
        )
        assert out.text_delta[0] == expected


def test_skip_special_tokens(tok: Tokenizer) -> None:
    pad = tok.token_to_id("<pad>")
    ids = tok.encode("hello").ids + [pad] + tok.encode(" world").ids
    fin = [{"type": "length", "length": len(ids)}]
    assert Detokenizer(tok).handle(token_out(["r"], [ids], fin)).text_delta == ["hello world"]
    out = Detokenizer(tok).handle(token_out(["r"], [ids], fin, skip_special=False))
    assert out.text_delta == ["hello<pad> world"]


def test_interleaved_requests_keep_separate_state(tok: Tokenizer) -> None:
    a, b = tok.encode("😀 alpha").ids, tok.encode("世 beta").ids
    detok = Detokenizer(tok)
    got = {"a": "", "b": ""}
    for n in range(max(len(a), len(b))):
        rids, new, fin = [], [], []
        for rid, ids in (("a", a), ("b", b)):
            if n < len(ids):
                rids.append(rid)
                new.append([ids[n]])
                fin.append({"type": "length", "length": n + 1} if n == len(ids) - 1 else None)
        out = detok.handle(token_out(rids, new, fin))
        for rid, delta in zip(rids, out.text_delta, strict=True):
            got[rid] += delta
    assert got == {"a": "😀 alpha", "b": "世 beta"}
    assert detok.num_active == 0


def test_abort_without_tokens_drops_state(tok: Tokenizer) -> None:
    detok = Detokenizer(tok)
    detok.handle(token_out(["r"], [tok.encode("abc").ids]))
    assert detok.num_active == 1
    out = detok.handle(token_out(["r"], [[]], [{"type": "abort", "message": "client gone"}]))
    assert out.text_delta == [""]
    assert detok.num_active == 0


@settings(max_examples=examples(300), deadline=None)
@given(
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=7), max_size=4),
    pieces=st.lists(st.text(alphabet="ab\nc", max_size=5), max_size=12),
)
def test_stop_prefixes_track_the_held_back_length_as_text_grows(stops, pieces) -> None:
    tracker = StopPrefixes(stops)
    text = ""
    for piece in pieces:
        text += piece
        assert tracker.feed(text) == held_back_len(text, stops), (text, stops)


def test_held_back_len_and_trim() -> None:
    assert held_back_len("abc EN", ["END", "xyz"]) == 2
    assert held_back_len("abc E", ["END"]) == 1
    assert held_back_len("abc", ["END"]) == 0
    assert held_back_len("abcEND", ["END"]) == 0  # a whole stop string is the scheduler's call
    assert held_back_len("a\n", ["\n\n", "\n"]) == 1
    assert trim_stop_str("abc END def END", 2, "END") == "abc "
    assert trim_stop_str("abc", 0, "END") == "abc"


def test_stop_strs_survive_the_wire(tok: Tokenizer) -> None:
    out = token_out(["r"], [[1, 2]], stop_strs=[["END"]])
    assert decode(encode(out)) == out
    legacy = token_out(["r"], [[1, 2]])
    assert decode(encode(legacy)).stop_strs == []
