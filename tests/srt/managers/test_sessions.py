"""SessionManager (srt/managers/sessions.py): histories, branching, replace, offset, limits,
expiry, and a randomized run against a reference that stores every turn's whole sequence."""

from __future__ import annotations

import random

import pytest

from radixlm.srt.managers.request_group import GenerateError
from radixlm.srt.managers.sessions import SessionManager, SessionParams
from radixlm.srt.sampling.params import UP_TO_CONTEXT


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(**limits) -> tuple[SessionManager, list[str]]:
    aborted: list[str] = []
    return SessionManager(abort=aborted.append, **limits), aborted


def turn(m: SessionManager, sid: str, name: str, new: list[int], out: list[int] | None, **p):
    """Plans, commits and (with ``out``) finishes turn ``name``; returns the input it got."""
    plan = m.plan(SessionParams(sid, **p), new, max_new_tokens=len(out or []) or 4)
    (t,) = m.commit([plan], [name])
    if out is not None:
        m.finish(sid, t, out)
    m.check_integrity()
    return plan.input_ids


def error(fn, *args, **kw) -> GenerateError:
    with pytest.raises(GenerateError) as e:
        fn(*args, **kw)
    assert e.value.status_code == 400
    return e.value


def test_turns_continue_branch_offset_and_drop_output() -> None:
    m, _ = make()
    sid = m.open(1000)
    assert turn(m, sid, "a", [1, 2, 3], [4, 5]) == [1, 2, 3]
    assert turn(m, sid, "b", [6], [7, 8], rid="a") == [1, 2, 3, 4, 5, 6]
    assert turn(m, sid, "c", [9], [10], rid="b") == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert turn(m, sid, "d", [11], [12], rid="a") == [1, 2, 3, 4, 5, 11]  # a branch
    assert turn(m, sid, "e", [13], [], rid="c", offset=4) == [1, 2, 3, 4, 13]
    assert turn(m, sid, "f", [14], [], rid="c", offset=-2) == [1, 2, 3, 4, 5, 6, 7, 8, 14]
    assert turn(m, sid, "g", [15], [], rid="b", drop_previous_output=True) == [1, 2, 3, 4, 5, 6, 15]
    assert turn(m, sid, "h", [16], [], rid="c", offset=9) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 16]
    assert turn(m, sid, "i", [17], []) == [17]  # no rid: a new branch without history
    assert sorted(m.sessions[sid].turns) == list("abcdefghi")


def test_replace_drops_the_branches_below_and_aborts_running_ones() -> None:
    m, aborted = make()
    sid = m.open(1000)
    turn(m, sid, "a", [1], [2])
    turn(m, sid, "b", [3], [4], rid="a")
    turn(m, sid, "c", [5], [6], rid="b")
    turn(m, sid, "d", [7], None, rid="a")  # still running
    assert turn(m, sid, "e", [8], [9], rid="a", replace=True) == [1, 2, 8]
    assert sorted(m.sessions[sid].turns) == ["a", "e"] and aborted == ["d"]
    assert turn(m, sid, "b", [10], [], rid="e") == [1, 2, 8, 9, 10]  # a dropped rid is free again
    turn(m, sid, "x", [11], None)
    assert turn(m, sid, "y", [12], [], replace=True) == [12]  # no rid: every turn goes
    assert sorted(m.sessions[sid].turns) == ["y"] and aborted == ["d", "x"]


def test_refusals_name_the_problem() -> None:
    m, _ = make()
    sid = m.open(20)
    turn(m, sid, "a", [1, 2], [3])
    turn(m, sid, "run", [4], None)
    assert "does not exist" in error(m.plan, SessionParams("nope"), [1], 1).message
    assert error(m.plan, SessionParams(sid, rid="zz"), [1], 1).param == "session_params.rid"
    assert "still running" in error(m.plan, SessionParams(sid, rid="run"), [1], 1).message
    assert error(m.plan, SessionParams(sid, rid="a", offset=4), [1], 1).param.endswith("offset")
    assert error(m.plan, SessionParams(sid, rid="a", offset=-4), [1], 1).param.endswith("offset")
    assert "capacity_of_str_len" in error(m.plan, SessionParams(sid, rid="a"), [1] * 10, 8).message
    plan = m.plan(SessionParams(sid, rid="a"), [5], 1)
    assert error(m.commit, [plan], ["a"]).param == "rid"  # rids are unique in a session
    replace = m.plan(SessionParams(sid, rid="a", replace=True), [5], 1)
    assert "single request" in error(m.commit, [replace, plan], ["p", "q"]).message
    assert error(m.open, 0).param == "capacity_of_str_len"
    assert error(m.open, True).param == "capacity_of_str_len"
    assert error(m.open, 5, "x" * 300).param == "session_id"
    assert error(m.open, 5, sid).param == "session_id"  # already open
    assert error(m.open, 5, None, -1.0).param == "timeout"
    assert error(m.close, "nope").param == "session_id"
    m.check_integrity()


