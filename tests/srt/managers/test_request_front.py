"""The request front on its own (no model, the fake stack's byte-level tokenizer, messages
collected in a list): sequences checked into messages, the rid registry (a running rid
refused, release leaves nothing, abort by client rid), session turns committed and ended by
the outputs, control bookkeeping."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from radixlm.srt.managers.front_door import FrontDoor, ModelLimits
from radixlm.srt.managers.generate_call import GenerateCall, split_call
from radixlm.srt.managers.request_front import RequestFront, is_busy, texts_to_tokenize
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.sessions import SessionParams
from radixlm.srt.messages import (
    AbortReq,
    BatchStrOut,
    BatchTokenOut,
    ControlReply,
    FlushCacheReq,
    ReleaseSessionReq,
    ServerInfoReq,
    TokenizedGenerateReq,
)

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
    # the running turn is aborted, then the scheduler lets go of the session's held prefix
    assert sent[-2:] == [AbortReq(rid=states[0].rid), ReleaseSessionReq(sid)]
    front.release(states, keys)
    front.assert_no_requests()


# ---------------------------------------------------------------------- control calls
def test_control_replies_go_to_their_waiter_and_read_only_answers_are_kept(front, sent) -> None:
    query = ServerInfoReq()
    req_id = front.send_control(query, "waiter", timeout_s=5)
    assert sent[-1].req_id == req_id and sent[-1].expires_at is not None
    reply = ControlReply(req_id, True, {"x": 1})
    assert front.reply_waiter(reply) == "waiter" and front.reply_waiter(reply) is None
    assert front.last_answer(query) is None
    front.remember(query, reply)
    last = front.last_answer(query)
    assert last is not None and last.data["x"] == 1 and last.data["age_s"] >= 0
    action = FlushCacheReq()
    front.remember(action, ControlReply("f", True))
    assert front.last_answer(action) is None  # an action is never answered from memory
    assert is_busy(ControlReply("u", False, {"busy": True}))
    assert not is_busy(ControlReply("u", False, {"message": "bad path"}))
