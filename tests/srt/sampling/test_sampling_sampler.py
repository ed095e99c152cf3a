from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from radixlm.srt.sampling import sampler as sampler_module
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.sampler import Sampler, SamplingBatchInfo, filtered_probs


def build(
    params: Sequence[SamplingParams],
    vocab_size: int,
    *,
    output_ids: Sequence[Sequence[int]] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    seed: int = 0,
    device: str = "cpu",
    **kwargs: object,
) -> SamplingBatchInfo:
    return SamplingBatchInfo.build(
        params,
        output_ids if output_ids is not None else [[] for _ in params],
        generators if generators is not None else [None] * len(params),
        vocab_size,
        device,
        torch.Generator(device).manual_seed(seed),
        **kwargs,
    )


def seeded(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Critical values of the chi-square distribution at p = 0.001.
CHI2_CRIT_001 = {2: 13.82, 4: 18.47, 5: 20.52}

# A crafted distribution: probs 0.5, 0.25, 0.15, 0.07, 0.03.
CRAFTED = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])


def test_greedy_is_argmax_with_fast_path() -> None:
    logits = torch.randn(8, 50, generator=seeded(1))
    info = build([SamplingParams(temperature=0.0)] * 8, 50)
    assert info.is_all_greedy and not info.has_logit_edits
    assert torch.equal(Sampler().sample(logits, info), logits.argmax(-1))


def test_top_k_1_equals_greedy_in_mixed_batch() -> None:
    logits = torch.randn(6, 40, generator=seeded(2))
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=0.0)] * 3
    info = build(params, 40)
    assert info.is_all_greedy
    for seed in range(5):
        info.default_generator.manual_seed(seed)
        assert torch.equal(Sampler().sample(logits, info), logits.argmax(-1))


def test_greedy_rows_next_to_sampled_rows() -> None:
    logits = torch.randn(4, 30, generator=seeded(3)) * 0.1  # nearly flat: sampling varies
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 2
    info = build(params, 30)
    draws = torch.stack([Sampler().sample(logits, info) for _ in range(50)])
    assert torch.equal(draws[:, 0], logits[0].argmax().expand(50))
    assert torch.equal(draws[:, 2], logits[2].argmax().expand(50))
    assert len(set(draws[:, 1].tolist())) > 5 and len(set(draws[:, 3].tolist())) > 5


@pytest.mark.parametrize(
    "kwargs,allowed",
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 4}, {0, 1, 2, 3}),
        ({"top_p": 0.7}, {0, 1}),
        ({"top_p": 0.8}, {0, 1, 2}),
        ({"top_p": 0.1}, {0}),
        ({"min_p": 0.25}, {0, 1, 2}),
        ({"min_p": 0.5}, {0, 1}),
        ({"top_k": 3, "top_p": 0.95}, {0, 1, 2}),
        ({"top_p": 0.95, "min_p": 0.1}, {0, 1, 2, 3}),
    ],
)
@pytest.mark.parametrize("candidates", [(256, 4096), (2,), (1, 3)])  # (2,): sort fallback too
def test_filters_keep_exactly_the_allowed_set(
    kwargs: dict, allowed: set[int], candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler_module, "CPU_CANDIDATES", candidates)
    n = 4000
    logits = CRAFTED.log().expand(n, 5).clone()
    # The constrained rows share the batch with unconstrained ones (per-row filtering).
    params = [SamplingParams(**kwargs), SamplingParams()] * (n // 2)
    out = Sampler().sample(logits, build(params, 5, seed=4))
    assert set(out[0::2].tolist()) == allowed
    assert set(out[1::2].tolist()) == {0, 1, 2, 3, 4}


def test_top_k_samples_renormalized_distribution() -> None:
    n = 20000
    logits = CRAFTED.log().expand(n, 5).clone()
    out = Sampler().sample(logits, build([SamplingParams(top_k=3)] * n, 5, seed=5))
    counts = torch.bincount(out, minlength=5).float()
    assert counts[3:].sum() == 0
    kept = CRAFTED[:3] / CRAFTED[:3].sum()
    assert chi_square(counts[:3], kept) < CHI2_CRIT_001[2]


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    n, vocab = 20000, 6
    base = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.2, 0.0])
    logits = base.expand(n, vocab).clone()
    out = Sampler().sample(logits, build([SamplingParams(temperature=temperature)] * n, vocab))
    counts = torch.bincount(out, minlength=vocab).float()
    expected = torch.softmax(base / temperature, dim=-1)
    assert chi_square(counts, expected) < CHI2_CRIT_001[5]
    # The test can fail: the same draws are far from the untempered distribution.
    if temperature != 1.0:
        assert chi_square(counts, torch.softmax(base, dim=-1)) > CHI2_CRIT_001[5]


