"""The fp8 KV pool's per-layer scales, chosen once at start-up (``--kv-cache-scales``).

``calibrate`` (the default), like vLLM's ``calculate_kv_scales``: the built-in
:data:`CALIBRATION_TEXT` (prose, a chat exchange, code, numbers and JSON; nothing downloaded)
runs through the model as one extend forward, on a request row and KV slots borrowed from the
runner's pools and given back afterwards, while the pool records each layer's largest |K| and
|V| before quantisation. ``unit``: every scale 1.0. Otherwise the path of a JSON file
``{"k_scales": [...], "v_scales": [...]}`` (one float per layer, e.g. a previous run's
``/server_info`` ``kv_scales``). The scales must be set before CUDA graphs are captured (they are
constants of the graphs) and before any request writes KV (``KVPool.set_scales`` refuses later).

A layer's scale is ``amax * SCALE_MARGIN / fp8_max`` rounded UP to a power of two:

- rounded to a power of two because dividing by one is exact: the scale only moves the window
  of representable magnitudes (e4m3: 2^-6..448 at full relative precision 2^-4, then subnormal
  steps of 2^-9), it adds no rounding of its own;
- rounded up, and with a margin, because other text may exceed what the calibration text
  produced: a value beyond ``fp8_max * scale`` saturates (clipped, still finite), while a scale
  twice too large only pushes the smallest values one binade further into the subnormals;
- never below :data:`MIN_SCALE` (an all-zero layer: the scale stays a finite positive number)
  nor above :data:`MAX_SCALE` (inf or NaN from a random-init model: values saturate instead).

With tensor parallelism every rank runs the same forward (the model has collectives) over its
own KV heads; the per-layer maxima are then taken over the ranks, so every rank uses the same
scales (the JSON format's and ``/server_info``'s one float per layer).

Measured on SmolLM2-135M (CPU, e4m3). The margin: the sixteen prompts of
``tests/srt/engine/test_engine_kv_fp8.py`` with 32 greedy tokens each went up to 1.15x (V)
and 1.01x (K) past the largest value that margin 1's scales hold, saturating 7e-7 of the V
values; with margin 1.5 none saturated, with 2 they used at most 0.58 of the range. Margin 2
leaves room for text further from the calibration's at no measurable cost:
teacher-forced over those prompts plus 128 greedy tokens (~2,500 positions), KL(plain || fp8)
is 6.0e-3 with margins 1, 2 or 4 and 6.1e-3 with 8 or 32 (5.8e-3 with unit scales: differences
of that size are noise, since e4m3's 3-bit mantissa, 2.6% RMS error on K and V at any of these
scales, dominates). Greedy agreement with the plain cache: see that test's docstring (6 of 16
prompts agree on all 32 tokens calibrated, 5 of 16 with unit scales). On this model calibration
changes little, because unit scales already hold its |K| < 19 and |V| < 12; it matters for
models whose K/V exceed 448 (unit scales saturate them) or sit far below 1.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from radixlm.srt.config import KV_CACHE_SCALE_MODES, read_kv_scales_file
from radixlm.srt.executor.forward_batch import ForwardBatch
from radixlm.srt.executor.memory_pool import KVAmax

if TYPE_CHECKING:
    from radixlm.srt.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

SCALE_MARGIN = 2.0  # headroom over the calibration amax (see the module docstring)
MIN_SCALE = 2.0**-24  # all-zero (or nearly) layers
MAX_SCALE = 2.0**24  # inf/NaN amax: saturate rather than scale by a non-finite number

CALIBRATION_TEXT = """\
The old lighthouse stood at the end of a narrow spit of rock, where the tide came in twice a \
day and took the path with it. For forty years the keeper climbed its ninety-two steps each \
evening, trimmed the wick, and wrote three lines in a logbook: the wind, the sea, the ships.

Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is \
split, oxygen is released, and carbon dioxide is fixed into sugars through the Calvin cycle. \
The overall reaction is 6 CO2 + 6 H2O -> C6H12O6 + 6 O2.

User: Can you explain what a hash table is, in two sentences?
Assistant: A hash table stores key-value pairs in an array, using a hash function to turn each \
key into an index. Lookups, inserts and deletes take constant time on average, as long as \
collisions are rare.
User: Thanks! And why would I pick a tree instead?
Assistant: Pick a balanced tree when you need the keys in order (range queries, the smallest \
key above x) or guaranteed worst-case O(log n) time.

```python
def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    \"\"\"Merges two sorted lists into one sorted list.\"\"\"
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]
```

Quarterly revenue (EUR millions): Q1 12.4, Q2 15.9, Q3 14.1, Q4 21.7; year-on-year growth \
was 8.3%, and 1,024 x 768 = 786,432 pixels.

{"id": 4817, "name": "Ada Lovelace", "born": 1815, "languages": ["en", "fr"], \
"scores": [0.92, 0.87, 1.0], "active": true, "address": null}

