from __future__ import annotations

import json

import pytest

from radixlm.srt.bench import schema_coverage
from radixlm.srt.bench.schema_coverage import Outcome


def test_loads_bench_files_plain_schemas_and_jsonl(tmp_path):
    (tmp_path / "Sub---a.json").write_text(json.dumps({"schema": {"type": "string"}, "tests": []}))
    (tmp_path / "plain.json").write_text(json.dumps({"type": "integer"}))
    (tmp_path / "more.jsonl").write_text(json.dumps({"id": "c", "schema": False}) + "\n\n")
    cases = schema_coverage.load_cases([tmp_path])
    assert [(c.name, c.schema) for c in cases] == [
        ("Sub---a", {"type": "string"}),
        ("plain", {"type": "integer"}),
        ("c", False),
    ]


def test_unenforced_keywords_are_dropped_for_the_second_verdict():
    schema = {"type": "array", "uniqueItems": True, "items": {"format": "color", "oneOf": [{}]}}
    enforced = schema_coverage.without_keywords(schema, ["uniqueItems", "format:color"])
    assert enforced == {"type": "array", "items": {"oneOf": [{}]}}
    assert schema["uniqueItems"] is True  # the input is left as it was


@pytest.mark.slow  # trains the test tokenizer and forks a child per schema: about 4 s
def test_compiles_walks_and_reports(tmp_path, capsys):
    cases = [
        {"id": "forbidden", "schema": {"properties": {"a": {"not": {}}, "b": {"type": "integer"}}}},
        {"id": "color", "schema": {"type": "string", "format": "color"}},
        {
            "id": "nothing",
            "schema": {"type": "object", "required": ["a"], "properties": {"a": False}},
        },
    ]
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in cases))
    outcomes = schema_coverage.main([str(path), "--walks", "2", "--limit-s", "20"])
    by_name = {o.name: o for o in outcomes}
    assert by_name["forbidden"].ok and by_name["forbidden"].valid == by_name["forbidden"].finished
    assert by_name["color"].unenforced == ["format:color"]
    assert not by_name["nothing"].ok and "no JSON document" in by_name["nothing"].reason
    out = capsys.readouterr().out
    assert "compiled 2/3 (66.7%), refused 1" in out
    assert "format:color 1" in out


def test_summary_counts_time_buckets_and_invalid_documents():
    outcomes = [
        Outcome(
            "a",
            True,
            0.05,
            backend="outlines",
            finished=2,
            valid=1,
            valid_enforced=2,
            invalid_example="[1, 1]",
            unenforced=["uniqueItems"],
        ),
        Outcome("b", False, 4.0, reason="over 3 s"),
    ]
    lines = schema_coverage.summarize(outcomes)
    assert lines[0] == "compiled 1/2 (50.0%), refused 1"
    assert "  1 x over 3 s  [b]" in lines
    assert any(
        line.startswith("all schemas within: 0.1 s 1, 0.5 s 1, 1 s 1, 3 s 1, 5 s 2")
        for line in lines
    )
    assert any("valid against the schema 1/2 (50.0%)" in line for line in lines)
    assert any("invalid a (1): [1, 1]" in line for line in lines)
