"""What the prefix cache promises users of the engine: cached-token counts, multi-turn reuse,
clear errors for prompts that can never fit, and ``flush_cache``."""

from __future__ import annotations

import random
import time

import pytest

POOL = 1024
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
CHAT = {"temperature": 0, "max_new_tokens": 20}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from radixlm.srt import Engine

    eng = Engine(model_path=str(tiny_llama_dir), max_total_tokens=POOL, log_level="warning")
    yield eng
    eng.shutdown()


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def wait_idle(engine, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = engine.get_server_info()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            return info
        time.sleep(0.02)
    raise TimeoutError("the engine did not become idle")


def assert_no_leak(engine) -> None:
    info = wait_idle(engine)
    assert info["available"] + info["evictable"] + info["protected"] == info["max_total_tokens"]
    assert engine.scheduler.check_idle()
    engine.scheduler.cache.check_integrity()


@pytest.mark.parametrize("n", [1, 2, 17, 300])
def test_prompt_sent_twice_reports_all_but_its_last_token_cached(engine, n):
    ids = random_ids(n, seed=n)
    first = engine.generate(input_ids=ids, sampling_params=GREEDY)
    second = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == n - 1
    assert second["meta_info"]["prompt_tokens"] == n
    assert second["output_ids"] == first["output_ids"]
    assert_no_leak(engine)


def test_prefix_of_a_cached_prompt_also_computes_its_last_token(engine):
    ids = random_ids(64, seed=99)
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    out = engine.generate(input_ids=ids[:20], sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 19
    assert_no_leak(engine)


@pytest.mark.slow  # the default model (smol_engine)
def test_multi_turn_chat_reuses_the_whole_previous_turn(smol_engine):
    """Each round resends the conversation so far (prompt + answer) plus a new question. The
    previous round's KV is cached except for its last sampled token, which was never fed back
    through the model; everything before it must be served from the cache."""
    tok = smol_engine.tokenizer
    questions = [
        "What is the capital of France?",
        "And the capital of Germany?",
        "Which of the two cities is larger?",
    ]
    ids = tok.encode(smol_engine.apply_chat_template([{"role": "user", "content": questions[0]}]))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    previous = None
    for r, question in enumerate(questions):
        if r:
            ended = [] if ids[-1] == eos else [eos]
            turn = f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            ids = ids + ended + tok.encode(turn)
        out = smol_engine.generate(input_ids=ids, sampling_params=CHAT)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        if previous is not None:
            reused = previous["prompt_tokens"] + previous["completion_tokens"] - 1
            assert reused <= meta["cached_tokens"] <= len(ids) - 1, (r, meta, previous)
        if r == 0:
            assert "Paris" in out["text"]
        previous = meta
        ids = ids + out["output_ids"]
    assert "Berlin" in tok.decode(ids)
    # The answer read through the cache equals the one computed from scratch.
    last_prompt = ids[: previous["prompt_tokens"]]
    assert smol_engine.flush_cache()
    fresh = smol_engine.generate(input_ids=last_prompt, sampling_params=CHAT)
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert fresh["output_ids"] == ids[len(last_prompt) :]


@pytest.mark.parametrize("n", [POOL, POOL + 500])
def test_prompt_that_can_never_fit_gets_a_clear_error(engine, n):
    with pytest.raises(ValueError, match=f"{n} tokens.*shorten"):
        engine.generate(input_ids=random_ids(n, seed=7), sampling_params=GREEDY)
    ok = engine.generate(input_ids=random_ids(POOL - 8, seed=8), sampling_params=GREEDY)
    assert ok["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    assert_no_leak(engine)


def test_flush_cache_empties_the_tree_when_idle(engine):
    ids = random_ids(50, seed=3)
    engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert engine.scheduler.cache.total_size() > 0
    assert engine.flush_cache() is True
    info = engine.get_server_info()
    assert info["evictable"] == info["protected"] == 0
    assert info["available"] == info["max_total_tokens"] == POOL
    assert engine.scheduler.cache.total_size() == 0
    again = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0
    assert_no_leak(engine)


def test_flush_cache_is_refused_while_a_request_runs(engine):
    engine.generate(input_ids=random_ids(40, seed=4), sampling_params=GREEDY)
    cached_before = engine.scheduler.cache.total_size()
    stream = engine.generate(
        input_ids=random_ids(30, seed=5),
        stream=True,
        sampling_params={"temperature": 0, "max_new_tokens": 500, "ignore_eos": True},
    )
    first = next(stream)
    assert first["meta_info"]["finish_reason"] is None  # still running
    assert engine.flush_cache() is False
    assert engine.scheduler.cache.total_size() >= cached_before
    stream.close()  # stops reading: the request is aborted
    assert_no_leak(engine)
    assert engine.flush_cache() is True
    assert engine.scheduler.cache.total_size() == 0
