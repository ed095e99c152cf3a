"""Structural tags on llguidance: every format type accepts and rejects the right strings (the
compiled matcher driven token by token), tool-call tags produce JSON valid against their
schemas (checked with jsonschema on random walks), the legacy form, and strict validation."""

from __future__ import annotations

import json
import random
import time

import jsonschema
import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.bitmask import allocate_token_bitmask, allowed_token_ids
from radixlm.grammar.limits import GrammarLimits, check_spec
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.registry import GrammarConfig, create_grammar_backend
from radixlm.grammar.structural_tag import parse_structural_tag, structural_tag_grammar
from radixlm.grammar.structural_tag_nodes import TriggeredTagsFormat
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "unit"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
}
TOOL_BEGIN = '<tool_call>\n{{"name": "{name}", "arguments": '
TOOL_END = "}\n</tool_call>"


def tool_tag(name: str, schema: dict) -> dict:
    begin = TOOL_BEGIN.format(name=name)
    content = {"type": "json_schema", "json_schema": schema}
    return {"type": "tag", "begin": begin, "content": content, "end": TOOL_END}


def tool_call(name: str, arguments: str) -> str:
    return TOOL_BEGIN.format(name=name) + arguments + TOOL_END


TOOLS = {"get_weather": WEATHER, "get_time": TIME}
TOOL_TAGS = [tool_tag(name, schema) for name, schema in TOOLS.items()]


def triggered(**flags) -> dict:
    return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": TOOL_TAGS, **flags}


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


@pytest.fixture(scope="module")
def backend(vocab):
    return LLGuidanceBackend(vocab)


def compile_format(backend, fmt: dict):
    return backend.compile(GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt}))


def accepts(grammar, vocab, text: str) -> bool:
    """Whether ``text`` followed by EOS is a complete output of ``grammar``."""
    matcher = grammar.new_matcher()
    if not matcher.accept_tokens(vocab.encode(text)):
        return False
    return matcher.accept_token(vocab.eos_token_ids[0])


def check_strings(grammar, vocab, good: list[str], bad: list[str]) -> None:
    for text in good:
        assert accepts(grammar, vocab, text), f"rejected {text!r}"
    for text in bad:
        assert not accepts(grammar, vocab, text), f"accepted {text!r}"


# --- each format type --------------------------------------------------------------------


def test_const_string(backend, vocab):
    grammar = compile_format(backend, {"type": "const_string", "value": 'say "hi"\n'})
    check_strings(grammar, vocab, ['say "hi"\n'], ["", 'say "hi"', 'say "hi"\nx', "say"])


def test_json_schema_uses_the_json_schema_kinds_options(backend, vocab):
    grammar = compile_format(backend, {"type": "json_schema", "json_schema": WEATHER})
    good = ['{"city": "Oslo", "unit": "c"}', '{"city":"Oslo","unit":"f","days":3}']
    bad = [
        '{"city": "Oslo"}',  # required unit missing
        '{"city": "Oslo", "unit": "k"}',
        '{"city":  "Oslo", "unit": "c"}',  # whitespace is bounded ([ ]?)
        '{"city": "Oslo", "unit": "c", "x": 1}',  # objects are closed as for json_schema
        '{"city": "Oslo", "unit": "c", "days": 10}',
        '{"city": "Oslo", "unit": "c"} ',
    ]
    check_strings(grammar, vocab, good, bad)


def test_json_schema_whitespace_follows_the_backend(vocab):
    tight = LLGuidanceBackend(vocab, whitespace_pattern="")
    grammar = compile_format(tight, tool_tag("get_time", TIME))
    good = [tool_call("get_time", '{"zone":"utc"}')]
    check_strings(grammar, vocab, good, [tool_call("get_time", '{"zone": "utc"}')])


def test_any_text(backend, vocab):
    grammar = compile_format(backend, {"type": "any_text"})
    check_strings(grammar, vocab, ["", "anything <at> all\n\t{ é"], [])


def test_any_text_inside_a_tag_stops_at_the_end_string(backend, vocab):
    think = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    grammar = compile_format(backend, think)
    good = ["<think></think>", "<think>a < b </thin k></think>"]
    bad = ["<think>x", "<think>x</think>y", "<think>x</think></think>", "x<think></think>"]
    check_strings(grammar, vocab, good, bad)