def _run_steps(
    rows: list[tuple[SamplingParams, torch.Generator | None, torch.Tensor]],
    steps: int,
    device: str = "cpu",
) -> list[list[int]]:
    """Sample ``steps`` tokens for each row; row i sees logits ``rows[i][2][step]``."""
    params = [r[0] for r in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    for step in range(steps):
        logits = torch.stack([r[2][step] for r in rows]).to(device)
        info = build(
            params,
            logits.shape[1],
            output_ids=outputs,
            generators=[r[1] for r in rows],
            seed=100 + step,
            device=device,
        )
        for i, token in enumerate(Sampler().sample(logits, info).tolist()):
            outputs[i].append(token)
    return outputs


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_seeded_rows_ignore_batch_composition(device: str) -> None:
    vocab, steps = (500, 12) if device == "cpu" else (50000, 24)
    logit_seq = [torch.randn(steps, vocab, generator=seeded(10 + i)) for i in range(5)]
    a = SamplingParams(temperature=1.3, top_p=0.9, top_k=200, min_p=0.01, seed=7)
    b = SamplingParams(temperature=0.8, seed=8)
    other = SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.3)
    greedy = SamplingParams(temperature=0.0, logit_bias={3: 2.0})

    alone = _run_steps([(a, seeded(7, device), logit_seq[0])], steps, device)[0]
    assert len(set(alone)) > 3  # genuinely random
    batch1 = _run_steps(
        [
            (other, None, logit_seq[2]),
            (b, seeded(8, device), logit_seq[1]),
            (a, seeded(7, device), logit_seq[0]),
        ],
        steps,
        device,
    )
    batch2 = _run_steps(
        [
            (a, seeded(7, device), logit_seq[0]),
            (greedy, None, logit_seq[3]),
            (other, None, logit_seq[4]),
            (other, None, logit_seq[2]),
        ],
        steps,
        device,
    )
    assert batch1[2] == alone and batch2[0] == alone
    b_alone = _run_steps([(b, seeded(8, device), logit_seq[1])], steps, device)[0]
    assert batch1[1] == b_alone
    assert _run_steps([(a, seeded(9, device), logit_seq[0])], steps, device)[0] != alone


def test_unseeded_rows_use_default_generator() -> None:
    logits = torch.zeros(3, 1000)
    params = [SamplingParams()] * 3
    first = Sampler().sample(logits, build(params, 1000, seed=1))
    again = Sampler().sample(logits, build(params, 1000, seed=1))
    other = Sampler().sample(logits, build(params, 1000, seed=2))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_suppression_per_row() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    out = Sampler().sample(logits, build(params, 4), suppress_token_ids=[[1], []])
    assert out.tolist() == [2, 0]
    out = Sampler().sample(logits, build(params, 4), suppress_token_ids=[[1, 2], [0]])
    assert out.tolist()[0] == 3 and out.tolist()[1] != 0
    # Sampled rows never produce a suppressed token.
    n = 2000
    flat = torch.zeros(n, 4)
    out = Sampler().sample(flat, build([SamplingParams()] * n, 4), [[0, 2]] * n)
    assert set(out.tolist()) == {1, 3}


def test_min_new_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 0.0]] * 3)
    p = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[1])
    outputs = [[], [3], [3, 3]]
    info = build([p] * 3, 4, output_ids=outputs, eos_token_ids=[0])
    assert Sampler().sample(logits, info).tolist() == [2, 2, 0]
    # Without eos_token_ids nothing is suppressed.
    assert Sampler().sample(logits, build([p] * 3, 4, output_ids=outputs)).tolist() == [0] * 3


