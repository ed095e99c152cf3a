"""Speculative decoding keeps greedy outputs token-identical to plain decoding, whatever the
drafts: a drafter that is always wrong, one that is right up to a spoiled token at every
position, the n-gram drafter; one request or several arriving at different steps; pages of 1
and 16 tokens; chunked prefill. The scheduler is stepped by hand on tiny random Llamas (one
whose greedy output varies with the context, and the stock one that repeats itself, where
n-gram drafts are accepted); after each run no KV, request row, plan or drafter state is left.
"""

from __future__ import annotations

import pytest
from spec_harness import (
    FixedDrafter,
    OracleDrafter,
    check_idle,
    drive,
    make_scheduler,
    msg,
    prompts,
    repetitive_prompts,
)

LENGTHS = (24, 1, 2, 17, 9, 30)  # max_new_tokens: 1 and 2 leave no room or one token for drafts


@pytest.fixture(scope="module")
def varied_llama_dir(tiny_model_writer, tmp_path_factory, default_model_dir):
    """A tiny random Llama initialised wide enough that its greedy tokens depend on the
    context (the stock one repeats a token), so a wrong KV entry changes the output."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    path = tmp_path_factory.mktemp("varied-llama")
    return tiny_model_writer(path, tok, initializer_range=0.2)


def _workload(seed: int = 3):
    """Six requests: three at once, the others while the first ones decode."""
    ps = prompts(seed, len(LENGTHS), length=21)
    msgs = [
        msg(f"r{i}", p, max_new_tokens=n) for i, (p, n) in enumerate(zip(ps, LENGTHS, strict=True))
    ]
    return msgs[:3], {4: msgs[3:5], 9: msgs[5:]}


def _run(model_dir, drafter=None, algorithm="ngram", **options):
    first, later = _workload()
    s = make_scheduler(model_dir, drafter, algorithm, **options)
    got = drive(s, first, later)
    check_idle(s)
    return s, {rid: r.ids for rid, r in got.items()}


@pytest.fixture(scope="module")
def reference(varied_llama_dir):
    s, out = _run(varied_llama_dir, algorithm="none")
    assert not s.spec.enabled
    assert len({tuple(v) for v in out.values()}) == len(LENGTHS)
    assert all(len(set(v)) > len(v) // 2 for v in out.values() if len(v) > 8)  # varied
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_wrong_drafter_leaves_greedy_outputs_unchanged(varied_llama_dir, reference, page_size):
    drafter = FixedDrafter([11, 12, 13, 14, 15, 16])
    s, out = _run(varied_llama_dir, drafter, page_size=page_size)
    assert out == reference
    info = s.server_info()["speculative"]
    assert info["num_proposed_tokens"] > 50 and info["num_accepted_tokens"] == 0
    assert info["mean_accept_length"] == 1.0
    # drafts need room for one more token: max_new_tokens 1 and 2 never speculate
    assert sorted(drafter.released) == sorted(r for r in reference if len(reference[r]) > 2)


@pytest.mark.parametrize("options", [{}, {"page_size": 16}, {"chunked_prefill_size": 8}])
def test_partly_right_drafts_leave_greedy_outputs_unchanged(varied_llama_dir, reference, options):
    """Accepted runs of every length, so the KV of accepted draft tokens is used by later
    steps and rejected ones are freed at every offset (page boundaries included)."""
    ref_by_prompt = {}
    first, later = _workload()
    for m in first + [m for ms in later.values() for m in ms]:
        ref_by_prompt[tuple(m.input_ids)] = reference[m.rid]
    drafter = OracleDrafter(ref_by_prompt)
    s, out = _run(varied_llama_dir, drafter, **options)
    assert out == reference
    info = s.server_info()["speculative"]
    assert 0.3 < info["acceptance_rate"] < 1.0, info
    assert info["mean_accept_length"] > 1.8, info
    plain, _ = _run(varied_llama_dir, algorithm="none", **options)
    assert s.num_forward_steps < plain.num_forward_steps * 0.7


@pytest.mark.parametrize("batched_fails", [False, True])
def test_greedy_drafts_are_verified_together(
    varied_llama_dir, reference, monkeypatch, batched_fails
):
    """All greedy drafts of a step are accepted by one ``accept_greedy_batch`` call (one
    argmax, one read-back); if that call fails, each request is verified on its own and the
    outputs are the same."""
    from radixlm.srt.scheduler import speculative_step

    ref_by_prompt = {}
    first, later = _workload()
    for m in first + [m for ms in later.values() for m in ms]:
        ref_by_prompt[tuple(m.input_ids)] = reference[m.rid]
    batch_sizes, single = [], []
    real_batch, real_single = speculative_step.accept_greedy_batch, speculative_step.accept_draft

    def batch_spy(logits, drafts):
        batch_sizes.append(len(drafts))
        if batched_fails:
            raise RuntimeError("injected")
        return real_batch(logits, drafts)

    def single_spy(*args, **kwargs):
        single.append(1)
        return real_single(*args, **kwargs)

    monkeypatch.setattr(speculative_step, "accept_greedy_batch", batch_spy)
    monkeypatch.setattr(speculative_step, "accept_draft", single_spy)
    s, out = _run(varied_llama_dir, OracleDrafter(ref_by_prompt))
    assert out == reference
    verified = s.server_info()["speculative"]["num_verify_steps"]
    assert sum(batch_sizes) == verified and max(batch_sizes) >= 3  # several requests at once
    assert len(single) == (verified if batched_fails else 0)


def test_batch_of_one_with_whole_drafts_accepted(varied_llama_dir, reference):
    """One request whose drafts are always right: k + 1 tokens per step."""
    m = _workload()[0][0]
    drafter = OracleDrafter({tuple(m.input_ids): reference[m.rid]}, spoil=False)
    s = make_scheduler(varied_llama_dir, drafter, speculative_num_draft_tokens=5)
    got = drive(s, [m])
    check_idle(s)
    assert got[m.rid].ids == reference[m.rid]
    assert s.num_forward_steps == 1 + 4  # the prefill samples 1 token, then 6 + 6 + 6 + 5
    info = s.server_info()["speculative"]
    assert info["acceptance_rate"] == 1.0 and info["num_verify_steps"] == 4, info


@pytest.mark.parametrize("page_size", [pytest.param(1, marks=pytest.mark.slow), 16])
def test_ngram_drafts_on_repetitive_text_keep_greedy_outputs(tiny_llama_dir, page_size):
    ps = repetitive_prompts(5, 4)
    msgs = [msg(f"n{i}", p, max_new_tokens=40) for i, p in enumerate(ps)]

    def run(algorithm, batch):
        s = make_scheduler(tiny_llama_dir, algorithm=algorithm, page_size=page_size)
        got = {}
        for group in [msgs[:1], msgs[1:]] if batch else [[m] for m in msgs]:
            got.update(drive(s, group))
        check_idle(s)
        return s, {rid: r.ids for rid, r in got.items()}

    _, want = run("none", batch=True)
    s, got = run("ngram", batch=True)
    assert got == want
    info = s.server_info()["speculative"]
    assert info["num_accepted_tokens"] > 20 and info["mean_accept_length"] > 1.5, info
    _, one_by_one = run("ngram", batch=False)
    assert one_by_one == want


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_draft_model_keeps_greedy_outputs(varied_llama_dir, tiny_llama_dir, reference, draft):
    """A draft model: the target itself (every draft accepted) or another random model (none
    accepted, the adaptive length shortens its drafts); the draft's own KV pool is empty after."""
    path = varied_llama_dir if draft == "itself" else tiny_llama_dir
    s, out = _run(varied_llama_dir, algorithm="draft", speculative_draft_model_path=str(path))
    assert out == reference
    info = s.server_info()["speculative"]
    assert info["drafter"]["draft_kv_tokens"] == 0
    if draft == "itself":
        assert info["acceptance_rate"] == 1.0 and info["mean_accept_length"] > 4, info
    else:
        assert info["num_proposed_tokens"] > 0 and info["num_accepted_tokens"] == 0, info


@pytest.mark.slow
def test_draft_model_sampled_acceptance(varied_llama_dir):
    """Sampled requests drafted by the target itself: the draft distribution equals the
    target's, so nearly every draft token is accepted even at temperature 1 (a wrong row or
    distribution alignment would reject most); seeded outputs are reproducible."""
    ms = [
        msg(f"t{i}", p, temperature=1.0, top_k=50, seed=i, max_new_tokens=16)
        for i, p in enumerate(prompts(21, 2))
    ]

    def run():
        s = make_scheduler(
            varied_llama_dir,
            algorithm="draft",
            speculative_draft_model_path=str(varied_llama_dir),
        )
        got = drive(s, ms)
        check_idle(s)
        return {k: v.ids for k, v in got.items()}, s.server_info()["speculative"]

    first, info = run()
    again, _ = run()
    assert first == again
    assert info["acceptance_rate"] > 0.9 and info["num_proposed_tokens"] > 10, info
