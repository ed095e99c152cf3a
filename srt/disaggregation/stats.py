"""Transfer figures for ``/server_info`` and ``/metrics``: cumulative counts and bytes, and the
rate over the transfers' own time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransferStats:
    num_transfers: int = 0  # completed
    num_failures: int = 0  # refused, failed or timed out
    bytes_total: int = 0
    seconds_total: float = 0.0  # time spent inside the engine's writes

    def on_transfer(self, nbytes: int, seconds: float) -> None:
        self.num_transfers += 1
        self.bytes_total += nbytes
        self.seconds_total += seconds

    def info(self, mode: str, backend: str, pending: int) -> dict:
        rate = self.bytes_total / self.seconds_total if self.seconds_total > 0 else 0.0
        return {
            "mode": mode,
            "transfer_backend": backend,
            "pending_transfers": pending,
            "num_transfers": self.num_transfers,
            "num_transfer_failures": self.num_failures,
            "transfer_bytes_total": self.bytes_total,
            "transfer_bytes_per_s": round(rate, 1),
        }
