"""The benchmark plots write PNGs, and return None (no error) without matplotlib."""

from __future__ import annotations

import sys

import pytest

from radixlm.srt.bench import plots

PNG = b"\x89PNG"
CASE = {"batch": 1, "backend": "triton", "kv_cache_dtype": "auto", "limit_ms": 3.9,
        "cpu_gap_ms": 0.1, "category_ms": {"gemm": 4.0, "attention": 0.3}}  # fmt: skip
RUNS = [
    {"commit": c, "set": "ci", "results": {"decode_step": {"cost": v}}}
    for c, v in (("a1", 1.5), ("b2", 1.52), ("c3", 3.0))
]


@pytest.fixture
def needs_matplotlib():
    pytest.importorskip("matplotlib")


@pytest.mark.slow  # matplotlib's first figure takes seconds on a loaded machine
def test_each_plot_writes_a_png(tmp_path, needs_matplotlib):
    written = [
        plots.plot_ttft_per_round(
            {"device": [0.2, 0.4], "host": [0.2, 0.25]},
            tmp_path / "ttft.png",
            hits={"device": {"device": 0.3}, "host": {"device": 0.3, "host": 0.5}},
        ),
        plots.plot_step_breakdown([CASE, {**CASE, "batch": 256}], tmp_path / "step.png"),
        plots.plot_baseline_history(RUNS, tmp_path / "history.png"),
    ]
    for path in written:
        assert path is not None and path.read_bytes()[:4] == PNG
        assert path.stat().st_size < 100_000


def test_without_matplotlib_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert plots.plot_baseline_history(RUNS, tmp_path / "h.png") is None
    assert plots.plot_step_breakdown([CASE], tmp_path / "s.png") is None
    assert not list(tmp_path.iterdir())
