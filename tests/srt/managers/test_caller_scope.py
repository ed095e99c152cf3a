"""Client-chosen rids and session ids in the namespace of their caller (caller_scope.py): two
callers may use the same names without meeting; one cannot abort, squat, continue, close or
probe the other's; the per-caller session quota; the empty namespace (the Engine) unchanged."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from radixlm.srt.managers.caller_scope import client_name, scoped
from radixlm.srt.managers.front_door import FrontDoor, ModelLimits
from radixlm.srt.managers.generate_call import GenerateCall, split_call
from radixlm.srt.managers.request_front import RequestFront
from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.sessions import SessionManager, SessionParams
from radixlm.srt.messages import AbortReq, FlushCacheReq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from fake_stack import make_tokenizer  # noqa: E402

A, B = "kaaaa", "kbbbb"


def test_scoped_keys() -> None:
    assert scoped("", "job-1") == "job-1"  # the Engine's keys are its names
    assert scoped(A, "job-1") != scoped(B, "job-1")
    assert client_name(scoped(A, "job-1")) == "job-1" and client_name("job-1") == "job-1"


@pytest.fixture
def sent() -> list[Any]:
    return []


@pytest.fixture
def front(sent) -> RequestFront:
    door = FrontDoor(make_tokenizer(), ModelLimits(320, 256, 1024))
    return RequestFront(lambda: door, sent.append, max_sessions_per_caller=2)


def _open(front: RequestFront, namespace: str, **call: Any):
    inputs, _ = split_call(GenerateCall(text="hi", sampling_params={"max_new_tokens": 2}, **call))
    return front.open(front.prepare_all(inputs, {}), list, namespace)


def test_same_rid_in_two_namespaces_and_abort_stays_inside(front, sent) -> None:
    a_states, a_keys = _open(front, A, rid="job-43")
    b_states, b_keys = _open(front, B, rid="job-43")  # not a squat: B's own rid
    with pytest.raises(GenerateError, match="rid 'job-43' is already running"):
        _open(front, A, rid="job-43")  # the same caller twice is still refused
    sent.clear()
    assert front.abort(scoped(B, "job-43")) == 1
    assert [m.rid for m in sent if isinstance(m, AbortReq)] == [b_states[0].rid]
    assert front.abort("job-43") == 0  # the bare name reaches nobody's request
    front.release(a_states, a_keys)
    front.release(b_states, b_keys)
    front.assert_no_requests()


def test_batch_abort_keys_are_scoped_too(front, sent) -> None:
    inputs, _ = split_call(
        GenerateCall(text=["x", "y"], rid="batch", sampling_params={"max_new_tokens": 2})
    )
    states, keys = front.open(front.prepare_all(inputs, {}), list, A)
    assert front.abort(scoped(B, "batch")) == 0
    assert front.abort(scoped(A, "batch")) == 2
    front.release(states, keys)
    front.assert_no_requests()


def test_a_failed_control_send_leaves_no_pending_waiter(front) -> None:
    def broken(msg: Any) -> None:
        raise OSError("socket closed")

    front.send = broken
    with pytest.raises(OSError):
        front.send_control(FlushCacheReq(), object(), 1.0)
    assert front.pending == {}


def _sessions(quota: int | None = 2) -> tuple[SessionManager, list[str]]:
    aborted: list[str] = []
    return SessionManager(abort=aborted.append, max_sessions_per_caller=quota), aborted


def test_sessions_are_private_to_their_caller() -> None:
    m, aborted = _sessions()
    assert m.open(100, "chat", namespace=A) == "chat"
    assert m.open(100, "chat", namespace=B) == "chat"  # no clash, and no existence probe
    plan = m.plan(SessionParams(scoped(A, "chat")), [1, 2], 2)
    (turn,) = m.commit([plan], ["t1"])
    with pytest.raises(GenerateError, match="session id chat does not exist"):
        m.close("chat")  # the anonymous caller does not reach A's session
    with pytest.raises(GenerateError, match="does not exist"):
        m.plan(SessionParams("chat", rid="t1"), [3], 2)
    m.close("chat", namespace=A)  # A's running turn is aborted under A's key
    assert aborted == [scoped(A, "t1")]
    m.close("chat", namespace=B)
    assert m.sessions == {} and m.info()["num_open_sessions"] == 0
    m.check_integrity()


def test_per_caller_session_quota_leaves_room_for_others() -> None:
    m, _ = _sessions(quota=2)
    m.open(10, namespace=A)
    m.open(10, namespace=A)
    with pytest.raises(GenerateError, match="--max-sessions-per-caller"):
        m.open(10, namespace=A)
    m.open(10, namespace=B)  # another caller still opens its own
    for _ in range(5):
        m.open(10)  # the anonymous namespace (no keys; the Engine) is not limited per caller
    sid = next(s.name for s in m.sessions.values() if s.namespace == A)
    m.close(sid, namespace=A)
    m.open(10, namespace=A)  # a closed session frees its place


def test_idle_sessions_of_the_caller_make_room_for_it() -> None:
    now = [0.0]
    m = SessionManager(max_sessions_per_caller=1, clock=lambda: now[0], min_idle_evict_s=60)
    m.open(10, "old", namespace=A)
    m.open(10, "other", namespace=B)
    now[0] = 61.0
    m.open(10, "new", namespace=A)  # A's idle session closed for it, B's kept
    assert {s.name for s in m.sessions.values()} == {"new", "other"}
