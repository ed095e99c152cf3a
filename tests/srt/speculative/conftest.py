"""Small request objects for drafter tests (drafters duck-type the scheduler's Req)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch

from radixlm.srt.sampling.params import SamplingParams

_rids = itertools.count()


@dataclass(eq=False)
class FakeReq:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    generator: torch.Generator | None = None
    rid: str = field(default_factory=lambda: f"req-{next(_rids)}")

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@pytest.fixture
def make_req():
    return FakeReq
