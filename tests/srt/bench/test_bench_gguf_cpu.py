"""bench_gguf_cpu: times the step's GEMVs, alone or against a git revision's kernels."""

from __future__ import annotations

import pytest
import torch

from radixlm.kernels import gguf_cpu
from radixlm.srt.bench import bench_gguf_cpu

pytestmark = pytest.mark.skipif(
    not gguf_cpu.available(), reason="the CPU kernels could not be built (no C++ compiler)"
)


@pytest.mark.slow
def test_prints_both_parts_against_a_revision(capsys):
    argv = ["--rows", "2", "--threads", "1", "--rounds", "1", "--layers", "1", "--against", "HEAD"]
    bench_gguf_cpu.main(argv)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    parts = {r[2]: r for r in rows if len(r) > 2 and r[0] == "2"}
    assert set(parts) == {"linears", "head"}
    assert all(r[-1].endswith("x") and float(r[3]) > 0 for r in parts.values())


def test_a_revision_without_the_file_is_an_error():
    with pytest.raises(Exception):  # noqa: B017 (git's error surfaces as CalledProcessError)
        bench_gguf_cpu.library_at("0000000000000000000000000000000000000000")


def test_builds_of_the_older_layout_get_float32_scales_and_mins():
    step = bench_gguf_cpu.Step(hidden=64, inter=96, qkv=96, layers=1, vocab=64)

    class Older:
        q4_1_layout = 0

    assert step.linears_for(gguf_cpu.library()) is step.linears
    older = step.linears_for(Older())
    for (w, n, k), (w32, n32, k32) in zip(step.linears, older, strict=True):
        assert (n, k) == (n32, k32) and w32.codes is w.codes
        assert w32.d.dtype == w32.m.dtype == torch.float32
        assert torch.equal(w32.d, w.d.float()) and torch.equal(w32.m, w.m.float())
