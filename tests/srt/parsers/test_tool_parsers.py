"""Tool-call parsers: whole outputs, streams split anywhere, malformed markup.

The reference for well-formed outputs is the generator: it writes the calls (random JSON
whitespace, key order, argument encodings) and knows the content and calls it wrote.
"""

from __future__ import annotations

import json
import random

import pytest
from growth import assert_grows_linearly, best_cpu_seconds
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_cases import (
    Case,
    call_object,
    check_arguments,
    check_deltas,
    random_pieces,
    spaced_json,
    stream,
)
from quick import examples

from radixlm.srt.parsers.registry import make_tool_parser
from radixlm.srt.parsers.tool_base import ToolCall, ToolCallDelta

PARSERS = ("hermes", "llama3", "generic")

_leaves = st.none() | st.booleans() | st.integers(-999, 999) | st.text(max_size=6)
_args = st.dictionaries(
    st.text(max_size=5),
    st.recursive(
        _leaves,
        lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=3), x, max_size=3),
        max_leaves=6,
    ),
    max_size=4,
)
_names = st.sampled_from(["get_weather", "f", 'quo"te', "ünïcode", "a/b"])
_calls = st.lists(st.tuples(_names, _args), min_size=1, max_size=3)
_words = st.text(alphabet="abc XY.,!<>/_{}\"'\nlotp", min_size=1, max_size=14)


def _text_segment(text: str) -> str:
    """A content segment without whitespace at its edges and without a full marker."""
    text = text.replace("<tool_call>", "<tool call>").strip(" \n")
    return text or "x"


def _parse(name: str, text: str):
    return make_tool_parser(name, []).parse(text)


def _check_case(name: str, case: Case, rng: random.Random) -> None:
    result = _parse(name, case.text)
    assert result.content == case.content, case.text
    assert result.calls == case.calls, case.text
    for _ in range(3):
        streamed, deltas = stream(name, random_pieces(case.text, rng, most=12))
        assert streamed == result
        check_deltas(deltas)


# -- generated well-formed outputs against the generator's record --


def hermes_case(segments: list, rng: random.Random) -> Case:
    text, content, calls = [], [], []
    for i, segment in enumerate(segments):
        sep = rng.choice(["", "\n", "\n\n", " "])
        is_call = isinstance(segment, list)
        lead = sep if i or rng.random() < 0.5 else ""
        text.append(lead)
        if not is_call:
            content.append(lead)  # whitespace before text is kept, before a block dropped
        if not is_call:
            text.append(_text_segment(segment))
            content.append(_text_segment(segment))
            continue
        objects = []
        for call_name, args in segment:
            args_text = spaced_json(args, rng)
            objects.append(call_object(call_name, args_text, rng))
            calls.append(ToolCall(call_name, args_text))
        if rng.random() < 0.7:  # one block per call, or all in one block
            blocks = [f"<tool_call>\n{o}\n</tool_call>" for o in objects]
            text.append(rng.choice(["\n", ""]).join(blocks))
        else:
            text.append("<tool_call>\n" + "\n".join(objects) + "\n</tool_call>")
    tail = rng.choice(["", "\n", " \n"])
    text.append(tail)
    if not segments or not isinstance(segments[-1], list):
        content.append(tail)
    return Case("".join(text), "".join(content), calls)


@pytest.mark.slow
@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.one_of(_words, _calls), max_size=5), st.randoms(use_true_random=False))
def test_hermes_generated_outputs(segments, rng) -> None:
    _check_case("hermes", hermes_case(segments, rng), rng)


def llama3_case(lead: str | None, calls_in: list, trailing: str, rng: random.Random) -> Case:
    text, calls = [], []
    content = ""
    if lead is not None:
        lead = _text_segment(lead).replace("{", "(").replace("<|python_tag|>", "")
        text.append(lead + rng.choice(["", " ", "\n"]) + "<|python_tag|>")
        content = lead
    else:
        text.append(rng.choice(["", " ", "\n\n"]))
    objects = []
    for call_name, args in calls_in:
        args_text = spaced_json(args, rng)
        key = rng.choice(["parameters", "parameters", "arguments"])
        objects.append(call_object(call_name, args_text, rng, key=key))
        calls.append(ToolCall(call_name, args_text))
    text.append("".join(o + rng.choice(["; ", ";", ";\n", "\n"]) for o in objects[:-1]))
    text.append(objects[-1])
    text.append(trailing)
    return Case("".join(text), content + trailing, calls)


