"""The qwen3_coder, mistral and pythonic formats: generated outputs (one call or several),
every split position, damaged and cut-off outputs, malformed markup, linear time; the
reference is the generator (format_cases.py), which knows the content and calls it wrote."""

from __future__ import annotations

import json
import random

import pytest
from format_cases import TOOLS, mistral_case, pythonic_case, qwen3_coder_case
from growth import assert_grows_linearly, best_cpu_seconds
from parser_cases import Case, check_arguments, check_deltas, random_pieces

from radixlm.srt.parsers.registry import make_tool_parser
from radixlm.srt.parsers.tool_base import ParseResult, ToolCall, calls_from_deltas

FORMATS = ("qwen3_coder", "mistral", "mistral_v11", "pythonic")


def stream(name: str, pieces: list[str]):
    parser = make_tool_parser(name, TOOLS)
    content, deltas = [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        content.append(text)
        deltas += new
    text, new = parser.flush()
    return ParseResult("".join(content) + text, calls_from_deltas(deltas + new)), deltas + new


def parse(name: str, text: str) -> ParseResult:
    return make_tool_parser(name, TOOLS).parse(text)


def case_of(name: str, calls: int, rng: random.Random) -> Case:
    if name == "qwen3_coder":
        return qwen3_coder_case(calls, rng)
    if name == "pythonic":
        return pythonic_case(calls, rng)
    return mistral_case(calls, rng, compact=name == "mistral_v11" and rng.random() < 0.8)


def check_streams(name: str, text: str, result: ParseResult, rng: random.Random) -> None:
    for _ in range(3):
        streamed, deltas = stream(name, random_pieces(text, rng, most=12))
        assert streamed == result, text
        check_deltas(deltas)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(40))
def test_generated_outputs_parse_and_stream(name: str, seed: int) -> None:
    rng = random.Random(seed)
    case = case_of(name, 1 + seed % 3, rng)  # one, two or three calls
    result = parse(name, case.text)
    assert result.content == case.content, case.text
    assert result.calls == case.calls, case.text
    check_streams(name, case.text, result, rng)


@pytest.mark.parametrize("name", FORMATS)
def test_every_split_position(name: str) -> None:
    case = case_of(name, 2, random.Random(name))
    result = parse(name, case.text)
    assert (result.content, result.calls) == (case.content, case.calls)
    for i in range(len(case.text) + 1):
        assert stream(name, [case.text[:i], case.text[i:]])[0] == result, i
    streamed, deltas = stream(name, list(case.text))
    assert streamed == result
    check_deltas(deltas)


EXAMPLES = {
    "qwen3_coder": [
        (
            "I'll check.\n<tool_call>\n<function=typed>\n<parameter=s>\nline 1\nline 2\n"
            "</parameter>\n<parameter=n>\n42\n</parameter>\n<parameter=b>\nFalse\n"
            "</parameter>\n</function>\n</tool_call>",
            "I'll check.",
            [ToolCall("typed", '{"s": "line 1\\nline 2", "n": 42, "b": false}')],
        ),
        # unknown parameters and tools are text; a value with tags inside is text
        (
            "<tool_call><function=other><parameter=q><b>x</b></parameter></function></tool_call>",
            "",
            [ToolCall("other", '{"q": "<b>x</b>"}')],
        ),
        # two functions in one block; a typed value that does not fit is its text
        (
            "<tool_call>\n<function=get_time>\n</function>\n<function=typed>\n<parameter=n>\n"
            "many\n</parameter>\n</function>\n</tool_call>",
            "",
            [ToolCall("get_time", "{}"), ToolCall("typed", '{"n": "many"}')],
        ),
        # "null" is text for a string parameter, null where null is allowed
        (
            "<tool_call>\n<function=typed>\n<parameter=s>\nnull\n</parameter>\n<parameter=u>\n"
            "null\n</parameter>\n</function>\n</tool_call>",
            "",
            [ToolCall("typed", '{"s": "null", "u": null}')],
        ),
        ("No call: 4 < 5 <b>", "No call: 4 < 5 <b>", []),
    ],
    "mistral": [
        (
            '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "a1b2c3d4e"}]',
            "",
            [ToolCall("f", '{"a": 1}')],
        ),
        (
            'Both. [TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": '
            '{"x": [1]}}]',
            "Both.",
            [ToolCall("f", "{}"), ToolCall("g", '{"x": [1]}')],
        ),
        (
            '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{"b": 2}',
            "",
            [ToolCall("f", "{}"), ToolCall("g", '{"b": 2}')],
        ),
        ("Plain [answer] here.", "Plain [answer] here.", []),
    ],
    "pythonic": [
        (
            "[get_weather(city='Paris', days=3), get_time()]",
            "",
            [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("get_time", "{}")],
        ),
        (
            '[f(a=True, b=None, c=(1, -2.5), d={"k": [false, null]}, e="\\u00e9")]',
            "",
            [
                ToolCall(
                    "f",
                    '{"a": true, "b": null, "c": [1, -2.5], "d": {"k": [false, null]}, "e": "é"}',
                )
            ],
        ),
        ("[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
        ("Call <|python_start|>[f(x=1)]<|python_end|>", "Call", [ToolCall("f", '{"x": 1}')]),
    ],
}


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [(n, *example) for n, examples in EXAMPLES.items() for example in examples],
)
def test_examples_at_every_split(name: str, text: str, content: str, calls: list) -> None:
    for parser in (name, "mistral_v11") if name == "mistral" else (name,):
        result = parse(parser, text)
        assert (result.content, result.calls) == (content, calls)
        for i in range(len(text) + 1):
            assert stream(parser, [text[:i], text[i:]])[0] == result, i


