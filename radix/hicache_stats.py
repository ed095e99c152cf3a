"""Counters and measured rates of a tiered prefix cache, and the load-or-recompute decision."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

EMA_WEIGHT = 0.2  # weight of the newest measurement in the moving averages
EXPLORE_EVERY = 16  # a load judged slower is still tried once in this many, to re-measure it
# The recompute cost is the marginal cost of a prompt token: a line fitted to recent prefill
# steps (seconds against tokens), so that a step's fixed cost (reading the weights, launching,
# the decode rows of a mixed step) is not charged to its tokens. Each step's weight in the fit
# falls by FIT_DECAY at every newer one; a slope needs step sizes that spread (coefficient of
# variation >= FIT_MIN_SPREAD), else the average cost per token stands.
FIT_DECAY = 0.05
FIT_MIN_SPREAD = 0.5


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new


@dataclass
class TierStats:
    """Hit tokens per tier, copies, skipped work, and the measured rates the cache decides by.

    ``prefill_s_per_token`` is what recomputing a token costs (from the scheduler's prefill
    steps: the slope of seconds against tokens where step sizes spread, which leaves a step's
    fixed cost out, never above the average cost per token);
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
    # what a disk hit really cost, end to end (wait for the reads, into the host pool, the
    # copy to the device), per token: the disk-or-recompute decision uses it once measured
    disk_s_per_token: float | None = None
    # seconds the scheduler thread spent in each phase (disk_wait, disk_to_host, load_back,
    # backup, store_pages): where a slow tier loses its time
    phase_seconds: dict[str, float] = field(default_factory=dict)
    _num_judged_slower: int = 0
    _prefill_avg: float | None = None  # moving average of seconds per token
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, n, s, n*n, n*s

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + elapsed

    def on_disk_load(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.disk_s_per_token = _ema(self.disk_s_per_token, seconds / num_tokens)

    def on_match(
        self, num_query: int, num_device: int, num_host: int, num_disk: int, loaded: bool
    ) -> None:
        self.queried_tokens += num_query
        self.device_hit_tokens += num_device
        if loaded:
            self.host_hit_tokens += num_host
            self.disk_hit_tokens += num_disk

    def on_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        self._prefill_avg = _ema(self._prefill_avg, seconds / num_tokens)
        keep, n, t = 1.0 - FIT_DECAY, float(num_tokens), seconds
        fit = self._fit
        for i, x in enumerate((1.0, n, t, n * n, n * t)):
            fit[i] = fit[i] * keep + x
        w, sum_n, sum_t, sum_nn, sum_nt = fit
        mean_n = sum_n / w
        var_n = sum_nn / w - mean_n * mean_n
        slope = None
        if var_n > (FIT_MIN_SPREAD * mean_n) ** 2:
            slope = (sum_nt / w - mean_n * sum_t / w) / var_n
        avg = self._prefill_avg
        self.prefill_s_per_token = slope if slope is not None and 0 < slope <= avg else avg

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
        return self._explore(load_seconds(num_tokens) < self.recompute_s(num_tokens))

    def _explore(self, pays_off: bool) -> bool:
        """``pays_off``, except that one load in EXPLORE_EVERY judged slower runs anyway: the
        rates it was judged by are measured only by loads that run."""
        if pays_off:
            return True
        self._num_judged_slower += 1
        return self._num_judged_slower % EXPLORE_EVERY == 0

    def disk_pays_off(
        self, num_tokens: int, bytes_per_token: int, load_seconds: Callable[[int], float]
    ) -> bool:
        """Whether reading ``num_tokens`` from disk and loading them beats recomputing them."""
        if self.prefill_s_per_token is None:
            return True
        if self.disk_s_per_token is not None:
            cost = num_tokens * self.disk_s_per_token
        else:
            read_s = 0.0
            if self.disk_bytes_per_s:
                read_s = num_tokens * bytes_per_token / self.disk_bytes_per_s
            cost = read_s + load_seconds(num_tokens)
        return self._explore(cost < self.recompute_s(num_tokens))

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        for private in ("_num_judged_slower", "_prefill_avg", "_fit"):
            del out[private]
        out["phase_seconds"] = {k: round(v, 4) for k, v in self.phase_seconds.items()}
        hits = self.device_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens
        q = self.queried_tokens
        out.update(
            hit_rate=round(hits / q, 4) if q else 0.0,
            device_hit_rate=round(self.device_hit_tokens / q, 4) if q else 0.0,
            host_hit_rate=round(self.host_hit_tokens / q, 4) if q else 0.0,
            disk_hit_rate=round(self.disk_hit_tokens / q, 4) if q else 0.0,
        )
        return out
