"""--log-requests records at SGLang's levels, in text and JSON, to stdout and folders."""

from __future__ import annotations

import json

import pytest

from radixlm.srt.config import config_from_kwargs
from radixlm.srt.managers.request_log import PARTIAL_CHARS, RequestLog
from radixlm.srt.sampling.params import SamplingParams

PARAMS = SamplingParams.from_dict({"max_new_tokens": 5, "temperature": 0.0, "stop": ["\n"]})
LONG = "x" * (PARTIAL_CHARS + 100)


def _record(log: RequestLog, prompt="hello there", output="general kenobi") -> dict:
    return log.record("r1", {"type": "stop"}, 7, 2, 5, 0.25, PARAMS, prompt, output)


def test_levels_add_params_then_partial_then_whole_text():
    base = {"rid", "finish_reason", "prompt_tokens", "cached_tokens", "completion_tokens"}
    r0 = _record(RequestLog(0))
    assert set(r0) == base | {"latency_s"} and r0["prompt_tokens"] == 7
    r1 = _record(RequestLog(1))
    assert r1["sampling_params"] == {"max_new_tokens": 5, "temperature": 0.0, "stop": ["\n"]}
    assert "prompt" not in r1 and "output" not in r1
    r2 = _record(RequestLog(2), prompt=LONG, output=LONG)
    assert len(r2["prompt"]) == len(r2["output"]) == PARTIAL_CHARS
    r3 = _record(RequestLog(3), prompt=LONG, output=LONG)
    assert r3["prompt"] == LONG and r3["output"] == LONG
    ids = _record(RequestLog(2), prompt=list(range(3000)))["prompt"]
    assert ids == list(range(PARTIAL_CHARS))  # a prompt sent as ids: its first ids


def test_text_and_json_lines_to_stdout_and_folders(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    log = RequestLog(2, "json", ("stdout", str(a), str(b)))
    log.write(_record(log))
    log.write(_record(log, prompt='quote " and\nnewline'))
    log.close()
    for text in (capsys.readouterr().out, (a / "requests.log").read_text()):
        recs = [json.loads(line) for line in text.splitlines()]
        assert [r["prompt"] for r in recs] == ["hello there", 'quote " and\nnewline']
    assert (b / "requests.log").read_text() == (a / "requests.log").read_text()
    text = RequestLog(1, "text", ())
    line_log = RequestLog(2, "text", (str(tmp_path / "t"),))
    line_log.write(_record(line_log, prompt="two\nlines"))
    line_log.close()
    (line,) = (tmp_path / "t" / "requests.log").read_text().splitlines()  # one line a request
    assert line.startswith("request 'r1' finished (stop): prompt 7 tokens (2 cached)")
    assert 'prompt "two\\nlines"' in line
    assert text.record("r", None, 1, 0, 0, 0.0)["finish_reason"] is None


def test_options_and_bad_values(tmp_path):
    cfg = config_from_kwargs(log_requests=True, log_requests_target="stdout")
    assert cfg.log_requests_target == ("stdout",) and cfg.log_requests_level == 0
    assert RequestLog.from_config(config_from_kwargs()) is None
    with pytest.raises(ValueError, match="log_requests_level"):
        config_from_kwargs(log_requests_level=4)
    with pytest.raises(ValueError, match="log_requests_format"):
        config_from_kwargs(log_requests_format="xml")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="log_requests_target .*cannot append"):
        RequestLog(0, "text", ("stdout", str(blocker / "logs")))
