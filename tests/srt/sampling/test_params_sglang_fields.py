"""SGLang's /generate sampling fields: every one is accepted with SGLang's meaning; the ones
radixlm added for them (stop_regex, structural_tag, custom_params, stream_interval,
sampling_seed) parse, validate, round-trip over the wire and are refused with messages (and
400 params at the front door) that name them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import orjson
import pytest

from radixlm.grammar.base import GrammarSpec
from radixlm.srt.managers.front_door import FrontDoor, ModelLimits, grammar_kind
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.stop_regex import (
    MAX_STOP_REGEX_CHARS,
    MAX_STOP_REGEXES,
    STOP_REGEX_WINDOW_CHARS,
    pattern_shape,
    window_chars,
)
from radixlm.srt.scheduler.grammar_queue import grammar_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from fake_stack import make_tokenizer  # noqa: E402

# The API fields of SGLang's SamplingParams (python/sglang/srt/sampling/sampling_params.py);
# its other attributes (stop_strs, stop_regex_strs, *_max_len, is_normalized) are set by its
# normalize() and are not part of what a client sends.
SGLANG_FIELDS = (
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p "
    "frequency_penalty presence_penalty repetition_penalty min_new_tokens n json_schema regex "
    "ebnf structural_tag ignore_eos skip_special_tokens spaces_between_special_tokens "
    "no_stop_trim custom_params stream_interval logit_bias sampling_seed"
).split()

TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
    "triggers": ["<f>"],
}

# One non-default value per SGLang field (the e2e test sends the same body over HTTP).
ALL_FIELDS = {
    "max_new_tokens": 16,
    "stop": ["\n\n"],
    "stop_token_ids": [7],
    "stop_regex": [r"\d+\.", "END"],
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.2,
    "repetition_penalty": 1.1,
    "min_new_tokens": 1,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": TAG,
    "ignore_eos": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": True,
    "no_stop_trim": True,
    "custom_params": {"thinking_budget": 10, "tags": ["a", "b"], "nested": {"k": 1.5}},
    "stream_interval": 3,
    "logit_bias": {"5": -1.0},
    "sampling_seed": 42,
}


def test_every_sglang_field_is_accepted_at_once() -> None:
    assert sorted(ALL_FIELDS) == sorted(SGLANG_FIELDS)
    p = SamplingParams.from_dict(ALL_FIELDS)
    p.validate(vocab_size=100)
    assert p.seed == 42 and p.stream_interval == 3 and p.no_stop_trim
    assert p.stop_regexes == [r"\d+\.", "END"]
    assert json.loads(p.structural_tag) == TAG
    assert p.custom_params == ALL_FIELDS["custom_params"]


def test_wire_round_trip_is_exact() -> None:
    p = SamplingParams.from_dict(ALL_FIELDS)
    wire = orjson.loads(orjson.dumps(p.to_dict()))
    assert SamplingParams.from_wire(wire) == p
    assert SamplingParams.from_dict(wire) == p
    assert "sampling_seed" not in wire and wire["seed"] == 42
    # to_dict copies the containers: changing the copy leaves the params as they were
    out = p.to_dict()
    out["custom_params"]["tags"].append("c")
    out["stop_regex"].append("x")
    assert p.custom_params["tags"] == ["a", "b"] and p.stop_regexes == [r"\d+\.", "END"]


def test_sglang_frontend_defaults_are_accepted() -> None:
    """sglang.lang's RuntimeEndpoint sends empty tuples (JSON lists) and nulls for unset
    fields on every gen call."""
    body = {"stop": [], "stop_token_ids": [], "stop_regex": [], "regex": None}
    body |= {"json_schema": None, "top_k": -1, "n": 1, "max_new_tokens": 8}
    p = SamplingParams.from_dict(body)
    p.validate(vocab_size=100)
    assert p.stop_regexes == [] and p.stop_strs == [] and grammar_kind(p) is None


def test_stop_regex_parses_as_string_or_list() -> None:
    assert SamplingParams.from_dict({"stop_regex": "a+b"}).stop_regexes == ["a+b"]
    assert SamplingParams.from_dict({"stop_regex": ("x", "y")}).stop_regex == ["x", "y"]
    assert SamplingParams().stop_regexes == []
    for bad in (5, ["ok", 3], {"a": 1}):
        with pytest.raises(ValueError, match="stop_regex must be a string or a list"):
            SamplingParams.from_dict({"stop_regex": bad})


@pytest.mark.parametrize(
    "patterns, message",
    [
        ("(ab", r"stop_regex\[0\] is not a valid regular expression"),
        (["ok", "[z-a]"], r"stop_regex\[1\] is not a valid regular expression"),
        ("", r"can match empty text"),
        ("a*", r"stop_regex\[0\] 'a\*' can match empty text"),
        (r"\b|$", "can match empty text"),
        ("(?=x)", "can match empty text"),
        ("a{300}", f"matches at least 300 characters, more than the {STOP_REGEX_WINDOW_CHARS}"),
        ("(?:a?){5000}b", "with its fixed repeats unrolled"),
        ("(" * 400 + "a" + ")" * 400, r"stop_regex\[0\] nests"),
        ("(" * 40 + "a" + ")" * 40, "nests more than 32 groups deep"),
        ("a" * (MAX_STOP_REGEX_CHARS + 1), f"at most {MAX_STOP_REGEX_CHARS} are allowed"),
        (["x"] * (MAX_STOP_REGEXES + 1), f"at most {MAX_STOP_REGEXES} patterns"),
    ],
)
def test_stop_regex_refusals(patterns, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({"stop_regex": patterns}).validate()


def test_pattern_shapes_bound_the_search_window() -> None:
    assert pattern_shape("abc").max_span == 3 and pattern_shape("abc").min_chars == 3
    assert pattern_shape(r"\d{2,5}x").max_span == 6 and pattern_shape(r"\d{2,5}x").min_chars == 3
    assert pattern_shape("ab|cdef").max_span == 4 and pattern_shape("ab|cdef").min_chars == 2
    assert pattern_shape(r"(?<=ab)c(?=de)").max_span == 5  # lookarounds are looked at
    assert pattern_shape(r"(?<=ab)c(?=de)").min_chars == 1
    assert pattern_shape(r"\d+\.").max_span is None  # unbounded
    assert pattern_shape(r"(a)\1").max_span is None  # a back-reference: no bound
    assert window_chars(("abc", "hello")) == 5
    assert window_chars(("abc", r".*x")) == STOP_REGEX_WINDOW_CHARS
    assert window_chars(("a{1,1000}",)) == STOP_REGEX_WINDOW_CHARS


def test_structural_tag_field() -> None:
    text = json.dumps(TAG)
    p = SamplingParams.from_dict({"structural_tag": text})
    assert p.structural_tag == text
    assert json.loads(SamplingParams.from_dict({"structural_tag": TAG}).structural_tag) == TAG
    p.validate()
    assert grammar_kind(p) == "structural_tag"
    spec = grammar_spec(p, grammar_kind(p))
    assert spec == GrammarSpec.structural_tag(TAG)
    with pytest.raises(ValueError, match="structural_tag must be a structural tag"):
        SamplingParams.from_dict({"structural_tag": 3})
    with pytest.raises(ValueError, match="structural_tag"):
        SamplingParams.from_dict({"structural_tag": "{not json"}).validate()
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf, choices"):
        SamplingParams.from_dict({"structural_tag": TAG, "regex": "a"}).validate()


def test_custom_params_shape_and_bounds() -> None:
    ok = {"a": None, "b": True, "c": 1, "d": 2.5, "e": "s", "f": [1, "x", None], "g": {"h": 1}}
    assert SamplingParams.from_dict({"custom_params": ok}).custom_params == ok
    for bad, message in [
        ([1], "custom_params must be an object with string keys"),
        ({1: 2}, "custom_params must be an object with string keys"),
        ({"a": [[1]]}, r"custom_params\['a'\] must be a JSON scalar"),
        ({"a": {"b": {"c": 1}}}, r"custom_params\['a'\]"),
        ({"a": float("nan")}, r"custom_params\['a'\]"),
        ({f"k{i}": i for i in range(65)}, "at most 64 entries"),
        ({"a": "x" * 20000}, "bytes of JSON; at most 16384"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams.from_dict({"custom_params": bad})


def test_stream_interval_range() -> None:
    assert SamplingParams.from_dict({"stream_interval": 1}).stream_interval == 1
    assert SamplingParams.from_dict({"stream_interval": None}).stream_interval is None
    for bad in (0, -3):
        with pytest.raises(ValueError, match=r"stream_interval must be in \[1, "):
            SamplingParams.from_dict({"stream_interval": bad}).validate()
    for bad in (1.5, "2", True):
        with pytest.raises(ValueError, match="stream_interval must be an integer"):
            SamplingParams.from_dict({"stream_interval": bad})


def test_sampling_seed_is_seed() -> None:
    assert SamplingParams.from_dict({"sampling_seed": 7}) == SamplingParams(seed=7)
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": None, "seed": 3}).seed == 3
    with pytest.raises(ValueError, match=r"sampling_seed \(1\) and seed \(2\) .* differ"):
        SamplingParams.from_dict({"sampling_seed": 1, "seed": 2})
    with pytest.raises(ValueError, match="sampling_seed must be an integer"):
        SamplingParams.from_dict({"sampling_seed": "1"})
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams.from_dict({"sampling_seed": -1}).validate()
    with pytest.raises(ValueError, match="unknown sampling parameter") as err:
        SamplingParams.from_dict({"stop_regex_strs": ["x"]})  # SGLang-internal, not API
    assert "sampling_seed" in str(err.value) and "stop_regex" in str(err.value)


@pytest.fixture(scope="module")
def door() -> FrontDoor:
    return FrontDoor(make_tokenizer(), ModelLimits(320, 256, 1024))


@pytest.mark.parametrize(
    "sp, param",
    [
        ({"stop_regex": "(ab"}, "stop_regex"),
        ({"stop_regex": ["a"] * 17}, "stop_regex"),
        ({"stop_regex": 1}, "stop_regex"),
        ({"structural_tag": "{bad"}, "structural_tag"),
        ({"custom_params": {"a": [[1]]}}, "custom_params"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"sampling_seed": 1, "seed": 2}, "sampling_seed"),
        ({"sampling_seed": "x"}, "sampling_seed"),
    ],
)
def test_front_door_400_names_the_field(door, sp, param) -> None:
    with pytest.raises(GenerateError) as err:
        door.prepare("r", input_ids=[1, 2, 3], sampling_params=sp)
    assert err.value.status_code == 400 and err.value.param == param
    assert param in err.value.message


def test_front_door_sends_the_fields_on(door) -> None:
    sp = {k: v for k, v in ALL_FIELDS.items() if k not in ("stop_token_ids", "logit_bias")}
    params, msg = door.prepare("r", input_ids=[1, 2, 3], sampling_params=sp)
    assert msg.grammar_kind == "structural_tag"
    assert SamplingParams.from_wire(msg.sampling_params) == params
    assert msg.sampling_params["seed"] == 42 and msg.sampling_params["stream_interval"] == 3


def test_empty_grammar_means_no_grammar() -> None:
    """SGLang: an empty ``regex``/``json_schema``/``ebnf``/``structural_tag`` is unset (it
    used to constrain the output to nothing, or be a 400)."""
    for name in ("regex", "json_schema", "ebnf", "structural_tag"):
        params = SamplingParams.from_dict({name: ""})
        assert getattr(params, name) is None and grammar_kind(params) is None


def test_null_max_new_tokens_is_up_to_the_context(door) -> None:
    """SGLang: ``max_new_tokens: null`` is no cap; what the context leaves after the prompt."""
    params, msg = door.prepare("r", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": None})
    assert msg.sampling_params["max_new_tokens"] == 256 - 3  # ModelLimits(320, 256, 1024)
    _, msg = door.prepare("r", input_ids=[1, 2, 3], sampling_params={})
    assert msg.sampling_params["max_new_tokens"] == 128  # absent: the default


@pytest.mark.parametrize(
    "name, off, on",
    [("beam_width", [None, 1], [2, True]), ("watermark", [None], [{"gamma": 0.5}, True])],
)
def test_sglang_fields_this_server_lacks_are_off_only(door, name, off, on) -> None:
    for value in off:
        door.prepare("r", input_ids=[1, 2], sampling_params={name: value, "max_new_tokens": 1})
    for value in on:
        with pytest.raises(GenerateError) as err:
            door.prepare("r", input_ids=[1, 2], sampling_params={name: value})
        assert err.value.status_code == 400 and err.value.param == name
        assert "not supported" in err.value.message


def test_logprob_start_len_may_equal_the_prompt_length(door) -> None:
    door.prepare(
        "r", input_ids=[1, 2, 3], sampling_params={}, return_logprob=True, logprob_start_len=3
    )
    with pytest.raises(GenerateError):
        door.prepare(
            "r", input_ids=[1, 2, 3], sampling_params={}, return_logprob=True, logprob_start_len=4
        )
