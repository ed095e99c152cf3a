"""Replays a request dump (``--dump-requests-dir``) against a server and compares.

    python -m radixlm.srt.bench.replay DUMP --url http://127.0.0.1:30000 [--rate-scale 2]

``DUMP`` is a dump folder (its files, oldest first) or one ``.jsonl`` file. Each call is sent
with its recorded body at its recorded offset from the first call, divided by ``--rate-scale``
(2: twice the recorded rate; ``--max-rate``: all at once). The outputs are compared with the
recording per sequence: token ids where the route answers with them (``/generate``), else the
text; "equal" or the share of equal leading tokens (characters for text). Latencies (and the
time to the first token of streamed calls) are compared as recorded vs replayed. Prints a table
of the calls that differ and a summary; ``--require-equal`` exits 1 unless every output is
equal (greedy requests on the same build and model are). A malformed or truncated dump is
refused with the file and line (exit 2). Secrets were redacted when the dump was written: give
``--api-key`` for a server that needs one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from radixlm.srt.observability.request_dump import DUMP_VERSION, dump_files

REQUIRED = ("route", "arrival_time", "body", "sequences")


class DumpError(ValueError):
    """The dump cannot be read; the message names the file and line."""


def load_dump(path: str | Path) -> list[dict[str, Any]]:
    """The dump's records in arrival order. Raises DumpError on a malformed or truncated line."""
    p = Path(path)
    if p.is_dir():
        files = dump_files(p)
        if not files:
            raise DumpError(f"{p}: no requests*.jsonl files in this folder")
    elif p.is_file():
        files = [p]
    else:
        raise DumpError(f"{p}: no such dump file or folder")
    records = []
    for f in files:
        for lineno, line in enumerate(f.read_bytes().splitlines(), 1):
            if line.strip():
                records.append(_record(line, f"{f}:{lineno}"))
    if not records:
        raise DumpError(f"{p}: the dump holds no requests")
    return sorted(records, key=lambda r: r["arrival_time"])


def _record(line: bytes, where: str) -> dict[str, Any]:
    try:
        rec = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise DumpError(f"{where}: not a JSON line ({e}); is the dump truncated?") from None
    if not isinstance(rec, dict):
        raise DumpError(f"{where}: a record must be a JSON object")
    if rec.get("v") != DUMP_VERSION:
        raise DumpError(f"{where}: dump version {rec.get('v')!r}, this tool reads {DUMP_VERSION}")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise DumpError(f"{where}: the record lacks {', '.join(missing)}")
    if not isinstance(rec["sequences"], list) or not isinstance(rec["arrival_time"], int | float):
        raise DumpError(f"{where}: sequences must be a list and arrival_time a number")
    return rec


@dataclass
class Replayed:
    record: dict[str, Any]
    status: int = 0
    latency_s: float = 0.0
    ttft_s: float | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)  # {"output_ids"?, "text"}
    error: str | None = None


def outputs_of(body: Any) -> list[dict[str, Any]]:
    """Per sequence ``{"output_ids": [...]}`` (native) or ``{"text": ...}`` of a JSON answer."""
    items = body if isinstance(body, list) else [body]
    outs = []
    for item in items:
        if not isinstance(item, dict):
            continue
        if "output_ids" in item:
            outs.append({"output_ids": item["output_ids"], "text": item.get("text", "")})
        elif "choices" in item:
            for c in item["choices"]:
                text = c.get("text") if "text" in c else (c.get("message") or {}).get("content")
                outs.append({"text": text or ""})
        elif isinstance(item.get("content"), list):  # Anthropic's Messages
            outs.append({"text": "".join(b.get("text", "") for b in item["content"])})
    return outs


def _fold_stream(events: list[Any]) -> list[dict[str, Any]]:
    """The outputs of a stream: native events are cumulative, OpenAI's are deltas."""
    native: dict[int, dict[str, Any]] = {}
    texts: dict[int, str] = {}
    for ev in events:
        if not isinstance(ev, dict):
            continue
        if "output_ids" in ev:
            native[ev.get("index", 0)] = {"output_ids": ev["output_ids"], "text": ev.get("text")}
        for c in ev.get("choices", []):
            delta = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            texts[c.get("index", 0)] = texts.get(c.get("index", 0), "") + (delta or "")
    if native:
        return [native[i] for i in sorted(native)]
    return [{"text": texts[i]} for i in sorted(texts)]


