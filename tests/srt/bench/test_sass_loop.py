"""The static loop profile of ``srt/bench/sass_loop.py`` (the loop found in SASS text; one real
sm_90 compile, slow) and ``tune_quant``'s summary lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from radixlm.srt.bench import sass_loop  # noqa: E402
from radixlm.srt.bench.tune_quant import summary  # noqa: E402

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;
        /*0020*/                   HADD2.BF16_V2 R4, R2, R5 ;
        /*0030*/              @P0  LOP3.LUT R6, R2, 0xf, RZ, 0xc0, !PT ;
        /*0040*/              @P1  BRA 0x10 ;
        /*0050*/                   STG.E desc[UR4][R8.64], R4 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
"""


def test_the_loop_is_the_longest_backward_branch_and_predicates_are_skipped():
    ops = sass_loop.loop_opcodes(SASS)
    assert ops == {"LOP3": 2, "HADD2": 1, "BRA": 1}  # 0x10..0x40; not the self-branch at 0x70


def test_the_summary_gives_the_range_over_shapes_per_kernel_and_rows():
    rows = [
        {"kernel": "int4_mm", "rows": 4, "heuristic_ratio": 1.5, "best_ratio": 1.2},
        {"kernel": "int4_mm", "rows": 4, "heuristic_ratio": 1.25, "best_ratio": 1.1},
        {"kernel": "bf16", "rows": 1, "heuristic_ratio": 1.04, "best_ratio": 1.04},
    ]
    assert summary(rows)[1:] == [
        "bf16 | 1 | 1.04-1.04x | 1.04-1.04x",
        "int4_mm | 4 | 1.25-1.50x | 1.10-1.20x",
    ]


@pytest.mark.slow
def test_int4_mm_costs_fewer_instructions_a_weight_than_the_fp32_gemv(tmp_path):
    """Compiled for sm_90 with Triton's bundled ptxas (no GPU; a process of its own: the suite
    runs Triton's interpreter): the packed conversion's K loop against the fp32 GEMV's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = tmp_path / "sass.json"
    cmd = [sys.executable, "-m", "radixlm.srt.bench.sass_loop", "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    (mm,) = [r for k, r in rows.items() if k.startswith("int4_mm rows 1 (") and "group" not in k]
    assert mm["per_weight"] < 0.5 * rows["int4 GEMV rows 1 (fp32 path)"]["per_weight"]
    assert mm["mma"] > 0  # tensor cores (wgmma or mma.sync, as Triton picks for the tile)
