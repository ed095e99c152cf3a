"""Outputs cut off (by max_tokens) at every position: no markup is content, a call with a
complete name stands with its arguments exactly as written so far (nothing closed or
invented), a call without a complete name is dropped, a cut generic answer is its text decoded
so far, and streaming gives what parse gives.

Each sample reply is built from parts whose roles are known, so the expected result of every
prefix follows from the parts (the reference): ``content`` (shown), ``markup`` (never shown),
``tag`` (markup that is one special token: no cut inside it), ``name`` (a call's name as a JSON
string; the call exists once it is complete), ``args`` (that call's arguments text), ``answer``
(a generic answer string's body, shown decoded) and ``value`` (a generic non-string answer,
shown as written).
"""

from __future__ import annotations

import json
import random

import pytest
from parser_cases import check_arguments, check_deltas, random_pieces, stream

from radixlm.srt.parsers.registry import make_tool_parser
from radixlm.srt.parsers.tool_base import ParseResult, ToolCall

WS = " \t\n\r"

Parts = list[tuple[str, str]]


def _call(name: str, key: str, args: str, open_: str = "{") -> Parts:
    return [
        ("markup", f'{open_}"name": '),
        ("name", json.dumps(name)),
        ("markup", f', "{key}": '),
        ("args", args),
        ("markup", "}"),
    ]


WEATHER_ARGS = '{"city": "Paris", "days": 2, "tags": ["a\\"b", null], "x": {"y": -1.5e3}}'
SAMPLES: dict[str, tuple[str, Parts]] = {
    "hermes_text_and_call": (
        "hermes",
        [
            ("content", "Let me check."),
            ("markup", "\n"),
            ("tag", "<tool_call>"),
            ("markup", "\n"),
            *_call("get_weather", "arguments", WEATHER_ARGS),
            ("markup", "\n"),
            ("tag", "</tool_call>"),
        ],
    ),
    "hermes_two_calls": (
        "hermes",
        [
            ("tag", "<tool_call>"),
            ("markup", "\n"),
            *_call("get_weather", "arguments", '{"city": "Par\\u00eds", "on": true}'),
            ("markup", "\n"),
            ("tag", "</tool_call>"),
            ("markup", "\n"),
            ("tag", "<tool_call>"),
            ("markup", "\n"),
            *_call("get_time", "arguments", "{}"),
            ("markup", "\n"),
            ("tag", "</tool_call>"),
        ],
    ),
    "llama3_tag_and_two_calls": (
        "llama3",
        [
            ("content", "Sure."),
            ("markup", " "),
            ("tag", "<|python_tag|>"),
            *_call("get_weather", "parameters", '{"city": "Paris", "n": [1, false]}'),
            ("markup", "; "),
            *_call("get_time", "parameters", '{"zone": "CET"}'),
        ],
    ),
    "llama3_bare_call": ("llama3", _call("f", "parameters", '{"a": {"b": [0.5, "x"]}}')),
    "generic_two_calls": (
        "generic",
        [
            ("markup", '{"tool_calls": ['),
            *_call("get_weather", "arguments", '{"city": "Paris"}'),
            ("markup", ", "),
            *_call("get_time", "arguments", '{"zone": "C\\u00c9T", "n": -12}'),
            ("markup", "]}"),
        ],
    ),
    "generic_answer": (
        "generic",
        [
            ("markup", '{"content": "'),
            ("answer", 'It is \\"sunny\\" in Paris.\\nCaf\\u00e9 \U0001f327 \\\\ ok'),
            ("markup", '"}'),
        ],
    ),
    "generic_json_answer": (
        "generic",
        [("markup", '{"content": '), ("value", '{"temp": 21, "sky": "clear"}'), ("markup", "}")],
    ),
}


def _decoded_prefix(body: str) -> str:
    """A JSON string body cut anywhere, decoded up to its last complete character."""
    for k in range(len(body), -1, -1):
        try:
            return json.loads('"' + body[:k] + '"')
        except ValueError:
            continue
    raise AssertionError(body)


def _expected(parts: Parts, cut: int) -> ParseResult:
    """What the first ``cut`` characters of the reply mean, from the roles of its parts."""
    content, calls, at = [], [], 0
    for kind, text in parts:
        piece = text[: max(0, cut - at)]
        if kind == "content" or kind == "value":
            content.append(piece)
        elif kind == "answer":
            content.append(_decoded_prefix(piece))
        elif kind == "name" and piece == text:
            calls.append(ToolCall(json.loads(text), ""))
        elif kind == "args" and calls and calls[-1].arguments == "" and piece:
            calls[-1].arguments = piece
        at += len(text)
    return ParseResult("".join(content), calls)


def _cuts(parts: Parts) -> list[int]:
    """Every cut position of the reply, except inside a special token."""
    cuts, at = [0], 0
    for kind, text in parts:
        inner = [] if kind == "tag" else range(at + 1, at + len(text))
        cuts += [*inner, at + len(text)]
        at += len(text)
    return cuts