@settings(max_examples=examples(150), deadline=None)
@given(
    st.none() | _words,
    _calls,
    st.sampled_from(["", " and done", "\n\nThanks."]),
    st.randoms(use_true_random=False),
)
def test_llama3_generated_outputs(lead, calls_in, trailing, rng) -> None:
    _check_case("llama3", llama3_case(lead, calls_in, trailing, rng), rng)


def generic_case(kind: str, calls_in: list, answer: object, rng: random.Random) -> Case:
    ws = lambda: rng.choice(["", " ", "\n"])  # noqa: E731
    if kind == "calls":
        objects, calls = [], []
        for call_name, args in calls_in:
            args_text = spaced_json(args, rng)
            objects.append(call_object(call_name, args_text, rng))
            calls.append(ToolCall(call_name, args_text))
        items = f"{ws()},{ws()}".join(objects)
        text = f'{ws()}{{{ws()}"tool_calls"{ws()}:{ws()}[{ws()}{items}{ws()}]{ws()}}}{ws()}'
        return Case(text, "", calls)
    if kind == "plain":
        return Case(
            _text_segment(str(answer)).lstrip("{ "), _text_segment(str(answer)).lstrip("{ "), []
        )
    value = spaced_json(answer, rng)
    content = answer if isinstance(answer, str) else value
    return Case(f'{{{ws()}"content"{ws()}:{ws()}{value}{ws()}}}{ws()}', content, [])


@settings(max_examples=examples(150), deadline=None)
@given(
    st.sampled_from(["calls", "answer", "plain"]),
    _calls,
    st.text(max_size=20) | _args,
    st.randoms(use_true_random=False),
)
def test_generic_generated_outputs(kind, calls_in, answer, rng) -> None:
    if kind == "plain" and not isinstance(answer, str):
        answer = "plain answer"
    _check_case("generic", generic_case(kind, calls_in, answer, rng), rng)


# -- fixed examples: single, multiple and no calls --

HERMES_TWO = (
    "Let me check both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET</tool_call>"}}\n</tool_call>'
)
EXAMPLES = {
    "hermes": [
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
            "",
            [ToolCall("f", '{"a": 1}')],
        ),
        (
            HERMES_TWO,
            "Let me check both.",
            [
                ToolCall("get_weather", '{"city": "Paris", "unit": "c"}'),
                ToolCall("get_time", '{"zone": "CET</tool_call>"}'),
            ],
        ),
        ("No tools needed: 4 < 5.", "No tools needed: 4 < 5.", []),
        # arguments given as a JSON string holding an object are decoded
        (
            '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>',
            "",
            [ToolCall("f", '{"a": [1, 2]}')],
        ),
        # an unknown tool name is kept: the client checks names
        (
            '<tool_call>{"name":"not_offered","arguments":{}}</tool_call>',
            "",
            [ToolCall("not_offered", "{}")],
        ),
    ],
    "llama3": [
        ('{"name": "f", "parameters": {"a": 1}}', "", [ToolCall("f", '{"a": 1}')]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b": "x"}}',
            "",
            [ToolCall("f", "{}"), ToolCall("g", '{"b": "x"}')],
        ),
        ("Paris is sunny today.", "Paris is sunny today.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "generic": [
        (
            '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}',
            "",
            [ToolCall("f", '{"a": 1}')],
        ),
        (
            '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": []}}]}',
            "",
            [ToolCall("f", "{}"), ToolCall("g", '{"x": []}')],
        ),
        ('{"content": "It is \\"sunny\\".\\n\\u00e9"}', 'It is "sunny".\né', []),
        ('{"content": {"temp": 21, "unit": "c"}}', '{"temp": 21, "unit": "c"}', []),
        ("Not JSON at all", "Not JSON at all", []),
        ('{"other": 1}', '{"other": 1}', []),
        ("[1, 2]", "[1, 2]", []),
    ],
}


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [(name, *example) for name, examples in EXAMPLES.items() for example in examples],
)
def test_examples_parse_and_stream_at_every_split(name, text, content, calls) -> None:
    result = _parse(name, text)
    assert (result.content, result.calls) == (content, calls)
    for i in range(len(text) + 1):
        assert stream(name, [text[:i], text[i:]])[0] == result, i
    streamed, deltas = stream(name, list(text))
    assert streamed == result
    check_deltas(deltas)


