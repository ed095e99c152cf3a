"""``--kv-cache-scales``: the pool's amax recording against a brute-force max, the power-of-two
scales, the start-up calibration on tiny models (real and dummy weights, pages of 1 and 16
tokens, tensor parallelism) leaving the pools as it found them, ``unit`` and JSON files (and
their refusals), and the scales in ``/server_info`` and the disk tier's fingerprint."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import tp_harness

from radixlm.srt import Engine
from radixlm.srt.config import config_from_kwargs
from radixlm.srt.executor import kv_calibration
from radixlm.srt.executor.kv_calibration import (
    MAX_SCALE,
    MIN_SCALE,
    SCALE_MARGIN,
    calibration_token_ids,
    record_kv_amax,
    scales_from_amax,
)
from radixlm.srt.executor.memory_pool import KVAmax, KVPool
from radixlm.srt.executor.model_runner import ModelRunner
from radixlm.srt.scheduler.cache_factory import model_fingerprint

CPU = torch.device("cpu")
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _is_power_of_two(x: float) -> bool:
    return math.frexp(x)[0] == 0.5


def test_recording_amax_equals_the_brute_force_max_of_what_was_written():
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(64, 3, 2, 8, torch.bfloat16, CPU, storage_dtype=torch.float8_e4m3fn)
    written: dict[tuple[int, str], list[torch.Tensor]] = {}
    with pool.recording_amax() as amax:
        for step in range(6):
            layer = step % 2  # layer 2 is never written: its amax stays 0
            n = 1 + step
            k = (torch.randn(n, 2, 8, generator=gen) * 10 ** (step - 3)).to(torch.bfloat16)
            v = (torch.randn(n, 2, 8, generator=gen) * 3).to(torch.bfloat16)
            pool.set_kv(layer, torch.arange(1, n + 1), k, v)
            written.setdefault((layer, "k"), []).append(k)
            written.setdefault((layer, "v"), []).append(v)
    for layer in range(2):
        for name, got in (("k", amax.k), ("v", amax.v)):
            expected = max(x.float().abs().max().item() for x in written[layer, name])
            assert got[layer] == expected, (layer, name)
    assert amax.k[2] == 0.0 and amax.v[2] == 0.0
    # writes inside the recording leave the scales settable; a write outside does not
    assert not pool.has_written_tokens
    pool.set_scales([0.5, 0.25, 1.0], [2.0, 1.0, 0.125])
    assert pool.get_scales(1) == (0.25, 1.0)
    pool.set_kv(0, torch.tensor([5]), k[:1], v[:1])
    with pytest.raises(RuntimeError, match="before any token is written"):
        pool.set_scales([1.0] * 3, [1.0] * 3)
    with pool.recording_amax() as again:  # a fresh recording starts from zero
        pool.set_kv(2, torch.tensor([7]), torch.full((1, 2, 8), -3.5), torch.zeros(1, 2, 8))
    assert again.k == [0.0, 0.0, 3.5] and again.v == [0.0, 0.0, 0.0]


def test_scales_are_the_smallest_powers_of_two_that_hold_amax_times_the_margin():
    amax = [19.0, 0.018, 448.0 / 2, 1e-9, 0.0, 1e12, float("inf"), float("nan"), 7.3]
    scales = scales_from_amax(amax, E4M3_MAX, 2.0)
    for a, s in zip(amax, scales, strict=True):
        assert _is_power_of_two(s) and MIN_SCALE <= s <= MAX_SCALE, (a, s)
        if math.isfinite(a) and s > MIN_SCALE and s < MAX_SCALE:
            assert a * 2.0 / s <= E4M3_MAX < a * 2.0 / (s / 2), (a, s)  # holds, and minimal
    assert scales[2] == 1.0  # exactly 448 after the margin: no rounding up
    assert scales[3] == scales[4] == MIN_SCALE  # (nearly) all-zero layers stay finite
    assert scales[5] == scales[6] == scales[7] == MAX_SCALE


def _runner(model_dir, **opts) -> ModelRunner:
    cfg = config_from_kwargs(
        model_path=str(model_dir),
        device="cpu",
        max_running_requests=4,
        max_total_tokens=1024,
        kv_cache_dtype="fp8_e4m3",
        **opts,
    )
    return ModelRunner(cfg)


def _assert_pools_idle(runner: ModelRunner) -> None:
    runner.allocator.check_integrity()
    assert runner.allocator.available_size() == runner.max_total_tokens
    table = runner.req_to_token_pool
    assert table.available_size() == table.num_req_slots
    assert not table.req_to_token.any()
    assert not runner.kv_pool.has_written_tokens


@pytest.mark.parametrize(
    "opts", [{}, {"page_size": 16}, {"load_format": "dummy", "page_size": 16}], ids=str
)
def test_calibration_sets_recorded_scales_and_gives_the_slots_back(tiny_llama_dir, opts):
    runner = _runner(tiny_llama_dir, **opts)
    _assert_pools_idle(runner)
    pool = runner.kv_pool
    ids = calibration_token_ids(runner)
    assert 400 <= len(ids) <= 600  # SmolLM2's tokenizer
    # the scales are those of the calibration forward's amax (run again: same forward)
    amax = record_kv_amax(runner, ids)
    _assert_pools_idle(runner)
    assert all(a > 0 for a in amax.k + amax.v)
    assert pool.k_scales == scales_from_amax(amax.k, E4M3_MAX, SCALE_MARGIN)
    assert pool.v_scales == scales_from_amax(amax.v, E4M3_MAX, SCALE_MARGIN)
    assert pool.k_scales != [1.0] * pool.num_layers  # a random model's |K| is far below 448
    for a, s in zip(amax.k + amax.v, pool.k_scales + pool.v_scales, strict=True):
        assert _is_power_of_two(s) and a * SCALE_MARGIN / s <= E4M3_MAX


def test_calibration_records_before_quantisation(tiny_llama_dir, monkeypatch):
    """A model whose K exceeds e4m3's range: the recorded amax is the real one (unit scales
    would saturate it), and the scale holds it."""
    seen: list[float] = []
    set_kv = KVPool.set_kv

    def scaled_set_kv(self, layer_id, kv_slots, k, v):
        if self._amax is not None:  # the calibration forward
            k = k * 1000.0
            seen.append(k.abs().max().item())
        return set_kv(self, layer_id, kv_slots, k, v)

    monkeypatch.setattr(KVPool, "set_kv", scaled_set_kv)
    runner = _runner(tiny_llama_dir)
    assert max(seen) > E4M3_MAX
    k_scales = runner.kv_pool.k_scales
    assert max(seen) * SCALE_MARGIN / max(k_scales) <= E4M3_MAX
    assert max(k_scales) == scales_from_amax([max(seen)], E4M3_MAX, SCALE_MARGIN)[0]


def test_unit_and_json_scales(tiny_llama_dir, tmp_path, caplog):
    unit = _runner(tiny_llama_dir, kv_cache_scales="unit")
    assert unit.kv_pool.scales_info() == {"k": [1.0, 1.0], "v": [1.0, 1.0]}
    path = tmp_path / "scales.json"
    path.write_text(json.dumps({"k_scales": [0.25, 0.5], "v_scales": [0.125, 3]}))
    with caplog.at_level("INFO", logger=kv_calibration.__name__):
        from_file = _runner(tiny_llama_dir, kv_cache_scales=str(path))
    assert from_file.kv_pool.scales_info() == {"k": [0.25, 0.5], "v": [0.125, 3.0]}
    assert any("k [2^-2 2^-1]; v [2^-3 3]" in r.getMessage() for r in caplog.records)
    calibrated = _runner(tiny_llama_dir)
    # a disk tier written with one set of scales is never read with another
    prints = [model_fingerprint(r.cfg, r) for r in (unit, from_file, calibrated)]
    assert len({json.dumps(p, sort_keys=True) for p in prints}) == 3
    assert prints[1]["kv_scales"] == {"k": [0.25, 0.5], "v": [0.125, 3.0]}
    # a file for another number of layers is refused at start-up
    path.write_text(json.dumps({"k_scales": [1.0] * 3, "v_scales": [1.0] * 3}))
    with pytest.raises(ValueError, match="kv_cache_scales file .* 3 scales .* 2 layers"):
        _runner(tiny_llama_dir, kv_cache_scales=str(path))


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "cannot read"),
        ("{not json", "not valid JSON"),
        ("[1.0, 2.0]", "must hold an object"),
        ('{"k_scales": [1.0]}', "must hold an object"),
        ('{"k_scales": [], "v_scales": []}', "k_scales must be a non-empty list"),
        ('{"k_scales": 1.0, "v_scales": [1.0]}', "k_scales must be a non-empty list"),
        ('{"k_scales": [1.0], "v_scales": [0]}', r"v_scales\[0\] must be a finite number > 0"),
        ('{"k_scales": [-2.0], "v_scales": [1.0]}', r"k_scales\[0\] must be a finite"),
        ('{"k_scales": [NaN], "v_scales": [1.0]}', r"k_scales\[0\] must be a finite"),
        ('{"k_scales": [Infinity], "v_scales": [1.0]}', r"k_scales\[0\] must be a finite"),
        ('{"k_scales": ["1"], "v_scales": [1.0]}', r"k_scales\[0\] must be a finite"),
        ('{"k_scales": [true], "v_scales": [1.0]}', r"k_scales\[0\] must be a finite"),
        ('{"k_scales": [1.0, 1.0], "v_scales": [1.0]}', "k_scales has 2 entries, v_scales 1"),
    ],
)
def test_bad_scales_files_are_refused_with_the_option_named(tmp_path, content, match):
    path = tmp_path / "scales.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        config_from_kwargs(kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(path))
    assert "kv_cache_scales" in str(info.value)


def test_a_scales_file_needs_an_fp8_kv_cache(tmp_path):
    path = tmp_path / "scales.json"
    path.write_text('{"k_scales": [1.0], "v_scales": [1.0]}')
    with pytest.raises(ValueError, match="kv_cache_scales .* needs an fp8 kv_cache_dtype"):
        config_from_kwargs(kv_cache_scales=str(path))
    for mode in ("calibrate", "unit"):  # modes: harmless without fp8 (nothing to scale)
        assert config_from_kwargs(kv_cache_scales=mode).kv_cache_scales == mode
    with pytest.raises(ValueError, match="kv_cache_scales must be calibrate, unit or"):
        config_from_kwargs(kv_cache_dtype="fp8_e5m2", kv_cache_scales="")


def test_engine_reports_the_scales_and_leaks_nothing(tiny_llama_dir):
    engine = Engine(
        model_path=str(tiny_llama_dir),
        device="cpu",
        kv_cache_dtype="fp8_e5m2",
        max_total_tokens=256,
        page_size=16,
        log_level="warning",
    )
    try:
        pool = engine.scheduler.runner.kv_pool
        info = engine.get_server_info()
        assert info["kv_scales"] == {"k": pool.k_scales, "v": pool.v_scales}
        assert all(_is_power_of_two(s) for s in pool.k_scales + pool.v_scales)
        out = engine.generate(
            "river mountain lantern " * 5, {"temperature": 0, "max_new_tokens": 4}
        )
        assert len(out["output_ids"]) == 4
        assert engine.scheduler.check_idle()
    finally:
        engine.shutdown()
    plain = Engine(
        model_path=str(tiny_llama_dir), device="cpu", max_total_tokens=256, log_level="warning"
    )
    try:
        assert plain.get_server_info()["kv_scales"] is None
        assert plain.scheduler.runner.kv_pool.scales_info() is None
    finally:
        plain.shutdown()


@pytest.mark.slow
def test_tensor_parallel_ranks_calibrate_together(tiny_llama_dir, tmp_path):
    """Every rank runs the calibration forward (the model's collectives pair up) and then
    serves: TP=2 with calibrated fp8 KV completes the harness's workload like TP=1."""
    results = tp_harness.run_ranks(tiny_llama_dir, tmp_path, kv_cache_dtype="fp8_e4m3")
    for r in results:
        assert "error" not in r, r["error"]
        assert r["exitcode"] == 0, r
    (outputs, steps, _), (ref_outputs, ref_steps, _) = results[0]["tp"], results[0]["ref"]
    assert len(outputs) == len(ref_outputs) == len(tp_harness.PROMPTS) + 1
    assert all(len(ids) == tp_harness.NUM_TOKENS for ids in outputs.values())
    pairs = [(g, r) for g, r in zip(steps, ref_steps, strict=True) if g.numel()]
    worst = max((g - r).abs().max().item() for g, r in pairs)
    print(f"TP=2 vs TP=1 logits, fp8 KV: max difference {worst:.2e}")
    assert worst < 1e-3, worst  # measured 3e-7: TP's rounding, rarely moved by an fp8 rounding


def test_ranks_take_each_layers_largest_amax():
    """With tensor parallelism each rank saw other KV heads: all use the per-layer maxima."""

    class TwoRanks:
        is_distributed = True

        def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
            other = torch.tensor([[1.0, 9.0, 0.5, 4.0]])  # the other rank's k0 k1 v0 v1
            return torch.cat([x, other], dim=dim)

    runner = SimpleNamespace(tp=TwoRanks(), device=CPU)
    mine = KVAmax(k=[2.0, 3.0], v=[0.25, 8.0])
    both = kv_calibration._max_over_ranks(runner, mine)
    assert both.k == [2.0, 9.0] and both.v == [0.5, 8.0]
