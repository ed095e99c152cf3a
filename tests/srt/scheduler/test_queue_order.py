"""Priority order, fair rounds, preemption choice and the queue bound, each checked against a
brute-force model on random queues (no model, no scheduler: plain ``Req`` objects)."""

from __future__ import annotations

import itertools
import sys

from hypothesis import given, settings
from hypothesis import strategies as st
from quick import examples

from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler.queue_gate import PUSHED_OUT, QUEUE_FULL, QueueGate
from radixlm.srt.scheduler.queue_order import PriorityRule, queue_victim
from radixlm.srt.scheduler.req import Req

PRIORITIES = st.one_of(st.none(), st.integers(-30, 30))


def _reqs(specs) -> list[Req]:
    """Requests in arrival order from (priority, caller, prompt length, admitted) tuples."""
    out = []
    for i, (prio, caller, n, admitted) in enumerate(specs):
        r = Req(rid=f"r{i}", prompt_ids=[1] * n, params=SamplingParams(), priority=prio)
        r.caller, r.arrival, r.admitted = caller, i, admitted
        out.append(r)
    return out


REQ_SPECS = st.lists(
    st.tuples(PRIORITIES, st.sampled_from("abc"), st.integers(1, 50), st.booleans()),
    max_size=12,
)


def _preference(prio, low_first: bool) -> float:
    """How much a priority is preferred (larger runs first), written apart from the rule."""
    if prio is None:
        return -float("inf")
    return -prio if low_first else prio


def brute_order(
    reqs: list[Req], low_first: bool, fair: bool, ranked: bool = True, last=None
) -> list[Req]:
    """Highest preference first (``ranked``); within one, arrival order, or (fair) rounds: each
    round takes every caller's earliest remaining request, the caller served longest ago
    (``last``: caller -> time served) or never first, then in arrival order."""
    last = last or {}

    def pref_of(r: Req) -> float:
        return _preference(r.priority, low_first) if ranked else 0

    out: list[Req] = []
    for pref in sorted({pref_of(r) for r in reqs}, reverse=True):
        left = [r for r in reqs if pref_of(r) == pref]
        if not fair:
            out += left
            continue
        while left:
            heads = {}
            for r in left:
                heads.setdefault(r.caller, r)
            round_ = sorted(heads.values(), key=lambda r: (last.get(r.caller, -1), r.arrival))
            out += round_
            left = [r for r in left if r not in round_]
    return out


@settings(max_examples=examples(100), deadline=None)
@given(REQ_SPECS, st.booleans(), st.booleans(), st.lists(st.sampled_from("abc"), max_size=4))
def test_order_is_priority_then_arrival_or_fair_rounds(specs, low_first, fair, served) -> None:
    reqs = _reqs(specs)
    rule = PriorityRule(enabled=True, low_values_first=low_first, fair=fair)
    last = {}
    for t, caller in enumerate(served):  # callers served earlier, in this order
        rule.note_served(_reqs([(0, caller, 1, False)])[0])
        last[caller] = t
    want = brute_order(reqs, low_first, fair, last=last if fair else None)
    assert [r.rid for r in rule.order(reqs)] == [r.rid for r in want]
    first = rule.first(reqs)
    assert first is (brute_order(reqs, low_first, False) or [None])[0]


@given(REQ_SPECS)
def test_without_priority_scheduling_the_policy_order_stands(specs) -> None:
    reqs = _reqs(specs)
    rule = PriorityRule(enabled=False)
    assert rule.order(reqs) == reqs
    assert not reqs or rule.victims(reqs[0], reqs) == []
    fair = PriorityRule(enabled=False, fair=True)  # fairness alone: rounds by caller
    assert fair.order(reqs) == brute_order(reqs, False, True, ranked=False)


RUNNING = st.lists(st.tuples(PRIORITIES, st.integers(1, 40)), min_size=0, max_size=7)


