"""Speculative decoding: drafters that propose tokens the scheduler verifies in one forward.

See ``base.py`` for the contract and README.md for the design; the acceptance rule lives in
``radixlm.srt.sampling.speculative``.
"""

from __future__ import annotations

from radixlm.srt.speculative.base import Draft, Drafter, NullDrafter
from radixlm.srt.speculative.registry import make_drafter

__all__ = ["Draft", "Drafter", "NullDrafter", "make_drafter"]
