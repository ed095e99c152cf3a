"""bench_cpu's table: medians over alternating rounds, ratios against the first contender."""

from __future__ import annotations

import sys

import pytest

from radixlm.srt.bench import bench_cpu
from radixlm.srt.bench.bench_cpu import Contender, report, same_ids_check


def fake(name: str, ids: list[int]) -> Contender:
    return Contender(name, run=lambda prompts, n: 0.0, ids=lambda prompt, n: ids[:n])


def test_report_gives_medians_and_ratios(capsys):
    a, b = fake("llama.cpp", []), fake("radixlm int4", [])
    loads = {"batch 1": ([[1] * 128], 5), "prefill 512": ([[1] * 512], 1)}
    # (full run, one-token run) per round: a steps at 100 ms, b at 50 ms (medians drop 9.0)
    a.times = {"batch 1": [(0.5, 0.1), (0.5, 0.1), (9.0, 0.1)], "prefill 512": [(1.0, 1.0)] * 3}
    b.times = {"batch 1": [(0.25, 0.05), (0.25, 0.05), (0.3, 0.1)], "prefill 512": [(0.5, 0.5)] * 3}
    report([a, b], loads)
    rows = {line[:46].split("  ")[0].strip() + "|" + line[20:46].strip(): line.split()[-3:]
            for line in capsys.readouterr().out.splitlines()[1:-1]}  # fmt: skip
    assert rows["batch 1|llama.cpp"] == ["10.0", "100.00", "1.00x"]
    assert rows["batch 1|radixlm int4"] == ["20.0", "50.00", "2.00x"]
    assert rows["prefill 512|radixlm int4"] == ["1024.0", "-", "2.00x"]


def test_same_ids_check_counts_agreeing_tokens(capsys):
    loads = {"batch 1": ([[5, 6]], 4)}
    same_ids_check([fake("a", [1, 2, 3, 4]), fake("b", [1, 2, 9, 4])], loads, 4)
    out = capsys.readouterr().out
    assert "greedy ids of a: 4/4" in out and "greedy ids of b: 3/4" in out


def test_llama_cpp_is_optional(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as when not installed
    with pytest.raises(ImportError):
        bench_cpu.llama_cpp_contender(tmp_path / "m.gguf", 1, 64, True)


def test_cpu_model_names_the_threads():
    assert "threads of" in bench_cpu.cpu_model()


class ProbeEngine:
    """An engine stand-in whose ``generate`` records ``probe()`` (what a contender's scope set)."""

    def __init__(self, probe):
        self.probe, self.seen = probe, []

    def flush_cache(self):
        pass

    def generate(self, input_ids, sampling_params):
        self.seen.append(self.probe())
        n = sampling_params["max_new_tokens"]
        return [{"output_ids": [1] * n, "meta_info": {"completion_tokens": n}}]


def test_step_contenders_switch_the_one_call_step(monkeypatch):
    from radixlm.kernels import cpu_step

    if not cpu_step.available():
        pytest.skip("the CPU kernels could not be built (no C++ compiler)")
    engine = ProbeEngine(cpu_step.available)
    for step in (True, False):
        bench_cpu.radixlm_contender(engine, "radixlm int4", True, step).run([[1]], 2)
    assert engine.seen == [True, False] and cpu_step.available()


def test_rows_contenders_set_the_int4_row_limit():
    from radixlm.kernels import gguf_cpu

    engine = ProbeEngine(gguf_cpu.matmul_rows)
    for rows in (16, None):
        bench_cpu.radixlm_contender(engine, "radixlm int4", True, rows=rows).run([[1]], 2)
    assert engine.seen == [16, gguf_cpu.MATMUL_ROWS]
    assert gguf_cpu.matmul_rows() == gguf_cpu.MATMUL_ROWS


@pytest.mark.slow
def test_llama_cpp_batched_equals_one_by_one():
    """Where llama-cpp-python is installed: its batch API decoding three prompts together gives
    the tokens its high-level API gives each prompt alone (the default model's GGUF)."""
    pytest.importorskip("llama_cpp")
    from radixlm.srt.models.default_model import default_gguf_path

    gguf = default_gguf_path()
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 140)), [2, 9, 77]]
    single = bench_cpu.llama_cpp_contender(gguf, 1, 128, True)
    expect = [single.ids(p, 8) for p in prompts]
    batched = bench_cpu.llama_cpp_batched_contender(gguf, 1, 128, len(prompts), True)
    assert batched.ids(prompts[1], 8) == expect[1]
    from radixlm.srt.bench.llama_cpp_batched import open_batched

    assert open_batched(gguf, len(prompts), 128, 1, True).generate(prompts, 8) == expect


def test_server_overhead_is_the_servers_time_less_its_engines(capsys):
    engine, server = fake("radixlm int4", []), fake("radixlm int4 server", [])
    loads = {"batch 1": ([[1] * 128], 5)}
    engine.times = {"batch 1": [(0.5, 0.1)] * 3}  # 100 ms a step, 100 ms the one-token run
    server.times = {"batch 1": [(0.62, 0.11)] * 3}  # 10 ms more a request, 27.5 ms a step
    bench_cpu.server_overhead([engine, server], loads)
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[-2:] == ["10.00", "27.50"]


@pytest.mark.slow
def test_the_server_contender_runs_a_batch_over_http(default_server):
    """A real server: one /generate for the workload's prompts, greedy ids as the run's."""
    c = bench_cpu.server_contender(default_server.url, "radixlm fp32 server")
    assert c.run([[1, 2, 3], [4, 5, 6, 7]], 3) > 0
    ids = c.ids([1, 2, 3], 4)
    assert len(ids) == 4 and ids[:3] == c.ids([1, 2, 3], 3)
