"""Hostile grammar specs: size, nesting and control-character limits at the front door;
recursive and empty grammars at compile time; parser limits; bounded jump-forward; bounded JSON
whitespace; outlines-core children under an address-space limit."""

from __future__ import annotations

import json
import random
import time

import psutil
import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.jump_forward import forced_continuation, retokenize_forced
from radixlm.grammar.limits import GrammarLimits, check_spec, json_nesting_depth
from radixlm.grammar.llguidance_backend import LLGuidanceBackend
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.outlines_worker import IndexWorkerPool
from radixlm.grammar.registry import GrammarConfig, create_grammar_backend
from radixlm.grammar.schema_checks import recursive_ref, unsatisfiable_reason
from radixlm.grammar.testing import random_walk, train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab
from radixlm.srt.sampling.params import SamplingParams

SELF_REF = {"$ref": "#"}
REQUIRED_SELF = {
    "$defs": {
        "n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
    },
    "$ref": "#/$defs/n",
}
REQUIRED_MUTUAL = {
    "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
    },
    "$ref": "#/$defs/a",
}
OPTIONAL_MUTUAL = {
    "$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},
        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}},
    },
    "$ref": "#/$defs/a",
}
TREE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "kids": {"type": "array", "items": {"$ref": "#"}},
    },
    "required": ["name"],
}


@pytest.fixture(scope="module")
def vocab():
    return build_vocab(train_byte_level_tokenizer())


@pytest.fixture(scope="module")
def auto(vocab):
    backend = create_grammar_backend(GrammarConfig(backend="auto"), vocab)
    yield backend
    backend.shutdown()


# ------------------------------------------------------------------ front door
def test_a_spec_over_the_size_limit_is_rejected_before_parsing():
    big = json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    )
    with pytest.raises(ValueError, match=r"json_schema is [\d,]+ bytes long; at most 262,144"):
        check_spec("json_schema", big)
    check_spec("json_schema", big, GrammarLimits(max_spec_bytes=len(big)))  # configurable
    with pytest.raises(ValueError, match="regex is"):
        check_spec("regex", "a" * (300 * 1024))
    with pytest.raises(ValueError, match="choices is"):
        check_spec("choices", ["x" * 1024] * 300)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 3000 + "1" + "}" * 3000])
def test_deep_json_is_rejected_without_recursion(text):
    with pytest.raises(ValueError, match="nests 100000 levels|nests 3000 levels"):
        check_spec("json_schema", text)


def test_nesting_depth_skips_brackets_inside_strings():
    assert json_nesting_depth('{"a": "[[[{{{", "b": [[1]], "c": "\\"]"}') == 3
    check_spec("json_schema", "[" * 0 + '{"type": "object", "description": "' + "[" * 500 + '"}')


