"""Constraint fragments of the qwen3_coder, mistral and pythonic formats: each is a structural
tag the grammar validates and compiles; it accepts exactly the outputs the tool choice allows,
what it accepts parses back into the calls it spells, and random walks of the grammar (any
token it allows, until it ends) parse into calls valid against the tools' schemas."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from grammar_check import Checker, _backend

from radixlm.grammar.structural_tag import parse_structural_tag
from radixlm.grammar.testing import random_walk
from radixlm.srt.parsers.registry import make_tool_parser
from radixlm.srt.parsers.tool_base import ToolSpec

WEATHER = ToolSpec(
    "get_weather",
    "Weather of a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "metric": {"type": "boolean"},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    strict=True,
)
CLOCK = ToolSpec(
    "get_time",
    None,
    {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
)
NOTE = ToolSpec(
    "note",
    None,
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
)
TOOLS = [WEATHER, CLOCK]
FORMATS = ("qwen3_coder", "mistral", "mistral_v11", "pythonic")
GOOD = ("get_weather", {"city": "Paris", "days": 3})
GOOD_CLOCK = ("get_time", {"zone": "CET"})
BAD = [
    ("get_weather", {"city": "Oslo", "days": 3}),  # not in the enum
    ("get_weather", {"city": "Paris"}),  # a required parameter missing
    ("get_weather", {"city": "Paris", "days": 9}),  # above the maximum
    ("get_weather", {"city": "Paris", "days": 2, "wind": 1}),  # not a parameter
    ("unknown", {}),
]


def value_text(fmt: str, value: object) -> str:
    if fmt == "qwen3_coder":
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(value)


def call_text(fmt: str, name: str, args: dict) -> str:
    if fmt == "qwen3_coder":
        params = "".join(
            f"\n<parameter={k}>\n{value_text(fmt, v)}\n</parameter>" for k, v in args.items()
        )
        return f"<tool_call>\n<function={name}>{params}\n</function>\n</tool_call>"
    if fmt == "pythonic":
        return f"{name}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) + ")"
    if fmt == "mistral_v11":
        return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(args)}"
    return json.dumps({"name": name, "arguments": args})


def reply(fmt: str, *calls: tuple[str, dict]) -> str:
    texts = [call_text(fmt, name, args) for name, args in calls]
    if fmt == "qwen3_coder":
        return "\n".join(texts)
    if fmt == "pythonic":
        return "[" + ", ".join(texts) + "]"
    if fmt == "mistral_v11":
        return "".join(texts)
    return "[TOOL_CALLS] [" + ", ".join(texts) + "]"


def fragment(fmt: str, choice: str, parallel: bool, schema=None, tools=TOOLS, names_only=False):
    frag = make_tool_parser(fmt, tools).constraint(tools, choice, parallel, schema, names_only)
    if frag is not None:
        assert set(frag) == {"structural_tag"}
        parse_structural_tag(frag["structural_tag"])
    return frag


def assert_parses_to(fmt: str, text: str, calls: list[tuple[str, dict]]) -> None:
    result = make_tool_parser(fmt, TOOLS + [NOTE]).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == calls, text
    assert result.content.strip() == ""


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_forces_one_schema_valid_call(fmt: str) -> None:
    checker = Checker(fragment(fmt, "required", parallel=False))
    for call in (GOOD, GOOD_CLOCK, ("get_weather", {"city": "Rome", "days": 1, "metric": True})):
        text = reply(fmt, call)
        assert checker.accepts(text), text
        assert_parses_to(fmt, text, [call])
    for call in BAD:
        assert not checker.accepts(reply(fmt, call)), call
    assert not checker.accepts(reply(fmt, GOOD, GOOD_CLOCK))
    assert not checker.accepts("It is sunny.")


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_and_named_choices(fmt: str) -> None:
    two = reply(fmt, GOOD, GOOD_CLOCK)
    assert Checker(fragment(fmt, "required", parallel=True)).accepts(two)
    assert_parses_to(fmt, two, [GOOD, GOOD_CLOCK])
    named = Checker(fragment(fmt, "function:get_time", parallel=False))
    assert named.accepts(reply(fmt, GOOD_CLOCK))
    assert not named.accepts(reply(fmt, GOOD))
    assert fragment(fmt, "none", True) is None
    assert fragment(fmt, "auto", True, tools=[CLOCK]) is None  # nothing strict


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_with_a_strict_tool(fmt: str) -> None:
    checker = Checker(fragment(fmt, "auto", parallel=False))
    assert checker.accepts("It is sunny in Paris.")
    lead = "" if fmt == "pythonic" else "Let me look. "  # pythonic calls stand at the start
    assert checker.accepts(lead + reply(fmt, GOOD))
    assert not checker.accepts(lead + reply(fmt, BAD[0]))
    # a non-strict tool: any of its parameters, any values
    loose = ("get_time", {"zone": "Mars"})
    assert checker.accepts(lead + reply(fmt, loose))
    result = make_tool_parser(fmt, TOOLS).parse(lead + reply(fmt, loose))
    assert [(c.name, json.loads(c.arguments)) for c in result.calls] == [loose]


@pytest.mark.parametrize("fmt", FORMATS)
def test_names_only_and_response_schema(fmt: str) -> None:
    names_only = Checker(fragment(fmt, "auto", True, tools=[CLOCK], names_only=True))
    assert names_only.accepts("Noon.") and names_only.accepts(reply(fmt, GOOD_CLOCK))
    assert not names_only.accepts(reply(fmt, GOOD))
    answer = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    checker = Checker(fragment(fmt, "auto", True, answer))
    assert checker.accepts('{"n": 1}') and not checker.accepts('{"n": "one"}')
    assert checker.accepts(reply(fmt, GOOD))


def test_qwen3_coder_text_parameters_take_any_text_but_the_end_tag() -> None:
    checker = Checker(fragment("qwen3_coder", "required", False, tools=[NOTE]))
    for text in ("two\nlines", "<b>x</b> </function> <parameter=y>", "", "a</parameter"):
        out = reply("qwen3_coder", ("note", {"text": text}))
        assert checker.accepts(out), out
        assert_parses_to("qwen3_coder", out, [("note", {"text": text})])
    assert not checker.accepts(reply("qwen3_coder", ("note", {"text": "a</parameter>b"})))


REF_TOOL = ToolSpec(
    "add_person",
    None,
    {
        "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}},
        "type": "object",
        "properties": {"name": {"type": "string"}, "pet": {"$ref": "#/$defs/Pet"}},
        "required": ["name", "pet"],
        "additionalProperties": False,
    },
    strict=True,
)


@pytest.mark.parametrize("fmt", FORMATS)
def test_references_keep_their_meaning(fmt: str) -> None:
    checker = Checker(fragment(fmt, "required", False, tools=[REF_TOOL]))
    assert checker.accepts(reply(fmt, ("add_person", {"name": "Ann", "pet": {"kind": "cat"}})))
    assert not checker.accepts(reply(fmt, ("add_person", {"name": "Ann", "pet": {"kind": "cow"}})))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_random_walks_parse_into_valid_calls(fmt: str, parallel: bool) -> None:
    backend = _backend()
    grammar = backend.compile(Checker(fragment(fmt, "required", parallel)).grammar.spec)
    rng = random.Random(f"{fmt}{parallel}")
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
        result = make_tool_parser(fmt, TOOLS).parse(text)
        assert result.calls and result.content.strip() == "", text
        assert parallel or len(result.calls) == 1
        for call in result.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert finished >= 3
