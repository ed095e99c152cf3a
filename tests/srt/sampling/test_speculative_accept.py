"""Acceptance of speculative drafts (srt/sampling/speculative.py) against plain decoding.

Greedy: accepting drafts gives exactly the tokens of argmax decoding. Sampled: a chi-square
test on a six-token vocabulary checks each emitted token keeps the target distribution, for a
one-hot (n-gram) draft and a random-q draft; the same test rejects two wrong rules (accepting
every draft token, and drawing from p instead of the residual after a rejection), so it can
fail.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.sampler import SamplingBatchInfo, filtered_probs
from radixlm.srt.sampling.speculative import (
    accept_draft,
    accept_greedy,
    accept_greedy_batch,
    accept_sampled,
    target_probs,
)

VOCAB = 6
TRIALS = 20_000
# chi-square with 5 degrees of freedom: P(stat > 25) ~ 1.4e-4 for a correct rule
CHI2_LIMIT = 25.0


# --------------------------------------------------------------------------- greedy


def _toy_logits(prefix: list[int], vocab: int = 11) -> torch.Tensor:
    """A deterministic 'model': logits for the token after ``prefix`` (depends on its tail)."""
    seed = (prefix[-1] * 31 + (prefix[-2] if len(prefix) > 1 else 7) * 17 + len(prefix)) % 9973
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def _greedy_decode(prompt: list[int], num: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num):
        seq.append(int(_toy_logits(seq).argmax()))
    return seq[len(prompt) :]


def test_greedy_acceptance_equals_argmax_decoding() -> None:
    prompt, num = [3, 1, 4], 60
    reference = _greedy_decode(prompt, num)
    rng = torch.Generator().manual_seed(0)
    seq, num_forwards = list(prompt), 0
    while len(seq) - len(prompt) < num:
        done = len(seq) - len(prompt)
        k = int(torch.randint(0, 5, (1,), generator=rng))
        # drafts: the true continuation with random corruptions (some right, some wrong)
        draft = list(reference[done : done + k])
        for i in range(len(draft)):
            if torch.rand(1, generator=rng) < 0.3:
                draft[i] = int(torch.randint(0, 11, (1,), generator=rng))
        rows = torch.stack([_toy_logits(seq + draft[:i]) for i in range(len(draft) + 1)])
        seq += accept_greedy(rows, draft)
        num_forwards += 1
    assert seq[len(prompt) : len(prompt) + num] == reference
    assert num_forwards < num  # some drafts were accepted


def test_greedy_batch_splits_rows_per_request() -> None:
    logits = torch.zeros(7, 5)
    for row, best in enumerate([1, 2, 3, 0, 4, 4, 2]):
        logits[row, best] = 1.0
    # request 0: draft [1, 2] -> both accepted, bonus 3; request 1: [0, 3] -> 0 kept, 4 chosen;
    # request 2: empty draft -> its one row
    assert accept_greedy_batch(logits, [[1, 2], [0, 3], []]) == [[1, 2, 3], [0, 4], [2]]
    with pytest.raises(ValueError, match="logit rows"):
        accept_greedy_batch(logits, [[1]])


def test_accept_draft_dispatches_on_params() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])
    assert accept_draft(logits, [1], None, SamplingParams(temperature=0.0)) == [1, 2]
    gen = torch.Generator().manual_seed(0)
    out = accept_draft(logits, [1], None, SamplingParams(temperature=1.0), gen)
    assert 1 <= len(out) <= 2


# --------------------------------------------------------------------------- target_probs


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=0.9, min_p=0.2),
        SamplingParams(temperature=1.1, top_k=5, top_p=0.8, min_p=0.05),
    ],
)
def test_target_probs_match_the_sampler(params: SamplingParams) -> None:
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    info = SamplingBatchInfo.build(
        [params] * 4, [[]] * 4, [None] * 4, 40, "cpu", torch.Generator().manual_seed(0)
    )
    expected = filtered_probs(logits, info)
    expected = expected / expected.sum(dim=-1, keepdim=True)
    got = target_probs(logits, params)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(4))


def test_target_probs_refuse_greedy_params() -> None:
    with pytest.raises(ValueError, match="greedy"):
        target_probs(torch.zeros(1, 4), SamplingParams(temperature=0.0))


# --------------------------------------------------------------------------- sampled


def _chi2(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def _setup(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, VOCAB, generator=gen) * 1.2, dim=-1)
    q = torch.distributions.Dirichlet(torch.ones(VOCAB)).sample((2,))
    return p, q


def _run(
    rule, p: torch.Tensor, q: torch.Tensor | None, seed: int, device: str = "cpu"
) -> tuple[list, list, list]:
    """Emitted tokens at positions 0, 1, 2 over TRIALS drafts of two tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    p = p.to(device)
    q = None if q is None else q.to(device)
    firsts, seconds, thirds = [], [], []
    fixed = [int(p[0].argmax()), int(p[1].argmax())]
    for _ in range(TRIALS):
        if q is None:
            draft = fixed  # a deterministic draft (one-hot q): each row's most likely token
        else:
            draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = rule(p, draft, q, gen)
        firsts.append(out[0])
        if len(out) > 1:
            seconds.append(out[1])
        if len(out) > 2:
            thirds.append(out[2])
    return firsts, seconds, thirds


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("random_q", [False, True], ids=["one-hot-draft", "random-q-draft"])
def test_sampled_acceptance_keeps_the_target_distribution(random_q: bool, device: str) -> None:
    torch.manual_seed(0)
    p, q = _setup(seed=3)
    firsts, seconds, thirds = _run(accept_sampled, p, q if random_q else None, 11, device)
    # every emitted token follows its row of p (given the draft before it was accepted)
    assert _chi2(firsts, p[0]) < CHI2_LIMIT
    assert _chi2(seconds, p[1]) < CHI2_LIMIT
    assert _chi2(thirds, p[2]) < CHI2_LIMIT
    assert len(thirds) > TRIALS // 20  # the bonus row was reached often enough to judge


def _accept_all(p, draft, q, gen):
    return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


def _resample_from_p(p, draft, q, gen):
    """Wrong: after a rejection draws from p rather than from the residual max(p - q, 0)."""
    out = []
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else float(q[i, x])
        if float(torch.rand(1, generator=gen)) * qx < float(p[i, x]):
            out.append(x)
            continue
        return out + [int(torch.multinomial(p[i], 1, generator=gen))]
    return out + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


@pytest.mark.parametrize(
    "random_q",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # random q: seconds of sampling
    ids=["one-hot-draft", "random-q-draft"],
)
@pytest.mark.parametrize("wrong_rule", [_accept_all, _resample_from_p])
def test_the_chi_square_check_catches_wrong_rules(wrong_rule, random_q: bool) -> None:
    torch.manual_seed(0)
    p, q = _setup(seed=3)
    firsts, _, _ = _run(wrong_rule, p, q if random_q else None, seed=11)
    assert _chi2(firsts, p[0]) > 10 * CHI2_LIMIT


def test_sampled_acceptance_is_reproducible_and_checks_shapes() -> None:
    p, q = _setup(seed=5)
    runs = [
        [accept_sampled(p, [1, 3], q, g) for _ in range(50)]
        for g in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))
    ]
    assert runs[0] == runs[1]
    with pytest.raises(ValueError, match="probability rows"):
        accept_sampled(p, [1], None)
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampled(p, [1, 3], q[:1])


def test_a_token_the_target_forbids_is_never_accepted() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        out = accept_sampled(p, [0], None, gen)
        assert out[0] in (1, 2) and len(out) == 1