def test_regex(backend, vocab):
    grammar = compile_format(backend, {"type": "regex", "pattern": r"^[a-z]+/\d{2}(x|y)?$"})
    good = ["ab/12", "z/00x", "q/99y"]
    bad = ["ab/1", "AB/12", "ab12", "ab/12z", "ab/\u0663\u0663"]  # \d is ASCII only
    check_strings(grammar, vocab, good, bad)


def test_grammar_lark_and_gbnf(backend, vocab):
    lark = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/'
    grammar = compile_format(backend, {"type": "grammar", "grammar": lark})
    check_strings(grammar, vocab, ["(1)", "(12,3)"], ["()", "(1,)", "(1)x", "1"])
    gbnf = 'root ::= "<" [a-c]+ ">"'
    grammar = compile_format(
        backend,
        {
            "type": "sequence",
            "elements": [
                {"type": "grammar", "grammar": gbnf},
                {"type": "const_string", "value": "!"},
            ],
        },
    )
    check_strings(grammar, vocab, ["<abc>!", "<a>!"], ["<>!", "<abc>", "<d>!"])


def test_sequence(backend, vocab):
    fmt = {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "n="},
            {"type": "regex", "pattern": "[0-9]+"},
            {"type": "const_string", "value": ";"},
            {"type": "json_schema", "json_schema": {"type": "boolean"}},
        ],
    }
    grammar = compile_format(backend, fmt)
    check_strings(grammar, vocab, ["n=12;true", "n=0;false"], ["n=;true", "n=1true", "n=1;"])


def test_or(backend, vocab):
    fmt = {
        "type": "or",
        "elements": [
            {"type": "const_string", "value": "none"},
            {"type": "json_schema", "json_schema": {"type": "integer"}},
        ],
    }
    grammar = compile_format(backend, fmt)
    check_strings(grammar, vocab, ["none", "42", "-7"], ["no", "4.5", "none42", ""])


def test_tag(backend, vocab):
    grammar = compile_format(backend, tool_tag("get_time", TIME))
    good = [tool_call("get_time", '{"zone": "cet"}')]
    bad = [
        tool_call("get_time", '{"zone": "pst"}'),
        tool_call("get_weather", '{"zone": "cet"}'),
        TOOL_BEGIN.format(name="get_time") + '{"zone": "cet"}',
        "x" + tool_call("get_time", '{"zone": "cet"}'),
    ]
    check_strings(grammar, vocab, good, bad)


def test_nested_tags_and_end_strings(backend, vocab):
    inner = {"type": "tag", "begin": "<b>", "content": {"type": "any_text"}, "end": "</b>"}
    fmt = {"type": "tag", "begin": "<a>", "content": inner, "end": "</a>"}
    grammar = compile_format(backend, fmt)
    check_strings(grammar, vocab, ["<a><b>x</b></a>", "<a><b></b></a>"], ["<a><b>x</a>"])


def test_json_beside_literals_sharing_a_first_character(backend, vocab):
    """A JSON alternative and a literal one may share a first character as long as the
    lexer can tell them apart (a string schema beside a quoted word, an object beside "n")."""
    string_or_word = {
        "type": "or",
        "elements": [
            {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 3}},
            {"type": "const_string", "value": '"x!'},
        ],
    }
    grammar = compile_format(backend, string_or_word)
    check_strings(grammar, vocab, ['"ab"', '"x!'], ['"x!"x', '"abcd"'])
    fmt = {"type": "or", "elements": [{"type": "json_schema", "json_schema": TIME}, *TOOL_TAGS]}
    grammar = compile_format(backend, fmt)  # "<" and "{" differ
    check_strings(grammar, vocab, ['{"zone": "utc"}', TIME_CALL], ['{"zone": 1}'])


# --- triggered_tags ----------------------------------------------------------------------

WEATHER_CALL = tool_call("get_weather", '{"city": "Oslo", "unit": "c"}')
TIME_CALL = tool_call("get_time", '{"zone": "utc"}')


