from __future__ import annotations

from radixlm.srt.bench import bench_stop_strings


def test_both_workloads_agree_and_print_a_row_each(capsys):
    bench_stop_strings.main(["--num-stops", "6", "--stop-chars", "12", "--num-tokens", "50"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| r")]
    assert [row.split("|")[1].strip() for row in rows] == ["random", "repeat"]