def test_logit_bias_per_row() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, logit_bias={"2": 2.5}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={0: -100.0}),
    ]
    info = build(params, 3)
    assert Sampler().sample(logits, info).tolist() == [2, 0, 1]
    processed = Sampler().process_logits(logits, info)
    assert processed.tolist() == [[2.0, 1.0, 2.5], [2.0, 1.0, 0.0], [-98.0, 1.0, 0.0]]
    # Sampled rows: a strong negative bias bans a token.
    n = 2000
    out = Sampler().sample(
        torch.zeros(n, 3), build([SamplingParams(logit_bias={1: -100.0})] * n, 3)
    )
    assert set(out.tolist()) == {0, 2}


def test_penalties_change_logits_as_specified() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [
        SamplingParams(
            temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0
        ),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[0, 0, 1], [0, 0, 1]]
    info = build(params, 4, output_ids=outputs, prompt_ids=[[3], [3]])
    processed = Sampler().process_logits(logits, info)
    # Row 0: repetition on seen {0, 1, 3} (prompt + output): 2 -> 1, -1 -> -2, 3 -> 1.5;
    # then counts [2, 1, 0, 0]: token 0: 1 - 2*0.5 - 0.25, token 1: -2 - 0.5 - 0.25.
    assert processed[0].tolist() == [-0.25, -2.75, 0.5, 1.5]
    assert processed[1].tolist() == logits[1].tolist()  # no penalties on row 1
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 2))  # input untouched
    assert Sampler().sample(logits, info).tolist() == [3, 3]
    # Without prompt ids only output tokens count for the repetition penalty.
    no_prompt = Sampler().process_logits(logits, build(params, 4, output_ids=outputs))
    assert no_prompt[0].tolist() == [-0.25, -2.75, 0.5, 3.0]


def test_penalty_flips_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    p = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert Sampler().sample(logits, build([p], 3, output_ids=[[]])).tolist() == [0]
    assert Sampler().sample(logits, build([p], 3, output_ids=[[0]])).tolist() == [1]


def test_batch_info_fast_path_flags() -> None:
    info = build([SamplingParams(top_p=0.9), SamplingParams(temperature=0.0, top_k=5)], 10)
    assert info.need_top_p and not info.need_top_k and not info.need_min_p
    assert info.top_ks.tolist() == [10, 5] and info.temperatures[1].item() == 1.0
    assert not info.is_all_greedy and info.sampled_rows == [0]
    plain = build([SamplingParams(temperature=0.5)], 10)
    assert plain.penalties is None and plain.logit_bias is None and not plain.has_logit_edits
    assert math.isclose(plain.temperatures.item(), 0.5)


CANDIDATES = [(256, 4096), (16,), (16, 128)]
FILTERS = [
    # about 300 of 600 tokens kept under top_p 0.9: beyond the candidates, the sort decides
    ({"top_p": 0.9}, (16, 128)),
    ({"top_p": 0.3, "temperature": 0.5}, (16,)),
    ({"top_k": 40, "top_p": 0.95}, (256, 4096)),
    ({"top_k": 300, "min_p": 0.2}, (16, 128)),
    ({"temperature": 1.3}, (16,)),  # no filter: inverse CDF over the whole vocabulary
]


def _filter_cases():
    """Every filter with every candidate ladder; each case samples 30,000 rows (seconds of CPU),
    so the inner loop runs each filter once over one ladder (every ladder at least once) and
    the full suite the rest."""
    for i, (kwargs, inner) in enumerate(FILTERS):
        for j, candidates in enumerate(CANDIDATES):
            marks = [] if candidates == inner else [pytest.mark.slow]
            yield pytest.param(kwargs, candidates, marks=marks, id=f"kwargs{i}-candidates{j}")


