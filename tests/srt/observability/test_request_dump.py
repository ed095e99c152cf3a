"""The request dump's files (rotation, the size bound, redaction) and the replay tool's
refusal of a malformed or truncated dump."""

from __future__ import annotations

import orjson
import pytest

from radixlm.srt.bench.replay import DumpError, load_dump, main, token_agreement
from radixlm.srt.observability.request_dump import (
    NUM_FILES,
    REDACTED,
    RequestDump,
    dump_files,
    redact,
    redact_headers,
)


def _record(i: int) -> dict:
    return {"route": "/generate", "arrival_time": 100.0 + i, "body": {"text": "x" * 200},
            "sequences": [{"output_ids": [i]}]}  # fmt: skip


def test_rotation_keeps_the_folder_within_its_bound(tmp_path):
    dump = RequestDump(tmp_path, max_bytes=4096)
    for i in range(200):
        dump.write(_record(i))
    files = dump_files(tmp_path)
    assert NUM_FILES - 1 <= len(files) <= NUM_FILES  # the current file may be new
    assert sum(f.stat().st_size for f in files) <= 4096 + NUM_FILES * 400  # a line past each
    records = load_dump(tmp_path)
    ids = [r["sequences"][0]["output_ids"][0] for r in records]
    assert ids == sorted(ids) and ids[-1] == 199  # the newest kept, in order, oldest dropped
    assert ids[0] > 0


def test_secrets_are_redacted():
    headers = redact_headers({"authorization": "Bearer k", "x-api-key": "k", "accept": "*/*"})
    assert headers == {"authorization": REDACTED, "x-api-key": REDACTED, "accept": "*/*"}
    body = redact({"text": "hi", "extra": [{"api_key": "k"}], "max_tokens": 3})
    assert body == {"text": "hi", "extra": [{"api_key": REDACTED}], "max_tokens": 3}


def test_a_truncated_dump_names_the_file_and_line(tmp_path, capsys):
    dump = RequestDump(tmp_path, max_bytes=2**20)
    dump.write(_record(0))
    path = tmp_path / "requests.jsonl"
    path.write_bytes(path.read_bytes() + orjson.dumps(_record(1))[:30])  # cut mid-line
    with pytest.raises(DumpError, match=r"requests\.jsonl:2: not a JSON line.*truncated"):
        load_dump(tmp_path)
    assert main([str(tmp_path), "--url", "http://127.0.0.1:9"]) == 2
    assert "requests.jsonl:2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "line, message",
    [
        (b"[1, 2]", "must be a JSON object"),
        (b'{"v": 7}', "dump version 7"),
        (b'{"v": 1, "route": "/generate"}', "lacks arrival_time, body, sequences"),
    ],
)
def test_malformed_records_are_refused(tmp_path, line, message):
    (tmp_path / "d.jsonl").write_bytes(line + b"\n")
    with pytest.raises(DumpError, match=message):
        load_dump(tmp_path / "d.jsonl")


def test_an_empty_or_missing_dump_is_refused(tmp_path):
    with pytest.raises(DumpError, match="no requests"):
        load_dump(tmp_path)
    with pytest.raises(DumpError, match="no such dump"):
        load_dump(tmp_path / "nope")


def test_token_agreement():
    assert token_agreement({"output_ids": [1, 2, 3]}, {"output_ids": [1, 2, 3]}) == 1.0
    assert token_agreement({"output_ids": [1, 2, 3, 4]}, {"output_ids": [1, 2, 9, 4]}) == 0.5
    assert token_agreement({"output_ids": [1], "text": "ab"}, {"text": "ac"}) == 0.5
