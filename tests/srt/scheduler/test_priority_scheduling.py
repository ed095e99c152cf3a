"""Priority scheduling, preemption and the bounded queue in a real scheduler (a tiny random
Llama on the CPU): a high-priority request overtakes the queue and retracts a running
low-priority one that then finishes with the same greedy tokens as alone; a full queue refuses
with 503 (or pushes out a worse waiting request); the idle invariant holds afterwards."""

from __future__ import annotations

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler.queue_gate import PUSHED_OUT, QUEUE_FULL

pytestmark = pytest.mark.slow  # seconds of CPU per test (a tiny model, many steps)

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
def make(tiny_llama_dir):
    def build(**opts) -> Scheduler:
        opts.setdefault("max_total_tokens", 4096)
        return Scheduler(
            config_from_kwargs(model_path=str(tiny_llama_dir), log_level="warning", **opts)
        )

    return build


def submit(s: Scheduler, rid: str, n_out: int, priority=None, caller="", prompt_len=6) -> None:
    prompt = [100 + (hash(rid) + i) % 5000 for i in range(prompt_len)]
    msg = TokenizedGenerateReq(
        rid, prompt, {**GREEDY, "max_new_tokens": n_out}, priority=priority, caller=caller
    )
    s.handle(msg)


def drive(s: Scheduler, max_steps: int = 2000) -> tuple[list[str], dict[str, dict]]:
    """Steps to the end: rids in the order they finished, and per rid its ids and reason."""
    done: list[str] = []
    got: dict[str, dict] = {}
    for _ in range(max_steps):
        if not s.has_work():
            break
        out = s.step()
        for i, rid in enumerate(out.rids if out is not None else []):
            r = got.setdefault(rid, {"ids": [], "reason": None})
            r["ids"] += out.new_token_ids[i]
            if out.finish_reason[i]:
                r["reason"] = out.finish_reason[i]
                done.append(rid)
    assert not s.has_work()
    return done, got


def test_a_higher_priority_request_overtakes_the_queue_fcfs_within_a_priority(make) -> None:
    s = make(enable_priority_scheduling=True, max_running_requests=1)
    submit(s, "running", 8, priority=0)
    s.step()  # admitted
    for rid, prio in [("low-1", 1), ("mid-1", 2), ("low-2", 1), ("high", 3), ("mid-2", 2)]:
        submit(s, rid, 2, priority=prio)
    done, _ = drive(s)
    # threshold 10: nothing is preempted; the queue runs by priority, FCFS within one
    assert done == ["running", "high", "mid-1", "mid-2", "low-1", "low-2"]
    assert s.num_preemptions == 0 and s.check_idle()


def test_low_values_first_reverses_the_order(make) -> None:
    s = make(
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=True,
        max_running_requests=1,
    )
    submit(s, "running", 4, priority=0)
    s.step()
    for rid, prio in [("b", 5), ("a", 1), ("none", None)]:
        submit(s, rid, 2, priority=prio)
    done, _ = drive(s)
    assert done == ["running", "a", "b", "none"]  # no priority: last


def test_preemption_above_the_threshold_retracts_and_the_victim_keeps_its_output(make) -> None:
    alone = make()
    submit(alone, "victim", 24, priority=0)
    _, ref = drive(alone)

    s = make(enable_priority_scheduling=True, max_running_requests=1)
    submit(s, "victim", 24, priority=0)
    for _ in range(5):
        s.step()
    submit(s, "below", 3, priority=10)  # difference 10: not above the threshold
    s.step()
    s.step()
    assert s.num_preemptions == 0 and [r.rid for r in s.running] == ["victim"]
    submit(s, "urgent", 3, priority=11)
    done, got = drive(s)
    assert done == ["urgent", "below", "victim"]  # the retracted one waits at priority 0
    assert s.num_preemptions == 1
    assert got["victim"]["ids"] == ref["victim"]["ids"]  # recomputed, same greedy tokens
    assert got["victim"]["reason"]["type"] == "length"
    assert s.check_idle()