def _check_result(parser: str, result: ParseResult, expected: ParseResult) -> None:
    if parser == "generic":
        assert result.content == expected.content
    else:  # whitespace before a tag is shown while no tag follows it
        assert result.content.startswith(expected.content)
        assert result.content.rstrip(WS) == expected.content.rstrip(WS)
    assert result.calls == expected.calls
    check_arguments(result.calls)


@pytest.mark.parametrize("sample", SAMPLES)
def test_every_cut_shows_no_markup_and_invents_no_arguments(sample: str) -> None:
    parser, parts = SAMPLES[sample]
    text = "".join(t for _, t in parts)
    rng = random.Random(sample)
    for cut in _cuts(parts):
        prefix = text[:cut]
        result = make_tool_parser(parser, []).parse(prefix)
        _check_result(parser, result, _expected(parts, cut))
        for pieces in (list(prefix), *(random_pieces(prefix, rng, 8) for _ in range(3))):
            streamed, deltas = stream(parser, pieces)
            assert streamed == result, (prefix, pieces)
            check_deltas(deltas)


@pytest.mark.parametrize("sample", SAMPLES)
def test_the_whole_reply_is_read_as_before(sample: str) -> None:
    """The reference at the last cut: the complete reply (nothing cut off)."""
    parser, parts = SAMPLES[sample]
    text = "".join(t for _, t in parts)
    result = make_tool_parser(parser, []).parse(text)
    _check_result(parser, result, _expected(parts, len(text)))
    for call in result.calls:
        assert isinstance(json.loads(call.arguments), dict)


# -- cuts seen on the default model (generic format) and the edges of each rule --

CUT_CASES = {
    "generic": [
        # the name is complete, the arguments not begun: the call stands with what was written
        ('{"tool_calls": [{"name": "get_weather", "', "", [ToolCall("get_weather", "")]),
        (
            '{"tool_calls": [{"name": "get_weather", "arguments": {',
            "",
            [ToolCall("get_weather", "{")],
        ),
        (
            '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "',
            "",
            [ToolCall("get_weather", '{"city": "')],
        ),
        ('{"tool_calls": [{"name": "get_wea', "", []),  # no complete name: dropped
        ('{"content":', "", []),
        ('{"content": "Hel', "Hel", []),
        ('{"content": "a\\', "a", []),  # a partial escape is no text yet
        ('{"content": "a\\u00', "a", []),
        ('{"content": "\\ud83d', "", []),  # half of a surrogate pair
        ('{"content": "\\ud83d\\ude00', "\U0001f600", []),
        ("{", "", []),
        (" \n", " \n", []),  # only whitespace: content
        ('{"oth', '{"oth', []),  # not the reply format: content
        ('{"tool_calls": [{"nam": "f"', '{"tool_calls": [{"nam": "f"', []),
    ],
    "hermes": [
        ("<tool_call>", "", []),
        ("Hi <tool_call>\n", "Hi", []),
        ('<tool_call>\n{"name": "f", "argu', "", [ToolCall("f", "")]),
        ('<tool_call>{"name": "f", "id": "x', "", [ToolCall("f", "")]),
        ('<tool_call>{"arguments": {"a": 1}, "name": "f"', "", [ToolCall("f", '{"a": 1}')]),
        ('<tool_call>{"arguments": {"a": 1}, "name": "f', "", []),
        ('<tool_call>{"arguments": {"a": 1', "", []),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1', "", [ToolCall("f", '{"a": 1')]),
        ('<tool_call>{"name": "f", "arguments": {"a": 1, "b', "", [ToolCall("f", '{"a": 1, "b')]),
        ('<tool_call>{"name": "f", "arguments": {"a": tr', "", [ToolCall("f", '{"a": tr')]),
        # markup that can no longer be a call object is content, as when it is complete
        ('<tool_call>{"xyz', '<tool_call>{"xyz', []),
        ('<tool_call>{"name": "f", "na', '<tool_call>{"name": "f", "na', []),
        ('<tool_call>{"name": "f", "arguments": "hello', None, []),
        ("a <tool_", "a <tool_", []),  # a partial tag is text (the tag is one token)
    ],
    "llama3": [
        ("<|python_tag|>", "", []),
        ("Sure <|python_tag|>", "Sure", []),
        ('Sure <|python_tag|>{"name": "f", "parameters": {"a"', "Sure", [ToolCall("f", '{"a"')]),
        ("  {", "", []),
        (
            '{"name": "f", "parameters": {}}; {"name": "g"',
            "",
            [ToolCall("f", "{}"), ToolCall("g", "")],
        ),
        ('{"ans', '{"ans', []),
    ],
}


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [(parser, *case) for parser, cases in CUT_CASES.items() for case in cases],
)
def test_cut_off_output(parser: str, text: str, content: str | None, calls: list) -> None:
    result = make_tool_parser(parser, []).parse(text)
    assert result == ParseResult(text if content is None else content, calls)
    for i in range(len(text) + 1):
        assert stream(parser, [text[:i], text[i:]])[0] == result, i
    streamed, deltas = stream(parser, list(text))
    assert streamed == result
    check_deltas(deltas)
