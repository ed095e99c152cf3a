"""Constraint fragments: every structural tag passes the grammar's own validation and compiles;
the grammar accepts exactly the outputs the choice allows, and what it accepts parses back
into the calls it spells (generic replies are also checked with jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_check import Checker

from radixlm.grammar.structural_tag import parse_structural_tag
from radixlm.srt.parsers.constraints import placed
from radixlm.srt.parsers.reasoning import ReasoningParser
from radixlm.srt.parsers.registry import make_tool_parser
from radixlm.srt.parsers.tool_base import ToolCall, ToolSpec

WEATHER = ToolSpec(
    "get_weather",
    "Current weather of a city",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
    strict=True,
)
CLOCK = ToolSpec(
    "get_time",
    None,
    {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
)
TOOLS = [WEATHER, CLOCK]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
}

GOOD_WEATHER = '{"city": "Paris"}'
BAD_WEATHER = '{"town": "Paris"}'
GOOD_CLOCK = '{"zone": "CET"}'


def call_text(parser: str, name: str, args: str) -> str:
    if parser == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    return f'{{"name": "{name}", "parameters": {args}}}'


def calls_text(parser: str, *calls: tuple[str, str]) -> str:
    sep = "\n" if parser == "hermes" else "; "
    return sep.join(call_text(parser, name, args) for name, args in calls)


def fragment(parser: str, choice: str, parallel: bool, response_schema=None, tools=TOOLS):
    return make_tool_parser(parser, tools).constraint(tools, choice, parallel, response_schema)


def check_tag(frag: dict) -> None:
    assert set(frag) == {"structural_tag"}
    parse_structural_tag(frag["structural_tag"])


def assert_accepts(checker: Checker, parser: str, text: str, calls: list[ToolCall]) -> None:
    assert checker.accepts(text), text
    result = make_tool_parser(parser, TOOLS).parse(text)
    assert result.calls == calls, text


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_nothing_to_enforce_gives_none(parser: str) -> None:
    assert fragment(parser, "none", True) is None
    assert fragment(parser, "auto", True, tools=[CLOCK]) is None  # no strict tool
    assert fragment(parser, "auto", True, tools=[]) is None


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_names_only_auto_lets_answers_through_and_calls_name_the_given_tools(parser) -> None:
    """allowed_tools narrowed the tools to CLOCK (not strict): under ``auto`` the model may
    answer, and a call must name get_time (its arguments stay free, as under plain auto)."""
    frag = make_tool_parser(parser, [CLOCK]).constraint([CLOCK], "auto", True, None, True)
    check_tag(frag)
    checker = Checker(frag)
    assert checker.accepts("It is noon.")
    one = call_text(parser, "get_time", '{"zone": 1}')
    assert_accepts(checker, parser, one, [ToolCall("get_time", '{"zone": 1}')])
    assert not checker.accepts(call_text(parser, "get_weather", GOOD_WEATHER))
    assert not checker.accepts(call_text(parser, "other", "{}"))


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_required_forces_one_schema_valid_call(parser: str) -> None:
    frag = fragment(parser, "required", parallel=False)
    check_tag(frag)
    checker = Checker(frag)
    one = calls_text(parser, ("get_weather", GOOD_WEATHER))
    assert_accepts(checker, parser, one, [ToolCall("get_weather", GOOD_WEATHER)])
    assert_accepts(
        checker,
        parser,
        call_text(parser, "get_time", GOOD_CLOCK),
        [ToolCall("get_time", GOOD_CLOCK)],
    )  # non-strict tools match their schema too
    assert not checker.accepts(calls_text(parser, ("get_weather", BAD_WEATHER)))
    assert not checker.accepts(calls_text(parser, ("get_time", '{"zone": 1}')))
    assert not checker.accepts(
        calls_text(parser, ("get_weather", GOOD_WEATHER), ("get_time", GOOD_CLOCK))
    )
    assert not checker.accepts("It is sunny.")
    assert not checker.accepts("")


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_required_parallel_allows_several_calls(parser: str) -> None:
    frag = fragment(parser, "required", parallel=True)
    check_tag(frag)
    text = calls_text(parser, ("get_weather", GOOD_WEATHER), ("get_time", GOOD_CLOCK))
    assert_accepts(
        Checker(frag),
        parser,
        text,
        [ToolCall("get_weather", GOOD_WEATHER), ToolCall("get_time", GOOD_CLOCK)],
    )


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_named_choice_allows_only_that_tool(parser: str) -> None:
    frag = fragment(parser, "function:get_time", parallel=False)
    check_tag(frag)
    checker = Checker(frag)
    assert_accepts(
        checker,
        parser,
        calls_text(parser, ("get_time", GOOD_CLOCK)),
        [ToolCall("get_time", GOOD_CLOCK)],
    )
    assert not checker.accepts(calls_text(parser, ("get_weather", GOOD_WEATHER)))
    with pytest.raises(ValueError, match="not offered"):
        fragment(parser, "function:missing", parallel=False)


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_auto_with_a_strict_tool_keeps_its_arguments_valid(parser: str) -> None:
    frag = fragment(parser, "auto", parallel=False)
    check_tag(frag)
    checker = Checker(frag)
    assert checker.accepts("It is sunny in Paris.")
    call = calls_text(parser, ("get_weather", GOOD_WEATHER))
    prefix = "Let me look.\n" if parser == "hermes" else ""  # llama3 calls stand at the start
    assert_accepts(checker, parser, prefix + call, [ToolCall("get_weather", GOOD_WEATHER)])
    assert not checker.accepts(prefix + calls_text(parser, ("get_weather", BAD_WEATHER)))
    # the non-strict tool: any object
    loose = calls_text(parser, ("get_time", '{"anything": [1]}'))
    assert_accepts(checker, parser, prefix + loose, [ToolCall("get_time", '{"anything": [1]}')])


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_response_schema_composes_with_calls(parser: str) -> None:
    frag = fragment(parser, "auto", parallel=True, response_schema=ANSWER_SCHEMA)
    if parser == "hermes":
        check_tag(frag)
    else:  # one JSON schema: the answer or one call
        assert set(frag) == {"json_schema"}
    checker = Checker(frag)
    assert checker.accepts('{"answer": 42}')
    assert not checker.accepts('{"answer": "many"}')
    assert not checker.accepts("free text")
    text = calls_text(parser, ("get_weather", GOOD_WEATHER))
    assert_accepts(checker, parser, text, [ToolCall("get_weather", GOOD_WEATHER)])
    assert make_tool_parser(parser, TOOLS).parse('{"answer": 42}').content == '{"answer": 42}'
    # required ignores the answer schema: calls only
    assert not Checker(fragment(parser, "required", True, ANSWER_SCHEMA)).accepts('{"answer": 1}')


def test_invalid_choices_are_refused() -> None:
    for parser in ("hermes", "llama3", "generic"):
        with pytest.raises(ValueError, match="tool_choice"):
            fragment(parser, "sometimes", True)
        with pytest.raises(ValueError, match="at least one tool"):
            fragment(parser, "required", True, tools=[])


# -- generic: JSON schema of the reply --


def _reply_calls(*calls: tuple[str, dict]) -> dict:
    return {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}


def test_generic_schema_under_auto() -> None:
    auto = fragment("generic", "auto", parallel=False)["json_schema"]
    good = [_reply_calls(("get_weather", {"city": "Paris"})), {"content": "Sunny."}]
    bad = [
        _reply_calls(("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})),  # parallel
        _reply_calls(("get_weather", {"town": "Paris"})),  # strict tool, wrong arguments
        _reply_calls(("unknown", {})),
        {"tool_calls": []},
        {"content": 5},
        {"content": "x", "tool_calls": []},
        {"answer": "x"},
    ]
    for reply in good:
        jsonschema.validate(reply, auto)
    for reply in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(reply, auto)
    # generic format: a non-strict tool's arguments follow its schema under auto too
    jsonschema.validate(_reply_calls(("get_time", {"zone": "CET"})), auto)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_reply_calls(("get_time", {"whatever": 1})), auto)


def test_generic_schema_for_forced_calls_and_answer_formats() -> None:
    required = fragment("generic", "required", parallel=True)["json_schema"]
    jsonschema.validate(
        _reply_calls(("get_weather", {"city": "A"}), ("get_time", {"zone": "B"})), required
    )
    for reply in ({"content": "Sunny."}, _reply_calls(("get_time", {"whatever": 1}))):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(reply, required)

    named = fragment("generic", "function:get_time", parallel=False)["json_schema"]
    jsonschema.validate(_reply_calls(("get_time", {"zone": "CET"})), named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_reply_calls(("get_weather", {"city": "Paris"})), named)

    answer = fragment("generic", "auto", True, ANSWER_SCHEMA)["json_schema"]
    jsonschema.validate({"content": {"answer": 3}}, answer)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"content": "three"}, answer)
    assert fragment("generic", "none", True) is None


def test_generic_grammar_output_parses_back() -> None:
    frag = fragment("generic", "auto", parallel=True)
    checker = Checker(frag)
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    assert checker.accepts(text)
    assert make_tool_parser("generic", TOOLS).parse(text).calls == [
        ToolCall("get_weather", GOOD_WEATHER)
    ]
    assert checker.accepts('{"content": "Sunny."}')
    assert make_tool_parser("generic", TOOLS).parse('{"content": "Sunny."}').content == "Sunny."
    assert not checker.accepts('{"tool_calls": [{"name": "get_weather", "arguments": {}}]}')


# -- reasoning: the constraint applies after </think> --


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
def test_wrapped_constraints_leave_the_reasoning_free(starts_in_reasoning: bool) -> None:
    reasoning = ReasoningParser("qwen3", starts_in_reasoning)
    opened = "" if starts_in_reasoning else "<think>\n"
    think = opened + "Paris? Maybe <think> or </thin k>.\n</think>\n\n"
    frag = fragment("hermes", "required", parallel=False)
    wrapped = reasoning.wrap_constraint(frag)
    check_tag(wrapped)
    checker = Checker(wrapped)
    call = calls_text("hermes", ("get_weather", GOOD_WEATHER))
    assert checker.accepts(think + call)
    assert not checker.accepts(think + calls_text("hermes", ("get_weather", BAD_WEATHER)))
    assert not checker.accepts(think + "free text")
    assert not checker.accepts(think.replace("</think>", "</think>x") + call)
    assert checker.accepts(call) is (not starts_in_reasoning)  # without a block
    _, content = reasoning.split(think + call)
    assert make_tool_parser("hermes", TOOLS).parse(content).calls == [
        ToolCall("get_weather", GOOD_WEATHER)
    ]

    schema = reasoning.wrap_constraint({"json_schema": json.dumps(ANSWER_SCHEMA)})
    check_tag(schema)
    checker = Checker(schema)
    assert checker.accepts(think + '{"answer": 1}')
    assert not checker.accepts(think + '{"answer": "one"}')
    assert reasoning.wrap_constraint(None) is None


def test_wrapping_the_legacy_and_other_forms() -> None:
    reasoning = ReasoningParser("deepseek-r1", False)  # R1 output starts in reasoning
    legacy = {
        "structural_tag": {
            "type": "structural_tag",
            "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
            "triggers": ["<f>"],
        }
    }
    for frag in (
        legacy,
        {"regex": "[0-9]+"},
        fragment("generic", "auto", True),
        fragment("hermes", "auto", False),
    ):
        wrapped = reasoning.wrap_constraint(frag)
        check_tag(wrapped)
        Checker(wrapped)  # compiles
    checker = Checker(reasoning.wrap_constraint(legacy))
    assert checker.accepts('hmm</think>\n\ntext <f>{"a": 1}</f> more')
    assert Checker(reasoning.wrap_constraint({"regex": "[0-9]+"})).accepts("x</think>42")
    choices = Checker(reasoning.wrap_constraint({"choices": ["red", "blue"]}))
    assert choices.accepts("x</think>red") and not choices.accepts("x</think>green")
    with pytest.raises(ValueError):
        reasoning.wrap_constraint({"json_schema": {}, "regex": "a"})


# -- tool and answer schemas with local references ($defs, "#", pointers) --

# What pydantic writes for nested models (``#/$defs/...``), a recursive reference to the
# schema's own root (``#``), a pointer into its properties, and a "$ref" key inside data.
PERSON_SCHEMA = {
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}}},
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "pet": {"$ref": "#/$defs/Pet"},
        "friends": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
        "alias": {"$ref": "#/properties/name"},
        "$ref": {"type": "integer"},  # a property named "$ref" is a schema, not a reference
        "note": {"type": "string", "default": {"$ref": "#/nowhere"}},
    },
    "required": ["name", "pet"],
    "additionalProperties": False,
}
# The same with an ``$id``: a validator resolves its references against it wherever it sits.
PERSON_WITH_ID = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://example.com/person",
    **PERSON_SCHEMA,
}
ANSWER_WITH_DEFS = {
    "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
    "required": ["items"],
}
GOOD_PERSON = (
    '{"name": "Ann", "pet": {"kind": "cat"}, "friends": [{"name": "Ann", "pet": {}}], '
    '"alias": "Ann", "$ref": 3}'
)
BAD_PERSONS = [
    '{"name": "Ann", "pet": {"kind": "cow"}}',  # the $defs target
    '{"name": "Ann", "pet": {}, "friends": [{"name": "Ann", "pet": {"kind": 1}}]}',  # "#"
    '{"name": "Ann", "pet": {}, "alias": 5}',  # the pointer
    '{"name": "Ann", "pet": {}, "$ref": "x"}',
]


@pytest.mark.parametrize("parser", ["generic", "hermes", "llama3"])
@pytest.mark.parametrize("choice", ["required", "function:add_person", "auto"])
@pytest.mark.parametrize("with_id", [False, True])
def test_tool_schemas_with_references_keep_their_meaning(
    parser: str, choice: str, with_id: bool
) -> None:
    schema = PERSON_WITH_ID if with_id else PERSON_SCHEMA
    tools = [ToolSpec("add_person", "Adds a person", schema, strict=True), CLOCK]
    frag = make_tool_parser(parser, tools).constraint(tools, choice, True, None)
    checker = Checker(frag)
    good = _reply_calls(("add_person", json.loads(GOOD_PERSON)))
    if parser == "generic":
        schema = frag["json_schema"]
        jsonschema.validate(good, schema)
        for bad in BAD_PERSONS:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(_reply_calls(("add_person", json.loads(bad))), schema)
        text = lambda args: json.dumps(_reply_calls(("add_person", json.loads(args))))  # noqa: E731
    else:
        text = lambda args: calls_text(parser, ("add_person", args))  # noqa: E731
    assert checker.accepts(text(GOOD_PERSON))
    for bad in BAD_PERSONS:
        assert not checker.accepts(text(bad)), bad
    assert tools[0].parameters["properties"]["pet"] == {"$ref": "#/$defs/Pet"}


@pytest.mark.parametrize("parser", ["generic", "hermes", "llama3"])
def test_answer_schema_with_references_composes_with_tools(parser: str) -> None:
    frag = make_tool_parser(parser, TOOLS).constraint(TOOLS, "auto", True, ANSWER_WITH_DEFS)
    checker = Checker(frag)
    good, bad = {"items": [{"n": 1}]}, {"items": [{"n": "one"}]}
    wrap = (lambda v: {"content": v}) if parser == "generic" else (lambda v: v)
    assert checker.accepts(json.dumps(wrap(good)))
    assert not checker.accepts(json.dumps(wrap(bad)))
    if parser == "generic":
        jsonschema.validate(wrap(good), frag["json_schema"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrap(bad), frag["json_schema"])


def test_placed_rebases_references_and_leaves_data_alone() -> None:
    defs: dict = {}
    assert placed(PERSON_WITH_ID, "tool_x", defs) == {"$ref": "#/$defs/tool_x"}
    body = defs["tool_x"]
    assert "$id" not in body and "$schema" not in body
    assert body["properties"]["pet"] == {"$ref": "#/$defs/tool_x/$defs/Pet"}
    assert body["properties"]["friends"]["items"] == {"$ref": "#/$defs/tool_x"}
    assert body["properties"]["alias"] == {"$ref": "#/$defs/tool_x/properties/name"}
    assert body["properties"]["$ref"] == {"type": "integer"}
    assert body["properties"]["note"]["default"] == {"$ref": "#/nowhere"}
    assert placed(ANSWER_SCHEMA, "answer", defs) is ANSWER_SCHEMA  # no references: inline


def test_schemas_without_references_stay_inline() -> None:
    schema = fragment("generic", "required", parallel=True)["json_schema"]
    assert "$defs" not in schema
    items = schema["properties"]["tool_calls"]["items"]["anyOf"]
    assert items[0]["properties"]["arguments"] == WEATHER.parameters
