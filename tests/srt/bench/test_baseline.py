"""The performance baseline's comparison: a stored run, two unchanged runs that pass, a slowed
one that fails (exit 1); the tracing-hooks share has a fixed bound. The measurements are
faked here (fast); the slow test runs the CI set for real with an injected decode delay."""

from __future__ import annotations

import json

import pytest

from radixlm.srt.bench import baseline
from radixlm.srt.bench.baseline import main
from radixlm.srt.bench.baseline_store import HOOKS_OFF_LIMIT, compare, load_store, machine


def _results(decode_cost: float, hooks: float = 1e-5) -> dict:
    return {
        "radix_insert_match": {"cost": 1.0, "time_s": 0.002, "reference_s": 0.002},
        "decode_step": {"cost": decode_cost, "time_s": 0.05, "reference_s": 0.05 / decode_cost},
        "trace_hooks_off": {"cost": hooks, "time_s": 1e-7, "reference_s": 0.05},
    }


def test_compare_flags_only_a_cost_past_the_tolerance():
    base = {"results": _results(1.5)}
    rows = {r[0]: r for r in compare(_results(1.6), base, 0.15)}
    assert rows["decode_step"][-1] and rows["decode_step"][3] == pytest.approx(1.6 / 1.5 - 1)
    rows = {r[0]: r for r in compare(_results(1.8), base, 0.15)}
    assert not rows["decode_step"][-1] and rows["radix_insert_match"][-1]
    assert all(r[-1] for r in compare(_results(9.0), None, 0.15))  # nothing stored: no verdict
    rows = {r[0]: r for r in compare(_results(1.5, hooks=2 * HOOKS_OFF_LIMIT), base, 0.15)}
    assert not rows["trace_hooks_off"][-1]


def test_save_then_unchanged_twice_passes_and_a_slowdown_fails(tmp_path, monkeypatch, capsys):
    costs = iter([1.50, 1.52, 1.47, 2.40])
    monkeypatch.setattr(baseline, "run_set", lambda name, delay_ms=0.0: _results(next(costs)))
    store = tmp_path / "baseline.json"
    args = ["--set", "ci", "--store", str(store)]
    assert main([*args, "--save"]) == 0
    assert main(args) == 0
    assert main(args) == 0
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "FAILED" in out
    (run,) = json.loads(store.read_text())["runs"]  # only --save stores
    assert run["set"] == "ci" and run["results"]["decode_step"]["cost"] == 1.50
    assert run["machine"] == machine() and run["commit"]


def test_a_broken_store_is_refused(tmp_path):
    store = tmp_path / "b.json"
    store.write_text("{not json")
    with pytest.raises(SystemExit, match="not JSON"):
        load_store(store)


@pytest.mark.slow
def test_the_ci_set_catches_an_injected_decode_sleep(tmp_path, capsys):
    """What CI runs of the baseline: the CI set (the model loads once), its tracing-off bound,
    and the comparison failing on a decode step slowed by a busy delay."""
    store = tmp_path / "baseline.json"
    args = ["--set", "ci", "--store", str(store)]
    assert main([*args, "--save"]) == 0  # trace_hooks_off within its bound too
    assert main([*args, "--inject-decode-delay-ms", "200"]) == 1
    assert "decode_step" in capsys.readouterr().out.split("REGRESSED")[0].splitlines()[-1]
