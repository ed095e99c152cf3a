"""Streaming stop-string hold-back in the detokenizer: the from-scratch check (every prefix of
every stop string against the text's end, each token) against the incremental tracker
(``managers/stop_prefix.py``), side by side in one run, per streamed token of one request.

    python -m radixlm.srt.bench.bench_stop_strings
    python -m radixlm.srt.bench.bench_stop_strings --num-stops 4 --stop-chars 8

Workloads: ``random`` (stop strings and output drawn from the same small alphabet, so partial
matches happen), ``repeat`` (the output is one letter repeated and every stop string is that
letter repeated and then another: the tracker's worst case). Both methods must agree on every
token; the run stops with an error otherwise.
"""

from __future__ import annotations

import argparse
import random
import time

from radixlm.srt.managers.detokenizer import held_back_len
from radixlm.srt.managers.stop_prefix import StopPrefixes

ALPHABET = "abcdefghij klmnop"


def workload(name: str, num_stops: int, stop_chars: int, num_tokens: int, seed: int):
    rng = random.Random(seed)
    if name == "repeat":
        stops = ["a" * (stop_chars - 1 - i % 8) + "b" for i in range(num_stops)]
        return stops, ["a" * 4] * num_tokens
    stops = ["".join(rng.choice(ALPHABET) for _ in range(stop_chars)) for _ in range(num_stops)]
    pieces = ["".join(rng.choice(ALPHABET) for _ in range(4)) for _ in range(num_tokens)]
    return stops, pieces


def per_token_ms(step, pieces: list[str]) -> tuple[float, list[int]]:
    text, held = "", []
    start = time.perf_counter()
    for piece in pieces:
        text += piece
        held.append(step(text))
    return (time.perf_counter() - start) / len(pieces) * 1e3, held


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-stops", type=int, default=64)
    ap.add_argument("--stop-chars", type=int, default=1024)
    ap.add_argument("--num-tokens", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(
        f"{args.num_stops} stop strings of {args.stop_chars} characters, {args.num_tokens} tokens"
    )
    print("| workload | from scratch | tracker | speed-up |")
    print("|---|---|---|---|")
    for name in ("random", "repeat"):
        stops, pieces = workload(name, args.num_stops, args.stop_chars, args.num_tokens, args.seed)
        scratch_ms, want = per_token_ms(lambda t, s=stops: held_back_len(t, s), pieces)
        tracker = StopPrefixes(stops)
        tracker_ms, got = per_token_ms(tracker.feed, pieces)
        if got != want:
            raise SystemExit(f"{name}: the tracker disagrees with the from-scratch check")
        print(
            f"| {name} | {scratch_ms:.3f} ms | {tracker_ms:.4f} ms | "
            f"{scratch_ms / max(tracker_ms, 1e-9):.0f}x |"
        )


if __name__ == "__main__":
    main()
