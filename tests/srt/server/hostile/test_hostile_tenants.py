"""Callers kept apart (see conftest.py): a client-chosen rid or session id lives in the
namespace of its caller (the API key; the ``user`` field on a server without keys), so another
caller can neither abort nor squat a rid, nor continue, close or probe a session; one caller
cannot take every session slot (``--max-sessions-per-caller``). Every test ends with the
folder's leak check."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import plain_http
import pytest
from hostile_util import ADMIN_KEY, API_KEY, HTTP_TIMEOUT_S, LiveServer

pytestmark = pytest.mark.slow

KEY_A = {"Authorization": f"Bearer {API_KEY}"}
KEY_B = {"Authorization": f"Bearer {ADMIN_KEY}"}
LONG = {"max_new_tokens": 160, "ignore_eos": True, "temperature": 0}


class Background:
    """A streaming request read in a thread; ``started`` is set at its first event."""

    def __init__(self, server: LiveServer, path: str, body: dict, headers: dict) -> None:
        self.started = threading.Event()
        self.events: list[str] = []
        self.status = 0
        self.thread = threading.Thread(target=self._run, args=(server, path, body, headers))
        self.thread.start()
        assert self.started.wait(60), "the stream never started"

    def _run(self, server: LiveServer, path: str, body: dict, headers: dict) -> None:
        try:
            with plain_http.stream(
                "POST", server.url + path, json=body, headers=headers, timeout=HTTP_TIMEOUT_S
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line)
                        self.started.set()
        finally:
            self.started.set()

    def finish(self) -> list[str]:
        self.thread.join(HTTP_TIMEOUT_S)
        assert self.status == 200 and self.events and self.events[-1] == "data: [DONE]"
        return self.events


def _finish_reason(events: list[str]) -> Any:
    import json

    last = json.loads(events[-2][len("data: ") :])
    if "choices" in last:
        return last["choices"][0]["finish_reason"]
    return last["meta_info"]["finish_reason"]["type"]


def test_users_keep_their_rids_on_a_server_without_keys(server: LiveServer) -> None:
    """A second client holding ``job-43`` made the first one's request a 400; any client could
    abort it."""
    chat = {"messages": [{"role": "user", "content": "count"}], "rid": "job-43", "stream": True}
    alice = Background(
        server,
        "/v1/chat/completions",
        {**chat, "user": "alice", "max_tokens": 160, "ignore_eos": True, "temperature": 0},
        {},
    )
    bob = server.post(
        "/v1/chat/completions", {**chat, "stream": False, "user": "bob", "max_tokens": 2}
    )
    assert bob.status_code == 200, bob.text  # bob's own job-43, beside alice's
    again = server.post(
        "/v1/chat/completions", {**chat, "stream": False, "user": "alice", "max_tokens": 2}
    )
    assert again.status_code == 400 and "already running" in again.text, again.text
    r = server.post("/abort_request", {"rid": "job-43"})  # an anonymous caller
    assert r.status_code == 200 and r.json()["num_aborted"] == 0, r.text
    assert _finish_reason(alice.finish()) == "length"  # ran to its end, not aborted


def test_keys_keep_their_rids(keyed: LiveServer) -> None:
    body = {"text": "once upon", "rid": "job-43", "stream": True, "sampling_params": LONG}
    a = Background(keyed, "/generate", body, KEY_A)
    r = keyed.post(
        "/generate",
        {**body, "stream": False, "sampling_params": {"max_new_tokens": 2}},
        headers=KEY_B,
    )
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "job-43", r.text
    r = keyed.post("/abort_request", {"rid": "job-43"}, headers=KEY_B)
    assert r.json()["num_aborted"] == 0, r.text
    assert _finish_reason(a.finish()) == "length"


def _missing_message(r: httpx.Response, session_id: str) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"].replace(session_id, "<id>")


def test_sessions_are_private_to_their_key(keyed: LiveServer) -> None:
    open_body = {"capacity_of_str_len": 128}
    assert keyed.post("/open_session", {**open_body, "session_id": "mine"}).json() == "mine"
    # the same id for another key: its own session, no clash (and so no existence probe)
    r = keyed.post("/open_session", {**open_body, "session_id": "mine"}, headers=KEY_B)
    assert r.status_code == 200 and r.json() == "mine", r.text
    first = keyed.post(
        "/generate",
        {
            "text": "hi",
            "rid": "t1",
            "session_params": {"id": "mine"},
            "sampling_params": {"max_new_tokens": 2},
        },
    )
    assert first.status_code == 200, first.text
    # B cannot continue (read) A's turn: in B's session of that name there is no t1
    r = keyed.post(
        "/generate",
        {
            "text": "more",
            "session_params": {"id": "mine", "rid": "t1"},
            "sampling_params": {"max_new_tokens": 2},
        },
        headers=KEY_B,
    )
    assert r.status_code == 400 and "no request with rid 't1'" in r.text, r.text
    # a session only A has does not exist for B, in the very words of one never opened
    keyed.post("/open_session", {**open_body, "session_id": "a-only"})
    seen = keyed.post("/close_session", {"session_id": "a-only"}, headers=KEY_B)
    never = keyed.post("/close_session", {"session_id": "never-opened"}, headers=KEY_B)
    assert _missing_message(seen, "a-only") == _missing_message(never, "never-opened")
    turn = {
        "text": "x",
        "session_params": {"id": "a-only"},
        "sampling_params": {"max_new_tokens": 1},
    }
    assert keyed.post("/generate", turn).status_code == 200  # still A's, still open
    for sid in ("mine", "a-only"):
        assert keyed.post("/close_session", {"session_id": sid}).status_code == 200
    assert keyed.post("/close_session", {"session_id": "mine"}, headers=KEY_B).status_code == 200
    assert keyed.info()["sessions"]["num_open_sessions"] == 0


def test_one_key_cannot_take_every_session_slot(keyed: LiveServer) -> None:
    """One client opened all 1,024 slots in 0.7 s and locked everyone else out for a minute."""
    opened = []
    with httpx.Client(headers=KEY_A, timeout=30) as client:
        while True:
            r = client.post(keyed.url + "/open_session", json={"capacity_of_str_len": 16})
            if r.status_code != 200:
                break
            opened.append(r.json())
            assert len(opened) <= 1024
        assert r.status_code == 400 and "--max-sessions-per-caller" in r.text, r.text
        assert len(opened) == 256  # the default quota
        other = keyed.post("/open_session", {"capacity_of_str_len": 16}, headers=KEY_B)
        assert other.status_code == 200, other.text  # room left for the others
        for sid in opened:
            assert (
                client.post(keyed.url + "/close_session", json={"session_id": sid}).status_code
                == 200
            )
    keyed.post("/close_session", {"session_id": other.json()}, headers=KEY_B)
    assert keyed.info()["sessions"]["num_open_sessions"] == 0
