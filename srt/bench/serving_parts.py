"""The parts a serving run is made of, measured on the same server right after the run
(``bench_serving --parts``), and the run priced at them.

A saturated server's throughput means little alone: the question is how close its steps come to
what the same server does with one kind of work at a time. Read from the scheduler's step
timeline (``srt/scheduler/timeline.py``), so every figure is the steps' own time:

- the full-chunk prefill rate: prompts of one whole chunk (``--chunked-prefill-size``, clipped
  to the context), one request at a time, nothing decoding: prompt tokens per second of their
  prefill-only steps (the better of two prompts);
- decode steps at given batch sizes: that many requests of one prompt length (by default the
  mean context a decode row of the run attended to) sent as one batch and decoding together,
  the median time of the decode-only steps that had exactly that many rows (each request
  decodes ``--parts-decode-tokens`` plus as many as its batch's prefill takes steps).

``step_timeline.price_steps`` then prices every step of each rate's slice at those parts (a
decode step linear between the measured batch sizes) and compares the total with the span the
steps took: the share of its parts' speed the server delivered at that rate.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import httpx

from radixlm.srt.bench.step_timeline import price_steps, read_records

DEFAULT_BATCH_SIZES = (1, 16, 64, 128)


def _generate(url: str, ids: list[int] | list[list[int]], max_new_tokens: int) -> None:
    """One native ``/generate`` (a list of prompts: one batch, all queued at once)."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": params}, timeout=3600
    )
    r.raise_for_status()


class PartsProbe:
    """Sends the probes to ``url`` and reads their steps from ``timeline`` from ``offset`` on."""

    def __init__(self, url: str, timeline: str | Path, offset: int, vocab: int, seed: int = 0):
        self.url, self.timeline, self.offset = url.rstrip("/"), timeline, offset
        self.vocab = vocab
        self.rng = random.Random(seed)

    def _ids(self, n: int) -> list[int]:
        # distinct random prompts: no prefix-cache hit between probes
        return [self.rng.randrange(10, self.vocab) for _ in range(n)]

    def _new_steps(self) -> list[dict[str, Any]]:
        records, self.offset = read_records(self.timeline, self.offset)
        return records

    def prefill_rate(self, prompt_len: int, tries: int = 2) -> float:
        """Prompt tokens per second of prefill-only steps, the best of ``tries`` prompts."""
        best = 0.0
        for _ in range(tries):
            self._new_steps()
            _generate(self.url, self._ids(prompt_len), 1)
            steps = [s for s in self._new_steps() if s["prefill_tokens"] and not s["decode_rows"]]
            seconds = sum(s["step_s"] for s in steps)
            if seconds > 0:
                best = max(best, sum(s["prefill_tokens"] for s in steps) / seconds)
        return best

    def decode_ms(self, rows: int, prompt_len: int, tokens: int) -> float | None:
        """Median milliseconds of the decode-only steps with exactly ``rows`` rows while ``rows``
        requests of ``prompt_len``-token prompts (one batch request) decode ``tokens`` tokens
        each; None if no step had that many rows (e.g. above the server's running-request
        limit, or a pool that does not hold them all)."""
        self._new_steps()
        _generate(self.url, [self._ids(prompt_len) for _ in range(rows)], tokens)
        times = [
            s["step_s"]
            for s in self._new_steps()
            if s["decode_rows"] == rows and not s["prefill_tokens"]
        ]
        return statistics.median(times) * 1000 if times else None


def mean_decode_context(records: list[dict[str, Any]]) -> float | None:
    """Context tokens a decode row attended to, on average over ``records`` (None: no rows, or
    a timeline without ``decode_context``)."""
    rows = sum(s["decode_rows"] for s in records)
    if not rows or any("decode_context" not in s for s in records if s["decode_rows"]):
        return None
    return sum(s.get("decode_context", 0) for s in records) / rows


def measure(
    url: str,
    timeline: str | Path,
    offset: int,
    *,
    vocab: int,
    chunk: int,
    max_prompt: int,
    prompt_len: int,
    batch_sizes: list[int],
    decode_tokens: int,
    seed: int = 0,
) -> dict[str, Any]:
    """The full-chunk prefill rate and the decode step times (``price_steps``' inputs)."""
    probe = PartsProbe(url, timeline, offset, vocab, seed)
    prompt_len = max(1, min(prompt_len, max_prompt - decode_tokens))
    full = max(1, min(chunk, max_prompt - 1))
    parts: dict[str, Any] = {
        "prefill_prompt_len": full,
        "prefill_tok_s": probe.prefill_rate(full),
        "decode_prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "decode_ms": {},
    }
    for rows in batch_sizes:
        # the first rows decode while the last are prefilled: enough tokens to outlast that
        tokens = decode_tokens + -(-rows * prompt_len // full)
        ms = probe.decode_ms(rows, prompt_len, tokens)
        if ms is not None:
            parts["decode_ms"][rows] = ms
    return parts


def price(records: list[dict[str, Any]], parts: dict[str, Any]) -> dict[str, float] | None:
    """``price_steps`` of one rate's steps at the measured parts (None without them)."""
    if not records or parts["prefill_tok_s"] <= 0 or not parts["decode_ms"]:
        return None
    return price_steps(records, parts["prefill_tok_s"], parts["decode_ms"])


def print_parts(parts: dict[str, Any]) -> None:
    decode = ", ".join(f"{b} rows {ms:.2f} ms" for b, ms in sorted(parts["decode_ms"].items()))
    print(
        f"parts (this server, alone): prefill {parts['prefill_tok_s']:.0f} tok/s at "
        f"{parts['prefill_prompt_len']}-token prompts; decode steps of "
        f"{parts['decode_prompt_len']}-token prompts: {decode or 'none measured'}",
        flush=True,
    )


def print_priced(rate: float, priced: dict[str, float] | None) -> None:
    if priced is None:
        print(f"rate {rate:g}: not priced (no steps, or no parts measured)", flush=True)
        return
    print(
        f"rate {rate:g}: its steps at the parts' speed: prefill {priced['prefill_part_s']:.2f} s "
        f"+ decode {priced['decode_part_s']:.2f} s = {priced['parts_s']:.2f} s of the "
        f"{priced['span_s']:.2f} s they spanned: {priced['ratio']:.1%}",
        flush=True,
    )
