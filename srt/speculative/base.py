"""The drafter contract: what the scheduler asks of a speculative-decoding proposer.

A *drafter* guesses the next few tokens of each running request; the scheduler verifies the
guesses with one target forward of ``1 + len(draft)`` positions per request and keeps the
longest prefix the acceptance rule (``srt/sampling/speculative.py``) accepts, plus one token
the target itself chose. A bad guess costs compute, never correctness.

Requests are duck-typed (this package sits below the scheduler and never imports it). A drafter
reads only:

- ``rid``: a hashable request id, the key of any per-request state;
- ``prompt_ids`` / ``output_ids``: ``list[int]``; the request's sequence is their concatenation,
  and a draft continues it after its last token;
- ``params``: the request's ``SamplingParams`` (temperature, top-k/top-p/min-p);
- ``generator``: a ``torch.Generator`` or None (seeded requests).

Calling order per request, from one thread (the scheduler's):
``propose`` (any number of steps) -> ``observe`` after each verification that had a draft ->
... -> ``release`` exactly once, when the request finishes or is retracted (a retracted request
that comes back starts again from ``propose``; the drafter rebuilds what it needs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Draft:
    """Proposed tokens for one request, continuing its sequence after its last token."""

    token_ids: list[int]  # the proposed continuation, possibly empty
    # [len(token_ids), vocab] float32, the distribution each draft token was drawn from (on any
    # device); None: a deterministic proposal (one-hot q, as n-gram drafts)
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(
                f"Draft.probs has {self.probs.shape[0]} rows for {len(self.token_ids)} tokens"
            )

    def __len__(self) -> int:
        return len(self.token_ids)


class Drafter(ABC):
    """Proposes draft tokens per request and learns from how many were accepted.

    Invariants: ``propose`` returns exactly one ``Draft`` per request, with at most
    ``max_tokens[i]`` tokens (0: an empty draft). A drafter holds per-request state only between
    a request's first ``propose`` and its ``release``; after ``release`` of every request it
    holds none (its KV pool, if it has one, is back to empty).
    """

    name: str = "base"

    @abstractmethod
    def propose(self, reqs: Sequence[Any], max_tokens: Sequence[int]) -> list[Draft]:
        """One draft per request, ``len(drafts[i]) <= max_tokens[i]``."""

    def observe(self, req: Any, num_proposed: int, num_accepted: int) -> None:  # noqa: B027
        """After verification: the first ``num_accepted`` (0..num_proposed) of the
        ``num_proposed`` draft tokens of the last ``propose`` were kept.

        Call it once per verified draft (``num_proposed > 0``), before the next ``propose``
        for that request, either before or after the accepted tokens (and the target's own
        next token) are appended to ``req.output_ids``: the drafter relies on the counts only.
        Adaptive drafters shorten or pause drafts here; draft-model drafters drop the draft KV
        of rejected tokens. A draft never observed (a step that failed) is tolerated: the next
        ``propose`` compares its state with the request's tokens.
        """

    def release(self, req: Any) -> None:  # noqa: B027 (a no-op is a valid default)
        """The request finished or was retracted: drop everything held for it."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters for server info: at least ``num_proposed`` and ``num_accepted``."""

    def num_tracked(self) -> int:
        """Requests the drafter holds state for: 0 when nothing runs (the leak invariant)."""
        return 0

    def close(self) -> None:  # noqa: B027
        """Free the drafter's own resources (model, KV pool) at shutdown."""


class NullDrafter(Drafter):
    """Speculation off: proposes nothing, holds nothing."""

    name = "none"

    def propose(self, reqs: Sequence[Any], max_tokens: Sequence[int]) -> list[Draft]:
        return [Draft([]) for _ in reqs]

    def stats(self) -> dict[str, float]:
        return {"num_proposed": 0.0, "num_accepted": 0.0}
