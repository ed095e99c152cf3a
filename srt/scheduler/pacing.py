"""Prefill pacing (``--tpot-target-ms``): how much prompt a step may prefill while requests are
decoding, so that the running requests' time per output token stays near a target.

Prefill first (the default, as SGLang) admits whatever fits in every step: under a queue that
never empties the running requests get no token until it does (seconds at saturation), and the
decode that was put off runs at the end at ever smaller batches. The pacer keeps a time credit
for the running requests instead:

- every step that computes their next token (a decode step, or a mixed step) earns one target
  ``T``: they were owed a token per ``T`` seconds;
- the time that passes while some request runs is spent from the credit (a step lasts from its
  start to the next step's, so the host's time and an overlapped step count as they happen);
- a step may prefill, beside running requests, as many prompt tokens as the credit pays for at
  the measured prefill rate (``PrefillRate``: prompt tokens per second of step time), up to the
  step's budget; below ``min_piece`` tokens it decodes instead and the credit grows by
  ``T`` less the decode step's time. A decode step slower than ``T`` (the target cannot be met
  by decoding alone) still earns prompts ``MIN_PREFILL_SHARE`` of the time, so the queue moves.

The credit is bounded by ``max_credit_s`` (one whole chunk at the measured rate), so a stall is
never longer than one chunk, and it starts from zero each time the running set empties. With
nothing running, a step prefills its whole budget: nobody waits on it. Over a window of one
prefill of ``S`` seconds and ``k`` decode steps of ``d`` seconds, the running requests' time
per token is ``(S + k d) / k <= T``: the decode batch grows while prompts wait, as long as a
decode step is faster than ``T``. Until a prefill rate is measured, nothing is paced.
"""

from __future__ import annotations

from radixlm.srt.scheduler.prefill import PrefillRate, min_mixed_chunk

MIN_PREFILL_SHARE = 0.2  # of the time, for prompts, when decoding alone misses the target


class PrefillPacer:
    """Nothing paced (``tpot_target_s`` None): every step may prefill its whole budget."""

    def __init__(
        self, tpot_target_s: float | None, chunk_size: int, rate: PrefillRate | None = None
    ) -> None:
        self.tpot_target_s = tpot_target_s
        self.chunk_size = chunk_size
        self.min_piece = min_mixed_chunk(chunk_size) if chunk_size > 0 else 1
        self.rate = rate or PrefillRate()
        self.credit_s = 0.0
        self.last_t: float | None = None  # when the previous step began, if requests ran then
        self.last_kind = "prefill"  # what it did for them: "decode", "mixed" or "prefill"

    @property
    def is_on(self) -> bool:
        return self.tpot_target_s is not None

    def max_credit_s(self) -> float:
        """One whole chunk at the measured rate: the longest stall paid for in advance."""
        rate = self.rate.tokens_per_s
        return self.chunk_size / rate if rate and self.chunk_size > 0 else 0.0

    def begin_step(self, now: float, num_running: int) -> None:
        """Settles the previous step (if requests were running then) from its duration."""
        if not self.is_on:
            return
        if self.last_t is not None:
            self.credit_s += self._earned(now - self.last_t)
            self.credit_s = min(self.credit_s, self.max_credit_s())
        self.last_t, self.last_kind = (now, "prefill") if num_running else (None, "prefill")
        if not num_running:
            self.credit_s = 0.0  # nothing owed: start afresh

    def _earned(self, step_s: float) -> float:
        if self.last_kind == "prefill":  # the running requests got no token
            return -step_s
        earned = self.tpot_target_s - step_s  # they got one
        if self.last_kind == "decode":  # a slow decode step still leaves prompts a share
            earned = max(earned, step_s * MIN_PREFILL_SHARE / (1 - MIN_PREFILL_SHARE))
        return earned

    def on_step(self, decodes: bool, prefills: bool) -> None:
        """What this step does for the running requests: their next token, a prompt, or both."""
        if self.is_on and decodes:
            self.last_kind = "mixed" if prefills else "decode"

    def budget(self, budget_tokens: int, num_running: int) -> int:
        """Prompt tokens this step may prefill beside ``num_running`` requests, of a budget of
        ``budget_tokens``: 0 when it should decode instead."""
        rate = self.rate.tokens_per_s
        if not self.is_on or not num_running or not rate:
            return budget_tokens
        fits = int(self.credit_s * rate + 1e-6)  # a credit at its cap pays a whole chunk
        if fits < min(self.min_piece, budget_tokens):
            return 0
        return min(budget_tokens, fits)
