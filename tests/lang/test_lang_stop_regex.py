"""gen(stop_regex=...) and the run-wide default reach the server's sampling parameters."""

from __future__ import annotations

import pytest

from radixlm.lang.ir import GenParams
from radixlm.lang.primitives import gen
from radixlm.lang.program import sampling_defaults
from radixlm.srt.sampling.params import SamplingParams


def test_gen_passes_stop_regex() -> None:
    params = gen("x", stop_regex=[r"\d+\.", "END"]).params
    sp = params.to_sampling_params()
    assert sp["stop_regex"] == [r"\d+\.", "END"]
    assert SamplingParams.from_dict(sp).stop_regexes == [r"\d+\.", "END"]
    assert gen("x", stop_regex="END").params.to_sampling_params()["stop_regex"] == "END"
    assert "stop_regex" not in gen("x").params.to_sampling_params()


def test_run_default_is_inherited_and_overridden() -> None:
    defaults = sampling_defaults(stop_regex=("a+b",))
    assert GenParams().merged_over(defaults).stop_regex == ("a+b",)
    own = gen("x", stop_regex="c").params.merged_over(defaults)
    assert own.stop_regex == "c"


@pytest.mark.parametrize("bad", ["(ab", "", ["ok", 3]])
def test_gen_refuses_bad_patterns(bad) -> None:
    with pytest.raises(ValueError, match=r"gen\('x'\): stop_regex"):
        gen("x", stop_regex=bad)