@settings(max_examples=examples(150), deadline=None)
@given(
    RUNNING,
    PRIORITIES,
    st.integers(0, 15),
    st.integers(1, 6),
    st.integers(0, 120),
    st.integers(1, 60),
    st.booleans(),
)
def test_preemption_matches_the_brute_force_choice(
    running_specs, incoming_prio, threshold, max_running, room, need, low_first
) -> None:
    running = _reqs([(p, "a", n, True) for p, n in running_specs])
    incoming = _reqs([(incoming_prio, "b", need, False)])[0]
    incoming.arrival = len(running)
    rule = PriorityRule(enabled=True, low_values_first=low_first, preemption_threshold=threshold)

    def fits(gone) -> bool:
        left = [r for r in running if r not in gone]
        return len(left) < max_running and need <= room + sum(r.fill_len for r in gone)

    got = rule.plan_preemption(incoming, running, fits)

    def outranked(r: Req) -> bool:  # the incoming request may retract r
        diff = _preference(incoming.priority, low_first) - _preference(r.priority, low_first)
        return diff > threshold

    # SGLang's order of victims: least preferred first, the newest first among equals; only
    # a run of outranked ones from the start of that order may go
    order = sorted(running, key=lambda r: (_preference(r.priority, low_first), -r.arrival))
    eligible = list(itertools.takewhile(outranked, order))
    if fits([]):
        assert got == []
    elif not any(fits(list(c)) for k in range(len(eligible) + 1) for c in [eligible[:k]]):
        assert got == []  # no allowed retraction makes room: none is made
    else:
        k = min(k for k in range(len(eligible) + 1) if fits(eligible[:k]))
        assert got == eligible[:k]  # the shortest run of the worst that makes room


@settings(max_examples=examples(100), deadline=None)
@given(REQ_SPECS, PRIORITIES, st.booleans())
def test_a_full_queue_pushes_out_only_a_strictly_worse_request_never_an_admitted_one(
    specs, prio, low_first
) -> None:
    waiting = _reqs(specs)
    incoming = _reqs([(prio, "z", 3, False)])[0]
    incoming.arrival = len(waiting)
    rule = PriorityRule(enabled=True, low_values_first=low_first)
    got = queue_victim(rule, incoming, waiting)
    fresh = [r for r in waiting if not r.admitted]
    key = lambda r: (_preference(r.priority, low_first), -r.arrival)  # noqa: E731
    worst = min(fresh, key=key, default=None)
    better = worst is not None and _preference(prio, low_first) > _preference(
        worst.priority, low_first
    )
    assert got is (worst if better else None)
    assert queue_victim(PriorityRule(enabled=False), incoming, waiting) is None


def test_queue_gate_refuses_past_the_cap_and_counts_compiling_grammars() -> None:
    rule = PriorityRule(enabled=True)
    gate = QueueGate(rule, max_queued_requests=2)
    waiting = _reqs([(0, "a", 5, False), (1, "a", 5, False)])
    low = _reqs([(0, "b", 5, False)])[0]
    assert gate.check(low, waiting) == (QUEUE_FULL, None)
    high = _reqs([(9, "b", 5, False)])[0]
    assert gate.check(high, waiting) == (None, waiting[0])  # the worst one goes
    assert gate.check(high, waiting[:1], num_compiling=1) == (None, waiting[0])
    assert QueueGate(PriorityRule(), max_queued_requests=2).check(high, waiting)[0] == QUEUE_FULL
    assert gate.check(low, waiting[:1]) == (None, None)
    assert PUSHED_OUT.startswith("The request is aborted")


def test_ttft_target_counts_the_prefill_queued_ahead_at_the_measured_rate() -> None:
    rule = PriorityRule(enabled=True)
    gate = QueueGate(rule, ttft_target_ms=1000)
    waiting = _reqs([(5, "a", 600, False), (0, "a", 900, False)])
    new = _reqs([(1, "b", 100, False)])[0]
    assert gate.check(new, waiting) == (None, None)  # no rate measured yet: no refusal
    gate.rate.observe(1000, 1.0)  # 1000 tokens/s
    # ahead of priority 1: the 600 tokens of priority 5 (not the 900 of priority 0)
    assert abs(gate.estimated_ttft_s(new, waiting) - 0.7) < 1e-9
    assert gate.check(new, waiting) == (None, None)
    assert gate.check(new, waiting, num_chunk_left=400)[0].startswith("The server cannot meet")
    gate.rate.observe(8, 1.0)  # too few tokens to say anything: ignored
    assert gate.prefill_tokens_per_s == 1000
    gate.rate.observe(2000, 1.0)
    assert 1000 < gate.prefill_tokens_per_s < 2000  # smoothed


def test_a_request_without_priority_ranks_last() -> None:
    rule = PriorityRule(enabled=True, low_values_first=True)
    none, big = _reqs([(None, "a", 1, False), (sys.maxsize - 1, "a", 1, False)])
    assert rule.order([none, big]) == [big, none]