@pytest.mark.parametrize(("kwargs", "candidates"), list(_filter_cases()))
def test_cpu_path_samples_the_filtered_distribution(
    kwargs: dict, candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU path (candidates, sort fallback, inverse CDF) against the sort-based filtered
    distribution that GPU rows and speculative decoding use: same support, and frequencies
    within a chi-square bound (p = 0.001, normal approximation for many categories)."""
    monkeypatch.setattr(sampler_module, "CPU_CANDIDATES", candidates)
    n, vocab = 30000, 600
    row = torch.randn(vocab, generator=seeded(21)) * 1.5
    params = [SamplingParams(**kwargs)] * n
    info = build(params, vocab, seed=22)
    out = Sampler().sample(row.expand(n, vocab).clone(), info)
    target = filtered_probs(row.unsqueeze(0), build(params[:1], vocab))[0]
    target = target / target.sum()
    support = target > 0
    counts = torch.bincount(out, minlength=vocab).double()
    assert counts[~support].sum() == 0
    kept = int(support.sum())
    if kept == 1:
        return
    # pool the rare categories so every expected count is >= 5
    order = target.argsort(descending=True)
    expected = target[order].double() * n
    observed = counts[order]
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    o = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    e, o = e[e > 0], o[e > 0]
    df = len(e) - 1
    chi2 = float(((o - e) ** 2 / e).sum())
    assert chi2 < df + 3.09 * math.sqrt(2 * df) + 10, (chi2, df)


def test_two_level_inverse_cdf_equals_one_level() -> None:
    """Wide rows are drawn block first, then inside the block: the same index as one cumsum
    over the whole row (rows with zeros, a row with one non-zero entry, a ragged last block)."""
    gen = seeded(31)
    n, vocab = 64, 5000
    weights = torch.rand(n, vocab, generator=gen) ** 4
    weights[weights < 0.05] = 0.0
    weights[0] = 0.0
    weights[0, 4999] = 0.3  # all mass in the ragged last block
    weights[1, :4096] = 0.0
    uniforms = torch.rand(n, dtype=torch.float64, generator=gen)
    assert vocab > 2 * sampler_module.CDF_BLOCK
    two = sampler_module._inverse_cdf(weights, uniforms)
    one = sampler_module._pick(weights, uniforms * weights.sum(dim=-1, dtype=torch.float64))
    assert torch.equal(two, one)
    assert two[0] == 4999 and two[1] >= 4096
    assert bool((weights.gather(1, two.unsqueeze(1)) > 0).all())


@pytest.mark.slow
def test_wide_vocabulary_temperature_sampling_frequencies() -> None:
    n, vocab = 40000, 3000  # wider than two CDF blocks: the two-level draw
    row = torch.full((vocab,), -20.0)
    hot = torch.tensor([5, 1500, 2047, 2048, 2999])
    row[hot] = torch.tensor([0.0, 0.5, 1.0, -0.3, 0.2])
    out = Sampler().sample(row.expand(n, vocab).clone(), build([SamplingParams()] * n, vocab))
    probs = torch.softmax(row, dim=-1)
    counts = torch.bincount(out, minlength=vocab).double()
    rest = counts.sum() - counts[hot].sum()
    assert rest <= 10  # the other 2,995 tokens hold ~1e-5 of the mass
    assert chi_square(counts[hot], probs[hot] / probs[hot].sum()) < CHI2_CRIT_001[4]


@pytest.mark.parametrize("candidates", [(256, 4096), (8,), (4, 64)])
def test_cpu_filtered_probs_equal_the_sort(candidates, monkeypatch: pytest.MonkeyPatch) -> None:
    """``filtered_probs`` on the CPU (candidates first; what speculative acceptance reads)
    gives exactly the full sort's result, row by row, whichever route a row takes."""
    monkeypatch.setattr(sampler_module, "CPU_CANDIDATES", candidates)
    vocab = 700
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.3, temperature=0.5),
        SamplingParams(top_k=40, top_p=0.95),
        SamplingParams(top_k=300, min_p=0.05),
        SamplingParams(top_k=3),
        SamplingParams(temperature=1.3),  # no filter
        SamplingParams(top_p=0.99, temperature=3.0),  # flat: beyond every tier
    ]
    logits = torch.randn(len(params), vocab, generator=seeded(41)) * 2
    info = build(params, vocab)
    got = filtered_probs(logits, info)
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * info.min_ps.unsqueeze(1)
    probs = probs.masked_fill(probs < threshold, 0.0)
    want = sampler_module._filter_sorted(probs, info.top_ks, info.top_ps)
    assert torch.equal(got, want)
    kept = (got > 0).sum(dim=-1).tolist()
    assert kept[4] == 3 and kept[5] == vocab and kept[6] > 64
