"""The brute-force model behind test_kv_state_machine.py: KV pages and requests' rows."""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.srt.scheduler.req import Req


@dataclass(eq=False)
class Tracked:
    req: Req
    phase: str  # "waiting" | "chunked" (between prefill chunks) | "running"
    slots: list[int]  # the model's req_to_token[req_slot, :num_kv_tokens]
    locked: tuple[int, ...] | None = None  # tokens of the locked cached prefix
    has_row: bool = False


class KVModel:
    """Pages: free, cached under ``tokens up to the page's end``, or owned by a request."""

    def __init__(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.free: set[int] = set(range(num_pages))
        self.cache: dict[tuple[int, ...], tuple[int, ...]] = {}

    def page_of(self, slot: int) -> int:
        return (slot - 1) // self.ps

    def pages(self, slots: list[int]) -> set[int]:
        return {self.page_of(s) for s in slots}

    def aligned(self, n: int) -> int:
        return n // self.ps * self.ps

    def cached_len(self, tokens: list[int]) -> int:
        n = 0
        while n + self.ps <= len(tokens) and tuple(tokens[: n + self.ps]) in self.cache:
            n += self.ps
        return n

    def cached_slots(self, tokens: list[int], n: int) -> list[int]:
        return [s for e in range(self.ps, n + 1, self.ps) for s in self.cache[tuple(tokens[:e])]]

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        present = self.cached_len(tokens)
        for end in range(present + self.ps, self.aligned(len(tokens)) + 1, self.ps):
            self.cache[tuple(tokens[:end])] = tuple(slots[end - self.ps : end])
        return present

    def release_pages(self, slots: list[int]) -> None:
        pages = self.pages(slots)
        assert not pages & self.free, f"pages {sorted(pages & self.free)} freed twice"
        self.free |= pages