def test_triggered_tags_free_text_with_tool_calls(backend, vocab):
    grammar = compile_format(backend, triggered())
    good = [
        "",
        "no tools needed",
        WEATHER_CALL,
        f"Let me check. {WEATHER_CALL}\nand {TIME_CALL} done",
        "a <tool_cal> is not the trigger",
    ]
    bad = [
        "mentions <tool_call> without a call",
        "text <tool_call>",
        tool_call("get_stock", '{"zone": "utc"}'),
        tool_call("get_time", '{"zone": "pst"}'),
        f"{WEATHER_CALL} then <tool_call>\n",
    ]
    check_strings(grammar, vocab, good, bad)


def test_triggered_tags_at_least_one(backend, vocab):
    grammar = compile_format(backend, triggered(at_least_one=True))
    good = [WEATHER_CALL, WEATHER_CALL + " after", TIME_CALL + " x " + WEATHER_CALL]
    bad = ["", "free text", " " + WEATHER_CALL, WEATHER_CALL + " <tool_call>"]
    check_strings(grammar, vocab, good, bad)


def test_triggered_tags_stop_after_first(backend, vocab):
    grammar = compile_format(backend, triggered(stop_after_first=True))
    good = ["", "just text", "text then " + TIME_CALL]
    bad = [TIME_CALL + " more", TIME_CALL + TIME_CALL, "text <tool_call> x"]
    check_strings(grammar, vocab, good, bad)


def test_at_least_one_and_stop_after_first_is_one_tag_then_only_eos(backend, vocab):
    grammar = compile_format(backend, triggered(at_least_one=True, stop_after_first=True))
    check_strings(grammar, vocab, [WEATHER_CALL, TIME_CALL], ["", "x", WEATHER_CALL + " "])
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens(vocab.encode(TIME_CALL))
    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed_token_ids(bitmask, 0, vocab.vocab_size) == list(vocab.eos_token_ids)
    assert matcher.accept_token(vocab.eos_token_ids[0]) and matcher.is_terminated()


def test_triggers_sharing_a_prefix_and_several_triggers(backend, vocab):
    tags = [
        {"begin": "<f=a>", "content": {"type": "const_string", "value": "1"}, "end": "</f>"},
        {"begin": "<func=b>", "content": {"type": "const_string", "value": "2"}, "end": "</f>"},
        {"begin": "[x]", "content": {"type": "const_string", "value": "3"}, "end": ""},
    ]
    fmt = {"type": "triggered_tags", "triggers": ["<f", "<func", "[x"], "tags": tags}
    grammar = compile_format(backend, fmt)
    good = ["t <f=a>1</f> u <func=b>2</f> v [x]3 w", "<func=b>2</f>"]
    bad = ["<f=b>2</f>", "<fun", "[x]4", "<func=a>1</f>"]
    check_strings(grammar, vocab, good, bad)


def test_triggered_tags_inside_a_tag_end_at_its_end(backend, vocab):
    fmt = {"type": "tag", "begin": "<turn>", "content": triggered(), "end": "</turn>"}
    grammar = compile_format(backend, fmt)
    good = ["<turn>hi</turn>", f"<turn>hi {TIME_CALL} bye</turn>"]
    bad = ["<turn>hi</turn> more", "<turn>hi <tool_call></turn>", "<turn>hi"]
    check_strings(grammar, vocab, good, bad)


def test_reasoning_wrapper_around_tool_calls(backend, vocab):
    think = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
    fmt = {"type": "sequence", "elements": [think, triggered(at_least_one=True)]}
    grammar = compile_format(backend, fmt)
    good = [f"<think>use <tool_call> maybe</think>{TIME_CALL}"]
    bad = ["<think>x</think>", "<think>x</think>text", f"{TIME_CALL}"]
    check_strings(grammar, vocab, good, bad)


# --- tags_with_separator -----------------------------------------------------------------


def test_tags_with_separator(backend, vocab):
    fmt = {"type": "tags_with_separator", "tags": TOOL_TAGS, "separator": "\n"}
    grammar = compile_format(backend, fmt)
    good = ["", TIME_CALL, f"{TIME_CALL}\n{WEATHER_CALL}"]
    bad = ["text", TIME_CALL + TIME_CALL, TIME_CALL + "\n", f"x{TIME_CALL}", TIME_CALL + " "]
    check_strings(grammar, vocab, good, bad)


