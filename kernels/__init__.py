"""radixlm's kernels, imported as ``radixlm.kernels``.

This folder is named ``kernels`` in the checkout, and so is an installed distribution that
transformers imports at start-up when it is present (``from kernels import ...``, Hugging Face's
hub kernels). When Python runs from the repository root (``python -m pytest``, ``python -m
radixlm.srt.server``) the root is first on ``sys.path``, so that import would find this folder
instead. Imported under the top-level name, this module hands the name to the installed
distribution (looked up without the repository root); without one it stays an empty module, as
before (transformers then finds no version and leaves hub kernels off).
"""

if __name__ == "kernels":
    import importlib
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _this = sys.modules.pop("kernels")
    try:
        importlib.import_module("kernels")  # the installed one: it takes sys.modules["kernels"]
    except ImportError:
        sys.modules["kernels"] = _this  # none installed: this (empty) module keeps the name
    finally:
        sys.path[:] = _saved
