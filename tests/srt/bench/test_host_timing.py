"""The bench instrumentation: host parts counted per step and removed afterwards; GPU gap
classes from profiler-like events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixlm.srt.bench.host_timing import HostTimer, gaps_per_step, gpu_gaps, per_step


@pytest.mark.slow
def test_host_timer_counts_steps_and_restores(tmp_path):
    from radixlm.srt import Engine
    from radixlm.srt.bench.bench_gpu import TINY_LLAMA, make_model_folder
    from radixlm.srt.scheduler import overlap
    from radixlm.srt.scheduler import scheduler as scheduler_module

    folder = make_model_folder(tmp_path / "tiny", TINY_LLAMA)
    engine = Engine(model_path=str(folder), load_format="dummy", log_level="warning")
    try:
        originals = (scheduler_module.launch_decode, overlap.InflightDecode.read_back)
        params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
        with HostTimer(engine) as timer:
            engine.generate(input_ids=[[5, 6, 7, 8]] * 3, sampling_params=params)
            snap = timer.snapshot()
        assert snap["scheduler.step"][1] >= 6  # a prefill and five decode steps at least
        assert snap["detokenizer.handle"][1] >= 1
        assert snap["engine.run_once"][0] >= snap["scheduler.step"][0] > 0
        # every wrapper is gone: instance attributes removed, class and module ones restored
        assert "step" not in vars(engine.scheduler)
        assert "_run_once" not in vars(engine)
        assert (scheduler_module.launch_decode, overlap.InflightDecode.read_back) == originals
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=params)
        assert len(out["output_ids"]) == 6
        assert snap == timer.snapshot()  # nothing counted after the exit
        assert timer.take() == snap and timer.snapshot()["scheduler.step"] == (0.0, 0)
    finally:
        engine.shutdown()


def _evt(start, end, name="k"):
    return SimpleNamespace(
        device_type=torch.autograd.DeviceType.CUDA,
        time_range=SimpleNamespace(start=start, end=end),
        name=name,
    )


def test_gpu_gaps_classes_and_long_pairs():
    cpu = SimpleNamespace(device_type=torch.autograd.DeviceType.CPU)
    events = [
        _evt(0, 10, "a"),
        _evt(5, 12, "b"),  # overlaps a: merged
        _evt(14, 20, "c"),  # 2 us gap
        _evt(50, 60, "d"),  # 30 us gap
        _evt(260, 300, "argmax"),  # 200 us gap, long
        _evt(1300, 1310, "gemm"),  # 1000 us gap, long
        cpu,
    ]
    prof = SimpleNamespace(events=lambda: events)
    g = gpu_gaps(prof)
    assert g["busy_us"] == pytest.approx(12 + 6 + 10 + 40 + 10)
    assert g["buckets"]["<5us"] == {"count": 1, "us": 2.0}
    assert g["buckets"]["<50us"] == {"count": 1, "us": 30.0}
    assert g["buckets"]["<500us"] == {"count": 1, "us": 200.0}
    assert g["buckets"]["<infus"] == {"count": 1, "us": 1000.0}
    assert [p["pair"] for p in g["long_gap_pairs"]] == ["d -> argmax", "argmax -> gemm"]
    empty = gpu_gaps(SimpleNamespace(events=lambda: []))
    per = gaps_per_step(empty, g, steps=2)["per_step"]
    assert per["<infus"] == {"count": 0.5, "ms": 0.5}


def test_per_step_difference():
    short = {"x": (1.0, 10)}
    long = {"x": (3.0, 30)}
    assert per_step(short, long, 4) == {"x": {"ms": 500.0, "calls": 5.0}}


def test_steady_step_is_the_median_launch_interval():
    from radixlm.srt.bench.host_timing import steady_step_s

    starts = [0.0, 5.0, 5.1, 5.2, 6.0, 7.0, 8.0, 9.5, 10.5]  # the first 3 intervals are warm-up
    assert steady_step_s(starts) == 1.0
    assert steady_step_s([0.0, 1.0]) is None
