"""Quantised checkpoints (FP8, AWQ, GPTQ, compressed-tensors) and ``--quantization fp8``: the
scheme a checkpoint declares (``scheme.py``), its on-disk layouts (``layouts.py``) and the
quantised linear layers that load and run them (``linear.py``)."""