def test_a_plan_whose_parent_was_dropped_meanwhile_is_refused() -> None:
    m, _ = make()
    sid = m.open(100)
    turn(m, sid, "a", [1], [2])
    turn(m, sid, "b", [3], [4], rid="a")
    stale = m.plan(SessionParams(sid, rid="b"), [5], 1)
    turn(m, sid, "c", [6], [7], rid="a", replace=True)  # drops b
    assert "dropped while" in error(m.commit, [stale], ["d"]).message
    m.close(sid)
    assert "does not exist" in error(m.commit, [stale], ["d"]).message


def test_limits_on_sessions_turns_and_stored_tokens() -> None:
    m, _ = make(max_sessions=2, max_turns=3, max_tokens=30)
    s1, s2 = m.open(100), m.open(100, "mine")
    assert s2 == "mine"
    assert "sessions are open" in error(m.open, 100).message
    turn(m, s1, "a", [1], [2])
    turn(m, s1, "b", [1], [2], rid="a")
    turn(m, s1, "c", [1], [2], rid="a")
    assert "requests, more than" in error(turn, m, s1, "d", [1], [2]).message
    turn(m, s1, "d", [1], [2], rid="a", replace=True)  # replace frees room
    stored = m.num_stored_tokens
    plan = m.plan(SessionParams(s2), [1] * 10, max_new_tokens=30 - stored - 9)
    assert "would store" in error(m.commit, [plan], ["x"]).message
    m.close(s1)
    assert m.num_stored_tokens == 0 and len(m.sessions) == 1
    m.open(100)  # a closed session frees its place
    m.check_integrity()


def test_running_turns_reserve_max_new_tokens_until_they_finish() -> None:
    m, _ = make()
    sid = m.open(100)
    (t,) = m.commit([m.plan(SessionParams(sid), [1, 2, 3], max_new_tokens=10)], ["a"])
    assert m.num_stored_tokens == 13
    m.finish(sid, t, [4, 5])
    assert m.num_stored_tokens == 5
    (t2,) = m.commit([m.plan(SessionParams(sid, rid="a"), [6], max_new_tokens=10)], ["b"])
    m.discard(sid, t2)  # did not finish normally: it leaves the session
    assert sorted(m.sessions[sid].turns) == ["a"] and m.num_stored_tokens == 5
    m.finish(sid, t2, [9])  # too late: ignored
    assert sorted(m.sessions[sid].turns) == ["a"]
    m.check_integrity()


def test_idle_sessions_expire_after_their_timeout_but_not_while_a_turn_runs() -> None:
    clock = Clock()
    aborted: list[str] = []
    m = SessionManager(abort=aborted.append, clock=clock)
    quick, forever = m.open(100, timeout_s=5.0), m.open(100)
    (t,) = m.commit([m.plan(SessionParams(quick), [1], 1)], ["a"])
    clock.now = 10.0
    m.sweep()
    assert quick in m.sessions  # a turn is running
    m.finish(quick, t, [2])
    clock.now = 14.0
    m.sweep()
    assert quick in m.sessions  # idle for 4 s only
    clock.now = 16.0
    m.sweep()
    assert quick not in m.sessions and forever in m.sessions and not aborted
    assert m.num_stored_tokens == 0


def test_at_a_limit_sessions_idle_long_enough_make_room_least_recently_used_first() -> None:
    clock = Clock()
    m = SessionManager(max_sessions=3, max_tokens=40, clock=clock, min_idle_evict_s=60.0)
    old, mid, busy = m.open(100, "old"), m.open(100, "mid"), m.open(100, "busy")
    turn(m, old, "a", [1] * 5, [2] * 5)
    clock.now = 10.0
    turn(m, mid, "b", [1] * 5, [2] * 5)
    (running,) = m.commit([m.plan(SessionParams(busy), [1], max_new_tokens=9)], ["c"])
    clock.now = 30.0
    assert "none has been idle for 60 s" in error(m.open, 100).message  # nobody idle long enough
    clock.now = 65.0
    assert m.open(100, "new") == "new"  # "old" (idle 65 s) closed; "mid" (55 s) kept
    assert sorted(m.sessions) == ["busy", "mid", "new"] and m.num_evicted == 1
    assert "closed for room" in error(m.plan, SessionParams(old), [1], 4).message
    clock.now = 500.0  # everyone idle but "busy" (a turn running) and "new", which asks
    plan = m.plan(SessionParams("new"), [1] * 11, max_new_tokens=10)  # 10 + 10 + 21 > 40
    m.commit([plan], ["d"])
    assert sorted(m.sessions) == ["busy", "new"] and m.num_evicted == 2
    plan = m.plan(SessionParams("new"), [1] * 5, max_new_tokens=5)  # 10 + 21 + 10 > 40
    assert "would store" in error(m.commit, [plan], ["e"]).message  # running: never closed
    m.finish(busy, running, [3])
    m.check_integrity()