MALFORMED = {
    "qwen3_coder": [
        "<tool_call>\nnot xml\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call><function=a b></function></tool_call>",
        "text <tool_call> more",
    ],
    "mistral": [
        "[TOOL_CALLS] hello there",
        '[TOOL_CALLS] [{"name": 5}]',
        "[TOOL_CALLS] [1, 2]",
        "[TOOL_CALLS]f[ARGS]not json",
        "[TOOL_CALLS]f[OTHER]{}",
    ],
    "pythonic": ["[x]", "[f x]", "['a', f()]", "[f.(a=1)]", "[1f(a=1)]", "[f"[:1] + " (a=1)]"],
}


@pytest.mark.parametrize(
    ("name", "text"), [(n, t) for n, texts in MALFORMED.items() for t in texts]
)
def test_malformed_markup_is_content(name: str, text: str) -> None:
    result = parse(name, text)
    assert (result.content, result.calls) == (text, [])
    for i in range(len(text) + 1):
        assert stream(name, [text[:i], text[i:]])[0] == result


@pytest.mark.parametrize(
    ("name", "text", "arguments", "content"),
    [
        # a call stands once its name is read; what breaks after is content
        (
            "qwen3_coder",
            "<tool_call><function=f><parameter=a>\n1\n</parameter>oops",
            '{"a": "1"}',
            "oops",
        ),
        ("pythonic", "[f(a=1, 2)]", '{"a": 1}', ", 2)]"),
        ("pythonic", "[f(a=open('x'))]", "{}", "a=open('x'))]"),
        ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1,,}}]', '{"a": 1}', ",,}}]"),
        ("mistral", '[TOOL_CALLS]f[ARGS]{"a": [1, }', '{"a": [1]}', ", }"),
    ],
)
def test_broken_calls_close_where_they_were(name, text, arguments, content) -> None:
    result = parse(name, text)
    assert result.calls == [ToolCall("f", arguments)] and result.content == content
    json.loads(arguments)
    for i in range(len(text) + 1):
        assert stream(name, [text[:i], text[i:]])[0] == result


# -- cut off (max_tokens) --

CUTS = {
    "qwen3_coder": [
        ("Hi <tool_call>\n<function=typ", "Hi", []),
        ("<tool_call>\n<function=typed>", "", [ToolCall("typed", "")]),
        ("<tool_call>\n<function=typed>\n<parameter=s>\nab", "", [ToolCall("typed", '{"s": "ab')]),
        (
            "<tool_call>\n<function=typed>\n<parameter=s>\nab\n</param",
            "",
            [ToolCall("typed", '{"s": "ab\\n</param')],
        ),
        ("<tool_call>\n<function=typed>\n<parameter=n>\n12", "", [ToolCall("typed", "")]),
        (
            "<tool_call>\n<function=typed>\n<parameter=n>\n12\n</parameter>\n",
            "",
            [ToolCall("typed", '{"n": 12')],
        ),
    ],
    "mistral": [
        ("Sure [TOOL_CALLS] [", "Sure", []),
        ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": tr', "", [ToolCall("f", '{"a": tr')]),
        ("[TOOL_CALLS]get_wea", "", []),
        ("[TOOL_CALLS]f[ARGS]", "", [ToolCall("f", "")]),
        ('[TOOL_CALLS]f[ARGS]{"a": "x', "", [ToolCall("f", '{"a": "x')]),
    ],
    "pythonic": [
        ("[get_wea", "", []),
        ("[f(", "", [ToolCall("f", "")]),
        ("[f(a=1, b='x", "", [ToolCall("f", '{"a": 1')]),
        ("[f(a=1), g(", "", [ToolCall("f", '{"a": 1}'), ToolCall("g", "")]),
    ],
}


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [(n, *case) for n, cases in CUTS.items() for case in cases],
)
def test_cut_off_outputs(name: str, text: str, content: str, calls: list) -> None:
    result = parse(name, text)
    assert result == ParseResult(content, calls)
    check_arguments(result.calls)
    for i in range(len(text) + 1):
        assert stream(name, [text[:i], text[i:]])[0] == result, i


