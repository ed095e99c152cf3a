"""Mooncake's transfer engine (PyPI ``mooncake-transfer-engine``, or ``-non-cuda`` on machines
without CUDA) behind the ``TransferEngine`` contract.

Started with ``P2PHANDSHAKE``: no metadata service; each engine listens on its own RPC port and
a peer's segment is opened on first use from its ``host:port``. Transports: ``tcp`` (any
machine) or ``rdma`` (RDMA NICs; ``ib_device`` names them). The wheel links
``libibverbs.so.1`` even for TCP (Debian: ``apt-get install libibverbs1``).
"""

from __future__ import annotations

import logging

import torch

from radixlm.srt.disaggregation.base import TransferError

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "the mooncake transfer engine is not importable: pip install mooncake-transfer-engine "
    "(CUDA) or mooncake-transfer-engine-non-cuda (CPU), and the RDMA verbs library "
    "(apt-get install libibverbs1)"
)


# writes submitted in one batch: the TCP transport's lane queue refuses a batch of a few
# thousand writes outright ("queue-full"), as a long prompt of scattered slots would make
MAX_WRITES_PER_BATCH = 256


class MooncakeEngine:
    name = "mooncake"

    def __init__(self, host: str, transport: str, ib_device: str | None) -> None:
        try:
            from mooncake.engine import TransferEngine as _Engine
        except ImportError as e:
            raise ValueError(f"{INSTALL_HINT} ({e})") from None
        self._engine = _Engine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", transport, ib_device or "")
        if rc != 0:
            raise ValueError(
                f"the mooncake transfer engine did not start on {host} with transport "
                f"{transport!r} (code {rc})"
            )
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self._buffers: list[torch.Tensor] = []  # kept alive while registered

    def register(self, buffers: list[torch.Tensor]) -> None:
        addrs = [b.data_ptr() for b in buffers]
        sizes = [b.numel() * b.element_size() for b in buffers]
        rc = self._engine.batch_register_memory(addrs, sizes)
        if rc != 0:
            raise ValueError(f"mooncake could not register the KV buffers (code {rc})")
        self._buffers += buffers

    def write_batch(
        self, peer: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]
    ) -> None:
        for i in range(0, len(src_addrs), MAX_WRITES_PER_BATCH):
            end = i + MAX_WRITES_PER_BATCH
            rc = self._engine.batch_transfer_sync_write(
                peer, src_addrs[i:end], dst_addrs[i:end], lengths[i:end]
            )
            if rc != 0:
                raise TransferError(f"mooncake write to {peer} failed (code {rc})")
