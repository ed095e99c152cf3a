"""An on/off switch of a kernel family, for benchmarks and tests that run the same process with
the kernels and without them (the callers then take their torch paths)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class KernelSwitch:
    def __init__(self) -> None:
        self.is_on = True

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Off inside the block (nested blocks restore what they found)."""
        previous, self.is_on = self.is_on, False
        try:
            yield
        finally:
            self.is_on = previous
