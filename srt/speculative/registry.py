"""Drafters by name: ``speculative_algorithm`` -> the drafter the scheduler verifies."""

from __future__ import annotations

from typing import Any

from radixlm.srt.config import SPECULATIVE_ALGORITHMS, ServerConfig
from radixlm.srt.speculative.base import Drafter, NullDrafter


def make_drafter(cfg: ServerConfig, target_runner: Any, cache: Any) -> Drafter:
    """The drafter ``cfg.speculative_algorithm`` names.

    ``target_runner`` is the target's ``ModelRunner`` (the draft model drafter reads its
    device, dtype, tokenizer, vocabulary and KV budget); ``cache`` is the scheduler's prefix
    cache (the n-gram drafter reads continuations from it, never changing it).
    ``"none"`` gives a :class:`NullDrafter`.
    """
    algo = cfg.speculative_algorithm
    if algo == "none":
        return NullDrafter()
    if algo == "ngram":
        from radixlm.srt.speculative.ngram import NgramDrafter  # only when asked for

        return NgramDrafter.from_config(cfg, cache)
    if algo == "draft":
        from radixlm.srt.speculative.draft_model import DraftModelDrafter  # loads a model

        return DraftModelDrafter.from_config(cfg, target_runner)
    raise ValueError(
        f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, got {algo!r}"
    )