def _mutated(text: str, rng: random.Random, pieces: list[str]) -> str:
    for _ in range(rng.randint(1, 3)):
        at = rng.randint(0, len(text))
        edit = rng.random()
        if edit < 0.25:
            text = text[:at]
        elif edit < 0.6:
            text = text[:at] + text[at + rng.randint(1, 3) :]
        else:
            text = text[:at] + rng.choice(pieces) + text[at:]
    return text


_PIECES = {
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</parameter>",
        "<parameter=x>",
        ">",
        "\n",
        "<",
    ],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "{", "}", "[", "]", '"', ",", ":"],
    "mistral_v11": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "{", "}", "[", "]", '"', ",", ":"],
    "pythonic": ["[", "]", "(", ")", "=", ",", "'", '"', "f(", "<|python_start|>", "\\"],
}


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(60))
def test_damaged_outputs_stream_like_parse(name: str, seed: int) -> None:
    rng = random.Random(seed)
    text = _mutated(case_of(name, 1 + seed % 2, rng).text, rng, _PIECES[name])
    result = parse(name, text)
    check_streams(name, text, result, rng)
    check_arguments(result.calls)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(60))
def test_any_text_streams_like_parse(name: str, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(_PIECES[name] + ["a", " ", "1", "typed", "s"]) for _ in range(30))
    result = parse(name, text)
    check_streams(name, text, result, rng)
    check_arguments(result.calls)


def _time(name: str, text: str) -> float:
    def stream() -> None:
        parser = make_tool_parser(name, TOOLS)
        for i in range(0, len(text), 3):
            parser.feed(text[i : i + 3])
        parser.flush()

    return best_cpu_seconds(stream)


@pytest.mark.slow  # timing checks (tests/growth.py): the full suite runs them
@pytest.mark.parametrize("name", FORMATS)
def test_long_outputs_take_linear_time(name: str) -> None:
    def output(n: int) -> str:
        words = "lorem ipsum " * n
        items = list(range(n))
        if name == "qwen3_coder":
            return (
                f"<tool_call>\n<function=typed>\n<parameter=s>\n{words}\n</parameter>\n"
                f"<parameter=a>\n{items}\n</parameter>\n</function>\n</tool_call>"
            )
        if name == "pythonic":
            return f"[typed(s={words!r}, a={items!r})]"
        args = json.dumps({"s": words, "a": items})
        return (
            f"[TOOL_CALLS]typed[ARGS]{args}"
            if name == "mistral_v11"
            else (f'[TOOL_CALLS] [{{"name": "typed", "arguments": {args}}}]')
        )

    assert_grows_linearly(_time(name, output(1_500)), _time(name, output(12_000)))
    assert json.loads(parse(name, output(12_000)).calls[0].arguments)["a"][-1] == 11_999


def test_mistral_ids_and_history() -> None:
    parser = make_tool_parser("mistral", TOOLS)
    ids = {parser.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0123456789abcdef",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"a": 1}'},
                },
                {
                    "id": "Abc123xyz",
                    "type": "function",
                    "function": {"name": "g", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "1"},
        {"role": "tool", "tool_call_id": "Abc123xyz", "content": "2"},
    ]
    out, _ = parser.render(history, TOOLS, "auto")
    first, second = (c["id"] for c in out[1]["tool_calls"])
    assert len(first) == 9 and first.isalnum() and second == "Abc123xyz"
    assert [m["tool_call_id"] for m in out[2:]] == [first, second]
    assert parser.render(history, TOOLS, "auto")[0] == out  # the same ids every time
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert history[1]["tool_calls"][0]["id"] == "call_0123456789abcdef"  # not modified
    assert parser.special_markers and not make_tool_parser("pythonic", []).special_markers


def test_qwen3_coder_text_values_stream_as_they_are_written() -> None:
    parser = make_tool_parser("qwen3_coder", TOOLS)
    assert parser.feed("Sure.\n<tool_call>\n<function=typ") == ("Sure.", [])
    content, deltas = parser.feed("ed>\n<parameter=s>\ndef f():\n")
    # the last line break waits: it drops if </parameter> follows
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [
        ("typed", '{"s": "def f():')
    ]
    assert parser.feed("    return 1\n</para")[1][0].arguments == "\\n    return 1"
    assert parser.feed("meter>\n<parameter=n>\n4")[1][0].arguments == '"'
    assert parser.feed("2\n</parameter>\n</function>")[1][0].arguments == ', "n": 42}'
    assert parser.feed("\n</tool_call>") == ("", [])
    assert parser.flush() == ("", [])
