"""Timing for the tests that check how a cost grows (linear, not quadratic, in the text).

CPU time of this process with garbage collection off, best of a few runs: on a busy machine
another process's turn on the core does not count, and a collection that falls in one run does
not either. Tests compare the costs of a text and of one 8x longer: linear is ~8x, quadratic
~64x."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable


def best_cpu_seconds(run: Callable[[], object], repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            start = time.process_time()
            run()
            elapsed = time.process_time() - start
        finally:
            gc.enable()
        best = min(best, elapsed)
    return best


def assert_grows_linearly(small_s: float, large_s: float, size_ratio: int = 8) -> None:
    """``large_s`` for a text ``size_ratio`` times longer than ``small_s``'s: at most twice the
    linear cost (a quadratic one would be ``size_ratio`` times it)."""
    assert large_s < 2 * size_ratio * small_s, (small_s, large_s)
