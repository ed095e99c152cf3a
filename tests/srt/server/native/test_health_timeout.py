"""/health_generate's wait comes from RADIXLM_HEALTH_CHECK_TIMEOUT (SGLang's 20 s by default);
a value that is not a positive number of seconds is refused, naming the variable."""

from __future__ import annotations

import pytest

from radixlm.srt.server.native.health import _health_check_timeout_s


def test_default_and_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RADIXLM_HEALTH_CHECK_TIMEOUT", raising=False)
    assert _health_check_timeout_s() == 20.0
    monkeypatch.setenv("RADIXLM_HEALTH_CHECK_TIMEOUT", "6.5")
    assert _health_check_timeout_s() == 6.5


@pytest.mark.parametrize("text", ["abc", "", "-1", "0", "inf", "nan"])
def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("RADIXLM_HEALTH_CHECK_TIMEOUT", text)
    with pytest.raises(ValueError, match="RADIXLM_HEALTH_CHECK_TIMEOUT"):
        _health_check_timeout_s()
