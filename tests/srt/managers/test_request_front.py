"""The request front on its own (no model, the fake stack's byte-level tokenizer, messages
collected in a list): a call split into sequences (batch x n, sample rids, per-prompt fields,
the sequence cap), the rid registry (a running rid refused, release leaves nothing, abort by
client rid), session turns committed and ended by the outputs, control bookkeeping."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from radixlm.srt.managers.front_door import FrontDoor, ModelLimits
from radixlm.srt.managers.generate_call import (
    MAX_SEQUENCES_PER_REQUEST,
    GenerateCall,
    engine_prompts,
    split_call,
)
from radixlm.srt.managers.request_front import RequestFront, is_busy, texts_to_tokenize
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.sessions import SessionParams
from radixlm.srt.messages import (
    AbortReq,
    BatchStrOut,
    BatchTokenOut,
    ControlReply,
    ControlReq,
    TokenizedGenerateReq,
)
from radixlm.srt.sampling.params import MAX_N

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from fake_stack import make_tokenizer  # noqa: E402

VOCAB, CONTEXT, POOL = 320, 256, 1024
SP = {"max_new_tokens": 4}


@pytest.fixture(scope="module")
def door() -> FrontDoor:
    return FrontDoor(make_tokenizer(), ModelLimits(VOCAB, CONTEXT, POOL))


@pytest.fixture
def sent() -> list[Any]:
    return []


@pytest.fixture
def front(door, sent) -> RequestFront:
    return RequestFront(lambda: door, sent.append)


def refusal(fn, *args, **kwargs) -> GenerateError:
    with pytest.raises(GenerateError) as err:
        fn(*args, **kwargs)
    assert err.value.status_code == 400
    return err.value


def opened(front: RequestFront, call: GenerateCall):
    inputs, _ = split_call(call)
    return front.open(front.prepare_all(inputs, {}), list)


def out(rids: list[str], new: list[list[int]], finish: list[dict | None]) -> BatchStrOut:
    n = len(rids)
    token_out = BatchTokenOut(
        rids,
        new,
        finish,
        [3] * n,
        [len(x) for x in new],
        [0] * n,
        [False] * n,
        [True] * n,
        [None] * n,
        [None] * n,
        [None] * n,
        [None] * n,
    )
    return BatchStrOut(token_out, ["x" * len(x) for x in new])


# ---------------------------------------------------------------------- the split
def test_a_batch_times_n_gets_sample_rids_and_abort_keys() -> None:
    call = GenerateCall(text=["a", "b"], sampling_params={"n": 2}, rid="r", stream=True)
    inputs, is_batch = split_call(call)
    assert is_batch and [i.text for i in inputs] == ["a", "a", "b", "b"]
    assert [i.rid for i in inputs] == ["r_0_0", "r_0_1", "r_1_0", "r_1_1"]
    assert [i.abort_keys for i in inputs] == [("r", "r_0")] * 2 + [("r", "r_1")] * 2
    assert all(i.stream and i.log_metrics and not i.return_logprob for i in inputs)
    single, is_batch = split_call(GenerateCall(input_ids=[1, 2], rid="x"))
    assert not is_batch and single[0].rid == "x" and single[0].abort_keys == ()
    samples, is_batch = split_call(
        GenerateCall(input_ids=[1, 2], rid="x", sampling_params={"n": 3})
    )
    assert is_batch and [(s.rid, s.abort_keys) for s in samples] == [
        ("x_0", ("x",)),
        ("x_1", ("x",)),
        ("x_2", ("x",)),
    ]


def test_per_prompt_fields_are_picked_and_their_lengths_checked() -> None:
    call = GenerateCall(
        input_ids=[[1], [2]],
        return_logprob=[True, None],
        top_logprobs_num=2,
        token_ids_logprob=[[5], None],
        rid=["p", "q"],
    )
    inputs, _ = split_call(call)
    assert [i.return_logprob for i in inputs] == [True, False]  # null: the default
    assert [i.top_logprobs_num for i in inputs] == [2, 2]
    assert [i.logprob_start_len for i in inputs] == [-1, -1]
    assert [i.token_ids_logprob for i in inputs] == [[5], None]
    assert [i.rid for i in inputs] == ["p", "q"]
    err = refusal(split_call, GenerateCall(text=["a", "b"], return_logprob=[True] * 3))
    assert err.message == "return_logprob has 3 entries for 2 prompts"
    assert err.param == "return_logprob"
    err = refusal(split_call, GenerateCall(text=["a", "b"], sampling_params=[{}]))
    assert err.param == "sampling_params"
    assert "unique" in refusal(split_call, GenerateCall(text=["a", "b"], rid=["s", "s"])).message
    assert "exactly one" in refusal(split_call, GenerateCall()).message
    assert refusal(split_call, GenerateCall(text=[])).message == "the batch is empty"
    assert refusal(split_call, GenerateCall(text="a", sampling_params={"n": 0})).param == "n"


def test_the_sequence_cap() -> None:
    num_prompts = MAX_SEQUENCES_PER_REQUEST // MAX_N + 1
    call = GenerateCall(text=["a"] * num_prompts, sampling_params={"n": MAX_N})
    err = refusal(split_call, call)
    assert err.param == "n"
    assert err.message == (
        f"this request asks for {num_prompts * MAX_N} sequences (prompts x n); at most "
        f"{MAX_SEQUENCES_PER_REQUEST} per request"
    )
    inputs, _ = split_call(call, capped=False)  # the Engine has no cap
    assert len(inputs) == num_prompts * MAX_N


def test_a_call_is_read_from_fields_by_name_and_the_engine_shapes_are_checked() -> None:
    call = GenerateCall.from_fields({"text": "a", "stream": True, "model": "m", "priority": 1})
    assert call == GenerateCall(text="a", stream=True)
    engine_prompts("a", None, [{}])
    with pytest.raises(GenerateError, match="pass exactly one of prompt"):
        engine_prompts(None, None, None)
    with pytest.raises(GenerateError, match="prompt must be a non-empty str or list of str"):
        engine_prompts([1], None, None)
    with pytest.raises(GenerateError, match="non-empty list of ints or of non-empty lists"):
        engine_prompts(None, [[1], []], None)
    with pytest.raises(GenerateError, match="got 1 sampling_params for 2 prompts"):
        engine_prompts(None, [[1], [2]], [{}])


def test_texts_are_tokenized_once(door, front) -> None:
    inputs, _ = split_call(GenerateCall(text=["hi", "hi"], sampling_params={"n": 2}))
    keys = texts_to_tokenize(inputs)
    assert keys == [("hi", True)]
    ids = {keys[0]: door.tokenize("hi")}
    prepared = front.prepare_all(inputs, ids)
    assert {tuple(p.msg.input_ids) for p in prepared} == {tuple(ids[keys[0]])}
    assert len({p.rid for p in prepared}) == 4  # internal rids are unique


# ---------------------------------------------------------------------- the registry
def test_a_running_rid_is_refused_and_nothing_is_registered(front, sent) -> None:
    states, keys = opened(front, GenerateCall(input_ids=[1, 2], sampling_params=SP, rid="dup"))
    assert [type(m) for m in sent] == [TokenizedGenerateReq]
    err = refusal(opened, front, GenerateCall(input_ids=[[3], [4]], rid=["new", "dup"]))
    assert "a request with rid 'dup' is already running" in err.message and err.param == "rid"
    assert len(sent) == 1 and len(front.states) == 1 and "new" not in front.client_rids
    front.release(states, keys)
    front.assert_no_requests()


def test_release_aborts_what_has_not_finished_and_leaves_nothing(front, sent) -> None:
    states, keys = opened(front, GenerateCall(input_ids=[[1], [2]], sampling_params=SP))
    first = states[0].rid
    assert front.fold(out([first], [[7]], [{"type": "length", "length": 1}])) == [(states[0], 1)]
    front.release(states, keys)
    assert sent[2:] == [AbortReq(rid=states[1].rid)]  # the finished one is not aborted
    front.assert_no_requests()
    assert front.fold(out([first], [[8]], [None])) == []  # a late output is dropped


def test_abort_by_client_rid_reaches_every_sample_under_it(front, sent) -> None:
    call = GenerateCall(input_ids=[[1], [2]], sampling_params={**SP, "n": 2}, rid="grp")
    states, keys = opened(front, call)
    del sent[:]
    assert front.abort("grp_1") == 2
    assert sent == [AbortReq(rid=s.rid) for s in states[2:]]
    assert front.abort("grp") == 4 and front.abort("grp_1_0") == 1 and front.abort("x") == 0
    assert states[0].result.rid == "grp_0_0"  # the client's rid is what the caller sees
    front.release(states, keys)
    front.assert_no_requests()


# ---------------------------------------------------------------------- session turns
def test_session_turns_are_committed_at_open_and_ended_by_their_output(front, door) -> None:
    sid = front.sessions.open(1000)
    call = GenerateCall(input_ids=[1, 2], sampling_params=SP, session_params=SessionParams(sid))
    (first,), keys = opened(front, GenerateCall(**{**call.__dict__, "rid": "t1"}))
    turn = front.sessions.sessions[sid].turns["t1"]
    assert turn.is_running
    front.fold(out([first.rid], [[9, 10]], [{"type": "stop", "matched": 10}]))
    assert not turn.is_running
    front.release([first], keys)
    nxt = SessionParams(sid, rid="t1")
    (second,), keys = opened(
        front, GenerateCall(input_ids=[3], sampling_params=SP, session_params=nxt)
    )
    assert second.req.msg.input_ids == [1, 2, 9, 10, 3]  # the history, then the new tokens
    front.release([second], keys)  # never finished: the turn leaves its session
    assert list(front.sessions.sessions[sid].turns) == ["t1"]
    front.assert_no_requests()


def test_a_closed_session_aborts_its_running_turns(front, sent) -> None:
    sid = front.sessions.open(1000)
    call = GenerateCall(
        input_ids=[1], rid="t", sampling_params=SP, session_params=SessionParams(sid)
    )
    states, keys = opened(front, call)
    front.sessions.close(sid)
    assert sent[-1] == AbortReq(rid=states[0].rid)
    front.release(states, keys)
    front.assert_no_requests()


# ---------------------------------------------------------------------- control calls
def test_control_replies_go_to_their_waiter_and_read_only_answers_are_kept(front, sent) -> None:
    query = ControlReq("", "server_info")
    req_id = front.send_control(query, "waiter", timeout_s=5)
    assert sent[-1].req_id == req_id and sent[-1].expires_at is not None
    reply = ControlReply(req_id, True, {"x": 1})
    assert front.reply_waiter(reply) == "waiter" and front.reply_waiter(reply) is None
    assert front.last_answer(query) is None
    front.remember(query, reply)
    last = front.last_answer(query)
    assert last is not None and last.data["x"] == 1 and last.data["age_s"] >= 0
    action = ControlReq("", "flush_cache")
    front.remember(action, ControlReply("f", True))
    assert front.last_answer(action) is None  # an action is never answered from memory
    assert is_busy(ControlReply("u", False, {"busy": True}))
    assert not is_busy(ControlReply("u", False, {"message": "bad path"}))
