"""How long ``radixlm serve`` takes from the command to a healthy ``/health``, and where it goes.

    python -m radixlm.srt.bench.bench_startup                          # the default model, 3 starts
    python -m radixlm.srt.bench.bench_startup --against HEAD~1 --rounds 4
    python -m radixlm.srt.bench.bench_startup --server-args "--model-path ./m --tp-size 2"

Each start runs the real command (``python -m radixlm.srt.cli serve`` on 127.0.0.1 and a free
port, its output in a log), polls ``/health`` every 20 ms until it answers 200, then stops the
server with SIGTERM and waits for it. Besides the time to healthy it reads three moments off the
server's log: the scheduler's first line (its imports done), the model loaded, and the HTTP side
serving (the tokenizer, the app and every child ready). ``--against REV`` checks a git revision
out into a temporary worktree and starts it the same way (its source first on ``PYTHONPATH``),
alternating the two in every round, since the machine may be shared; the ratio is old / new.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson

from radixlm.srt.server.process.server_process import free_port

ROOT = Path(__file__).resolve().parents[2]
# the log lines that mark each phase's end, in the order they come
PHASES = {
    "scheduler_first_log_s": "[scheduler]",
    "model_loaded_s": "radixlm.srt.models.loader: loaded",
    "serving_s": "radixlm.srt.server.process.launch: serving",
}
POLL_S = 0.02


def phase_times(log: str, launched_at: float) -> dict[str, float | None]:
    """Seconds from ``launched_at`` (epoch) to the first log line of each phase; None where the
    log has no such line. Log lines start with ``YYYY-MM-DD HH:MM:SS,mmm`` in local time."""
    out: dict[str, float | None] = dict.fromkeys(PHASES)
    for line in log.splitlines():
        for name, marker in PHASES.items():
            if out[name] is None and marker in line:
                try:
                    stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                except ValueError:
                    continue
                out[name] = round(stamp.timestamp() - launched_at, 3)
    return out


def start_once(
    server_args: list[str], pythonpath: str | None, timeout_s: float
) -> dict[str, float | None]:
    """One start: seconds to a healthy /health and to each phase's log line."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "radixlm.srt.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *server_args]
    with tempfile.TemporaryFile() as log:
        launched_at, t0 = time.time(), time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        healthy_s = None
        try:
            with httpx.Client(timeout=5) as client:
                while time.monotonic() - t0 < timeout_s and proc.poll() is None:
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                            healthy_s = round(time.monotonic() - t0, 3)
                            break
                    time.sleep(POLL_S)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
    if healthy_s is None:
        tail = "\n".join(text.splitlines()[-20:])
        raise RuntimeError(f"the server did not become healthy in {timeout_s} s:\n{tail}")
    return {"healthy_s": healthy_s, **phase_times(text, launched_at)}


@contextlib.contextmanager
def source_at(rev: str) -> Iterator[str]:
    """A ``PYTHONPATH`` entry whose ``radixlm`` package is the source at git revision ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev],
            check=True,
        )
        try:
            (Path(tmp) / "path").mkdir()
            (Path(tmp) / "path" / "radixlm").symlink_to(tree)
            yield str(Path(tmp) / "path")
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False
            )


def summarise(runs: list[dict[str, float | None]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("healthy_s", *PHASES):
        values = [r[key] for r in runs if r[key] is not None]
        out[f"{key}_median"] = round(statistics.median(values), 3) if values else None
    out["healthy_s_min"] = min(r["healthy_s"] for r in runs)  # type: ignore[type-var]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="starts of each source")
    ap.add_argument("--against", default=None, help="a git revision started beside this source")
    ap.add_argument("--server-args", default="", help="extra `radixlm serve` arguments, quoted")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.timeout <= 0:
        ap.error("--rounds must be at least 1 and --timeout above 0")
    server_args = shlex.split(args.server_args)
    with contextlib.ExitStack() as stack:
        sources: dict[str, str | None] = {"this": None}
        if args.against:
            sources = {args.against: stack.enter_context(source_at(args.against)), **sources}
        runs: dict[str, list[dict[str, float | None]]] = {name: [] for name in sources}
        for r in range(args.rounds):
            for name, path in sources.items():
                run = start_once(server_args, path, args.timeout)
                runs[name].append(run)
                print(f"round {r + 1} {name}: {run}", flush=True)
    result = {
        "command": "radixlm serve " + " ".join(server_args),
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "summary": {name: summarise(rs) for name, rs in runs.items()},
    }
    for name, summary in result["summary"].items():
        print(f"{name}: {summary}")
    if args.against:
        old = result["summary"][args.against]["healthy_s_median"]
        new = result["summary"]["this"]["healthy_s_median"]
        result["ratio_old_over_new"] = round(old / new, 3)
        print(f"time to healthy, {args.against} / this: {result['ratio_old_over_new']}x")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return result


if __name__ == "__main__":
    main()
