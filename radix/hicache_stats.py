"""Counters and measured rates of a tiered prefix cache, and the load-or-recompute decision."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

EMA_WEIGHT = 0.2  # weight of the newest measurement in the moving averages


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new


@dataclass
class TierStats:
    """Hit tokens per tier, copies, skipped work, and the measured rates the cache decides by.

    ``prefill_s_per_token`` is what recomputing costs (from the scheduler's prefill steps);
    ``disk_bytes_per_s`` what reading pages back costs (from the storage threads' reads). Before
    a rate is measured the cache assumes loading pays off; the first measurement replaces that.
    """

    queried_tokens: int = 0  # tokens (page-aligned) admissions asked for
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    load_back_tokens: int = 0  # host -> device
    write_back_tokens: int = 0  # device -> host
    device_evicted_to_host: int = 0  # tokens that left the device but stayed in host memory
    disk_read_bytes: int = 0
    loads_skipped_slower: int = 0  # loads estimated slower than recomputing the tokens
    loads_skipped_no_memory: int = 0  # no device slots for an all-or-nothing load
    backups_skipped: int = 0  # host pool full of locked or in-flight pages
    disk_writes_skipped: int = 0  # the disk writer's queue was full
    prefill_s_per_token: float | None = None
    disk_bytes_per_s: float | None = None

    def on_match(
        self, num_query: int, num_device: int, num_host: int, num_disk: int, loaded: bool
    ) -> None:
        self.queried_tokens += num_query
        self.device_hit_tokens += num_device
        if loaded:
            self.host_hit_tokens += num_host
            self.disk_hit_tokens += num_disk

    def on_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.prefill_s_per_token = _ema(self.prefill_s_per_token, seconds / num_tokens)

    def on_disk_read(self, num_bytes: int, seconds: float) -> None:
        self.disk_read_bytes += num_bytes
        if num_bytes > 0 and seconds > 1e-6:
            self.disk_bytes_per_s = _ema(self.disk_bytes_per_s, num_bytes / seconds)

    def recompute_s(self, num_tokens: int) -> float:
        """Seconds to recompute ``num_tokens`` tokens (0 before any prefill was measured)."""
        return 0.0 if self.prefill_s_per_token is None else num_tokens * self.prefill_s_per_token

    def load_pays_off(self, num_tokens: int, load_seconds: Callable[[int], float]) -> bool:
        """Whether copying ``num_tokens`` host tokens to the device beats recomputing them."""
        if self.prefill_s_per_token is None:
            return True
        return load_seconds(num_tokens) < self.recompute_s(num_tokens)

    def disk_pays_off(
        self, num_tokens: int, bytes_per_token: int, load_seconds: Callable[[int], float]
    ) -> bool:
        """Whether reading ``num_tokens`` from disk and loading them beats recomputing them."""
        if self.prefill_s_per_token is None:
            return True
        read_s = 0.0
        if self.disk_bytes_per_s:
            read_s = num_tokens * bytes_per_token / self.disk_bytes_per_s
        return read_s + load_seconds(num_tokens) < self.recompute_s(num_tokens)

    def as_dict(self) -> dict[str, float | int | None]:
        out = asdict(self)
        hits = self.device_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens
        q = self.queried_tokens
        out.update(
            hit_rate=round(hits / q, 4) if q else 0.0,
            device_hit_rate=round(self.device_hit_tokens / q, 4) if q else 0.0,
            host_hit_rate=round(self.host_hit_tokens / q, 4) if q else 0.0,
            disk_hit_rate=round(self.disk_hit_tokens / q, 4) if q else 0.0,
        )
        return out
