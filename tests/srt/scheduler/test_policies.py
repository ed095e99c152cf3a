"""SGLang's ``--schedule-policy`` values beyond fcfs/lpm/dfs-weight (policy.py): ``lof``,
``random``, ``hrrn``, ``shortest-prefill-first`` and ``routing-key``, each against an order
written apart from the rule on random queues; ``routing-key`` in a scheduler too."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quick import examples

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.messages import AbortReq, TokenizedGenerateReq
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.scheduler import Scheduler
from radixlm.srt.scheduler import policy as policy_module
from radixlm.srt.scheduler.policy import SPF_MAX_WAIT_S, make_policy
from radixlm.srt.scheduler.req import Req

SPEC = st.tuples(st.floats(0, 9), st.integers(1, 40), st.integers(0, 40), st.sampled_from("abc-"))


def _reqs(specs) -> list[Req]:
    """(arrived, prompt length, max_new_tokens / cached tokens, routing key or "-")."""
    reqs = []
    for i, (arrived, n, m, key) in enumerate(specs):
        r = Req(rid=f"r{i}", prompt_ids=[i] * n, params=SamplingParams(max_new_tokens=m + 1))
        r.arrival_time, r.routing_key = arrived, None if key == "-" else key
        reqs.append(r)
    return reqs


class _Cache:
    """``match_prefix`` answering each request's preset number of cached tokens."""

    def __init__(self, cached: dict[int, int]) -> None:
        self.cached = cached

    def match_prefix(self, ids, salt):
        matched = min(self.cached[ids[0]], len(ids)) if ids else 0
        return SimpleNamespace(matched_len=matched, last_node=None)


def _ordered(policy: str, reqs, cache=None, running=(), now: float = 10.0) -> list[str]:
    policy_module.time = SimpleNamespace(monotonic=lambda: now)
    try:
        return [r.rid for r in make_policy(policy, seed=3).order(reqs, cache, running)]
    finally:
        policy_module.time = __import__("time")


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(SPEC, max_size=12))
def test_each_policy_matches_an_order_written_apart(specs) -> None:
    reqs = _reqs(specs)
    ids = [r.rid for r in reqs]
    idx = range(len(reqs))

    want = sorted(idx, key=lambda i: (-reqs[i].params.max_new_tokens, i))
    assert _ordered("lof", reqs) == [ids[i] for i in want]

    cached = {i: specs[i][2] for i in idx}
    uncached = [
        max(len(reqs[i].prompt_ids) - min(cached[i], reqs[i].max_prefix_match()), 0) for i in idx
    ]
    now = 10.0
    overdue = [i for i in idx if now - reqs[i].arrival_time > SPF_MAX_WAIT_S]
    young = sorted((i for i in idx if i not in overdue), key=lambda i: (uncached[i], i))
    for name in ("shortest-prefill-first", "spf"):
        assert _ordered(name, reqs, _Cache(cached)) == [ids[i] for i in overdue + young]

    def ratio(i: int) -> float:
        return float("inf") if uncached[i] == 0 else (now - reqs[i].arrival_time) / uncached[i]

    want = sorted(idx, key=lambda i: (-ratio(i), i))
    assert _ordered("hrrn", reqs, _Cache(cached)) == [ids[i] for i in want]

    running = _reqs([(0.0, 1, 0, k) for k in "aab"])  # a: 2 running, b: 1
    counts = {"a": 2, "b": 1}
    want = sorted(idx, key=lambda i: (-counts.get(reqs[i].routing_key, 0), i))
    assert _ordered("routing-key", reqs, running=running) == [ids[i] for i in want]
    assert _ordered("routing-key", reqs) == ids  # nothing running: arrival order

    shuffled = _ordered("random", reqs)
    assert sorted(shuffled) == sorted(ids) and shuffled == _ordered("random", reqs)  # seeded


def test_random_differs_from_arrival_and_names_are_checked() -> None:
    reqs = _reqs([(0.0, 5, 1, "-")] * 20)
    assert _ordered("random", reqs) != [r.rid for r in reqs]
    with pytest.raises(ValueError, match="--enable-priority-scheduling"):
        make_policy("priority")
    with pytest.raises(ValueError, match="shortest-prefill-first"):
        make_policy("sjf")
    with pytest.raises(ValueError, match="schedule_policy must be one of"):
        config_from_kwargs(model_path="/tmp", schedule_policy="sjf")
    for name in ("lof", "random", "hrrn", "shortest-prefill-first", "spf", "routing-key"):
        assert config_from_kwargs(model_path="/tmp", schedule_policy=name).schedule_policy == name


def test_routing_key_admits_the_key_the_running_requests_share(tiny_llama_dir, tmp_path) -> None:
    s = Scheduler(
        config_from_kwargs(
            model_path=str(tiny_llama_dir),
            log_level="warning",
            grammar_cache_dir=str(tmp_path),
            max_running_requests=3,
            schedule_policy="routing-key",
        )
    )
    rng = random.Random(0)

    def send(rid: str, key: str | None, n: int = 8, max_new: int = 6) -> None:
        ids = [rng.randrange(3, 200) for _ in range(n)]
        params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new}
        s.handle(TokenizedGenerateReq(rid, ids, params, routing_key=key))

    send("a1", "a", max_new=40)
    send("a2", "a", max_new=40)
    while len(s.running) < 2:
        s.step()
    send("other", "b")  # arrived first
    send("none", None)
    send("a3", "a")  # shares the running requests' key
    s.step()
    assert {r.rid for r in s.running} == {"a1", "a2", "a3"}  # the one free seat
    s.handle(AbortReq(abort_all=True))
    while s.has_work():
        s.step()
    assert s.check_idle()


@pytest.mark.parametrize("n", [1, 4])
def test_num_continuous_decode_steps_holds_prompts_back(tiny_llama_dir, tmp_path, n) -> None:
    """SGLang's ``--num-continuous-decode-steps``: the running requests get ``n`` decode steps
    in a row before a waiting prompt is prefilled."""
    s = Scheduler(
        config_from_kwargs(
            model_path=str(tiny_llama_dir),
            log_level="warning",
            grammar_cache_dir=str(tmp_path),
            num_continuous_decode_steps=n,
            disable_overlap_schedule=True,
        )
    )
    greedy = {"temperature": 0, "ignore_eos": True}
    s.handle(TokenizedGenerateReq("first", list(range(3, 13)), {**greedy, "max_new_tokens": 30}))
    s.step()  # its prefill
    assert [r.rid for r in s.running] == ["first"]
    s.handle(TokenizedGenerateReq("next", list(range(20, 30)), {**greedy, "max_new_tokens": 2}))
    decodes = 0
    while "next" not in {r.rid for r in s.running} and not any(
        r.rid == "next" and r.is_finished for r in s.live
    ):
        s.step()
        decodes += 1
    assert decodes - 1 == n - 1  # n - 1 decode steps, then the step that prefills it
    with pytest.raises(ValueError, match="num_continuous_decode_steps"):
        config_from_kwargs(num_continuous_decode_steps=0)
    s.handle(AbortReq(abort_all=True))
    while s.has_work():
        s.step()
    assert s.check_idle()
