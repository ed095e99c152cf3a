"""Imports flow one way: the libraries never import the serving runtime."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRT_IMPORT = re.compile(r"^\s*(from|import)\s+radixlm\.srt\b", re.M)


@pytest.mark.parametrize("lib", ["radix", "grammar", "hicache", "kernels"])
def test_library_never_imports_srt(lib):
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / lib).rglob("*.py") if SRT_IMPORT.search(p.read_text())]
    assert offenders == []
