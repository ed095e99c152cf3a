"""gpt-oss's harmony format (parsers/harmony.py): generated outputs of analysis, preamble, final
and call messages (both header layouts, one call or several) whose reasoning, content and calls
are known by construction; every split position; damaged, malformed and cut-off outputs; the
reasoning parser followed by the tool-call parser reads what the tool-call parser alone reads;
linear time; the constraints accept the calls they spell and those parse back."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from grammar_check import Checker, _backend
from growth import assert_grows_linearly, best_cpu_seconds
from hypothesis import given, settings
from hypothesis import strategies as st
from parser_cases import check_arguments, check_deltas, random_pieces, spaced_json
from quick import examples

from radixlm.grammar.testing import random_walk
from radixlm.srt.parsers.harmony import HarmonyReasoningParser, harmony_history
from radixlm.srt.parsers.registry import (
    make_reasoning_parser,
    make_tool_parser,
    resolve_tool_parser,
)
from radixlm.srt.parsers.tool_base import ParseResult, ToolCall, ToolSpec, calls_from_deltas

NAME = "gpt-oss"
_TEXT = "abc XYZ é\"'<>|/{}[],=()\\\n\t"


def parse(text: str) -> ParseResult:
    return make_tool_parser(NAME, []).parse(text)


def stream(pieces: list[str]):
    parser = make_tool_parser(NAME, [])
    content, deltas = [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        content.append(text)
        deltas += new
    text, new = parser.flush()
    deltas += new
    return ParseResult("".join(content) + text, calls_from_deltas(deltas)), deltas


def split_reasoning(pieces: list[str]) -> tuple[str, str]:
    parser = make_reasoning_parser(NAME, False)
    out = [parser.feed(p) for p in pieces] + [parser.flush()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


def check_all(text: str, rng: random.Random, splits: int = 3, composed: bool = True) -> ParseResult:
    """Streams equal parse (both parsers); ``composed`` (well-formed outputs): the reasoning
    parser's content read by the tool-call parser gives what the tool-call parser reads alone
    (markup that one parser shows as content the next may read as markup again)."""
    result = parse(text)
    reasoning, content = HarmonyReasoningParser().split(text)
    for _ in range(splits):
        pieces = random_pieces(text, rng, most=12)
        streamed, deltas = stream(pieces)
        assert streamed == result, text
        check_deltas(deltas)
        assert split_reasoning(pieces) == (reasoning or "", content), text
    assert not composed or parse(content) == result, text
    check_arguments(result.calls)
    return result


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_TEXT) for _ in range(rng.randint(0, 12)))


def _json_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["int", "str", "list", "dict", "bool"] if depth < 2 else ["int"])
    if kind == "int":
        return rng.randint(-99, 99)
    if kind == "str":
        return _text(rng)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_text(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def harmony_case(rng: random.Random, calls_in: int) -> tuple[str, str | None, str, list]:
    """(text, reasoning or None, content, calls) of a generated output."""
    kinds = [rng.choice(["analysis", "preamble", "final"]) for _ in range(rng.randint(0, 3))]
    kinds += ["call"] * calls_in
    if rng.random() < 0.5:
        rng.shuffle(kinds)
    if rng.random() < 0.5:
        kinds.insert(0, "analysis")
    parts, reasoning, content, calls = [], [], [], []
    for i, kind in enumerate(kinds):
        last = i == len(kinds) - 1
        lead = "" if i == 0 else "<|start|>assistant"
        if kind == "call":
            name = rng.choice(["get_weather", "f", "a-b_c"])
            args = spaced_json(
                {_text(rng): _json_value(rng) for _ in range(rng.randint(0, 3))}, rng
            )
            if rng.random() < 0.5:
                header = f"<|channel|>commentary to=functions.{name} <|constrain|>json"
            else:
                header = f" to=functions.{name}<|channel|>commentary json"
            end = "" if last and rng.random() < 0.5 else "<|call|>"
            parts.append(f"{lead}{header}<|message|>{args}{end}")
            calls.append(ToolCall(name, args))
            continue
        body = _text(rng)
        channel = "commentary" if kind == "preamble" else kind
        end = "<|end|>" if kind != "final" else ("" if last else "<|return|>")
        parts.append(f"{lead}<|channel|>{channel}<|message|>{body}{end}")
        (reasoning if kind == "analysis" else content).append(body)
    has_reasoning = "analysis" in kinds
    return "".join(parts), "".join(reasoning) if has_reasoning else None, "".join(content), calls


@pytest.mark.parametrize("seed", range(80))
def test_generated_outputs_parse_and_stream(seed: int) -> None:
    rng = random.Random(seed)
    text, reasoning, content, calls = harmony_case(rng, seed % 4)  # no call up to three
    result = check_all(text, rng)
    assert (result.content, result.calls) == (content, calls), text
    got_reasoning, rest = HarmonyReasoningParser().split(text)
    assert got_reasoning == reasoning, text
    if not calls:
        assert rest == content  # no markup left for the tool-call parser


def test_every_split_position() -> None:
    rng = random.Random(7)
    text, reasoning, content, calls = harmony_case(rng, 2)
    result = parse(text)
    assert (result.content, result.calls) == (content, calls)
    whole = HarmonyReasoningParser().split(text)
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]])[0] == result, i
        assert split_reasoning([text[:i], text[i:]]) == (whole[0] or "", whole[1]), i
    streamed, deltas = stream(list(text))
    assert streamed == result
    check_deltas(deltas)


W = '{"city": "Paris"}'
EXAMPLES = [
    # (text, reasoning, content, calls): the reasoning parser's reasoning; the tool-call
    # parser's content and calls
    (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        f"commentary to=functions.get_weather <|constrain|>json<|message|>{W}<|call|>",
        "Need the weather.",
        "",
        [ToolCall("get_weather", W)],
    ),
    (
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hi there!<|return|>",
        "Easy.",
        "Hi there!",
        [],
    ),
    # the recipient in the role part, and a plain content type
    (f" to=functions.f<|channel|>commentary json<|message|>{W}", None, "", [ToolCall("f", W)]),
    (
        "<|start|>assistant to=functions.f<|channel|>commentary<|message|>{}",
        None,
        "",
        [ToolCall("f", "{}")],
    ),
    # a preamble is content; two calls; an empty body is {}
    (
        "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant<|channel|>"
        "commentary to=functions.f <|constrain|>json<|message|><|call|><|start|>assistant"
        '<|channel|>commentary to=functions.g <|constrain|>json<|message|> {"x": [1]}\n<|call|>',
        None,
        "Checking both.",
        [ToolCall("f", "{}"), ToolCall("g", '{"x": [1]}')],
    ),
    # another namespace keeps its name (the chat route drops what was not offered)
    (
        '<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>',
        None,
        "",
        [ToolCall("browser.search", '{"q": "x"}')],
    ),
    # no markup at all; a literal <| in text
    ("Just text, 1 <| 2.", None, "Just text, 1 <| 2.", []),
    # a final message without a terminator, unannounced next message
    (
        "<|channel|>final<|message|>A<|channel|>analysis<|message|>B<|start|>assistant"
        "<|channel|>final<|message|>C",
        "B",
        "AC",
        [],
    ),
    # stray terminators are markup
    ("<|end|>x<|return|>", None, "x", []),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), EXAMPLES)
def test_examples_at_every_split(text: str, reasoning, content: str, calls: list) -> None:
    result = parse(text)
    assert (result.content, result.calls) == (content, calls)
    assert HarmonyReasoningParser().split(text)[0] == reasoning
    check_all(text, random.Random(text), splits=1)
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]])[0] == result, i


MALFORMED = [
    "<|channel|>commentary to=functions.f <|constrain|>json<|message|>not json",
    "<|start|>assistant hello<|channel|>final<|message|>",  # a word before the channel
    "<|channel|><|message|>x",  # no channel name
    "<|channel|>commentary to=<|message|>{}",  # no recipient name
    "<|channel|>final<|end|>",  # a header without <|message|>
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_markup_is_content(text: str) -> None:
    result = parse(text)
    assert result.calls == [] and result.content.startswith(text[: text.index("|>") + 2])
    assert "x" not in text or "x" in result.content
    check_all(text, random.Random(text), composed=False)


def test_header_past_the_limit_is_content() -> None:
    text = "<|channel|>final" + " " * 600 + "<|message|>hi"
    result = check_all(text, random.Random(0), composed=False)
    assert result.content == text and result.calls == []


@pytest.mark.parametrize(
    ("text", "arguments", "content"),
    [
        # arguments that stop being JSON close where they were; the rest of the body is content
        ('<|channel|>commentary to=functions.f<|message|>{"a": 1,,}<|call|>', '{"a": 1}', ",,}"),
        # a terminator inside the object breaks it the same way
        (
            '<|channel|>commentary to=functions.f<|message|>{"a": [1, "b<|call|>',
            '{"a": [1, "b"]}',
            "",
        ),
        # text after the object is content
        ('<|channel|>commentary to=functions.f<|message|>{"a": 1} ok<|call|>', '{"a": 1}', " ok"),
    ],
)
def test_broken_calls_close_where_they_were(text: str, arguments: str, content: str) -> None:
    result = check_all(text, random.Random(text))
    assert result == ParseResult(content, [ToolCall("f", arguments)])
    json.loads(arguments)


CUTS = [
    ("<|channel|>analysis<|message|>Thinking", "", []),
    ("<|channel|>final<|message|>Partial ans", "Partial ans", []),
    ("<|channel|>commentary to=functions.get_wea", "", []),
    ("<|channel|>commentary to=functions.get_weather <|constr", "", [ToolCall("get_weather", "")]),
    ("<|channel|>commentary to=functions.f<|message|>", "", [ToolCall("f", "")]),
    ('<|channel|>commentary to=functions.f<|message|>{"a": tr', "", [ToolCall("f", '{"a": tr')]),
    ("Hi<|start|>assistant<|chan", "Hi", []),
    ("<|start|>assistant to=functions.foo<|chan", "", [ToolCall("foo", "")]),
]


@pytest.mark.parametrize(("text", "content", "calls"), CUTS)
def test_cut_off_outputs(text: str, content: str, calls: list) -> None:
    result = check_all(text, random.Random(text))
    assert result == ParseResult(content, calls)
    for i in range(len(text) + 1):
        assert stream([text[:i], text[i:]])[0] == result, i


_PIECES = [
    "<|start|>",
    "assistant",
    "<|channel|>",
    "analysis",
    "final",
    "commentary",
    " to=functions.f",
    " to=",
    "<|constrain|>",
    "json",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|",
    "<",
    "|>",
    "{",
    "}",
    '"a"',
    ":",
    "1",
    ",",
    " ",
    "\n",
    "x",
]


def _mutated(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 3)):
        at = rng.randint(0, len(text))
        edit = rng.random()
        if edit < 0.25:
            text = text[:at]
        elif edit < 0.6:
            text = text[:at] + text[at + rng.randint(1, 3) :]
        else:
            text = text[:at] + rng.choice(_PIECES) + text[at:]
    return text


@pytest.mark.parametrize("seed", range(120))
def test_damaged_outputs_stream_like_parse(seed: int) -> None:
    rng = random.Random(seed)
    check_all(_mutated(harmony_case(rng, 1 + seed % 3)[0], rng), rng, composed=False)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=30), st.randoms(use_true_random=False))
def test_any_text_streams_like_parse(parts: list[str], rng: random.Random) -> None:
    check_all("".join(parts), rng, splits=2, composed=False)


def _time(text: str, reasoning: bool) -> float:
    def stream() -> None:
        parser = make_reasoning_parser(NAME, False) if reasoning else make_tool_parser(NAME, [])
        for i in range(0, len(text), 3):
            parser.feed(text[i : i + 3])
        parser.flush()

    return best_cpu_seconds(stream)


@pytest.mark.slow  # timing checks (tests/growth.py): the full suite runs them
@pytest.mark.parametrize("reasoning", [False, True])
def test_long_outputs_take_linear_time(reasoning: bool) -> None:
    def output(n: int) -> str:
        args = json.dumps({"s": "lorem <|ipsum " * n, "a": list(range(n))})
        think = "<|channel|>analysis<|message|>" + "why < not |> " * n + "<|end|>"
        calls = "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{}<|call|>" * n
        return f"{think}<|start|>assistant<|channel|>commentary to=functions.typed <|constrain|>json<|message|>{args}<|call|>{calls}"

    assert_grows_linearly(_time(output(400), reasoning), _time(output(3_200), reasoning))
    calls = parse(output(300)).calls
    assert len(calls) == 301 and json.loads(calls[0].arguments)["a"][-1] == 299


def test_selection_by_name_and_template() -> None:
    gpt_oss_like = "{{- '<|start|>assistant<|channel|>final<|message|>' }}{{- '<|call|>' }}"
    assert resolve_tool_parser("auto", gpt_oss_like) == "gpt-oss"
    assert resolve_tool_parser("openai", None) == "gpt-oss"
    assert resolve_tool_parser("auto", "<tool_call>") == "hermes"
    assert isinstance(make_reasoning_parser("openai_gptoss", False), HarmonyReasoningParser)
    with pytest.raises(ValueError, match="known"):
        make_reasoning_parser("harmony", False)
    assert "<|call|>" in make_tool_parser(NAME, []).special_markers


def test_history_is_one_call_per_message_with_its_result() -> None:
    call = lambda i, name: {  # noqa: E731
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": {"a": i}},
    }
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "two calls",
            "tool_calls": [call(1, "f"), call(2, "g")],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
        {"role": "assistant", "content": "done"},
    ]
    out = harmony_history(history)
    assert [(m["role"], m.get("content")) for m in out] == [
        ("user", "hi"),
        ("assistant", None),
        ("tool", "one"),
        ("assistant", ""),
        ("tool", "two"),
        ("assistant", "done"),
    ]
    assert out[1]["thinking"] == "two calls" and "reasoning_content" not in out[1]
    assert [m["tool_calls"][0]["id"] for m in (out[1], out[3])] == ["call_1", "call_2"]
    rendered, kwargs = make_tool_parser(NAME, []).render(history, [ToolSpec("f")], "auto")
    assert len(rendered) == 6 and kwargs["tools"][0]["function"]["name"] == "f"
    assert history[1]["tool_calls"][1]["id"] == "call_2"  # not modified


# -- constraints (llguidance, a byte-level tokenizer: the markers are ordinary text here) --

WEATHER = ToolSpec(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    strict=True,
)
CLOCK = ToolSpec("get_time", None, {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}})
TOOLS = [WEATHER, CLOCK]


def call_text(name: str, args: dict) -> str:
    return (
        f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        f"{json.dumps(args)}<|call|>"
    )


def constraint(choice: str, parallel: bool = False, schema: dict | None = None) -> dict:
    fragment = make_tool_parser(NAME, TOOLS).constraint(TOOLS, choice, parallel, schema)
    assert fragment is not None
    return fragment


def test_required_accepts_calls_that_parse_back() -> None:
    good = call_text("get_weather", {"city": "Paris", "days": 3})
    checker = Checker(constraint("required"))
    assert checker.accepts(good)
    assert not checker.accepts(call_text("get_weather", {"city": "Oslo", "days": 3}))
    assert not checker.accepts("<|channel|>final<|message|>Hi")
    assert not checker.accepts(good + "<|start|>assistant" + call_text("get_time", {}))
    assert parse(good).calls == [ToolCall("get_weather", '{"city": "Paris", "days": 3}')]
    two = good + "<|start|>assistant" + call_text("get_time", {"zone": "UTC"})
    assert Checker(constraint("required", parallel=True)).accepts(two)
    assert [c.name for c in parse(two).calls] == ["get_weather", "get_time"]
    named = Checker(constraint("function:get_time"))
    assert named.accepts(call_text("get_time", {})) and not named.accepts(good)


def test_auto_with_a_strict_tool_and_a_response_schema() -> None:
    auto = Checker(constraint("auto"))
    assert auto.accepts("<|channel|>final<|message|>Sunny.")
    assert auto.accepts("Let me see. " + call_text("get_weather", {"city": "Rome", "days": 1}))
    assert not auto.accepts(call_text("get_weather", {"city": "Rome"}))
    answer = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    either = Checker(constraint("auto", schema=answer))
    assert either.accepts('<|channel|>final<|message|>{"x": 1}')
    assert either.accepts(call_text("get_time", {}))
    assert not either.accepts('{"x": 1}')
    assert parse('<|channel|>final<|message|>{"x": 1}').content == '{"x": 1}'


def test_reasoning_wrap_allows_an_analysis_message_first() -> None:
    wrapped = HarmonyReasoningParser().wrap_constraint(constraint("required"))
    checker = Checker(wrapped)
    good = call_text("get_weather", {"city": "Paris", "days": 2})
    thought = "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant"
    assert checker.accepts(good) and checker.accepts(thought + good)
    assert not checker.accepts("<|channel|>analysis<|message|>a<|end|>b<|end|><|start|>assistant")
    assert HarmonyReasoningParser().split(thought + good)[0] == "Use the tool."
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    answer = Checker(HarmonyReasoningParser().wrap_constraint({"json_schema": schema}))
    text = thought + '<|start|>assistant<|channel|>final<|message|>{"x": 3}'
    assert answer.accepts(thought + '<|channel|>final<|message|>{"x": 3}') and not answer.accepts(
        text
    )
    assert HarmonyReasoningParser().split(thought + '<|channel|>final<|message|>{"x": 3}') == (
        "Use the tool.",
        '{"x": 3}',
    )


@pytest.mark.parametrize("parallel", [False, True])
def test_random_walks_parse_into_valid_calls(parallel: bool) -> None:
    backend = _backend()
    grammar = backend.compile(Checker(constraint("required", parallel)).grammar.spec)
    rng = random.Random(f"harmony{parallel}")
    schemas = {t.name: t.parameters for t in TOOLS}
    finished = 0
    for _ in range(6):
        ids, done = random_walk(
            grammar.new_matcher(), backend.vocab, rng, max_tokens=300, check_rejections=False
        )
        if not done:
            continue
        finished += 1
        text = backend.vocab.decode_bytes(ids).decode("utf-8")
        result = parse(text)
        assert result.calls and result.content == "", text
        assert parallel or len(result.calls) == 1
        for call in result.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert finished >= 3
