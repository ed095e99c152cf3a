"""The incremental JSON scanner and string decoder against json.loads (the reference)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quick import examples

from radixlm.srt.parsers.json_stream import DONE, FAILED, RUNNING, JsonScanner, StringDecoder

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


def _strict_loads(text: str):
    def refuse(name: str):
        raise ValueError(name)

    return json.loads(text, parse_constant=refuse)


def _spaced(value, rng: random.Random) -> str:
    """json text of value with random whitespace between tokens and random escapes."""
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
    out, in_string, escaped = [], False, False
    for c in text:
        if not in_string and c in ",:[]{}" and rng.random() < 0.4:
            out.append(rng.choice([" ", "\n", "\t", "  ", "\r\n"]))
        out.append(c)
        if not in_string and c in ",:[]{}" and rng.random() < 0.4:
            out.append(rng.choice([" ", "\n  "]))
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
    return "".join(out)


def _scan_in_pieces(text: str, rng: random.Random, object_only: bool = False):
    scanner = JsonScanner(object_only=object_only)
    pos = 0
    while pos < len(text) and scanner.status == RUNNING:
        end = min(len(text), pos + rng.randint(1, 7))
        stop = scanner.scan(text, pos, end)
        assert stop == end or scanner.status != RUNNING
        pos = stop
    scanner.finish()
    return scanner, pos


@pytest.mark.slow
@settings(max_examples=examples(300), deadline=None)
@given(_json_values, st.integers(0, 2**32))
def test_valid_json_is_read_whole_and_every_safe_prefix_closes(value, seed) -> None:
    rng = random.Random(seed)
    text = _spaced(value, rng)
    assert _strict_loads(text) == value or value != value  # the reference reads it
    scanner, stop = _scan_in_pieces(text, rng)
    assert scanner.status == DONE
    assert text[stop:].strip() == ""  # only a top-level number needs the character after it
    # every prefix: the safe point closes into valid JSON
    probe = JsonScanner()
    for i in range(len(text) + 1):
        probe.scan(text, i, i + 1) if i < len(text) else None
        if probe.status != RUNNING:
            break
        if probe.safe_end:
            closed = text[: probe.safe_end] + probe.closing()
            _strict_loads(closed)


@settings(max_examples=examples(400), deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE+-tfnrulase \\u\n', max_size=24))
def test_scanner_accepts_exactly_what_json_loads_accepts(text) -> None:
    rng = random.Random(len(text))
    scanner, stop = _scan_in_pieces(text, rng)
    try:
        _strict_loads(text)
        valid = True
    except ValueError:
        valid = False
    scanned_whole = scanner.status == DONE and text[stop:].strip() == ""
    assert scanned_whole == valid, (text, scanner.status, stop)


@pytest.mark.parametrize(
    ("text", "status", "stop"),
    [
        ('{"a": 1} tail', DONE, 8),
        ("[1, 2,]", FAILED, 6),
        ('{"a" 1}', FAILED, 5),
        ("01", DONE, 1),
        ("-", RUNNING, 1),
        ("tru", RUNNING, 3),
        ("trux", FAILED, 3),
        ('"a\x01"', FAILED, 2),
    ],
)
def test_scanner_stops_where_expected(text: str, status: str, stop: int) -> None:
    scanner = JsonScanner()
    assert scanner.scan(text) == stop
    assert scanner.status == status


def test_object_only_refuses_other_values_at_once() -> None:
    scanner = JsonScanner(object_only=True)
    assert scanner.scan("[1]") == 0 and scanner.status == FAILED


def test_safe_point_holds_back_keys_commas_and_partial_numbers() -> None:
    cases = {
        '{"a": 1, "b': ('{"a": 1', "}"),
        '{"a": "xy': ('{"a": "xy', '"}'),
        '{"a": "x\\u00': ('{"a": "x', '"}'),
        '{"a": [1.': ('{"a": [1', "]}"),
        '{"a": [1.5': ('{"a": [1.5', "]}"),
        '{"a": tr': ("{", "}"),
        "{": ("{", "}"),
    }
    for text, (prefix, closing) in cases.items():
        scanner = JsonScanner()
        scanner.scan(text)
        assert (text[: scanner.safe_end], scanner.closing()) == (prefix, closing), text


@settings(max_examples=examples(300), deadline=None)
@given(st.text(max_size=30), st.integers(0, 2**32))
def test_string_decoder_matches_json_loads(value, seed) -> None:
    rng = random.Random(seed)
    body = json.dumps(value, ensure_ascii=rng.random() < 0.5)[1:]
    decoder, pos, out = StringDecoder(), 0, []
    while pos < len(body) and decoder.status == RUNNING:
        pos, text = decoder.decode(body, pos, min(len(body), pos + rng.randint(1, 4)))
        out.append(text)
    assert decoder.status == DONE and pos == len(body)
    expected = value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert "".join(out) == expected


def test_string_decoder_replaces_lone_surrogates_and_refuses_bad_escapes() -> None:
    decoder = StringDecoder()
    assert decoder.decode('\\ud83d\\ude00 \\ud83dx\\ude00"') == (27, "\U0001f600 \ufffdx\ufffd")
    bad = StringDecoder()
    bad.decode("ab\\q")
    assert bad.status == FAILED
