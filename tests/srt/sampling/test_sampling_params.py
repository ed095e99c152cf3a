from __future__ import annotations

import orjson
import pytest

from radixlm.srt.sampling.params import UP_TO_CONTEXT, SamplingParams


def test_defaults_match_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k) == (
        128,
        0,
        1.0,
        1.0,
        -1,
    )
    assert (p.min_p, p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (
        0.0,
        0.0,
        0.0,
        1.0,
    )
    assert p.stop is None and p.stop_token_ids is None and p.seed is None and p.n == 1
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not (p.ignore_eos or p.no_stop_trim)
    assert p.json_schema is None and p.regex is None and p.ebnf is None and p.logit_bias is None


def test_from_dict_none_and_nulls_mean_defaults() -> None:
    assert SamplingParams.from_dict(None) == SamplingParams()
    d = {"temperature": None, "stop": None, "top_k": None, "seed": None}
    assert SamplingParams.from_dict(d) == SamplingParams()
    # but max_new_tokens: null is "no cap" (SGLang): the front door makes it the context's rest
    assert SamplingParams.from_dict({"max_new_tokens": None}).max_new_tokens == UP_TO_CONTEXT
    p = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 7, "top_p": None})
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.max_new_tokens == 7 and p.top_p == 1.0


def test_from_dict_unknown_names_listed() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter") as err:
        SamplingParams.from_dict({"max_tokenz": 3, "bogus": 1, "temperature": 0.5})
    assert "bogus, max_tokenz" in str(err.value) and "temperature," not in str(err.value)[:60]


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", "10"),
        ("max_new_tokens", 1.5),
        ("top_k", True),
        ("temperature", "hot"),
        ("top_p", [0.5]),
        ("ignore_eos", 1),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 7),
        ("seed", 1.0),
        ("n", "2"),
        ("regex", 3),
        ("json_schema", 3),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"5": "x"}),
    ],
)
def test_from_dict_wrong_type_names_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


@pytest.mark.parametrize(
    "changes,name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"n": 0}, "n"),
        ({"stop_token_ids": [3, 100]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logit_bias": {"100": 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"regex": "a+", "ebnf": "root ::= 'a'"}, "regex"),
        ({"json_schema": "{}", "regex": "a"}, "json_schema"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_validate_rejects_and_names_parameter(changes: dict, name: str) -> None:
    p = SamplingParams.from_dict(changes)
    with pytest.raises(ValueError, match=name):
        p.validate(vocab_size=100)


def test_validate_messages_state_range() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingParams(top_p=0.0).validate()
    with pytest.raises(ValueError, match=r"in \[0, 100\)"):
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=100)


def test_validate_accepts_edges() -> None:
    ok = dict(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        repetition_penalty=2.0,
        max_new_tokens=0,
        min_new_tokens=0,
        stop_token_ids=[0, 99],
        logit_bias={"99": -100, 0: 3.5},
        json_schema={"type": "object"},
    )
    SamplingParams.from_dict(ok).validate(vocab_size=100)
    SamplingParams(top_k=-1, stop_token_ids=[10**6]).validate()  # no vocab known yet


def test_is_greedy_and_stop_strs() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy
    assert SamplingParams().stop_strs == []
    assert SamplingParams(stop="\n").stop_strs == ["\n"]
    assert SamplingParams.from_dict({"stop": ("a", "b")}).stop_strs == ["a", "b"]


def test_to_dict_round_trips_through_orjson() -> None:
    p = SamplingParams.from_dict(
        {
            "temperature": 0.3,
            "stop": ["x", "y"],
            "stop_token_ids": [4],
            "seed": 11,
            "logit_bias": {"5": 2, 7: -1.5},
            "json_schema": {"type": "string"},
            "n": 2,
        }
    )
    wire = orjson.loads(orjson.dumps(p.to_dict()))
    assert wire["logit_bias"] == {"5": 2.0, "7": -1.5}
    assert SamplingParams.from_dict(wire) == p
    assert p.logit_bias_by_id == {5: 2.0, 7: -1.5}
    assert orjson.loads(p.json_schema) == {"type": "string"}


def test_spaces_between_special_tokens_only_at_its_default() -> None:
    """An SGLang field the detokenizer does not implement: its default is accepted, the other
    value refused (a 400 at the front door), never silently ignored."""
    SamplingParams.from_dict({"spaces_between_special_tokens": True}).validate()
    with pytest.raises(ValueError, match="spaces_between_special_tokens=false is not supported"):
        SamplingParams.from_dict({"spaces_between_special_tokens": False}).validate()