def test_arguments_stream_while_they_are_generated() -> None:
    parser = make_tool_parser("hermes", [])
    assert parser.feed("Sure.\n<tool_") == ("Sure.", [])  # a partial marker is held back
    content, deltas = parser.feed('call>\n{"name": "f", "arguments": {"city": "Pa')
    assert (content, deltas) == ("", [ToolCallDelta(0, "f", '{"city": "Pa')])
    # the comma and the key are held until the value starts, a complete number is sent
    assert parser.feed('ris", "days": 1') == ("", [ToolCallDelta(0, None, 'ris", "days": 1')])
    assert parser.feed("0}}\n</tool_call>") == ("", [ToolCallDelta(0, None, "0}")])
    assert parser.feed("\n<tool_call>") == ("", [])
    content, deltas = parser.feed('{"name": "g", "arguments": {}}')
    assert deltas == [ToolCallDelta(1, "g", "{}")]
    assert parser.flush() == ("", [])


def test_a_partial_marker_that_is_not_one_is_released_as_content() -> None:
    parser = make_tool_parser("hermes", [])
    assert parser.feed("a <tool_") == ("a", [])
    assert parser.feed("box> b") == (" <tool_box> b", [])
    assert parser.flush() == ("", [])


MALFORMED = {
    "hermes": [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "not an object"}\n</tool_call>',
        '<tool_call>\n{"nam": "f", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "name": "g", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"nam": "f", "argu',  # cut off, but not a call object (test_cut_off.py)
        "text <tool_call> more text",
    ],
    "llama3": [
        '{"name": 1}',
        '{"name": "f", "parameters": 3}',
        "{not json",
        '{"x": {"name": "f"}}',
    ],
    "generic": ['{"tool_calls": 1}', '{"tool_calls": [{"arguments": {}}]}', '{"contents": "x"}'],
}


@pytest.mark.parametrize(
    ("name", "text"), [(name, text) for name, texts in MALFORMED.items() for text in texts]
)
def test_malformed_call_markup_is_content(name: str, text: str) -> None:
    result = _parse(name, text)
    assert (result.content, result.calls) == (text, [])
    for i in range(len(text) + 1):
        assert stream(name, [text[:i], text[i:]])[0] == result


def test_malformed_block_between_good_ones_keeps_the_good_calls() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        "<tool_call>\n{oops}\n</tool_call>\n"
        '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>'
    )
    result = _parse("hermes", text)
    assert result.calls == [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')]
    assert result.content == "\n<tool_call>\n{oops}\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "arguments", "content"),
    [
        # broken inside the arguments after they started: closed, the rest is content (an
        # output cut off inside them is not closed: test_cut_off.py)
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": 1,,}}\n</tool_call>',
            '{"a": 1}',
            ",,}}\n</tool_call>",
        ),
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": tx}]}}\n</tool_call>',
            '{"a": [1, {}]}',
            '"b": tx}]}}\n</tool_call>',
        ),
    ],
)
def test_broken_arguments_close_into_valid_json(text, arguments, content) -> None:
    result = _parse("hermes", text)
    assert result.calls == [ToolCall("f", arguments)] and result.content == content
    json.loads(arguments)
    for i in range(len(text) + 1):
        assert stream("hermes", [text[:i], text[i:]])[0] == result


# -- any text at all: the stream invariant and valid arguments --

_fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "<tool_",
        "<|python_tag|>",
        "{",
        "}",
        "[",
        "]",
        '"',
        ":",
        ",",
        ";",
        " ",
        "\n",
        '"name"',
        '"arguments"',
        '"parameters"',
        '"f"',
        "1",
        "tr",
        "ue",
        '"tool_calls"',
        '"content"',
        "\\",
        "x",
        "\\u00e9",
    ]
)