def test_priority_is_ignored_when_off_or_refused_with_503_when_asked(make) -> None:
    s = make(max_running_requests=1)
    submit(s, "first", 4, priority=0)
    s.step()
    submit(s, "a", 2, priority=1)
    submit(s, "b", 2, priority=9)
    done, _ = drive(s)
    assert done == ["first", "a", "b"]  # FCFS: the priorities do nothing
    strict = make(abort_on_priority_when_disabled=True)
    submit(strict, "p", 2, priority=1)
    submit(strict, "plain", 2)
    _, got = drive(strict)
    assert got["p"]["reason"]["status_code"] == 503
    assert "priority is disabled" in got["p"]["reason"]["message"]
    assert got["plain"]["reason"]["type"] == "length" and strict.check_idle()


def test_a_full_queue_refuses_with_503_and_leaks_nothing(make) -> None:
    s = make(max_running_requests=1, max_queued_requests=2)
    submit(s, "run", 6)
    s.step()
    for rid in ("q1", "q2", "q3", "q4"):
        submit(s, rid, 2)
    done, got = drive(s)
    for rid in ("q3", "q4"):
        assert got[rid]["reason"] == {"type": "abort", "message": QUEUE_FULL, "status_code": 503}
        assert got[rid]["ids"] == []
    assert done[:2] == ["q3", "q4"]  # refused at once, reported by the next step
    assert [r for r in done if r not in ("q3", "q4")] == ["run", "q1", "q2"]
    assert s.gate.num_refused == 2 and s.check_idle() and not s.live
    assert s.server_info()["num_refused"] == 2


def test_with_priorities_a_full_queue_pushes_out_the_worst_waiting_request(make) -> None:
    s = make(enable_priority_scheduling=True, max_running_requests=1, max_queued_requests=2)
    submit(s, "run", 6, priority=100)  # not preemptible by anything below
    s.step()
    submit(s, "w5", 2, priority=5)
    submit(s, "w1", 2, priority=1)
    submit(s, "w3", 2, priority=3)  # pushes out w1
    submit(s, "w0", 2, priority=0)  # worse than everything queued: refused
    done, got = drive(s)
    assert got["w1"]["reason"]["message"] == PUSHED_OUT
    assert got["w0"]["reason"]["message"] == QUEUE_FULL
    assert [r for r in done if r not in ("w1", "w0")] == ["run", "w5", "w3"]
    assert s.check_idle()


def test_fair_scheduling_takes_callers_round_robin(make) -> None:
    s = make(enable_fair_scheduling=True, max_running_requests=1)
    submit(s, "first", 4, caller="burst")
    s.step()
    for i in range(4):
        submit(s, f"burst-{i}", 1, caller="burst")
    submit(s, "other-0", 1, caller="other")
    submit(s, "other-1", 1, caller="other")
    done, _ = drive(s)
    # "burst" was served last (by "first"): "other" goes first, then they alternate
    assert done == ["first", "other-0", "burst-0", "other-1", "burst-1", "burst-2", "burst-3"]
    plain = make(max_running_requests=1)  # without it: arrival order
    submit(plain, "first", 4, caller="burst")
    plain.step()
    for rid, caller in [("burst-0", "burst"), ("burst-1", "burst"), ("other-0", "other")]:
        submit(plain, rid, 1, caller=caller)
    assert drive(plain)[0] == ["first", "burst-0", "burst-1", "other-0"]


def test_preemption_when_the_kv_pool_has_no_room(make) -> None:
    alone = make(max_total_tokens=160)
    submit(alone, "victim", 40, priority=0, prompt_len=60)
    _, ref = drive(alone)
    s = make(enable_priority_scheduling=True, max_total_tokens=160)
    submit(s, "victim", 40, priority=0, prompt_len=60)
    for _ in range(3):
        s.step()
    submit(s, "urgent", 20, priority=50, prompt_len=70)  # needs more than is left
    done, got = drive(s)
    assert done == ["urgent", "victim"] and s.num_preemptions == 1
    assert got["victim"]["ids"] == ref["victim"]["ids"]
    assert s.check_idle()


