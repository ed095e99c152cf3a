"""Sessions in the in-process Engine: a turn runs on the history plus its new tokens (the same
ids and greedy output as sending the whole history), served from the radix cache; refusals are
ValueErrors; nothing is left behind."""

from __future__ import annotations

import pytest

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from radixlm.srt import Engine

    eng = Engine(model_path=str(tiny_llama_dir), max_total_tokens=2048, log_level="warning")
    yield eng
    eng.shutdown()


def test_engine_turns_equal_whole_history_requests(engine) -> None:
    sid = engine.open_session(512)
    t1 = engine.generate("Hello there", GREEDY, session_params={"id": sid}, rid="one")
    first_ids = engine.tokenizer.encode("Hello there")
    history = first_ids + t1["output_ids"]
    new = engine.tokenizer.encode(" and more", add_special_tokens=False)
    t2 = engine.generate(
        input_ids=new, sampling_params=GREEDY, session_params={"id": sid, "rid": "one"}
    )
    assert t2["meta_info"]["prompt_tokens"] == len(history) + len(new)
    assert t2["meta_info"]["cached_tokens"] >= len(history) - 1
    ref = engine.generate(input_ids=history + new, sampling_params=GREEDY)
    assert ref["output_ids"] == t2["output_ids"]
    text_turn = engine.generate(" and more", GREEDY, session_params={"id": sid, "rid": "one"})
    assert text_turn["output_ids"] == t2["output_ids"]  # text is tokenized without specials
    samples = engine.generate(
        input_ids=new, sampling_params={**GREEDY, "n": 2}, session_params={"id": sid, "rid": "one"}
    )
    assert [s["output_ids"] for s in samples] == [t2["output_ids"]] * 2
    assert len(engine.sessions.sessions[sid].turns) == 5
    engine.close_session(sid)
    assert not engine.sessions.sessions
    engine.front.assert_no_requests()
    assert engine.scheduler.check_idle()


def test_engine_session_refusals_and_streams(engine) -> None:
    sid = engine.open_session(64, session_id="mine")
    with pytest.raises(ValueError, match="does not exist"):
        engine.generate("x", GREEDY, session_params={"id": "nope"})
    with pytest.raises(ValueError, match="needs session_params.id"):
        engine.generate("x", GREEDY, session_params={"rid": "a"})
    with pytest.raises(ValueError, match="must be int"):
        engine.generate("x", GREEDY, session_params={"id": sid, "offset": "1"})
    with pytest.raises(ValueError, match="capacity_of_str_len"):
        engine.generate("x", {**GREEDY, "max_new_tokens": 80}, session_params={"id": sid})
    with pytest.raises(ValueError, match="already exists"):
        engine.open_session(64, session_id="mine")
    chunks = list(engine.generate("Hi", GREEDY, stream=True, rid="s1", session_params={"id": sid}))
    assert not engine.sessions.sessions[sid].turns["s1"].is_running
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    stream = engine.generate(
        "Hey",
        {**GREEDY, "max_new_tokens": 30},
        stream=True,
        rid="s2",
        session_params={"id": sid, "rid": "s1"},
    )
    next(stream)
    stream.close()  # the consumer stopped early: the turn leaves the session
    assert "s2" not in engine.sessions.sessions[sid].turns and "s2" not in engine.front.client_rids
    engine.close_session(sid)
    with pytest.raises(ValueError, match="does not exist"):
        engine.close_session(sid)
    engine.sessions.check_integrity()
    while engine.scheduler.has_work():
        engine.scheduler.step()
    assert engine.scheduler.check_idle()
