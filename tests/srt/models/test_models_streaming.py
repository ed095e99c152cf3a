"""The weight-streaming decoder layer (``kernels/gemv.py``: norms, silu*mul and residual adds
folded into the projections) gives the layer-by-layer path's logits. On a CPU the kernels run
under the Triton interpreter, so the path is forced on here; on a GPU it is taken by itself for
batches of up to ``gemv.MAX_ROWS`` rows."""

from __future__ import annotations

import pytest
import torch
from model_batches import KVSession, max_rel_err, run_logits
from tiny_checkpoints import VOCAB, write_checkpoint

from radixlm.kernels import gemv
from radixlm.srt.executor.forward_batch import ForwardMode
from radixlm.srt.models.loader import load_model

# the Triton interpreter makes these minutes of CPU: part of the full suite, not the inner loop
pytestmark = [pytest.mark.skipif(gemv.triton is None, reason="needs triton"), pytest.mark.slow]

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE


@pytest.fixture(scope="module", params=["llama3_rope_sharded", "qwen3_qk_norm", "qwen3_moe_mixed"])
def model(request, tmp_path_factory):
    folder = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return load_model(folder, torch.float32, "cpu")


def _decode(model, prompts: list[list[int]], steps: int, streaming: bool) -> list[torch.Tensor]:
    """Logits of ``steps`` decode steps of the batch after a (layer-by-layer) prefill."""
    session = KVSession(model.config)
    reqs = [session.new_request() for _ in prompts]
    run_logits(model, session, EXTEND, [(r, p[:-1]) for r, p in zip(reqs, prompts, strict=True)])
    nxt = [p[-1] for p in prompts]
    out, calls = [], []
    cls = type(model.model.layers[0])  # LlamaDecoderLayer, MoEDecoderLayer
    original = cls._streams
    cls._streams = (
        (lambda self, h: calls.append(1) or self.can_stream(h)) if streaming else original
    )
    try:
        for _ in range(steps):
            logits = run_logits(
                model, session, DECODE, list(zip(reqs, [[t] for t in nxt], strict=True))
            )
            out.append(logits)
            nxt = logits.argmax(-1).tolist()
    finally:
        cls._streams = original
    assert not streaming or calls, "the streaming path was not asked"
    return out


# Output rows a program of the interpreted kernels: the launch config's GPU-sized blocks (4 rows
# at these widths) make one interpreted program per 4 rows, most of this module's time; a
# result does not depend on the config (tests/kernels/test_gemv.py), which this module does not
# test, so the layers' wiring is checked with fewer, wider programs.
INTERPRETED_BLOCK_N = 64


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.setattr(gemv, "ENABLED", True)
    launch_config = gemv.config

    def wide_config(m: int, n: int, k: int) -> dict:
        return {**launch_config(m, n, k), "BLOCK_N": INTERPRETED_BLOCK_N}

    monkeypatch.setattr(gemv, "config", wide_config)


@pytest.mark.parametrize("rows", [1, 3])
def test_streaming_decode_matches_layer_by_layer(model, rows, monkeypatch):
    widths = []  # the output widths of the streaming GEMVs (a MoE router's: its experts)
    plain = gemv.gemv
    monkeypatch.setattr(
        gemv, "gemv", lambda x, w, *a, **k: widths.append(w.shape[0]) or plain(x, w, *a, **k)
    )
    g = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(3, VOCAB, (9 + 4 * i,), generator=g).tolist() for i in range(rows)]
    layer = model.model.layers[0]
    assert layer.can_stream(torch.zeros(rows, model.config.hidden_size))
    ref = _decode(model, prompts, 2, streaming=False)
    got = _decode(model, prompts, 2, streaming=True)
    for step, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert max_rel_err(a, b) < 1e-5, f"decode step {step}"
    experts = getattr(getattr(layer.mlp, "gate", None), "weight", None)
    if experts is not None:  # the MoE layers route through the GEMV too
        assert experts.shape[0] in widths


def test_streaming_refuses_what_it_cannot_fold(model):
    layer = model.model.layers[0]
    assert not layer.can_stream(torch.zeros(gemv.MAX_ROWS + 1, model.config.hidden_size))
    assert not layer._streams(torch.zeros(1, model.config.hidden_size))  # a CPU tensor
    gemv.ENABLED = False  # restored by the fixture
    assert not layer.can_stream(torch.zeros(1, model.config.hidden_size))
    gemv.ENABLED = True
    bias = torch.nn.Parameter(torch.zeros(layer.self_attn.o_proj.out_features))
    layer.self_attn.o_proj.bias = bias
    layer._stream_ok.clear()  # the checks are kept per dtype once loaded: a new bias is new weights
    try:
        assert not layer.can_stream(torch.zeros(1, model.config.hidden_size))
    finally:
        layer.self_attn.o_proj.bias = None
        layer._stream_ok.clear()
