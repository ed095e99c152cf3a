"""Makes the helper modules of this folder importable (tests/ has no packages)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