def record_prefills(s: Scheduler) -> list[list[tuple[str, int, int]]]:
    """Each step's prompt pieces (rid, start, tokens), decode rows of a mixed step left out."""
    steps: list[list[tuple[str, int, int]]] = []
    seen = s.timeline.batch

    def batch(sched, b) -> None:
        if b is not None:
            running = {id(r) for r in sched.running}
            pieces = zip(b.reqs, b.starts, b.extend_lens, strict=True)
            prompt = [(r.rid, st, n) for r, st, n in pieces if id(r) not in running]
            if prompt:
                steps.append(prompt)
        seen(sched, b)

    s.timeline.batch = batch
    return steps


@pytest.mark.parametrize("priority_on", [True, False])
def test_a_high_priority_prompt_is_prefilled_without_lower_ones(make, priority_on) -> None:
    """The step that prefills a high-priority prompt carries no lower-priority prompt (the
    step would otherwise be as long as the chunk); without priority scheduling the prompts
    share steps as before. The outputs are the same either way."""
    s = make(enable_priority_scheduling=priority_on, chunked_prefill_size=64)
    steps = record_prefills(s)
    for i in range(4):
        submit(s, f"low-{i}", 3, priority=0, prompt_len=24)
    submit(s, "high", 3, priority=9, prompt_len=8)
    _, got = drive(s)
    if priority_on:
        assert steps[0] == [("high", 0, 8)]
        assert [rid for rid, _, _ in steps[1]] == ["low-0", "low-1", "low-2"]  # 64 tokens
    else:
        assert [rid for rid, _, _ in steps[0]] == ["low-0", "low-1", "low-2"]
    assert sum(n for step in steps for _, _, n in step) == 4 * 24 + 8  # nothing recomputed
    assert all(g["reason"]["type"] == "length" and len(g["ids"]) == 3 for g in got.values())
    assert s.check_idle()


def test_a_prompt_between_chunks_waits_for_a_higher_priority_one(make) -> None:
    """A low-priority prompt half prefilled waits again when a high-priority request arrives:
    the high-priority prompt's step is its own, and the low one resumes from the prefix
    cache where it stopped, finishing with the tokens it gets alone."""
    alone = make()
    submit(alone, "long", 6, priority=0, prompt_len=100)
    _, ref = drive(alone)

    s = make(enable_priority_scheduling=True, chunked_prefill_size=32)
    steps = record_prefills(s)
    submit(s, "long", 6, priority=0, prompt_len=100)
    s.step()
    assert steps == [[("long", 0, 32)]] and s.chunked is not None
    submit(s, "urgent", 4, priority=5, prompt_len=10)
    submit(s, "same", 2, priority=0, prompt_len=10)  # an equal rank parks nothing
    done, got = drive(s)
    assert steps[1] == [("urgent", 0, 10)]
    # resumed where it stopped (found in the cache), beside urgent's decode row: 31 tokens
    assert steps[2] == [("long", 32, 31)]
    assert s.num_parked_chunks == 1 and s.server_info()["num_parked_chunks"] == 1
    assert done[0] == "urgent"
    assert got["long"]["ids"] == ref["long"]["ids"]
    assert s.check_idle()


def test_the_engine_takes_sglangs_priority_keyword(tiny_llama_dir) -> None:
    from radixlm.srt import Engine

    with Engine(
        model_path=str(tiny_llama_dir),
        enable_priority_scheduling=True,
        max_total_tokens=2048,
        log_level="warning",
    ) as engine:
        out = engine.generate("Hi", {"max_new_tokens": 2, "ignore_eos": True}, priority=5)
        assert out["meta_info"]["completion_tokens"] == 2
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.generate("Hi", {"max_new_tokens": 2}, priority="high")
