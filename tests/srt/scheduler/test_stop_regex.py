"""stop_regex through the scheduler's finish check, its output step and the detokenizer, with
SmolLM2's tokenizer: each case feeds a text's tokens one by one, as decoding appends them,
and compares with a reference that runs Python's ``re`` on the whole decoded output after each
token (where it first matches, what it matched, the text before the match)."""

from __future__ import annotations

import re
import time

import pytest

from radixlm.srt.managers.detokenizer import Detokenizer
from radixlm.srt.sampling.params import SamplingParams
from radixlm.srt.sampling.stop_regex import MATCH_FROM_END_KEY, MATCH_TEXT_KEY
from radixlm.srt.scheduler.output import build_batch_output
from radixlm.srt.scheduler.req import PENDING_TOKEN, Req
from radixlm.srt.scheduler.stop import STOP_REGEX_TIMEOUT_S, StopChecker

EOS = 2


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def reference(tok, ids: list[int], patterns: list[str]) -> tuple[int, str, str] | None:
    """(tokens when a pattern first matches, the matched text, the text before the match)
    by searching the whole decoded output with ``re`` after each token; None: no match."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        for pattern in patterns:
            m = re.search(pattern, text)
            if m:
                return n, m.group(0), text[: m.start()]
    return None


def generate(tok, text: str, sp: dict, *, stream: bool = True, interval: int = 1):
    """Feeds ``text``'s tokens as decoding would; returns (request, streamed deltas, the
    finish reason the client sees)."""
    params = SamplingParams.from_dict(sp)
    params.validate()
    req = Req("r", [1], params, stream=stream)
    stop, detok = StopChecker(tok, {EOS}, 10**6), Detokenizer(tok)
    deltas: list[str] = []
    client_reason = None
    for token in tok.encode(text, add_special_tokens=False):
        req.output_ids.append(token)
        stop.check(req)
        out = build_batch_output([req], interval, stop)
        if out is not None:
            deltas.append(detok.handle(out).text_delta[0])
            client_reason = out.finish_reason[0]
        if req.is_finished:
            break
    return req, deltas, client_reason


CASES = [
    ("Count: 1, 2, 33. Done", [r"\d+\."]),
    ("The answer is 42 END of story", [r"answer is \d+ END"]),  # spans many tokens
    ("concatenate the cat sat down", [r"\bcat\b"]),  # "cat" also inside "concatenate"
    ("Paris is the capital of France.\n\nNext", [r"\n\n", "zzz"]),
    ("Hi 世界 and 日本語 end", ["日本"]),  # multi-byte characters split across tokens
    ("price: $100 or $250 total", [r"\$2\d0", r"\$1\d\d"]),  # the first pattern that matches
    ("Hello there. Hello again", [r"^Hello"]),  # at the very start
    ("a b c d e f g h i j k l m n o p", [r"(?<=k )l"]),  # a lookbehind
]


@pytest.mark.parametrize("text, patterns", CASES)
@pytest.mark.parametrize("stream", [False, True])
def test_matches_like_re_on_the_whole_output(tok, text, patterns, stream) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    expected = reference(tok, ids, patterns)
    assert expected is not None
    num_tokens, matched, before = expected
    req, deltas, client_reason = generate(tok, text, {"stop_regex": patterns}, stream=stream)
    assert len(req.output_ids) == num_tokens
    pattern = next(p for p in patterns if re.search(p, tok.decode(req.output_ids)))
    assert req.finish_reason == {
        "type": "stop",
        "matched": pattern,  # the pattern, as SGLang reports it
        MATCH_FROM_END_KEY: ANY_INT,
        MATCH_TEXT_KEY: matched,
    }
    assert client_reason == {"type": "stop", "matched": pattern}  # the match stays inside
    assert "".join(deltas) == before
    if stream:  # a stop never reaches the client, not even in part
        for k in range(1, len(deltas) + 1):
            assert before.startswith("".join(deltas[:k]))


def test_no_stop_trim_keeps_the_match(tok) -> None:
    text = "concatenate the cat sat down"
    num_tokens, _, _ = reference(tok, tok.encode(text, add_special_tokens=False), [r"\bcat\b"])
    req, deltas, _ = generate(tok, text, {"stop_regex": r"\bcat\b", "no_stop_trim": True})
    full = tok.decode(req.output_ids, skip_special_tokens=True)
    assert len(req.output_ids) == num_tokens
    assert "".join(deltas) == full[: full.index("the cat") + len("the cat")]  # up to the match


def test_caret_does_not_match_inside_a_long_output(tok) -> None:
    """Past the search window the text before it is context: ``^`` never matches there."""
    text = "word " * 400 + "Hello again"
    req, deltas, _ = generate(
        tok, text, {"stop_regex": ["^Hello", "again"], "max_new_tokens": 1000}, stream=False
    )
    assert req.finish_reason["matched"] == "again" and req.finish_reason[MATCH_TEXT_KEY] == "again"
    assert "".join(deltas) == "word " * 400 + "Hello "


def test_no_match_runs_to_the_length_limit(tok) -> None:
    text = "nothing to see here at all"
    n = len(tok.encode(text, add_special_tokens=False))
    req, deltas, reason = generate(tok, text, {"stop_regex": r"\d", "max_new_tokens": n})
    assert reason == {"type": "length", "length": n} and "".join(deltas) == text


def test_min_new_tokens_does_not_hold_back_stops(tok) -> None:
    """min_new_tokens only keeps EOS and stop ids from being sampled; a stop regex ends the
    request where it first matches (as SGLang), so the ids, the text and the stream agree."""
    text = "1. one 2. two 3. three"
    expected = reference(tok, tok.encode(text, add_special_tokens=False), [r"\d\."])
    for stream in (False, True):
        req, deltas, reason = generate(
            tok, text, {"stop_regex": r"\d\.", "min_new_tokens": 5}, stream=stream
        )
        assert len(req.output_ids) == expected[0] < 5
        assert reason == {"type": "stop", "matched": r"\d\."} and "".join(deltas) == ""


def test_ignore_eos_turns_off_stop_token_ids_too(tok) -> None:
    """SGLang's rule (vLLM keeps stop_token_ids under ignore_eos): fixed-length runs that
    benchmarks ask for with ignore_eos are not cut by a stop id either."""
    text = "one two three four five"
    ids = tok.encode(text, add_special_tokens=False)
    stop_id = ids[2]
    req, _, reason = generate(tok, text, {"stop_token_ids": [stop_id], "max_new_tokens": 99})
    assert reason == {"type": "stop", "matched": stop_id} and len(req.output_ids) == 3
    sp = {"stop_token_ids": [stop_id], "ignore_eos": True, "max_new_tokens": len(ids)}
    req, _, reason = generate(tok, text, sp)
    assert reason == {"type": "length", "length": len(ids)} and req.output_ids == ids
    sp = {"stop_token_ids": [stop_id], "ignore_eos": True, "min_new_tokens": 4}
    stop = StopChecker(tok, {EOS}, 10**6)
    assert stop.suppressed_ids(Req("r", [1], SamplingParams.from_dict(sp))) == []
    params = SamplingParams.from_dict({**sp, "ignore_eos": False})
    assert stop.suppressed_ids(Req("r", [1], params)) == sorted({EOS, stop_id})


def test_pending_token_is_ignored(tok) -> None:
    """With overlap scheduling the last id can be a token not read back yet."""
    params = SamplingParams.from_dict({"stop_regex": r"\d+\."})
    req = Req("r", [1], params, stream=True)
    req.output_ids = tok.encode("Items 12", add_special_tokens=False) + [PENDING_TOKEN]
    assert StopChecker(tok, {EOS}, 10**6).holds_stream(req)  # "12" may become "12."


def test_hostile_pattern_is_bounded_in_time(tok) -> None:
    """``(a|aa)+c`` backtracks exponentially over a run of a's: one search is cut at its
    timeout and the request ends with a 400 naming stop_regex, the others unaffected."""
    text = "a" * 400
    started = time.perf_counter()
    req, deltas, reason = generate(tok, text, {"stop_regex": ["x", "(a|aa)+c"]})
    elapsed = time.perf_counter() - started
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"].startswith("stop_regex[1] '(a|aa)+c' took too long")
    assert elapsed < 50 * STOP_REGEX_TIMEOUT_S + 2.0
    n = len(tok.encode(text, add_special_tokens=False))
    other, _, _ = generate(tok, text, {"stop_regex": "aaaa c", "max_new_tokens": n})
    assert other.finish_reason == {"type": "length", "length": n}


def test_hostile_pattern_in_the_stream_hold_ends_the_request(tok) -> None:
    """A partial search past its time limit holds the tokens; the next check ends it."""
    params = SamplingParams.from_dict({"stop_regex": "(a|aa)+c"})
    req = Req("r", [1], params, stream=True)
    req.output_ids = tok.encode("a" * 300, add_special_tokens=False)
    stop = StopChecker(tok, {EOS}, 10**6)
    assert stop.holds_stream(req)
    req.output_ids.append(tok.encode("a", add_special_tokens=False)[0])
    stop.check(req)
    assert req.finish_reason["type"] == "abort" and "stop_regex[0]" in req.finish_reason["message"]


class _AnyInt:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other > 0


ANY_INT = _AnyInt()
