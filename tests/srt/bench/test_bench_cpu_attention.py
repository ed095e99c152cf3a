"""bench_cpu_attention runs and prints a row per cached length."""

from __future__ import annotations

import pytest

from radixlm.kernels import cpu_decode
from radixlm.srt.bench import bench_cpu_attention


@pytest.mark.skipif(not cpu_decode.available(), reason="no C++ compiler")
def test_a_row_per_length(capsys):
    argv = ["--lens", "3,40", "--layers", "2", "--rounds", "1", "--iters", "2", "--batch", "2"]
    bench_cpu_attention.main(argv)
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["3", "40"]
    assert all(float(x) > 0 for r in rows for x in r.split()[1:])
