"""Picks an attention backend by name: ``auto``, ``torch``, ``cpu``, ``triton`` or ``flashinfer``.

``auto`` resolves once at start-up: flashinfer where it imports on a CUDA device (and the model
has no attention sinks, which it does not implement), else triton on a CUDA device; on a CPU,
cpu where its C++ kernels build (``kernels/cpu_decode.py``), else torch. The GPU backends import
their libraries lazily, so this module
imports on any machine.
"""

from __future__ import annotations

import os

import torch

from radixlm.kernels import cpu_decode
from radixlm.kernels.attention.base import AttentionBackend, AttentionVariant
from radixlm.kernels.attention.cpu_backend import CpuAttentionBackend
from radixlm.kernels.attention.torch_backend import TorchAttentionBackend

ATTENTION_BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "flashinfer")
# head sizes FlashInfer's decode (split-KV state merging) and prefill kernels are built for
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # no float32 kernels


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # a broken install counts as missing
        return False
    return True


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_attention_backend(
    name: str,
    device: torch.device,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    sinks: bool = False,
) -> str:
    """The concrete backend name for ``name`` on ``device`` (``auto`` resolved; a ``head_dim``
    or ``dtype`` FlashInfer has no kernels for, or a model with attention ``sinks``, resolves
    to triton)."""
    if name not in ATTENTION_BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of "
            f"{', '.join(ATTENTION_BACKEND_NAMES)}"
        )
    if name != "auto":
        return name
    if device.type == "cuda":
        fits = (
            (head_dim is None or head_dim in FLASHINFER_HEAD_DIMS)
            and (dtype is None or dtype in FLASHINFER_DTYPES)
            and not sinks
        )
        if fits and flashinfer_available():
            return "flashinfer"
        if triton_available():
            return "triton"
    if device.type == "cpu" and cpu_decode.available():
        return "cpu"
    return "torch"


def make_attention_backend(
    name: str,
    device: torch.device,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    page_size: int = 1,
    scaling: float | None = None,
    dtype: torch.dtype | None = None,
    variants: list[AttentionVariant] | None = None,
    sinks: bool = False,
) -> AttentionBackend:
    """Builds the backend ``name`` for ``device``. flashinfer needs the model's attention shape
    (``num_heads``, ``num_kv_heads``, ``head_dim``), the KV ``page_size`` and, for layers with
    sliding windows, soft-caps or another scale, their ``variants`` (``base.attention_variants``)
    at construction. ``sinks``: the model's attention has sink logits (``auto`` then avoids
    flashinfer)."""
    resolved = resolve_attention_backend(name, device, head_dim, dtype, sinks)
    if resolved == "torch":
        return TorchAttentionBackend()
    if resolved == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU only, got {device}")
        if not cpu_decode.available():
            raise ValueError(
                "the cpu attention backend's C++ kernels could not be built (no compiler, or "
                "RADIXLM_CPU_KERNELS=0); use --attention-backend torch"
            )
        return CpuAttentionBackend()
    if resolved == "triton":
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpreted:
            raise ValueError(
                f"the triton attention backend needs a CUDA device, got {device} "
                "(set TRITON_INTERPRET=1 to debug the kernels on the CPU)"
            )
        if not triton_available():
            raise ValueError("the triton attention backend needs the triton package")
        from radixlm.kernels.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if None in (num_heads, num_kv_heads, head_dim):
        raise ValueError(
            "the flashinfer attention backend needs num_heads, num_kv_heads and head_dim"
        )
    from radixlm.kernels.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(
        device,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        scaling=scaling,
        dtype=dtype,
        variants=variants,
    )