def test_unparsable_or_non_object_schemas_are_rejected():
    for text, message in [
        ("{bad", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ("", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_spec("json_schema", text)
    check_spec("json_schema", "true")


@pytest.mark.parametrize(
    "kind,text",
    [
        ("regex", "\x00abc"),
        ("regex", r"\x00abc"),
        ("regex", r"a\u0000"),
        ("regex", r"\x{0}"),
        ("ebnf", 'root ::= "\x01"'),
        ("ebnf", 'root ::= "\\x00"'),
        ("choices", ["ok", "a\x00"]),
    ],
)
def test_control_characters_are_rejected(kind, text):
    with pytest.raises(ValueError, match="control character|NUL escape"):
        check_spec(kind, text)


# Invalid on their own, valid once wrapped as (?:...)$: "a)|(b" would read as (?:a)|(b)$ and
# generate "b".
@pytest.mark.parametrize("text", ["a)|(b", "\\", "a\\", "(a", "[ab", "a)"])
def test_regexes_the_wrapping_would_change_are_rejected(text):
    with pytest.raises(ValueError, match="regex"):
        check_spec("regex", text)


@pytest.mark.parametrize("text", ["[]]", "[^]a]", "[(]", r"\(", "[a[b]]", r"\p{L}+", "(a)(b)"])
def test_balanced_regexes_pass_the_structure_check(text):
    check_spec("regex", text)


def test_escaped_backslashes_and_whitespace_controls_pass():
    check_spec("regex", r"\\x00")  # a backslash, then "x00"
    check_spec("regex", "a\tb\nc\r")
    check_spec("ebnf", 'root ::= "a\\n"')


def test_sampling_params_reject_hostile_grammars_with_value_error():
    for params in [
        {"regex": "\x00a"},
        {"json_schema": "[" * 100_000},
        {"json_schema": {"type": "object", "description": "x" * 300_000}},
    ]:
        with pytest.raises(ValueError):
            SamplingParams.from_dict(params).validate(100)
    nested: dict = {}
    node = nested
    for _ in range(3000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ValueError, match="nests"):
        SamplingParams.from_dict({"json_schema": nested}).validate(100)
    SamplingParams.from_dict({"json_schema": TREE}).validate(100)


# ------------------------------------------------------------------ shapes
def test_recursion_is_found_and_unsatisfiable_recursion_named():
    assert recursive_ref(TREE) == "#" and recursive_ref(OPTIONAL_MUTUAL) is not None
    assert recursive_ref({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    for schema in (SELF_REF, REQUIRED_SELF, REQUIRED_MUTUAL):
        assert "no finite JSON document" in unsatisfiable_reason(schema)
    # no recursion: the reason says what else empties it (it blamed recursion before)
    closed = {"properties": {"a": {}}, "required": ["a", "b"], "additionalProperties": False}
    for schema in (closed, {"enum": []}, {"properties": {"a": False}, "required": ["a"]}):
        assert unsatisfiable_reason(schema).startswith("no JSON document matches the schema: ")
    for schema in (
        TREE,
        OPTIONAL_MUTUAL,
        {
            "$defs": {
                "t": {
                    "anyOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "properties": {"n": {"$ref": "#/$defs/t"}},
                            "required": ["n"],
                        },
                    ]
                }
            },
            "$ref": "#/$defs/t",
        },
    ):
        assert unsatisfiable_reason(schema) is None


@pytest.mark.parametrize("schema", [SELF_REF, REQUIRED_SELF, REQUIRED_MUTUAL])
@pytest.mark.parametrize("backend_name", ["auto", "outlines", "llguidance"])
def test_schemas_without_finite_documents_fail_at_compile_time(vocab, schema, backend_name):
    backend = create_grammar_backend(GrammarConfig(backend=backend_name), vocab)
    try:
        with pytest.raises(GrammarCompileError, match="no finite JSON document"):
            backend.compile(GrammarSpec.json_schema(schema))
    finally:
        backend.shutdown()


@pytest.mark.parametrize("schema", [TREE, OPTIONAL_MUTUAL])
def test_recursive_schemas_go_to_llguidance_and_generate_valid_documents(vocab, auto, schema):
    import jsonschema

    grammar = auto.compile(GrammarSpec.json_schema(schema))
    assert grammar.backend_name == "llguidance"  # outlines-core would unroll a fixed depth
    finished = 0
    for seed in range(6):
        ids, ended = random_walk(
            grammar.new_matcher(), vocab, random.Random(seed), max_tokens=300, eos_probability=0.5
        )
        if ended:
            finished += 1
            jsonschema.validate(json.loads(vocab.decode_bytes(ids).decode()), schema)
    assert finished >= 3


@pytest.mark.parametrize(
    "grammar", ["root ::= root", 'root ::= "a" root', 'start: "a" start', "start: start"]
)
def test_grammars_without_finite_strings_fail_at_compile_time(auto, grammar):
    with pytest.raises(GrammarCompileError, match="accepts no string|too complex"):
        auto.compile(GrammarSpec.ebnf(grammar))


def test_left_recursion_compiles(vocab, auto):
    grammar = auto.compile(GrammarSpec.ebnf('start: start "a" | "b"'))
    matcher = grammar.new_matcher()
    assert matcher.accept_tokens(vocab.encode("baaa"))


def test_an_object_past_the_parser_row_limit_fails_at_once(vocab, auto):
    # 3,000 optional properties need about 12,000 Earley items after "{" (limit 8,000); building
    # the matcher alone took about 10 s, so the count is checked first.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    began = time.perf_counter()
    with pytest.raises(GrammarCompileError, match="3,000 optional properties; at most 1,998"):
        LLGuidanceBackend(vocab).compile(GrammarSpec.json_schema(schema))
    with pytest.raises(GrammarCompileError, match="optional properties") as failure:
        auto.compile(GrammarSpec.json_schema(schema))
    assert "lenient" not in str(failure.value)  # not retried: leniency cannot shrink it
    assert time.perf_counter() - began < 2.0


def test_an_object_of_1000_optional_properties_decodes(vocab):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    matcher = LLGuidanceBackend(vocab).compile(GrammarSpec.json_schema(schema)).new_matcher()
    assert matcher.accept_tokens(vocab.encode('{"p7": 1, "p999": 2}'))
    assert matcher.error() is None


# ------------------------------------------------------------------ jump-forward
@pytest.mark.parametrize("backend_cls", [OutlinesBackend, LLGuidanceBackend])
def test_forced_tokens_take_a_maximum(vocab, backend_cls):
    grammar = backend_cls(vocab).compile(GrammarSpec.regex("x{200}"))
    matcher = grammar.new_matcher()
    assert len(matcher.forced_tokens()) > 3
    assert len(matcher.forced_tokens(max_tokens=3)) == 3
    forced = forced_continuation(matcher, vocab, max_tokens=3)
    assert (
        len(forced.token_ids) == 3
        and forced.text == vocab.decode_bytes(list(forced.token_ids)).decode()
    )
    assert forced_continuation(matcher, vocab, max_tokens=0).token_ids == ()
    full = forced_continuation(matcher, vocab)  # old call sites keep working
    edit = retokenize_forced(matcher, vocab, [], full.text, max_tokens=3)
    assert len(edit.token_ids) - edit.num_rollback <= 3 and matcher.copy().accept_tokens(
        list(edit.token_ids)
    )


# ------------------------------------------------------------------ whitespace
def _accepts(matcher, vocab, text: str) -> bool:
    return matcher.copy().accept_tokens(vocab.encode(text))


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        GrammarSpec.json_object(),
        GrammarSpec.ebnf(
            'start: %json {"type": "object", "properties": {"a": {"type": "integer"}}}'
        ),
        GrammarSpec.ebnf('start: "x" %json {"type": "object"}'),
    ],
)
@pytest.mark.parametrize("backend_cls", [OutlinesBackend, LLGuidanceBackend])
def test_json_whitespace_is_at_most_one_space_by_default(vocab, spec, backend_cls):
    if spec.kind == "ebnf" and backend_cls is OutlinesBackend:
        pytest.skip("EBNF is llguidance's")
    if spec.kind == "json_object" and backend_cls is OutlinesBackend:
        pytest.skip("slow generic-JSON DFA; auto sends json_object to llguidance")
    matcher = backend_cls(vocab).compile(spec).new_matcher()
    prefix = "x{" if "x" in str(spec.value)[:12] else "{"
    assert matcher.accept_tokens(vocab.encode(prefix))
    assert _accepts(matcher, vocab, " ") and not _accepts(matcher, vocab, "  ")
    assert not _accepts(matcher, vocab, "\n")


def test_an_explicit_whitespace_option_in_a_json_rule_is_kept(vocab):
    lark = 'start: %json {"type": "object", "x-guidance": {"whitespace_pattern": "[ \\\\n]{0,4}"}}'
    matcher = LLGuidanceBackend(vocab).compile(GrammarSpec.ebnf(lark)).new_matcher()
    assert matcher.accept_tokens(vocab.encode("{"))
    assert _accepts(matcher, vocab, " \n ")


# ------------------------------------------------------------------ memory
@pytest.mark.slow
def test_an_index_build_past_the_address_space_limit_kills_only_the_child(vocab):
    outlines = OutlinesBackend(vocab)
    pool = IndexWorkerPool(outlines.outlines_vocabulary, max_memory_bytes=768 << 20)
    try:
        assert pool.start("(?:abc)$", "regex").wait(30.0) is not None
        # outlines-core writes every order of optional properties: a regex of about 560 MB.
        schema = json.dumps(
            {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
        )
        before = psutil.Process().memory_info().rss
        with pytest.raises(GrammarCompileError, match="ran out of memory.*0.75 GiB"):
            pool.start_schema(schema, "[ ]?", None).wait(120.0)
        assert psutil.Process().memory_info().rss - before < (100 << 20)
        assert pool.start("(?:abc)$", "regex").wait(30.0) is not None  # a fresh child
    finally:
        pool.close()


def test_auto_skips_outlines_when_optional_properties_make_its_regex_too_long(vocab):
    # 200 optional properties: outlines-core's regex would have millions of characters.
    backend = create_grammar_backend(GrammarConfig(backend="auto"), vocab)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    try:
        assert backend.compile(GrammarSpec.json_schema(schema)).backend_name == "llguidance"
        assert backend.index_workers.num_idle() == 0  # no outlines-core child was started
        small = {"type": "object", "properties": {"a": {"type": "string"}}}
        assert backend.compile(GrammarSpec.json_schema(small)).backend_name == "outlines"
    finally:
        backend.shutdown()


def test_unresolved_ref_finds_dangling_and_remote_references() -> None:
    from radixlm.grammar.schema_checks import unresolved_ref

    pet = {"type": "object"}
    assert unresolved_ref({"$defs": {"Pet": pet}, "items": {"$ref": "#/$defs/Pet"}}) is None
    assert unresolved_ref({"properties": {"a": {"$ref": "#"}}}) is None
    assert unresolved_ref({"properties": {"a": {"$ref": "#/properties"}}}) is None
    assert unresolved_ref({"items": [{"$ref": "#/$defs/Cat"}]}) == "#/$defs/Cat"
    assert unresolved_ref({"items": {"$ref": "other.json#/a"}}) == "other.json#/a"
    # "$ref" inside data is not a reference; a property named "$ref" is a schema
    assert unresolved_ref({"const": {"$ref": "#/x"}, "default": {"$ref": "#/y"}}) is None
    assert unresolved_ref({"properties": {"$ref": {"type": "string"}}}) is None
    assert unresolved_ref({"properties": {"enum": {"$ref": "#/nowhere"}}}) == "#/nowhere"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 10**20},
        {"type": ["integer", "null"], "exclusiveMinimum": 2**63 - 1},
        {"type": "integer", "maximum": -(10**19)},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1e20}}},
        {"type": "number", "minimum": 1e20},
    ],
)
def test_bounds_no_engine_enforces_are_refused(auto, schema):
    """llguidance clamps integer bounds to 64 bits and the other engines ignore bounds: such
    schemas are refused (auto used to fall back and write 9223372036854775807 for 1e20)."""
    with pytest.raises(GrammarCompileError, match="grammar engine"):
        auto.compile(GrammarSpec.json_schema(schema))
    # bounds inside the 64-bit range still compile
    auto.compile(
        GrammarSpec.json_schema({"type": "integer", "minimum": 2**62, "maximum": 2**63 - 2})
    )
