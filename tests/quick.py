"""The inner loop's lighter property tests.

Under ``pytest -m "not slow"`` (the quick pass while working) the property-based and stateful
tests run a quarter of their examples; every other run, CI's whole suite included, runs them at
full strength. ``settings(max_examples=examples(300))``."""

from __future__ import annotations

import os

QUICK_ENV = "RADIXLM_TEST_QUICK"  # set by tests/conftest.py when the run deselects slow tests


def examples(full: int) -> int:
    """``full`` examples, or a quarter of them (at least 5) in the quick pass."""
    return max(5, full // 4) if os.environ.get(QUICK_ENV) == "1" else full
