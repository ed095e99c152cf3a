"""The tiered-tree harness's fixture for the radix tests (tests/ is not a package)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hiradix_world import make_world  # noqa: E402,F401  (a fixture)
