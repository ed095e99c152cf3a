"""Engine.shutdown stops the grammar path's threads and outlines-core child processes; the
engine still serves constrained requests afterwards."""

from __future__ import annotations

import re


def test_engine_shutdown_stops_grammar_children_and_stays_usable(tiny_llama_dir):
    from radixlm.srt import Engine

    params = {"regex": "[0-9]{3}", "max_new_tokens": 8, "temperature": 0}
    engine = Engine(model_path=str(tiny_llama_dir), log_level="warning")
    try:
        assert re.fullmatch("[0-9]{3}", engine.generate("n:", params)["text"])
        pool = engine.scheduler.grammars.compile_cache.backend.index_workers
        children = [w.process for w in pool._idle]
        assert children and all(p.poll() is None for p in children)
        engine.shutdown()
        assert all(p.poll() is not None for p in children)
        assert engine.scheduler.grammars.compile_cache is None
        assert re.fullmatch("[0-9]{3}", engine.generate("n:", params)["text"])
    finally:
        engine.shutdown()
