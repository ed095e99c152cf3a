"""bench_speculative end to end on a tiny random model (CPU): every mode runs, prints its row,
and greedy outputs with n-gram drafts equal those without."""

from __future__ import annotations

import pytest

from radixlm.srt.bench import bench_speculative as bench


def test_workloads_are_embedded_and_distinct() -> None:
    copy = bench.copy_tasks()
    assert len(copy) == 16 and len(set(copy)) == 16
    assert len(set(bench.FREE_TOPICS)) == 16
    assert '"status": "active"' in copy[0]  # the record is in the prompt, to be copied


@pytest.mark.slow
def test_the_benchmark_runs_every_mode(tiny_llama_dir, capsys) -> None:
    bench.main(
        [
            "--model-path", str(tiny_llama_dir),
            "--draft-model-path", str(tiny_llama_dir),
            "--batch-sizes", "1,3",
            "--batch1-prompts", "1",
            "--workloads", "copy",
            "--output-len", "12",
            "--max-total-tokens", "4096",
            "--device", "cpu",
        ]
    )  # fmt: skip
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("copy", str(batch), mode) for mode in ("off", "ngram", "draft") for batch in (1, 3)
    ]
    for row in rows:
        assert float(row[3]) > 0  # decode tok/s
        assert row[-1] in ("1/1", "3/3")  # greedy: the same text in every mode


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--workloads", "poetry"])
