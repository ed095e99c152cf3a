"""Engine.async_generate (SGLang's): concurrent coroutines are batched and give the outputs of
the synchronous call; streaming is an async iterator; a cancelled call leaves nothing behind.
Tiny random Llama (SmolLM2's tokenizer)."""

from __future__ import annotations

import asyncio

import pytest

from radixlm.srt import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
POOL = 2048


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with Engine(str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning") as e:
        yield e


def _idle(engine: Engine) -> None:
    assert engine.scheduler.check_idle() and not engine.front.states
    u = engine.scheduler.kv.usage()
    assert u["available"] + u["evictable"] + u["protected"] == POOL, u


def test_concurrent_calls_match_the_synchronous_ones(engine: Engine) -> None:
    prompts = [f"Item {i}: the weather in city {i} is" for i in range(6)]
    want = [engine.generate(p, GREEDY)["output_ids"] for p in prompts]

    async def main():
        return await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in prompts))

    got = asyncio.run(main())
    assert [g["output_ids"] for g in got] == want
    batch = asyncio.run(engine.async_generate(prompts[:2], GREEDY))
    assert [b["output_ids"] for b in batch] == want[:2]
    _idle(engine)


def test_streaming_is_an_async_iterator(engine: Engine) -> None:
    want = engine.generate("Once upon a time", GREEDY)

    async def main():
        chunks = []
        async for chunk in await engine.async_generate("Once upon a time", GREEDY, stream=True):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(main())
    assert len(chunks) > 1 and chunks[-1]["text"] == want["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    _idle(engine)


def test_a_cancelled_call_aborts_its_request(engine: Engine) -> None:
    long = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}

    async def main():
        task = asyncio.create_task(engine.async_generate("Count to a million:", long))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    engine.generate("flush", {"max_new_tokens": 1})  # runs the steps that report the abort
    _idle(engine)
    with pytest.raises(ValueError):
        asyncio.run(engine.async_generate("x", {"max_new_tokens": -3}))
    _idle(engine)


def test_sglang_keywords_at_their_defaults_are_taken_and_others_named(engine: Engine) -> None:
    """SGLang callers pass ``lora_path=None``, ``image_data=None``... explicitly."""
    out = engine.generate(
        "Hello",
        {"max_new_tokens": 2},
        lora_path=None,
        image_data=None,
        return_hidden_states=False,
        custom_logit_processor=None,
        external_trace_header={"traceparent": "00-abc"},
    )
    assert out["meta_info"]["completion_tokens"] == 2
    with pytest.raises(ValueError, match="lora_path"):
        engine.generate("Hello", {"max_new_tokens": 2}, lora_path="adapter")
    with pytest.raises(ValueError, match="return_hidden_states"):
        asyncio.run(engine.async_generate("Hello", return_hidden_states=True))
    with pytest.raises(TypeError, match="no_such_option"):
        engine.generate("Hello", no_such_option=1)
    _idle(engine)


def test_model_info_has_the_server_route_fields(engine: Engine, tiny_llama_dir) -> None:
    info = engine.get_model_info()
    assert info["model_path"] == str(tiny_llama_dir) and info["is_generation"]
    assert info["served_model_name"] == tiny_llama_dir.name
    assert info["context_length"] > 0 and info["vocab_size"] > 0


def test_lang_runtime_answers_sglang_runtime_calls(tiny_llama_dir) -> None:
    """SGLang's ``Runtime``: ``generate`` returns the /generate answer as JSON text,
    ``async_generate`` streams text pieces, ``get_tokenizer`` gives the tokenizer."""
    import json

    import radixlm.lang as rl

    runtime = rl.Runtime(str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning")
    try:
        out = json.loads(runtime.generate("Hello there", GREEDY, return_logprob=True))
        assert len(out["meta_info"]["output_token_logprobs"]) == GREEDY["max_new_tokens"]

        async def pieces():
            return [p async for p in runtime.async_generate("Hello there", GREEDY)]

        assert "".join(asyncio.run(pieces())) == out["text"]
        assert runtime.get_tokenizer() is runtime.engine.tokenizer

        @rl.function
        def prog(s):
            s += "Hello there" + rl.gen("x", max_tokens=4)

        want = runtime.engine.generate("Hello there", {"max_new_tokens": 4, "temperature": 0})
        assert prog.run(backend=runtime, temperature=0)["x"] == want["text"]
    finally:
        runtime.shutdown()


def test_streams_dropped_unread_or_part_read_leave_nothing(engine: Engine) -> None:
    import gc

    long = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
    unread = engine.generate("Count slowly:", long, stream=True)
    part = engine.generate("Count again:", long, stream=True)
    next(part)
    del unread, part
    gc.collect()

    async def dropped():
        stream = await engine.async_generate("Count once more:", long, stream=True)
        del stream
        gc.collect()

    asyncio.run(dropped())
    engine.generate("flush", {"max_new_tokens": 1})  # runs the steps that report the aborts
    _idle(engine)
