"""Prefill-decode disaggregation: the transfer engine contract (``base.py``), Mooncake's
engine (``mooncake.py``), the pair's control messages and sockets (``handshake.py``) and the
transfer figures (``stats.py``). The scheduler's two roles built on them are
``srt/scheduler/disagg_prefill.py`` and ``srt/scheduler/disagg_decode.py``."""

from __future__ import annotations

from radixlm.srt.disaggregation.base import (
    KVLayout,
    TransferEngine,
    TransferError,
    kv_writes,
    make_transfer_engine,
    slot_runs,
)
from radixlm.srt.disaggregation.handshake import (
    Cancel,
    Link,
    Outcome,
    Registration,
    is_listening,
    prompt_digest,
)
from radixlm.srt.disaggregation.stats import TransferStats

__all__ = [
    "Cancel",
    "KVLayout",
    "Link",
    "Outcome",
    "Registration",
    "TransferEngine",
    "TransferError",
    "TransferStats",
    "is_listening",
    "kv_writes",
    "make_transfer_engine",
    "prompt_digest",
    "slot_runs",
]
