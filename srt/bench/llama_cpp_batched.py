"""llama.cpp decoding many prompts at once through llama-cpp-python's low-level API.

Its high-level ``Llama.generate`` runs one sequence at a time. Here every request is a sequence
of one context: the prompts are prefilled in batches of up to ``n_batch`` tokens (sequences
mixed, logits for each prompt's last token only), then each step decodes one token of every
unfinished request in one ``llama_decode`` call and takes the argmax of each row's logits
(greedy, EOS ignored). Each sequence has its own ``ctx_per_seq`` cells of the KV cache (not
``kv_unified``: with a unified cache 16 prompts of 32-512 tokens took 25-62 s to prefill on a
2-core EPYC, against 20-21 s). An optional benchmark dependency:
importing this module needs llama-cpp-python.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp
import numpy as np


class BatchedLlama:
    """One llama.cpp context for up to ``max_seqs`` sequences of ``ctx_per_seq`` tokens."""

    def __init__(
        self, llm: llama_cpp.Llama, max_seqs: int, ctx_per_seq: int, threads: int, flash_attn: bool
    ):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_seqs * ctx_per_seq
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self._llm = llm  # owns the model
        self._ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create the batched context")
        self._n_batch = params.n_batch
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
        self._vocab = llm.n_vocab()
        self.max_seqs = max_seqs

    def close(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        llama_cpp.llama_free(self._ctx)

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """``n`` greedy tokens for each prompt (EOS ignored), all decoded together."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"at most {self.max_seqs} prompts at once")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self._ctx), True)
        items = [  # (sequence, position, token, wants logits): prompts' last tokens do
            (s, pos, tok, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        outs: list[list[int]] = [[] for _ in prompts]
        for i in range(0, len(items), self._n_batch):
            chunk = items[i : i + self._n_batch]
            self._decode(chunk)
            for row, (s, _, _, wanted) in enumerate(chunk):
                if wanted:  # the prompt's last token: its first output
                    outs[s].append(self._argmax(row))
        for _ in range(n - 1):
            step = [
                (s, len(p) + len(outs[s]) - 1, outs[s][-1], True) for s, p in enumerate(prompts)
            ]
            self._decode(step)
            for s in range(len(prompts)):
                outs[s].append(self._argmax(s))
        return outs

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (sequence, position, token, wants logits) items."""
        b = self._batch
        b.n_tokens = len(items)
        for i, (seq, pos, tok, wanted) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if wanted else 0
        if llama_cpp.llama_decode(self._ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, row: int) -> int:
        """The greedy token of the last decode's output ``row`` (its index in the batch)."""
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
        row_ptr = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
        logits = np.ctypeslib.as_array(row_ptr, shape=(self._vocab,))
        return int(np.argmax(logits))


def open_batched(
    gguf: Path, max_seqs: int, ctx_per_seq: int, threads: int, flash_attn: bool
) -> BatchedLlama:
    """The GGUF's model in a batched context (see :class:`BatchedLlama`)."""
    llm = llama_cpp.Llama(str(gguf), verbose=False, n_ctx=64, n_threads=threads)
    return BatchedLlama(llm, max_seqs, ctx_per_seq, threads, flash_attn)