async def replay_one(
    client: httpx.AsyncClient, url: str, rec: dict[str, Any], headers: dict[str, str]
) -> Replayed:
    out = Replayed(rec)
    started = time.perf_counter()
    try:
        async with client.stream(
            "POST", url + rec["route"], json=rec["body"], headers=headers
        ) as r:
            out.status = r.status_code
            if r.headers.get("content-type", "").startswith("text/event-stream"):
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        if out.ttft_s is None:
                            out.ttft_s = time.perf_counter() - started
                        events.append(orjson.loads(line[5:]))
                out.outputs = _fold_stream(events)
            else:
                raw = await r.aread()
                out.outputs = outputs_of(orjson.loads(raw)) if raw else []
    except (httpx.HTTPError, orjson.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.latency_s = time.perf_counter() - started
    return out


async def replay(
    records: list[dict[str, Any]],
    url: str,
    rate_scale: float = 1.0,
    api_key: str | None = None,
    timeout_s: float = 600.0,
) -> list[Replayed]:
    """Sends every record at its recorded offset / ``rate_scale`` (inf: all at once)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = records[0]["arrival_time"]
    start = time.perf_counter()

    async def one(rec: dict[str, Any]) -> Replayed:
        delay = (rec["arrival_time"] - t0) / rate_scale - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        return await replay_one(client, url.rstrip("/"), rec, headers)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        return await asyncio.gather(*(one(r) for r in records))


def token_agreement(recorded: dict[str, Any], replayed: dict[str, Any]) -> float:
    """The share of equal leading tokens (token ids where both have them, else characters)."""
    if "output_ids" in replayed and recorded.get("output_ids") is not None:
        a, b = recorded["output_ids"], replayed["output_ids"]
    else:
        a, b = recorded.get("text") or "", replayed.get("text") or ""
    if not a and not b:
        return 1.0
    same = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return same / max(len(a), len(b))


@dataclass
class Comparison:
    num_calls: int
    num_sequences: int
    num_equal: int
    mean_agreement: float
    rows: list[dict[str, Any]]  # one per call

    @property
    def all_equal(self) -> bool:
        return self.num_equal == self.num_sequences


def compare(results: list[Replayed]) -> Comparison:
    rows, shares = [], []
    for res in results:
        rec = res.record
        recorded = rec["sequences"]
        seq_shares = [
            token_agreement(a, b) for a, b in zip(recorded, res.outputs, strict=False)
        ] + [0.0] * abs(len(recorded) - len(res.outputs))
        shares += seq_shares
        ttfts = [s.get("ttft_s") for s in recorded if s.get("ttft_s") is not None]
        rows.append(
            {
                "route": rec["route"],
                "status": (rec.get("status"), res.status),
                "latency_s": (rec.get("latency_s"), res.latency_s),
                "ttft_s": (min(ttfts) if ttfts else None, res.ttft_s),
                "agreement": min(seq_shares) if seq_shares else 1.0,
                "error": res.error,
            }
        )
    equal = sum(1 for s in shares if s == 1.0)
    mean = statistics.fmean(shares) if shares else 1.0
    return Comparison(len(results), len(shares), equal, mean, rows)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def report(c: Comparison, out: Any = sys.stdout) -> None:
    print(f"{'#':>4} {'route':<22} {'status':>9} {'latency s rec/now':>19} {'equal':>7}", file=out)
    for i, row in enumerate(c.rows):
        rec_l, now_l = row["latency_s"]
        if row["agreement"] == 1.0 and row["status"][0] == row["status"][1] and not row["error"]:
            continue  # only the calls that differ
        status = f"{row['status'][0]}/{row['status'][1]}"
        lat = f"{rec_l or 0:8.3f}/{now_l:8.3f}"
        print(
            f"{i:>4} {row['route']:<22} {status:>9} {lat:>19} {row['agreement']:>7.1%}"
            + (f"  {row['error']}" if row["error"] else ""),
            file=out,
        )
    print(
        f"{c.num_calls} calls, {c.num_sequences} sequences: {c.num_equal} equal outputs, "
        f"mean share of equal tokens {c.mean_agreement:.1%}",
        file=out,
    )
    for name in ("latency_s", "ttft_s"):
        rec = [r[name][0] for r in c.rows if r[name][0] is not None]
        now = [r[name][1] for r in c.rows if r[name][1] is not None]
        if rec and now:
            print(
                f"{name:<10} recorded p50 {_pct(rec, 0.5):.3f} p90 {_pct(rec, 0.9):.3f} | "
                f"replayed p50 {_pct(now, 0.5):.3f} p90 {_pct(now, 0.9):.3f} | "
                f"p50 ratio {_pct(now, 0.5) / max(_pct(rec, 0.5), 1e-9):.2f}",
                file=out,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="a --dump-requests-dir folder or one of its .jsonl files")
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="2: twice the recorded rate")
    ap.add_argument("--max-rate", action="store_true", help="send every call at once")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--limit", type=int, default=None, help="replay the first N calls only")
    ap.add_argument("--require-equal", action="store_true", help="exit 1 unless all equal")
    args = ap.parse_args(argv)
    if not args.rate_scale > 0:
        ap.error(f"--rate-scale must be > 0, got {args.rate_scale}")
    try:
        records = load_dump(args.dump)[: args.limit]
    except DumpError as e:
        print(f"replay: {e}", file=sys.stderr)
        return 2
    scale = float("inf") if args.max_rate else args.rate_scale
    results = asyncio.run(replay(records, args.url, scale, args.api_key))
    comparison = compare(results)
    report(comparison)
    return 1 if args.require_equal and not comparison.all_equal else 0


if __name__ == "__main__":
    sys.exit(main())
