"""bench_startup: the time from `radixlm serve` to a healthy /health, and its phases from the log."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixlm.srt.bench import bench_startup


def _line(at: dt.datetime, text: str) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S,") + f"{at.microsecond // 1000:03d} {text}"


def test_phase_times_are_read_off_the_log_lines():
    t0 = dt.datetime(2026, 12, 7, 22, 0, 0)
    log = "\n".join(
        [
            "INFO:     not a stamped line [scheduler]",
            _line(t0 + dt.timedelta(seconds=4.25), "[scheduler] INFO radixlm.srt.config: config"),
            _line(
                t0 + dt.timedelta(seconds=5.5),
                "[scheduler] INFO radixlm.srt.models.loader: loaded X",
            ),
            _line(
                t0 + dt.timedelta(seconds=6), "[scheduler] INFO radixlm.srt.models.loader: loaded Y"
            ),
        ]
    )
    times = bench_startup.phase_times(log, t0.timestamp())
    assert times == {"scheduler_first_log_s": 4.25, "model_loaded_s": 5.5, "serving_s": None}


def test_a_revision_is_imported_from_its_own_tree():
    with bench_startup.source_at("HEAD") as path:
        out = subprocess.run(
            [sys.executable, "-c", "import radixlm.srt.cli as m; print(m.__file__)"],
            env={"PYTHONPATH": path},
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        ).stdout
        assert out.startswith(path)
    listed = subprocess.run(
        ["git", "-C", str(bench_startup.ROOT), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert str(Path(path).parent) not in listed  # the worktree is removed afterwards


@pytest.mark.slow  # starts the server on the default model
def test_one_start_of_the_default_server(tmp_path, capsys):
    out = tmp_path / "startup.json"
    result = bench_startup.main(["--rounds", "1", "--json", str(out)])
    run = result["runs"]["this"][0]
    assert 0 < run["scheduler_first_log_s"] < run["model_loaded_s"] < run["serving_s"]
    assert run["serving_s"] <= run["healthy_s"] + 0.5  # the log's clock is rounded to 1 ms
    assert json.loads(out.read_text())["summary"]["this"]["healthy_s_median"] == run["healthy_s"]
    assert "this: {" in capsys.readouterr().out
