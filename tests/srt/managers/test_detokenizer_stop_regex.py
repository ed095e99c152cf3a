"""The detokenizer's side of stop_regex: the match offset the scheduler sends in the finish
reason cuts the text exactly (never at an earlier copy of the matched text) and is removed
before the reason reaches the client, also after the wire's orjson round trip."""

from __future__ import annotations

from radixlm.srt.managers.detokenizer import (
    Detokenizer,
    public_finish_reason,
    trim_regex_match,
)
from radixlm.srt.messages import BatchTokenOut, decode, encode
from radixlm.srt.sampling.stop_regex import MATCH_FROM_END_KEY, MATCH_TEXT_KEY


class CharTokenizer:
    """One token per character (ids are code points): decoding is exact and easy to check."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def token_out(new_ids: list[int], finish: dict | None, no_stop_trim: bool = False):
    return BatchTokenOut(
        rids=["r"],
        new_token_ids=[new_ids],
        finish_reason=[finish],
        prompt_tokens=[1],
        completion_tokens=[len(new_ids)],
        cached_tokens=[0],
        no_stop_trim=[no_stop_trim],
        skip_special_tokens=[True],
        output_token_logprobs=[None],
        output_top_logprobs=[None],
        input_token_logprobs=[None],
        input_top_logprobs=[None],
        stop_strs=[[]],
    )


def test_trim_at_the_offset_not_at_an_earlier_copy() -> None:
    text = "concatenate the cat"
    assert trim_regex_match(text, "cat", 3) == "concatenate the "
    assert trim_regex_match("x\n\n", "\n", 2) == "x"  # the first of two newlines
    assert trim_regex_match("ab 12. tail", "12.", 8) == "ab "  # text after the match goes


def test_trim_falls_back_to_the_nearest_copy() -> None:
    """When the offset does not land on the matched text (the detokenizer's text differs from
    the scheduler's window), the copy nearest to it is cut; no copy: nothing is cut."""
    assert trim_regex_match("a cat b cat c", "cat", 6) == "a cat b "
    assert trim_regex_match("a cat b cat c", "cat", 12) == "a "
    assert trim_regex_match("a cat b cat c", "cat", 7) == "a cat b "
    assert trim_regex_match("no match here", "zzz", 3) == "no match here"
    assert trim_regex_match("short", "short", 99) == ""


def test_public_finish_reason() -> None:
    reason = {"type": "stop", "matched": "P", MATCH_FROM_END_KEY: 3, MATCH_TEXT_KEY: "12."}
    assert public_finish_reason(reason) == ({"type": "stop", "matched": "P"}, (3, "12."))
    assert MATCH_FROM_END_KEY in reason  # the scheduler's dict is left alone
    assert public_finish_reason(None) == (None, None)
    plain = {"type": "stop", "matched": "\n"}
    assert public_finish_reason(plain) == (plain, None)


def test_stream_then_finish_over_the_wire() -> None:
    detok = Detokenizer(CharTokenizer())
    first = detok.handle(decode(encode(token_out(ids("concatenate the "), None))))
    assert first.text_delta == ["concatenate the "]
    finish = {"type": "stop", "matched": "P", MATCH_FROM_END_KEY: 3, MATCH_TEXT_KEY: "cat"}
    last = detok.handle(decode(encode(token_out(ids("cat"), finish))))
    assert last.text_delta == [""]
    assert last.token_out.finish_reason == [{"type": "stop", "matched": "P"}]
    assert detok.num_active == 0


def test_no_stop_trim_keeps_text_and_still_hides_the_offset() -> None:
    detok = Detokenizer(CharTokenizer())
    finish = {"type": "stop", "matched": "P", MATCH_FROM_END_KEY: 4, MATCH_TEXT_KEY: "cat"}
    out = detok.handle(token_out(ids("the cat!"), finish, no_stop_trim=True))
    assert out.text_delta == ["the cat"]  # up to the match's end, as SGLang
    assert out.token_out.finish_reason == [{"type": "stop", "matched": "P"}]


def test_match_already_streamed_in_part_sends_nothing_more() -> None:
    """Without the scheduler's hold (stream over its limits) the sent text stays; the rest of
    the match and what follows it are not sent."""
    detok = Detokenizer(CharTokenizer())
    assert detok.handle(token_out(ids("value 12"), None)).text_delta == ["value 12"]
    finish = {"type": "stop", "matched": "P", MATCH_FROM_END_KEY: 5, MATCH_TEXT_KEY: "12."}
    assert detok.handle(token_out(ids(". x"), finish)).text_delta == [""]