Il pleut doucement sur la ville. Der schnelle braune Fuchs springt über den faulen Hund. \
東京は日本の首都です。 Привет, как дела?
"""


def apply_kv_scales(runner: ModelRunner) -> None:
    """Sets the runner's (quantised) KV pool's scales as ``runner.cfg.kv_cache_scales`` says
    and logs them; call before any CUDA graph is captured and any request runs."""
    mode = runner.cfg.kv_cache_scales
    pool = runner.kv_pool
    fp8_max = torch.finfo(pool.storage_dtype).max
    if mode == "unit":
        k_scales, v_scales, source = [1.0] * pool.num_layers, [1.0] * pool.num_layers, "unit"
    elif mode == "calibrate":
        token_ids = calibration_token_ids(runner)
        amax = _max_over_ranks(runner, record_kv_amax(runner, token_ids))
        k_scales = scales_from_amax(amax.k, fp8_max, SCALE_MARGIN)
        v_scales = scales_from_amax(amax.v, fp8_max, SCALE_MARGIN)
        source = f"calibrated on {len(token_ids)} tokens, margin {SCALE_MARGIN:g}"
    else:
        assert mode not in KV_CACHE_SCALE_MODES
        k_scales, v_scales = read_kv_scales_file(mode)
        if len(k_scales) != pool.num_layers:
            raise ValueError(
                f"kv_cache_scales file {mode!r} has {len(k_scales)} scales per list, the model "
                f"has {pool.num_layers} layers"
            )
        source = f"from {mode}"
    pool.set_scales(k_scales, v_scales)
    logger.info(
        "KV scales (%s): k %s; v %s", source, _compact(pool.k_scales), _compact(pool.v_scales)
    )


def scales_from_amax(
    amax: list[float], fp8_max: float, margin: float = SCALE_MARGIN
) -> list[float]:
    """Per layer: ``amax * margin / fp8_max`` rounded up to a power of two, within
    ``[MIN_SCALE, MAX_SCALE]`` (non-finite amax: ``MAX_SCALE``)."""
    out = []
    for a in amax:
        x = min(a * margin / fp8_max, MAX_SCALE) if math.isfinite(a) else MAX_SCALE
        if x <= MIN_SCALE:
            out.append(MIN_SCALE)
            continue
        mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= mantissa < 1
        out.append(2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent)
    return out


def calibration_token_ids(runner: ModelRunner) -> list[int]:
    """:data:`CALIBRATION_TEXT` in the runner's tokenizer, ids the model knows only, cut to what
    one request may hold (the context length and the free KV slots); ``[0]`` if none is left."""
    ids = runner.tokenizer.encode(CALIBRATION_TEXT)
    ids = [t for t in ids if 0 <= t < runner.vocab_size]
    return ids[: min(runner.context_length, runner.allocator.available_size())] or [0]


def record_kv_amax(runner: ModelRunner, token_ids: list[int]) -> KVAmax:
    """Runs ``token_ids`` as one extend forward of a temporary request (a request row and KV
    slots from the runner's pools, given back afterwards: the pools are as before, but for the
    bytes in free slots) and returns the per-layer max |K| and |V| the pool was given. Calls
    the model directly, not ``runner.forward``: every tensor-parallel rank runs it itself."""
    table, allocator = runner.req_to_token_pool, runner.allocator
    n = len(token_ids)
    req_slot = table.alloc()
    kv_slots = allocator.alloc(n)
    if req_slot is None or kv_slots is None:  # cannot happen at start-up: the pools are empty
        raise RuntimeError(f"no request row or {n} KV slots free for the KV calibration")
    try:
        with torch.inference_mode(), runner.kv_pool.recording_amax() as amax:
            fb = ForwardBatch.one_prompt(
                token_ids,
                req_slot,
                kv_slots,
                req_to_token_pool=table,
                kv_pool=runner.kv_pool,
                attn_backend=runner.attn_backend,
            )
            runner.model(fb.input_ids, fb.positions, fb)
    finally:
        table.free(req_slot)
        allocator.free(kv_slots)
        allocator.collect_freed()
    return amax


def _max_over_ranks(runner: ModelRunner, amax: KVAmax) -> KVAmax:
    """Each layer's maxima over the tensor-parallel ranks (each holds other KV heads)."""
    if not runner.tp.is_distributed:
        return amax
    mine = torch.tensor([amax.k + amax.v], dtype=torch.float32, device=runner.device)
    both = runner.tp.all_gather(mine, dim=0).amax(dim=0).tolist()
    n = len(amax.k)
    return KVAmax(k=both[:n], v=both[n:])


def _compact(scales: list[float]) -> str:
    """``[2^-5 2^-4 0.3]``: powers of two as exponents, others with 3 digits."""
    parts = []
    for s in scales:
        mantissa, exponent = math.frexp(s)
        parts.append(f"2^{exponent - 1}" if mantissa == 0.5 else f"{s:.3g}")
    return "[" + " ".join(parts) + "]"
