"""outlines-core index builds in child processes: same index as in-process, errors, kills."""

from __future__ import annotations

import threading
import time

import outlines_core
import pytest

from radixlm.grammar.base import GrammarCompileError, GrammarSpec
from radixlm.grammar.outlines_backend import OutlinesBackend
from radixlm.grammar.outlines_worker import IndexWorkerPool
from radixlm.grammar.testing import train_byte_level_tokenizer
from radixlm.grammar.vocab import build_vocab


@pytest.fixture(scope="module")
def outlines():
    return OutlinesBackend(build_vocab(train_byte_level_tokenizer()))


@pytest.fixture
def pool(outlines):
    pool = IndexWorkerPool(outlines.outlines_vocabulary)
    yield pool
    pool.close()


def _transitions(index) -> dict:
    return {state: dict(moves) for state, moves in index.get_transitions().items()}


def test_child_builds_the_same_index(outlines, pool):
    for pattern in (r"[0-9]{3}-[a-f]+", r"(cat|category) ?"):
        regex = outlines.regex_for(GrammarSpec.regex(pattern))
        index = pool.start(regex, "regex").wait(10.0)
        local = outlines_core.Index(regex, outlines.outlines_vocabulary())
        assert index.get_initial_state() == local.get_initial_state()
        assert _transitions(index) == _transitions(local)
        assert set(index.get_final_states()) == set(local.get_final_states())
    assert pool.num_idle() == 1  # one child served both


def test_rejected_regex_gives_the_backends_reason(outlines, pool):
    regex = outlines.regex_for(GrammarSpec.regex("a{2,1}"))
    with pytest.raises(GrammarCompileError) as in_child:
        pool.start(regex, "regex").wait(10.0)
    with pytest.raises(GrammarCompileError) as in_process:
        outlines.compile(GrammarSpec.regex("a{2,1}"))
    assert in_child.value.reason == in_process.value.reason
    assert pool.num_idle() == 1  # a rejection does not cost the child


def test_wait_returns_none_while_building_and_cancel_kills(outlines, pool):
    job = pool.start(outlines.regex_for(GrammarSpec.regex("[ab]*a[ab]{18}")), "regex")
    process = job._worker.process
    assert job.wait(0.05) is None
    job.cancel()
    assert process.poll() is not None and pool.num_killed == 1 and pool.num_idle() == 0
    with pytest.raises(GrammarCompileError, match="cancelled"):
        job.wait(1.0)
    assert pool.start(outlines.regex_for(GrammarSpec.regex("x")), "regex").wait(10.0) is not None


def test_a_child_that_dies_fails_its_build_and_is_replaced(outlines, pool):
    job = pool.start(outlines.regex_for(GrammarSpec.regex("[ab]*a[ab]{18}")), "regex")
    job._worker.process.kill()
    with pytest.raises(GrammarCompileError, match="worker"):
        job.wait(10.0)
    assert pool.start(outlines.regex_for(GrammarSpec.regex("y")), "regex").wait(10.0) is not None


def test_concurrent_builds_run_in_separate_children(outlines, pool):
    slow = outlines.regex_for(GrammarSpec.regex("[ab]*a[ab]{15}"))
    results = []

    def build():
        results.append(pool.start(slow, "regex").wait(30.0))

    threads = [threading.Thread(target=build) for _ in range(2)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and all(r is not None for r in results)
    assert pool.num_idle() == 2
    assert time.perf_counter() - began < 10.0


def test_closed_pool_stops_its_children(outlines):
    pool = IndexWorkerPool(outlines.outlines_vocabulary)
    pool.start(outlines.regex_for(GrammarSpec.regex("z")), "regex").wait(10.0)
    process = pool._idle[0].process
    pool.close()
    assert process.poll() is not None
    with pytest.raises(GrammarCompileError, match="shut down"):
        pool.start("z", "regex")
