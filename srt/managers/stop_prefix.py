"""How much of a growing text may be the start of a stop string, updated as text arrives.

A streaming request holds back the longest suffix of its text that is a proper prefix of one of
its stop strings. Recomputing that from scratch each step compared every prefix of every stop
string with the text's end: with 64 stop strings of 1,024 characters that was about 3 ms per
token per stream (``srt/bench/bench_stop_strings.py``). Here each stop string runs a
Knuth-Morris-Pratt automaton over the new
characters only (amortised O(1) per character and stop string); a stop string none of whose
first characters has appeared is skipped at C speed.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1024)
def _failure(stop: str) -> tuple[int, ...]:
    """``fail[q]``: the length of the longest proper border of ``stop[:q]``."""
    fail = [0] * (len(stop) + 1)
    k = 0
    for q in range(1, len(stop)):
        while k and stop[q] != stop[k]:
            k = fail[k]
        if stop[q] == stop[k]:
            k += 1
        fail[q + 1] = k
    return tuple(fail)


class StopPrefixes:
    """The held-back length of a text that only grows; :meth:`feed` it the whole text each
    step (what it saw before is not read again)."""

    def __init__(self, stops: list[str]) -> None:
        # a one-character stop string has no non-empty proper prefix to hold back
        self._stops = [s for s in dict.fromkeys(stops) if len(s) > 1]
        self._fails: list[tuple[int, ...] | None] = [None] * len(self._stops)
        self._states = [0] * len(self._stops)
        self._seen = 0

    def feed(self, text: str) -> int:
        """The length of the longest suffix of ``text`` that is a proper prefix of a stop
        string (``text`` extends the text of the previous call)."""
        new = text[self._seen :]
        self._seen = len(text)
        if new:
            for j, stop in enumerate(self._stops):
                q = self._states[j]
                if q == 0 and stop[0] not in new:
                    continue
                fail = self._fails[j]
                if fail is None:
                    fail = self._fails[j] = _failure(stop)
                m = len(stop)
                for ch in new:
                    while q and stop[q] != ch:
                        q = fail[q]
                    if stop[q] == ch:
                        q += 1
                        if q == m:  # a whole stop string: the scheduler's call; keep its border
                            q = fail[m]
                self._states[j] = q
        return max(self._states, default=0)