def test_tags_with_separator_flags(backend, vocab):
    base = {"type": "tags_with_separator", "tags": TOOL_TAGS, "separator": ","}
    one_or_more = compile_format(backend, {**base, "at_least_one": True})
    check_strings(one_or_more, vocab, [TIME_CALL, f"{TIME_CALL},{TIME_CALL}"], [""])
    at_most_one = compile_format(backend, {**base, "stop_after_first": True})
    check_strings(at_most_one, vocab, ["", TIME_CALL], [f"{TIME_CALL},{TIME_CALL}"])


# --- the legacy form ---------------------------------------------------------------------


def test_legacy_structures_and_triggers(backend, vocab):
    legacy = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<function=get_time>", "schema": TIME, "end": "</function>"},
            {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
        ],
        "triggers": ["<function="],
    }
    tag = parse_structural_tag(legacy)
    assert isinstance(tag.format, TriggeredTagsFormat)
    assert tag.format.triggers == ("<function=",) and len(tag.format.tags) == 2
    grammar = backend.compile(GrammarSpec.structural_tag(legacy))
    good = ["hi", 'a <function=get_time>{"zone": "cet"}</function> b']
    bad = ['<function=get_time>{"zone": 1}</function>', "<function=other>", "x <function="]
    check_strings(grammar, vocab, good, bad)


# --- random walks: outputs parse back into the structure --------------------------------


def parse_tool_calls(text: str, trigger: str = "<tool_call>") -> list[tuple[str, object, int, int]]:
    """The (name, arguments, start, end) of each tool call in ``text``; AssertionError unless
    every trigger occurrence starts a complete call of a known tool (the reference reading)."""
    calls, position = [], 0
    decoder = json.JSONDecoder()
    while (start := text.find(trigger, position)) >= 0:
        names = [n for n in TOOLS if text.startswith(TOOL_BEGIN.format(name=n), start)]
        assert len(names) == 1, f"no tool begins at {text[start:]!r}"
        after_begin = start + len(TOOL_BEGIN.format(name=names[0]))
        arguments, json_end = decoder.raw_decode(text, after_begin)
        assert text.startswith(TOOL_END, json_end), f"no end after {text[:json_end]!r}"
        position = json_end + len(TOOL_END)
        calls.append((names[0], arguments, start, position))
    return calls


def walk(grammar, vocab, rng, inject: str = "", eos_p: float = 0.03, max_tokens: int = 2000) -> str:
    """Samples allowed tokens (EOS with probability ``eos_p`` where allowed; ``inject`` forced in
    with probability 0.05 wherever the matcher takes it) until EOS; returns the text."""
    matcher = grammar.new_matcher()
    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    eos = set(vocab.eos_token_ids)
    ids: list[int] = []
    for _ in range(max_tokens):
        if inject and rng.random() < 0.05 and matcher.accept_tokens(vocab.encode(inject)):
            ids += vocab.encode(inject)
            continue
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_token_ids(bitmask, 0, vocab.vocab_size)
        assert allowed, f"dead end after {vocab.decode_bytes(ids)!r}"
        allowed_eos = [t for t in allowed if t in eos]
        text_ids = [t for t in allowed if t not in eos]
        pick_eos = allowed_eos and (not text_ids or rng.random() < eos_p)
        token = rng.choice(allowed_eos if pick_eos else text_ids)
        assert matcher.accept_token(token), f"masked-in token {token} rejected"
        if matcher.is_terminated():
            return vocab.decode_bytes(ids).decode("utf-8")
        ids.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {vocab.decode_bytes(ids)!r}")


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"at_least_one": True},
        {"stop_after_first": True},
        {"at_least_one": True, "stop_after_first": True},
    ],
)
def test_random_walks_parse_back_into_tool_calls(backend, vocab, flags):
    grammar = compile_format(backend, triggered(**flags))
    rng = random.Random(7)
    num_calls = 0
    for _ in range(12):
        text = walk(grammar, vocab, rng, inject="<tool_call>")
        calls = parse_tool_calls(text)
        for name, arguments, _, _ in calls:
            jsonschema.validate(arguments, TOOLS[name])
        if flags.get("at_least_one"):
            assert calls and calls[0][2] == 0, text
        if flags.get("stop_after_first"):
            assert len(calls) <= 1 and (not calls or calls[0][3] == len(text)), text
        num_calls += len(calls)
    assert num_calls >= 6  # the walks do reach the tags


