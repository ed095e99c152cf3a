"""Reasoning parser: split against a direct reference, streams split anywhere, markers split
across chunks, missing </think>, and the regex of text before a marker (brute force)."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_cases import random_pieces
from quick import examples

from radixlm.srt.parsers.reasoning import (
    ReasoningParser,
    starts_in_reasoning_for,
    text_without,
)

WS = " \t\n\r"


def reference_split(text: str, starts_in: bool) -> tuple[str | None, str]:
    """The documented rules, written directly on the whole text."""
    body = text.lstrip(WS)
    opens = len(text) - len(body) <= 64 and body.startswith("<think>")
    if not opens and not starts_in:
        return None, text
    rest = (body[len("<think>") :] if opens else body).lstrip(WS)
    end = rest.find("</think>")
    if end < 0:
        return rest, ""
    reasoning = rest[:end]
    keep = len(reasoning.rstrip(WS))
    reasoning = reasoning[: max(keep, end - 64)]
    return reasoning, rest[end + len("</think>") :].lstrip(WS)


def run_stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = [], []
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = parser.flush()
    return "".join(reasoning) + r, "".join(content) + c


_fragments = st.sampled_from(
    ["<think>", "</think>", "<thi", "nk>", "</th", "ink>", "<", "/", ">", " ", "\n", "a", "b c"]
)


@settings(max_examples=examples(500), deadline=None)
@given(
    st.lists(_fragments, max_size=16),
    st.booleans(),
    st.sampled_from(["qwen3", "deepseek-r1"]),
    st.randoms(use_true_random=False),
)
def test_split_matches_the_reference_and_streams_alike(parts, starts_in, name, rng) -> None:
    text = "".join(parts)
    parser = ReasoningParser(name, starts_in)
    expected = reference_split(text, starts_in or name == "deepseek-r1")
    assert parser.split(text) == expected
    for _ in range(3):
        assert run_stream(ReasoningParser(name, starts_in), random_pieces(text, rng, 8)) == (
            expected[0] or "",
            expected[1],
        )


def test_markers_split_across_chunks_are_held_back() -> None:
    parser = ReasoningParser("qwen3", starts_in_reasoning=False)
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("nk>\nLet me") == ("Let me", "")
    assert parser.feed(" think.</th") == (" think.", "")
    assert parser.feed("ink>\n\nIt is") == ("", "It is")
    assert parser.feed(" sunny.") == ("", " sunny.")
    assert parser.flush() == ("", "")


def test_every_split_position_of_a_qwen3_output() -> None:
    text = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny in Paris."
    expected = ("The user asks about Paris.", "It is sunny in Paris.")
    assert ReasoningParser("qwen3", False).split(text) == expected
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            pieces = [text[:i], text[i:j], text[j:]]
            assert run_stream(ReasoningParser("qwen3", False), pieces) == expected


def test_a_missing_close_is_all_reasoning() -> None:
    truncated = "<think>\nStill thinking about </thi"
    assert ReasoningParser("qwen3", False).split(truncated) == ("Still thinking about </thi", "")
    # the prompt opened the block (DeepSeek-R1, some Qwen3 templates)
    assert ReasoningParser("qwen3", True).split("step one, step two") == (
        "step one, step two",
        "",
    )
    parser = ReasoningParser("deepseek-r1", False)
    assert run_stream(parser, ["step one", " </thin"]) == ("step one </thin", "")


def test_no_block_is_all_content_and_none_reasoning() -> None:
    parser = ReasoningParser("qwen3", False)
    assert parser.split("Hello <think>not a block</think>") == (
        None,
        "Hello <think>not a block</think>",
    )
    assert parser.split("") == (None, "")
    assert ReasoningParser("deepseek-r1", False).split("") == ("", "")
    assert parser.split("<think></think>Answer") == ("", "Answer")


def test_r1_may_repeat_the_opening_marker() -> None:
    parser = ReasoningParser("deepseek-r1", True)
    assert parser.split("<think>\nhmm\n</think>\n\nAnswer") == ("hmm", "Answer")
    assert parser.split("hmm</think>Answer</think>") == ("hmm", "Answer</think>")


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("o1", False)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("<|im_start|>assistant\n", False),
        ("<｜Assistant｜><think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking switched off
        ("<think>old</think> user: hi <|im_start|>assistant\n<think>\n", True),
    ],
)
def test_starts_in_reasoning_for(prompt: str, expected: bool) -> None:
    assert starts_in_reasoning_for(prompt) is expected


def test_text_without_marker_regex_by_brute_force() -> None:
    marker = "</think>"
    pattern = re.compile(text_without(marker))
    for n in range(6):
        for letters in itertools.product("</thinka>", repeat=n):
            s = "".join(letters)
            assert (pattern.fullmatch(s) is not None) == (marker not in s), s
    rng = random.Random(0)
    pieces = ["<", "/", "t", "h", "i", "n", "k", ">", "</think>", "</thin", "<<", "a", "\n"]
    for _ in range(20_000):
        s = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        assert (pattern.fullmatch(s) is not None) == (marker not in s), s
    other = re.compile(text_without("[x]"))  # class characters are escaped
    assert other.fullmatch("[x[] x]") and not other.fullmatch("a[x]b")
