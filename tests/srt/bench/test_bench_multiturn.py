"""bench_multiturn's outputs check, and every KV tier token-identical to no prefix cache.

The end-to-end test runs the bench's own modes on a tiny random Llama in float32 on the CPU
(no default model): a host pool of a quarter of the device pool in the disk modes, so pages
leave the host pool for the disk and come back from it, then a restart over the folder. In
float32 a near-tie flipped by rounding is far rarer than in bf16, so any differing output here
is a tier handing back other KV than it was given; the top-2 logprob gaps must agree too
(a tiny random model's greedy tokens barely depend on its prefix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm.srt.bench import bench_multiturn as bm
from radixlm.srt.bench.multiturn_report import NEAR_TIE, divergences, print_outputs_check


def _run(mode: str, outputs: dict, gaps: dict) -> bm.ModeRun:
    run = bm.ModeRun(mode)
    run.outputs, run.gaps = outputs, gaps
    return run


def test_a_difference_at_a_near_tie_is_called_rounding_and_a_wide_one_is_not(capsys):
    ref = _run(
        "off", {(0, 0): [1, 2, 3], (1, 0): [4, 5, 6]}, {(0, 0): [1, 0.001, 1], (1, 0): [1, 1, 1]}
    )
    tie = _run("disk", {(0, 0): [1, 9, 3], (1, 0): [4, 5, 6]}, {(0, 0): [1, 0.002, 1]})
    wrong = _run("restart", {(0, 0): [1, 2, 3], (1, 0): [7, 5, 6]}, {(1, 0): [2, 1, 1]})
    # (conversation, round): prompt 64 tokens, of which 48 cached in restart's (0, 0)
    wrong.reqs = [
        bm.RequestStats(0, 0, 0.1, 0.2, 64, 48, 3),
        bm.RequestStats(1, 0, 0.1, 0.2, 64, 0, 3),
    ]
    assert divergences(ref, tie) == [0.001]  # the smaller gap of the two runs
    assert divergences(ref, wrong) == [1]
    print_outputs_check([tie, wrong, ref])  # off is the reference wherever it ran
    out = capsys.readouterr().out
    assert "identical to off's (no prefix cache): disk 1/2, restart 1/2" in out
    assert "disk: 1 differ first at a near-tie" in out and "rounding, not a wrong page" in out
    assert f"restart: 1 differ first where the top-2 gap was >= {NEAR_TIE} nats (1.0000 x1)" in out
    assert "not a near-tie" in out
    assert "restart: prompt tokens computed per request (median): 64 where the output " in out
    assert "differs, 16 where it does not" in out


def test_identical_outputs_print_no_notes(capsys):
    ref = _run("device", {(0, 0): [1, 2]}, {(0, 0): [0.5, 0.5]})
    print_outputs_check([ref, _run("host", {(0, 0): [1, 2]}, {})])
    out = capsys.readouterr().out
    assert (
        out.strip()
        == "outputs identical to device's (itself cached under its own splits): host 1/1"
    )


@pytest.mark.slow
def test_every_tier_gives_the_outputs_of_no_cache_in_float32(tmp_path, tiers_always_load):
    from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder

    folder = make_model_folder(tmp_path / "tiny", dict(TINY_LLAMA))
    args = bm.parse_args(
        [
            *("--model-path", str(folder), "--load-format", "dummy", "--dtype", "float32"),
            *("--device", "cpu", "--num-conversations", "16", "--num-rounds", "4"),
            *("--turn-len", "64", "--output-len", "8", "--replies", "fixed"),
            *("--disk-host-ratio", "0.25", "--progress-s", "1000"),
        ]
    )
    workload = bm.build_workload(args)
    args.max_total_tokens = bm.default_pool_tokens(
        workload, args.overflow, args.page_size, args.concurrency
    )
    storage = str(tmp_path / "disk")
    Path(storage).mkdir()
    runs = {m: bm.run_mode(args, m, workload, storage) for m in bm.MODES}
    assert all(r.error is None for r in runs.values()), [r.error for r in runs.values()]
    assert runs["disk"].tiers["disk_hit_tokens"] > 0  # pages came back from the disk
    assert runs["restart"].tiers["disk_hit_tokens"] > runs["disk"].tiers["disk_hit_tokens"]
    assert all(runs[m].tiers["loads_skipped_slower"] == 0 for m in bm.HICACHE_MODES)
    for mode in ("device", "host", "disk", "restart"):
        assert len(runs[mode].outputs) == workload.num_requests
        assert divergences(runs["off"], runs[mode]) == [], mode
        for key, gaps in runs["off"].gaps.items():  # a tiny random model's tokens move little
            assert runs[mode].gaps[key] == pytest.approx(gaps, abs=1e-4), (mode, key)
