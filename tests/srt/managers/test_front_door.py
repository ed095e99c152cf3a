"""The front door on its own (no model, the fake stack's byte-level tokenizer): each check
refuses once with the HTTP status, parameter and message the tests of both entry points
assert; the grammar kind (json_object its own kind) is decided here and travels on the wire."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from radixlm.grammar.base import GrammarSpec
from radixlm.srt.managers.front_door import FrontDoor, ModelLimits, grammar_kind
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.messages import decode, encode
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.grammar_manager import grammar_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from fake_stack import make_tokenizer  # noqa: E402

VOCAB, CONTEXT, POOL = 320, 256, 1024  # default max_new_tokens (128) fits


@pytest.fixture(scope="module")
def door() -> FrontDoor:
    return FrontDoor(make_tokenizer(), ModelLimits(VOCAB, CONTEXT, POOL))


def refusal(fn, *args, **kwargs) -> GenerateError:
    with pytest.raises(GenerateError) as err:
        fn(*args, **kwargs)
    assert err.value.status_code == 400
    return err.value


@pytest.mark.parametrize(
    "sp, param, message",
    [
        ({"temperature": -1}, "temperature", "temperature must be >= 0"),
        ({"bogus": 1}, "bogus", "unknown sampling parameter(s): bogus"),
        ({"top_k": "3"}, "top_k", "sampling parameter top_k must be an integer"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids", f"in [0, {VOCAB}) (the vocabulary)"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias", "logit_bias token id must be in [0,"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, None, "at most one of json_schema, regex"),
        ({"regex": "(ab"}, "regex", "regex"),
        ({"json_schema": "{not json"}, "json_schema", "json_schema"),
        ({"json_schema": "[" * 200 + "]" * 200}, "json_schema", "json_schema"),
    ],
)
def test_sampling_params_are_refused_naming_the_parameter(door, sp, param, message):
    err = refusal(door.prepare, "r", input_ids=[1, 2, 3], sampling_params=sp)
    assert message in err.message
    assert err.param == param


def test_input_ids_are_checked_against_the_vocabulary(door):
    err = refusal(door.prepare, "r", input_ids=[1, VOCAB, -2, True])
    assert err.message == f"input_ids must be token ids in [0, {VOCAB}), got [{VOCAB}, -2, True]"
    assert err.param == "input_ids"
    # a prompt too long for the context is refused by its length, before any id is looked at
    err = refusal(door.prepare, "r", input_ids=[-1] * CONTEXT)
    assert err.message.startswith(
        f"the prompt has {CONTEXT} tokens, but this server takes at most {CONTEXT - 1}"
    )


def test_prompt_lengths(door):
    assert "the prompt is empty" in refusal(door.prepare, "r", input_ids=[]).message
    assert "the prompt is empty" in refusal(door.prepare, "r", text="").message
    err = refusal(
        door.prepare, "r", input_ids=[1] * 10, sampling_params={"max_new_tokens": CONTEXT - 9}
    )
    assert (
        err.param == "max_new_tokens" and f"exceeds the context length of {CONTEXT}" in err.message
    )
    door.prepare("r", input_ids=[1] * 10, sampling_params={"max_new_tokens": CONTEXT - 10})
    err = refusal(door.prepare, "r", text="x" * (door.max_prompt_chars + 1))
    assert err.param == "text" and f"more than the {CONTEXT}-token context" in err.message
    small_pool = FrontDoor(door.tokenizer, ModelLimits(VOCAB, CONTEXT, 8))
    assert "KV pool 8 tokens" in refusal(small_pool.prepare, "r", input_ids=[1] * 8).message


def test_logprob_arguments(door):
    err = refusal(door.prepare, "r", input_ids=[1, 2], return_logprob=True, logprob_start_len=3)
    assert err.param == "logprob_start_len" and "in [0, 2]" in err.message
    err = refusal(door.prepare, "r", input_ids=[1, 2], return_logprob=True, top_logprobs_num=21)
    assert err.param == "top_logprobs_num"
    # without return_logprob the message carries no logprob request
    _, msg = door.prepare("r", input_ids=[1, 2], logprob_start_len=0, top_logprobs_num=3)
    assert (msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num) == (False, -1, 0)


def test_exactly_one_of_text_and_input_ids(door):
    assert "exactly one" in refusal(door.prepare, "r").message
    assert "exactly one" in refusal(door.prepare, "r", text="a", input_ids=[1]).message


@pytest.mark.parametrize(
    "sp, kind",
    [
        ({"json_schema": '{"type": "object"}'}, "json_object"),
        ({"json_schema": {"type": "object"}}, "json_object"),
        ({"json_schema": '{"type": "object", "required": ["a"]}'}, "json_schema"),
        ({"json_schema": "true"}, "json_schema"),
        ({"regex": "[ab]+"}, "regex"),
        ({"ebnf": 'root ::= "a"'}, "ebnf"),
        ({"choices": ["yes", "no"]}, "choices"),
        ({}, None),
    ],
)
def test_the_grammar_kind_is_decided_once_and_travels(door, sp, kind):
    params, msg = door.prepare("r", text="Hello world", sampling_params=sp)
    assert msg.grammar_kind == kind == grammar_kind(params)
    wire = decode(encode(msg))
    assert wire == msg
    wire_params = SamplingParams.from_wire(wire.sampling_params)
    assert wire_params == params
    spec = grammar_spec(wire_params, wire.grammar_kind)
    assert (spec.kind if spec else None) == kind
    if kind == "json_object":
        assert spec == GrammarSpec.json_object()  # no schema text left to parse


def test_a_message_without_a_kind_keeps_its_grammar_field():
    """Senders other than the front door (scheduler tests) leave grammar_kind None."""
    params = SamplingParams.from_dict({"json_schema": '{"type": "object"}'})
    assert grammar_spec(params).kind == "json_schema"


def test_the_wire_message(door):
    sp = {"n": 3, "seed": 7, "stop": ["x"], "logit_bias": {"5": 2.0}, "temperature": 0.5}
    params, msg = door.prepare("rid-1", text="Hello world", sampling_params=sp, stream=True)
    assert params.n == 3 and msg.sampling_params["n"] == 1  # one message per sample
    assert msg.rid == "rid-1" and msg.stream
    assert msg.input_ids == door.tokenizer.encode("Hello world")
    wire = SamplingParams.from_wire(json.loads(json.dumps(msg.sampling_params)))
    assert wire == params.replace(n=1) and wire.logit_bias_by_id == {5: 2.0}


# ---------------------------------------------------------------- disaggregation's fields
BOOTSTRAP = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**64 - 1}


def test_bootstrap_fields_are_refused_on_a_whole_server(door):
    params = SamplingParams()
    err = refusal(door.admit, "r", [1, 2], params, bootstrap_room=3)
    assert err.param == "bootstrap_room" and "--disaggregation-mode" in str(err)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_bootstrap_fields_travel_to_the_scheduler_on_a_pd_worker(mode):
    door = FrontDoor(make_tokenizer(), ModelLimits(VOCAB, CONTEXT, POOL, mode))
    msg = door.admit("r", [1, 2], SamplingParams(), **BOOTSTRAP)
    back = decode(encode(msg))
    assert (back.bootstrap_host, back.bootstrap_port, back.bootstrap_room) == (
        "127.0.0.1",
        8998,
        2**64 - 1,
    )
    assert door.admit("r", [1, 2], SamplingParams()).bootstrap_room is None  # runs whole


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"bootstrap_room": 1}, "bootstrap_host"),
        ({**BOOTSTRAP, "bootstrap_port": 0}, "bootstrap_port"),
        ({**BOOTSTRAP, "bootstrap_room": -1}, "bootstrap_room"),
        ({**BOOTSTRAP, "bootstrap_room": 2**64}, "bootstrap_room"),
        ({**BOOTSTRAP, "bootstrap_host": ""}, "bootstrap_host"),
    ],
)
def test_bootstrap_fields_are_checked_on_a_pd_worker(fields, param):
    door = FrontDoor(make_tokenizer(), ModelLimits(VOCAB, CONTEXT, POOL, "decode"))
    assert refusal(door.admit, "r", [1, 2], SamplingParams(), **fields).param == param


def test_logprobs_are_refused_with_bootstrap_fields_for_now():
    door = FrontDoor(make_tokenizer(), ModelLimits(VOCAB, CONTEXT, POOL, "decode"))
    err = refusal(door.admit, "r", [1, 2], SamplingParams(), return_logprob=True, **BOOTSTRAP)
    assert err.param == "return_logprob"
    assert door.admit("r", [1, 2], SamplingParams(), return_logprob=True).return_logprob
