"""Shared test set-up: the `gpu` marker skips without CUDA; one cache folder per session."""

from __future__ import annotations

import os
import tempfile

import pytest

# Converted default-model weights are cached here for the whole run (and reused across runs
# when RADIXLM_CACHE_DIR is set by the caller).
os.environ.setdefault("RADIXLM_CACHE_DIR", os.path.join(tempfile.gettempdir(), "radixlm-test-cache"))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
