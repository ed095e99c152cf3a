"""radix/ is a library: it never imports the serving runtime (radixlm.srt)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

RADIX_DIR = Path(__file__).resolve().parents[2] / "radix"
SRT_IMPORT = re.compile(r"^\s*(from|import)\s+(radixlm\.srt|srt)\b|['\"]radixlm\.srt", re.M)


def test_no_radix_source_mentions_an_srt_import() -> None:
    sources = sorted(RADIX_DIR.rglob("*.py"))
    assert sources, f"no sources found under {RADIX_DIR}"
    offenders = [str(p) for p in sources if SRT_IMPORT.search(p.read_text())]
    assert offenders == []


def test_pattern_catches_srt_imports() -> None:
    assert SRT_IMPORT.search("from radixlm.srt.config import ServerConfig\n")
    assert SRT_IMPORT.search("    import radixlm.srt\n")
    assert SRT_IMPORT.search("importlib.import_module('radixlm.srt.x')\n")
    assert not SRT_IMPORT.search("from radixlm.radix.base import PrefixCache\n")


def test_importing_radix_loads_no_srt_module() -> None:
    code = (
        "import sys, radixlm.radix; print([m for m in sys.modules if m.startswith('radixlm.srt')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
