"""Per-request draft lengths that follow acceptance, and the counters every drafter reports."""

from __future__ import annotations

from dataclasses import dataclass

MISSES_BEFORE_PAUSE = 2  # verifications in a row with nothing accepted before pausing
FIRST_PAUSE_STEPS = 4  # steps without drafts after the first pause; doubles per failed probe
MAX_PAUSE_STEPS = 64


@dataclass
class DraftLength:
    """One request's draft-length state (see :class:`AdaptiveLength`)."""

    length: int  # most tokens to propose next
    misses: int = 0  # verifications in a row that accepted nothing
    pause_steps: int = 0  # steps left without proposing
    next_pause: int = FIRST_PAUSE_STEPS  # pause after the next run of misses


class AdaptiveLength:
    """Draft lengths from acceptance: a fully accepted draft doubles the length (up to
    ``max_len``), a partly accepted one sets it to accepted + 1, a rejected one halves it;
    ``MISSES_BEFORE_PAUSE`` rejected drafts in a row pause drafting for a while, after which one
    probe draft runs; each failed probe doubles the pause (up to ``MAX_PAUSE_STEPS``), and any
    accepted token ends the backoff. With ``enabled`` False the length stays ``max_len``.
    """

    def __init__(self, max_len: int, enabled: bool = True) -> None:
        if max_len < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {max_len}")
        self.max_len = max_len
        self.enabled = enabled

    def new_state(self) -> DraftLength:
        return DraftLength(length=self.max_len)

    def limit(self, state: DraftLength) -> int:
        """The most tokens to propose this step (0 while paused); counts one paused step."""
        if not self.enabled:
            return self.max_len
        if state.pause_steps > 0:
            state.pause_steps -= 1
            return 0
        return state.length

    def update(self, state: DraftLength, num_proposed: int, num_accepted: int) -> None:
        if not self.enabled or num_proposed <= 0:
            return
        if num_accepted <= 0:
            state.misses += 1
            state.length = max(1, state.length // 2)
            if state.misses >= MISSES_BEFORE_PAUSE:
                state.pause_steps = state.next_pause
                state.next_pause = min(2 * state.next_pause, MAX_PAUSE_STEPS)
            return
        state.misses = 0
        state.next_pause = FIRST_PAUSE_STEPS
        if num_accepted >= num_proposed:
            state.length = min(self.max_len, max(state.length + 1, 2 * state.length))
        else:
            state.length = min(self.max_len, num_accepted + 1)


@dataclass
class DraftCounters:
    """Totals over verified drafts, for ``Drafter.stats``."""

    num_proposed: int = 0  # draft tokens verified
    num_accepted: int = 0  # of those, accepted
    num_verified: int = 0  # drafts verified (observe calls with a non-empty draft)

    def add(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed > 0:
            self.num_proposed += num_proposed
            self.num_accepted += num_accepted
            self.num_verified += 1

    def as_dict(self) -> dict[str, float]:
        return {
            "num_proposed": float(self.num_proposed),
            "num_accepted": float(self.num_accepted),
            "num_verified": float(self.num_verified),
            "acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            # accepted draft tokens per verified draft (the target adds one token of its own)
            "mean_accepted_len": self.num_accepted / self.num_verified
            if self.num_verified
            else 0.0,
        }
