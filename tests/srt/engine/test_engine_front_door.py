"""Both entry points go through the same front door: for the same input the in-process Engine
and the HTTP tokenizer manager build the same scheduler message, or refuse it with the same
message (a ValueError from the Engine, a 400 GenerateError from the tokenizer manager)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from radixlm.srt import Engine
from radixlm.srt.config import ServerConfig
from radixlm.srt.managers.generate_call import GenerateCall
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.scheduler_process import IpcEndpoints
from radixlm.srt.managers.tokenizer_manager import GenerateInput, TokenizerManager

POOL = 512


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Iterator[Engine]:
    engine = Engine(model_path=str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tm(engine, tmp_path_factory) -> Iterator[TokenizerManager]:
    """A tokenizer manager over the engine's tokenizer and limits (nothing is sent)."""
    tm = TokenizerManager(
        ServerConfig(), engine.tokenizer, IpcEndpoints.in_dir(tmp_path_factory.mktemp("ipc"))
    )
    tm.info = engine.scheduler.ready_info()
    yield tm
    asyncio.run(tm.close())


def both(
    engine: Engine,
    tm: TokenizerManager,
    text: str | None = None,
    input_ids: list[int] | None = None,
    sp: dict | None = None,
    **logprob: Any,
):
    """(the Engine's message or ValueError, the tokenizer manager's message or error)."""
    options = {
        "return_logprob": False,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
        **logprob,
    }
    try:
        call = GenerateCall(text=text, input_ids=input_ids, sampling_params=sp, **options)
        prepared, _ = engine._prepare(call)
        from_engine: Any = dataclasses.replace(prepared[0].msg, rid="")
    except ValueError as e:
        from_engine = e
    try:
        inp = GenerateInput(text=text, input_ids=input_ids, sampling_params=sp, **logprob)
        from_tm: Any = dataclasses.replace(asyncio.run(tm.prepare(inp)).msg, rid="")
    except GenerateError as e:
        from_tm = e
    return from_engine, from_tm


@pytest.mark.parametrize(
    "text, input_ids, sp, logprob",
    [
        ("Hello there", None, {"max_new_tokens": 4, "json_schema": '{"type": "object"}'}, {}),
        ("Hello there", None, {"regex": "[ab]+", "n": 2, "seed": 3}, {}),
        (
            None,
            [1, 2, 3, 4],
            {"temperature": 0.5, "stop": ["x"], "logit_bias": {"7": 1.5}},
            {"return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2},
        ),
        (None, [5, 6], None, {"logprob_start_len": 1}),  # no return_logprob: no logprobs sent
    ],
)
def test_the_same_message_from_both_entry_points(engine, tm, text, input_ids, sp, logprob):
    from_engine, from_tm = both(engine, tm, text, input_ids, sp, **logprob)
    assert from_engine == from_tm
    if sp and "json_schema" in sp:
        assert from_tm.grammar_kind == "json_object"


@pytest.mark.parametrize(
    "text, input_ids, sp, logprob, expected",
    [
        ("hi", None, {"top_p": 0}, {}, "top_p must be in (0, 1]"),
        ("hi", None, {"regex": "a", "choices": ["b"]}, {}, "at most one of json_schema, regex"),
        ("hi", None, {"json_schema": "{"}, {}, "json_schema"),
        (None, [1, 10**9], None, {}, "input_ids must be token ids in"),
        (None, [1] * POOL, {"max_new_tokens": 1}, {}, f"KV pool {POOL} tokens"),
        (None, [1] * 10, {"max_new_tokens": 2040}, {}, "exceeds the context length"),
        (None, [1, 2], None, {"return_logprob": True, "top_logprobs_num": 99}, "top_logprobs_num"),
        ("", None, None, {}, "the prompt is empty"),
    ],
)
def test_the_same_refusal_from_both_entry_points(
    engine, tm, text, input_ids, sp, logprob, expected
):
    from_engine, from_tm = both(engine, tm, text, input_ids, sp, **logprob)
    assert type(from_engine) is ValueError and isinstance(from_tm, GenerateError)
    assert expected in str(from_engine)
    assert str(from_engine) == from_tm.message and from_tm.status_code == 400


def test_the_engine_refuses_before_anything_is_queued(engine):
    with pytest.raises(ValueError, match="input_ids must be token ids"):
        engine.generate(input_ids=[[1, 2], [1, 10**9]], sampling_params={"max_new_tokens": 1})
    assert not engine.scheduler.has_work() and not engine.front.states
