from __future__ import annotations

import torch

from radixlm.srt.bench import bench_sampler


def test_sampler_table_runs_on_given_logits(monkeypatch, capsys):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 5000, generator=gen) * 4  # peaked and flat rows
    monkeypatch.setattr(bench_sampler, "model_logits", lambda: logits)
    bench_sampler.main(["--skip-engine", "--batch-sizes", "1,8", "--reps", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith(("1 ", "8 "))]
    assert len(rows) == 2 * len(bench_sampler.SETTINGS)
    assert all(line.rstrip().endswith(("-", "%")) for line in rows)


def test_beyond_candidates_counts_rows_past_each_tier():
    vocab = 5000
    flat = torch.zeros(1, vocab)  # top_p 0.95 keeps 4,750 tokens: beyond 256 and 4,096
    peaked = torch.full((1, vocab), -30.0)
    peaked[0, :3] = 0.0  # three tokens hold the mass
    info = bench_sampler._info(bench_sampler.SamplingParams(top_p=0.95), 2, vocab, seed=0)
    assert bench_sampler.beyond_candidates(torch.cat([flat, peaked]), info) == "50%/50%"
    assert bench_sampler.beyond_candidates(torch.cat([peaked, peaked]), info) == "0%/0%"
