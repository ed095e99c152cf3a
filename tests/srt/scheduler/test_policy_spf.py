"""``--schedule-policy spf`` (policy.py): shortest prompt first, a request overdue (waited more
than ``SPF_MAX_WAIT_S``) before every younger one; checked against a sort written apart from
the rule on random queues, then in a scheduler on a virtual clock (a tiny random Llama)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st
from quick import examples

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import TokenizedGenerateReq
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler import policy as policy_module
from radixlm.srt.scheduler import scheduler as scheduler_module
from radixlm.srt.scheduler.policy import SPF_MAX_WAIT_S, make_policy
from radixlm.srt.scheduler.req import Req


def _fake_time(monkeypatch, now: list[float]) -> None:
    clock = SimpleNamespace(monotonic=lambda: now[0], perf_counter=lambda: now[0])
    monkeypatch.setattr(policy_module, "time", clock)
    monkeypatch.setattr(scheduler_module, "time", clock)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 40)), max_size=12), st.floats(0, 6))
def test_spf_order_matches_a_brute_force_sort(specs, now) -> None:
    reqs = []
    for i, (arrived, n) in enumerate(specs):
        r = Req(rid=f"r{i}", prompt_ids=[1] * n, params=SamplingParams())
        r.arrival_time = arrived
        reqs.append(r)
    policy_module.time = SimpleNamespace(monotonic=lambda: now)
    try:
        got = make_policy("spf").order(reqs, cache=None)
    finally:
        policy_module.time = __import__("time")

    def rank(i: int) -> tuple:
        overdue = now - reqs[i].arrival_time > SPF_MAX_WAIT_S
        return (0, 0, i) if overdue else (1, len(reqs[i].prompt_ids), i)

    assert [r.rid for r in got] == [reqs[i].rid for i in sorted(range(len(reqs)), key=rank)]


def test_a_short_prompt_overtakes_until_the_long_one_is_overdue(
    tiny_llama_dir, tmp_path, monkeypatch
) -> None:
    now = [0.0]
    _fake_time(monkeypatch, now)
    s = Scheduler(
        config_from_kwargs(
            model_path=str(tiny_llama_dir),
            log_level="warning",
            grammar_cache_dir=str(tmp_path),
            chunked_prefill_size=32,
            max_running_requests=1,  # one at a time: the order is the admission order
            schedule_policy="spf",
        )
    )
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 2}
    order: list[str] = []

    def submit(rid: str, n: int, at: float) -> None:
        now[0] = at
        s.handle(TokenizedGenerateReq(rid, list(range(100, 100 + n)), greedy))

    def admit_next() -> str:
        while True:
            s.step()
            fresh = [r.rid for r in s.running if r.rid not in order]
            if fresh:
                order.extend(fresh)
                return fresh[0]

    submit("first", 5, 0.0)
    submit("long", 60, 0.0)
    submit("short", 10, 1.0)
    assert admit_next() == "first" and admit_next() == "short"  # arrived later, shorter
    submit("late", 3, SPF_MAX_WAIT_S + 1)
    assert admit_next() == "long"  # overdue: before the shorter "late"
    assert admit_next() == "late"
    while s.has_work():
        s.step()
    assert s.check_idle()