@settings(max_examples=examples(400), deadline=None)
@given(
    st.sampled_from(PARSERS), st.lists(_fragments, max_size=30), st.randoms(use_true_random=False)
)
def test_any_text_streams_like_parse_and_calls_hold_json_objects(name, parts, rng) -> None:
    text = "".join(parts)
    result = _parse(name, text)
    for _ in range(3):
        streamed, deltas = stream(name, random_pieces(text, rng, most=10))
        assert streamed == result
        check_deltas(deltas)
    check_arguments(result.calls)
    if not result.calls and name != "generic":
        assert text.startswith(result.content)  # nothing is lost but markup cut off at the end


def _mutated(text: str, rng: random.Random) -> str:
    """text with a few random edits: cut off, characters dropped, markup pieces inserted."""
    for _ in range(rng.randint(1, 3)):
        at = rng.randint(0, len(text))
        edit = rng.random()
        if edit < 0.25:
            text = text[:at]
        elif edit < 0.6:
            text = text[:at] + text[at + rng.randint(1, 3) :]
        else:
            text = (
                text[:at]
                + rng.choice(["{", "}", '"', ",", ":", "<tool_call>", "x", "\\"])
                + text[at:]
            )
    return text


@settings(max_examples=examples(300), deadline=None)
@given(
    st.sampled_from(PARSERS),
    st.lists(st.one_of(_words, _calls), min_size=1, max_size=4),
    st.randoms(use_true_random=False),
)
def test_damaged_outputs_stream_like_parse(name, segments, rng) -> None:
    calls_in = [call for segment in segments if isinstance(segment, list) for call in segment]
    calls_in = calls_in or [("f", {"a": 1})]
    case = {
        "hermes": lambda: hermes_case(segments, rng),
        "llama3": lambda: llama3_case(None, calls_in, "", rng),
        "generic": lambda: generic_case("calls", calls_in, None, rng),
    }[name]()
    text = _mutated(case.text, rng)
    result = _parse(name, text)
    for _ in range(3):
        streamed, deltas = stream(name, random_pieces(text, rng, most=10))
        assert streamed == result, text
        check_deltas(deltas)
    check_arguments(result.calls)


# -- bounded hold-back, linear time --


def test_hold_back_is_bounded() -> None:
    parser = make_tool_parser("hermes", [])
    shown = 0
    text = ("word < <tool " * 2000) + " " * 500
    for i, c in enumerate(text):
        shown += len(parser.feed(c)[0])
        assert i + 1 - shown <= 64 + len("<tool_call>"), i
    # a call header that never ends is released once past the limit
    parser = make_tool_parser("hermes", [])
    parser.feed('<tool_call>{"id": "')
    shown = sum(len(parser.feed("x")[0]) for _ in range(40_000))
    assert shown >= 40_000 - 16_384 and parser.flush()[1] == []


def _stream_time(name: str, text: str) -> float:
    def stream() -> None:
        parser = make_tool_parser(name, [])
        for i in range(0, len(text), 3):
            parser.feed(text[i : i + 3])
        parser.flush()

    return best_cpu_seconds(stream)


@pytest.mark.slow  # timing checks (tests/growth.py): the full suite runs them
@pytest.mark.parametrize("name", PARSERS)
def test_long_outputs_take_linear_time(name: str) -> None:
    def output(n: int) -> str:
        args = json.dumps({"text": "lorem ipsum " * n, "items": list(range(n))})
        call = f'{{"name": "f", "arguments": {args}}}'
        return {
            "hermes": f"<tool_call>\n{call}\n</tool_call>",
            "llama3": call,
            "generic": f'{{"tool_calls": [{call}]}}',
        }[name]

    assert_grows_linearly(_stream_time(name, output(1_500)), _stream_time(name, output(12_000)))
    result = _parse(name, output(12_000))
    assert json.loads(result.calls[0].arguments)["items"][-1] == 11_999


@pytest.mark.slow  # timing checks (tests/growth.py): the full suite runs them
def test_many_markers_in_one_text_take_linear_time() -> None:
    """Every marker used to copy the rest of the text (8x the markers took ~64x the time)."""

    def parse_time(n: int) -> float:
        text = "<tool_call>x" * n
        result = _parse("hermes", text)
        assert result.content == text and result.calls == []
        return best_cpu_seconds(lambda: _parse("hermes", text))

    assert_grows_linearly(parse_time(10_000), parse_time(80_000))