def test_random_walks_of_separated_tags(backend, vocab):
    fmt = {"type": "tags_with_separator", "tags": TOOL_TAGS, "separator": "\n;"}
    grammar = compile_format(backend, {**fmt, "at_least_one": True})
    rng = random.Random(3)
    for _ in range(10):
        text = walk(grammar, vocab, rng, eos_p=0.4)
        calls = parse_tool_calls(text)
        assert calls and calls[0][2] == 0 and calls[-1][3] == len(text), text
        for previous, call in zip(calls, calls[1:], strict=False):
            assert text[previous[3] : call[2]] == "\n;", text  # only separators between tags
        for name, arguments, _, _ in calls:
            jsonschema.validate(arguments, TOOLS[name])


# --- validation --------------------------------------------------------------------------


def fmt_tag(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


ANY_TAG = {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}
INVALID = [
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
    ({"type": "json_schema", "format": {"type": "any_text"}}, '"type" must be "structural_tag"'),
    ({"type": "structural_tag"}, 'needs "format"'),
    ({"format": {"type": "any_text"}, "extra": 1}, "unknown field(s) 'extra'"),
    (fmt_tag({"type": "free_text"}), "unknown type 'free_text'"),
    (fmt_tag({"value": "x"}), "unknown type None"),
    (fmt_tag("any_text"), "format must be an object, got a string"),
    (fmt_tag({"type": "const_string"}), "is missing 'value'"),
    (fmt_tag({"type": "const_string", "value": 3}), "format.value must be a string, got a number"),
    (fmt_tag({"type": "any_text", "excludes": []}), "unknown field(s) 'excludes'"),
    (fmt_tag({"type": "tag", "begin": "", "content": ANY_TAG, "end": "x"}), "begin must not be"),
    (fmt_tag({"type": "tag", "begin": "<a>", "content": ANY_TAG}), "is missing 'end'"),
    (fmt_tag({"type": "tag", "begin": "<a>", "content": ANY_TAG, "end": None}), "end must be a"),
    (fmt_tag({"type": "sequence", "elements": []}), "elements must not be empty"),
    (fmt_tag({"type": "or", "elements": {"type": "any_text"}}), "elements must be a list"),
    (fmt_tag({"type": "json_schema", "json_schema": "{}"}), "must be a JSON schema object"),
    (fmt_tag({"type": "json_schema", "json_schema": False}), "no JSON document is valid"),
    (fmt_tag({"type": "regex", "pattern": "(ab"}), "unclosed '(' group"),
    (fmt_tag({"type": "regex", "pattern": "a\\x00"}), "NUL escape"),
    (fmt_tag({"type": "grammar", "grammar": ""}), "grammar must not be empty"),
    (fmt_tag({"type": "const_string", "value": "a\x00b"}), "control character U+0000"),
    (fmt_tag(triggered(triggers=[])), "triggers must not be empty"),
    (fmt_tag(triggered(triggers=[""])), "triggers[0] must not be empty"),
    (fmt_tag(triggered(triggers="<tool_call>")), "triggers must be a list"),
    (fmt_tag(triggered(triggers=["<tool_call>\x1b"])), "control character U+001B"),
    (fmt_tag(triggered(triggers=["<tool_call>", "<x>"])), "trigger '<x>' begins no tag"),
    (fmt_tag(triggered(triggers=["<call"])), "starts with none of the triggers"),
    (fmt_tag(triggered(tags=[])), "tags must not be empty"),
    (fmt_tag(triggered(tags=[{"type": "const_string", "value": "x"}])), 'must be a "tag"'),
    (fmt_tag(triggered(at_least_one=1)), "at_least_one must be true or false"),
    (fmt_tag(triggered(stop_after_first="yes")), "stop_after_first must be true or false"),
    (
        fmt_tag(
            {
                "type": "triggered_tags",
                "triggers": ["<f", "x<f"],
                "tags": [{"begin": "<f>", "content": {"type": "any_text"}, "end": "</f>"}]
                + [{"begin": "x<f>", "content": {"type": "any_text"}, "end": "</f>"}],
            }
        ),
        "contains the trigger '<f'",
    ),
    (fmt_tag({"type": "tags_with_separator", "tags": TOOL_TAGS}), "is missing 'separator'"),
    (
        {"structures": [{"begin": "<f=a>", "schema": TIME, "end": "</f>"}], "triggers": ["<g"]},
        "structures[0].begin '<f=a>' starts with none of the triggers",
    ),
    ({"structures": [{"begin": "<f=a>", "schema": TIME}], "triggers": ["<f"]}, "missing 'end'"),
    ({"structures": [], "triggers": ["<f"]}, "structures must not be empty"),
    (
        {"structures": [{"begin": "<f=a>", "schema": [], "end": ""}], "triggers": ["<f"]},
        "schema must be a JSON schema object (or true), got a list",
    ),
    (
        fmt_tag(
            {
                "type": "or",
                "elements": [
                    {"type": "json_schema", "json_schema": {"type": "object"}},
                    {
                        "type": "tag",
                        "begin": '{"name": "f", "parameters": ',
                        "content": {"type": "json_schema", "json_schema": TIME},
                        "end": "}",
                    },
                ],
            }
        ),
        'starting with \'{"name": "f"\'; llguidance cannot keep both open',
    ),
    # free text that nothing closes
    (
        fmt_tag({"type": "sequence", "elements": [{"type": "any_text"}, ANY_TAG]}),
        "any_text must come last",
    ),
    (
        fmt_tag({"type": "sequence", "elements": [triggered(), ANY_TAG]}),
        "triggered_tags (its free text) must come last",
    ),
    (
        fmt_tag(
            {"type": "tags_with_separator", "separator": ",", "tags": [{**ANY_TAG, "end": ""}]}
        ),
        "any_text must come last",
    ),
]


@pytest.mark.parametrize(("value", "message"), INVALID)
def test_invalid_structural_tags_are_refused_with_the_reason(backend, value, message):
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(ValueError) as refused:
        check_spec("structural_tag", text)
    assert str(refused.value).startswith("structural_tag"), str(refused.value)
    assert message in str(refused.value), str(refused.value)
    with pytest.raises(GrammarCompileError, match="Failed to compile structural_tag grammar"):
        backend.compile(GrammarSpec.structural_tag(text))


def test_accepted_shapes_parse(backend, vocab):
    """Closed free text is fine: in a tag, last in a sequence, and an at-least-one,
    stop-after-first triggered_tags (one tag, no free text) anywhere."""
    one = triggered(at_least_one=True, stop_after_first=True)
    fmt = {"type": "sequence", "elements": [one, {"type": "const_string", "value": "!"}]}
    grammar = compile_format(backend, fmt)
    check_strings(grammar, vocab, [TIME_CALL + "!"], [TIME_CALL, "x" + TIME_CALL + "!"])
    empty_end = {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": ""}
    grammar = compile_format(backend, empty_end)  # nothing follows: text to the end
    check_strings(grammar, vocab, ["<a>", "<a> anything"], ["<b>"])


def test_spec_is_canonical_json(vocab):
    value = {"type": "structural_tag", "format": {"type": "const_string", "value": "é"}}
    from_dict = GrammarSpec.structural_tag(value)
    from_text = GrammarSpec.structural_tag(json.dumps(value, indent=2))
    assert from_dict == from_text and from_dict.value == json.dumps(
        value, separators=(",", ":"), ensure_ascii=False
    )
    assert from_dict.canonical() == from_dict.value
    assert GrammarSpec.structural_tag("{broken").value == "{broken"


# --- hostile inputs: refused by the cheap check, fast -------------------------------------


def _nested_sequences(depth: int) -> str:
    return '{"format":' + '{"type":"sequence","elements":[' * depth + "{}" + "]}" * depth + "}"


def _many_tags(count: int) -> dict:
    tags = [
        {"begin": f"<t{i}>", "content": {"type": "any_text"}, "end": "</t>"} for i in range(count)
    ]
    return fmt_tag({"type": "triggered_tags", "triggers": ["<t"], "tags": tags})


HOSTILE = [
    ("huge", json.dumps(fmt_tag({"type": "const_string", "value": "x" * 300_000})), "bytes long"),
    ("deep", _nested_sequences(5_000), "nests 10002 levels deep"),
    ("many tags", json.dumps(_many_tags(3_000)), "more than 1,024 formats"),
    (
        "many triggers",
        json.dumps(
            fmt_tag(
                {
                    "type": "triggered_tags",
                    "triggers": [f"<{i}>" for i in range(500)],
                    "tags": [ANY_TAG],
                }
            )
        ),
        "more than 128 triggers",
    ),
]


@pytest.mark.parametrize(("name", "text", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_structural_tags_are_refused_quickly(name, text, message):
    began = time.perf_counter()
    with pytest.raises(ValueError, match="^structural_tag") as refused:
        check_spec("structural_tag", text)
    elapsed = time.perf_counter() - began
    assert message in str(refused.value), str(refused.value)
    assert elapsed < 1.0, f"{name} took {elapsed:.3f} s"  # (a loaded CI machine: margin)


def test_limits_are_configurable():
    tight = GrammarLimits(max_structural_nodes=3)
    with pytest.raises(ValueError, match="more than 3 formats"):
        parse_structural_tag(fmt_tag(triggered()), tight)
    parse_structural_tag(fmt_tag(triggered()))
    with pytest.raises(ValueError, match="max_structural_nodes"):
        GrammarLimits(max_structural_nodes=0)


# --- backends ----------------------------------------------------------------------------


def test_64_tools_compile_well_under_a_second(backend, vocab):
    schemas = {
        f"tool_{i}": {
            "type": "object",
            "properties": {"q": {"type": "string"}, f"n{i}": {"type": "integer"}},
            "required": ["q"],
        }
        for i in range(64)
    }
    tags = [tool_tag(name, schema) for name, schema in schemas.items()]
    spec = GrammarSpec.structural_tag(
        fmt_tag({"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags})
    )
    began = time.perf_counter()
    grammar = backend.compile(spec)
    elapsed = time.perf_counter() - began
    assert elapsed < 1.0, f"64 tools compiled in {elapsed:.2f} s"
    call = tool_call("tool_63", '{"q": "x", "n63": 5}')
    check_strings(grammar, vocab, [f"ok {call}"], [tool_call("tool_63", '{"q": "x", "n62": 5}')])


def test_auto_routes_to_llguidance_and_outlines_refuses(vocab):
    spec = GrammarSpec.structural_tag(fmt_tag(triggered()))
    auto = create_grammar_backend(GrammarConfig(), vocab)
    try:
        grammar = auto.compile(spec)
        assert grammar.backend_name == "llguidance"
        assert accepts(grammar, vocab, f"hi {TIME_CALL}")
        reloaded = auto.deserialize(spec, grammar.backend_name, grammar.serialize())
        assert accepts(reloaded, vocab, f"hi {TIME_CALL}")
    finally:
        auto.shutdown()
    with pytest.raises(GrammarCompileError, match="regular grammars only"):
        OutlinesBackend(vocab).compile(spec)


def test_lenient_json_options_reach_the_tags(backend, vocab):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    fmt = {"type": "tag", "begin": "<a>", "content": {"type": "json_schema", "json_schema": schema}}
    spec = GrammarSpec.structural_tag(fmt_tag({**fmt, "end": "</a>"}))
    with pytest.raises(GrammarCompileError, match="uniqueItems"):
        backend.compile(spec)
    grammar = backend.lenient_twin().compile(spec)
    check_strings(grammar, vocab, ["<a>[1, 2]</a>"], ["<a>[1, 2.5]</a>"])
    auto = create_grammar_backend(GrammarConfig(), vocab)
    try:
        assert accepts(auto.compile(spec), vocab, "<a>[3]</a>")
    finally:
        auto.shutdown()


def test_unsatisfiable_tag_schemas_are_refused(backend):
    loop = {
        "type": "tag",
        "begin": "<a>",
        "content": {"type": "json_schema", "json_schema": {"$ref": "#"}},
        "end": "",
    }
    with pytest.raises(GrammarCompileError, match="a tag's JSON schema"):
        backend.compile(GrammarSpec.structural_tag(fmt_tag(loop)))


def test_grammar_text_without_json_options(vocab):
    tag = parse_structural_tag(fmt_tag({"type": "json_schema", "json_schema": TIME}))
    text = structural_tag_grammar(tag, None)
    assert '"whitespace_pattern"' not in text and '"coerce_one_of": true' in text
    text = structural_tag_grammar(tag, "", lenient=True)
    assert '"whitespace_pattern": ""' in text and '"lenient": true' in text