def test_max_new_tokens_null_is_what_the_capacity_leaves() -> None:
    m, _ = make()
    sid = m.open(20)
    plan = m.plan(SessionParams(sid), [1, 2, 3], max_new_tokens=UP_TO_CONTEXT)
    assert plan.max_new_tokens == 17 and plan.reserved == 20
    (t,) = m.commit([plan], ["a"])
    m.finish(sid, t, [4] * 5)
    plan = m.plan(SessionParams(sid, rid="a"), [6], max_new_tokens=UP_TO_CONTEXT)
    assert plan.max_new_tokens == 20 - 9
    assert (
        "capacity_of_str_len" in error(m.plan, SessionParams(sid), [1] * 20, UP_TO_CONTEXT).message
    )
    # a capacity past the context: what the context leaves (a huge capacity reserved it all)
    big = m.open(10**9)
    plan = m.plan(SessionParams(big), [1, 2], max_new_tokens=UP_TO_CONTEXT, context_length=64)
    assert plan.max_new_tokens == 62


def test_close_aborts_running_turns_and_late_finishes_are_ignored() -> None:
    m, aborted = make()
    sid = m.open(100)
    (t,) = m.commit([m.plan(SessionParams(sid), [1], 3)], ["a"])
    m.close(sid)
    assert aborted == ["a"] and not m.sessions and m.num_stored_tokens == 0
    m.finish(sid, t, [1, 2])
    m.discard(sid, t)
    m.check_integrity()


def test_random_operations_match_a_reference_of_whole_sequences() -> None:
    rng = random.Random(0)
    m, _ = make(max_turns=20)
    # session -> rid -> (whole input, output or None while running, parent rid)
    ref: dict[str, dict[str, tuple[list[int], list[int] | None, str | None]]] = {}
    for _ in range(40):
        ref[m.open(25)] = {}
    for step in range(3000):
        sid = rng.choice(sorted(ref))
        turns, rid = ref[sid], f"r{step}"
        finished = [r for r, t in turns.items() if t[1] is not None]
        parent = rng.choice(finished) if finished and rng.random() < 0.8 else None
        drop = rng.random() < 0.2
        history = [] if parent is None else list(turns[parent][0])
        if parent is not None and not drop:
            history += turns[parent][1]
        offset = rng.choice([None, 0, rng.randint(-len(history), len(history))])
        replace = rng.random() < 0.1
        new = [rng.randrange(100) for _ in range(rng.randint(0, 4))]
        params = SessionParams(sid, parent, offset, replace, drop)
        try:
            plan = m.plan(params, new, max_new_tokens=rng.randint(0, 5))
            (t,) = m.commit([plan], [rid])
        except GenerateError:
            continue
        kept = history[:offset] if offset else history
        assert plan.input_ids == kept + new
        if replace:
            for r in list(turns) if parent is None else descendants(turns, parent):
                del turns[r]
        turns[rid] = (kept + new, None, parent)
        fate = rng.random()
        if fate < 0.7:
            out = [rng.randrange(100) for _ in range(rng.randint(0, plan.max_new_tokens))]
            m.finish(sid, t, out)
            turns[rid] = (kept + new, out, parent)
        elif fate < 0.85:
            m.discard(sid, t)
            del turns[rid]
        assert sorted(m.sessions[sid].turns) == sorted(turns)
        if step % 100 == 0:
            m.check_integrity()
    for sid in sorted(ref):
        m.close(sid)
    assert m.num_stored_tokens == 0 and not m.sessions
    m.check_integrity()


def descendants(turns: dict, rid: str) -> list[str]:
    children = [r for r, t in turns.items() if t[2] == rid]
    return children + [d for c in children for d in descendants(turns, c)]


def test_every_session_that_ends_has_its_held_prefix_released() -> None:
    """Closed, expired or closed for room: the scheduler is told to let go of its KV hold."""
    clock = Clock()
    released: list[str] = []
    m = SessionManager(release=released.append, clock=clock, max_sessions=2)
    m.open(100, "closed")
    m.open(100, "expiring", timeout_s=5.0)
    m.close("closed")
    assert released == ["closed"]
    clock.now = 10.0
    m.sweep()
    assert released == ["closed", "expiring"]
    m.open(100, "idle")
    m.open(100, "busy")
    clock.now = 100.0
    m.open(100, "new")  # the idle one is closed for room
    assert released[-1] == "idle" and m.num_evicted == 1
