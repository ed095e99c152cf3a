"""A compiled outlines-core index and its per-request matcher.

The index maps (DFA state, token id) to the next state. Everything the matcher needs per state
is derived once and memoized on the shared grammar: the packed allowed-token row (so a repeated
state costs one row copy) and the forced continuation (for jump-forward).

Small DFAs (regexes, choices, enums: ``warm_rows``) get every row at compile time. Otherwise a
row is built on the state's first visit by an outlines-core ``Guide`` standing in the state:
``write_mask_into`` writes it straight into the batch bitmask in native code (about 80 us for a
string state of SmolLM2's 49k tokens, against about 2 ms for turning
``Index.get_allowed_tokens`` into a row in Python). Each matcher keeps one guide, advanced lazily
over its accepted tokens only when it meets a state without a row. A memoized row is copied into
the batch bitmask as bytes (``BitmaskBuffer``), with no torch op per row.
"""

from __future__ import annotations

import threading

import numpy as np
import outlines_core

from radixlm.grammar.base import CompiledGrammar, GrammarMatcher, GrammarSpec
from radixlm.grammar.bitmask import BitmaskBuffer, pack_token_ids
from radixlm.grammar.vocab import TokenizerVocab

_MAX_FORCED_DEPTH = 64  # tokens followed when computing a forced continuation
WARM_MAX_TRANSITIONS = 20_000  # compile-time row warming: DFAs with at most this many
WARM_MAX_STATES = 1024  # transitions and states (rows take 4 * ceil(V/32) bytes each)
# An index holds about this many bytes of memory per byte of its binary form (measured on
# SmolLM2: 1.7 for a 62 MB index of 8.9 M transitions; rounded up for the memo tables).
MEMORY_PER_SERIALIZED_BYTE = 2


class OutlinesGrammar(CompiledGrammar):
    """An outlines-core ``Index`` plus per-state memo tables, shared by all its matchers."""

    backend_name = "outlines"

    def __init__(
        self,
        spec: GrammarSpec,
        index,
        vocab: TokenizerVocab,
        serialized_bytes: int | None = None,
    ) -> None:
        self.spec = spec
        self.index = index
        self._serialized_bytes = serialized_bytes  # length of the index's binary form
        self.vocab = vocab
        self.initial_state: int = index.get_initial_state()
        self._final_states = frozenset(index.get_final_states())
        self._eos_ids = frozenset(vocab.eos_token_ids)
        self._eos_array = np.array(vocab.eos_token_ids, dtype=np.int64)
        self.eos_row = _packed(self._eos_array, vocab.vocab_size)
        self._rows: dict[int, bytes] = {}  # state -> packed int32 row (little-endian bytes)
        self._unique_rows: dict[bytes, bytes] = {}  # one shared copy of each distinct row
        self._forced: dict[int, bytes] = {}  # state -> forced continuation bytes
        self._forced_lock = threading.Lock()

    def new_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self, self.initial_state)

    def serialize(self) -> bytes:
        _, (data,) = self.index.__reduce__()
        return bytes(data)

    def size_bytes(self) -> int:
        if self._serialized_bytes is None:  # not known from a child's message or a file
            self._serialized_bytes = len(self.serialize())
        rows = sum(map(len, list(self._unique_rows)))
        return MEMORY_PER_SERIALIZED_BYTE * self._serialized_bytes + rows

    def is_final(self, state: int) -> bool:
        return state in self._final_states

    def is_eos(self, token_id: int) -> bool:
        return token_id in self._eos_ids

    def next_state(self, state: int, token_id: int) -> int | None:
        if token_id in self._eos_ids or not 0 <= token_id < self.vocab.vocab_size:
            return None
        return self.index.get_next_state(state, token_id)

    def text_token_ids(self, state: int) -> np.ndarray:
        """Allowed non-EOS tokens in ``state``."""
        ids = np.asarray(self.index.get_allowed_tokens(state) or [], dtype=np.int64)
        return ids[~np.isin(ids, self._eos_array)]

    def mask_row(self, state: int) -> bytes:
        """The packed row of ``state`` (memoized; a missing one is built from the index, which
        is slow for large states: matchers build theirs natively with ``write_row``)."""
        row = self._rows.get(state)
        if row is None:
            ids = self.text_token_ids(state)
            if self.is_final(state):
                ids = np.concatenate([ids, self._eos_array])
            row = self._memoize(state, _packed(ids, self.vocab.vocab_size))
        return row

    def warm_rows(
        self, max_transitions: int = WARM_MAX_TRANSITIONS, max_states: int = WARM_MAX_STATES
    ) -> bool:
        """Memoizes the row of every reachable state if the DFA is small (a breadth-first walk
        from the initial state meets at most ``max_transitions`` transitions and ``max_states``
        states), so that its matchers never build a row while decoding; returns whether it did.

        Meant for compile time. Larger DFAs keep building each row on its first visit: a JSON
        string state alone has about 48k transitions on SmolLM2's vocabulary, and walking them
        here would hold the GIL (in pieces) for milliseconds per state.
        """
        states = [self.initial_state]
        seen = {self.initial_state}
        budget = max_transitions
        for state in states:  # grows while it is walked
            tokens = self.index.get_allowed_tokens(state) or []
            budget -= len(tokens)
            if budget < 0:
                return False
            for token in tokens:
                nxt = self.next_state(state, token)
                if nxt is not None and nxt not in seen:
                    if len(seen) == max_states:
                        return False
                    seen.add(nxt)
                    states.append(nxt)
        for state in states:
            self.mask_row(state)
        return True

    def write_row(
        self, state: int, guide: outlines_core.Guide, buffer: BitmaskBuffer, row: int
    ) -> None:
        """Writes the row of ``state`` into ``buffer`` with ``guide`` (which must stand in
        ``state``) and memoizes it."""
        assert guide.get_state() == state, (guide.get_state(), state)
        guide.write_mask_into(buffer.row_address(row), buffer.num_words, 4)  # zeroes it first
        if self.is_final(state):  # the index knows the first EOS id only
            buffer.set_bits(row, self.vocab.eos_token_ids)
        self._memoize(state, buffer.read(row))

    def _memoize(self, state: int, row: bytes) -> bytes:
        """Stores ``row`` for ``state``, sharing one copy among states with equal rows."""
        return self._rows.setdefault(state, self._unique_rows.setdefault(row, row))

    def forced_bytes(self, state: int) -> bytes:
        """Bytes every continuation from ``state`` starts with (empty where it may end)."""
        with self._forced_lock:
            return self._forced_from(state, 0)

    def _forced_from(self, state: int, depth: int) -> bytes:
        if state in self._forced:
            return self._forced[state]
        if depth >= _MAX_FORCED_DEPTH:
            return b""
        self._forced[state] = b""  # guards cycles; any prefix of the truth is a safe answer
        result = self._compute_forced(state, depth)
        self._forced[state] = result
        return result

    def _compute_forced(self, state: int, depth: int) -> bytes:
        if self.is_final(state):
            return b""
        token_bytes = self.vocab.token_bytes
        ids = self.text_token_ids(state).tolist()
        if not ids:
            return b""
        first_byte = token_bytes[ids[0]][:1]
        if any(token_bytes[t][:1] != first_byte for t in ids):
            return b""
        common: bytes | None = None
        for token_id in ids:
            nxt = self.index.get_next_state(state, token_id)
            text = token_bytes[token_id] + self._forced_from(nxt, depth + 1)
            common = text if common is None else _common_prefix(common, text)
            if len(common) <= 1:  # every allowed token shares the first byte
                break
        return common or b""

    def forced_token_ids(self, state: int, max_tokens: int | None = None) -> list[int]:
        """Tokens spelling the forced bytes, longest vocabulary match first (at most
        ``max_tokens`` of them)."""
        remaining = self.forced_bytes(state)
        ids_by_bytes = self.vocab.ids_by_bytes
        tokens: list[int] = []
        while remaining and (max_tokens is None or len(tokens) < max_tokens):
            step = self._longest_forced_token(state, remaining, ids_by_bytes)
            if step is None:
                break
            token_id, state = step
            tokens.append(token_id)
            remaining = remaining[len(self.vocab.token_bytes[token_id]) :]
        return tokens

    def _longest_forced_token(
        self, state: int, remaining: bytes, ids_by_bytes: dict[bytes, list[int]]
    ) -> tuple[int, int] | None:
        for length in range(min(len(remaining), self.vocab.max_token_len), 0, -1):
            for token_id in ids_by_bytes.get(remaining[:length], ()):
                nxt = self.next_state(state, token_id)
                if nxt is not None:
                    return token_id, nxt
        return None


def _packed(token_ids: np.ndarray, vocab_size: int) -> bytes:
    return pack_token_ids(token_ids, vocab_size).numpy().tobytes()


def _common_prefix(a: bytes, b: bytes) -> bytes:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]


class OutlinesMatcher(GrammarMatcher):
    """A DFA state plus the stack of states before each accepted token.

    ``_guide`` (built on first need) has consumed ``_tokens[:_guide_len]``; it catches up only
    when the matcher meets a state whose mask row is not memoized yet.
    """

    def __init__(self, grammar: OutlinesGrammar, state: int) -> None:
        self._grammar = grammar
        self._state = state
        self._terminated = False
        self._history: list[tuple[int, bool]] = []  # (state, terminated) before each token
        self._tokens: list[int] = []  # the accepted tokens, parallel to _history
        self._guide: outlines_core.Guide | None = None
        self._guide_len = 0

    @property
    def num_accepted_tokens(self) -> int:
        return len(self._history)

    @property
    def state(self) -> int:
        return self._state

    def fill_row(self, buffer: BitmaskBuffer, row: int) -> None:
        grammar = self._grammar
        if self._terminated:
            buffer.write(row, grammar.eos_row)
            return
        packed = grammar._rows.get(self._state)
        if packed is None:
            grammar.write_row(self._state, self._synced_guide(), buffer, row)
        else:
            buffer.write(row, packed)

    def _synced_guide(self) -> outlines_core.Guide:
        """The guide, advanced to the current state (never terminated here: no EOS to feed)."""
        if self._guide is None:
            self._guide = outlines_core.Guide(self._grammar.index)
            self._guide_len = 0
        for token_id in self._tokens[self._guide_len :]:
            self._guide.advance(token_id, return_tokens=False)
        self._guide_len = len(self._tokens)
        return self._guide

    def accept_token(self, token_id: int) -> bool:
        grammar = self._grammar
        if grammar.is_eos(token_id):
            if not (self._terminated or grammar.is_final(self._state)):
                return False
            self._history.append((self._state, self._terminated))
            self._tokens.append(token_id)
            self._terminated = True
            return True
        if self._terminated:
            return False
        nxt = grammar.next_state(self._state, token_id)
        if nxt is None:
            return False
        self._history.append((self._state, self._terminated))
        self._tokens.append(token_id)
        self._state = nxt
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {len(self._history)} are accepted"
            )
        if num_tokens == 0:
            return
        self._state, self._terminated = self._history[-num_tokens]
        del self._history[-num_tokens:]
        del self._tokens[-num_tokens:]
        self._rewind_guide()

    def _rewind_guide(self) -> None:
        """Keeps the guide at or behind the accepted tokens, dropping it if it cannot go back."""
        excess = self._guide_len - len(self._tokens)
        if self._guide is None or excess <= 0:
            return
        if excess <= self._guide.get_allowed_rollback():
            self._guide.rollback_state(excess)
            self._guide_len -= excess
        else:
            self._guide = None

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_tokens(self, max_tokens: int | None = None) -> list[int]:
        if self._terminated:
            return []
        return self._grammar.forced_token_ids(self._state, max_tokens)

    def forced_bytes(self) -> bytes:
        if self._terminated:
            return b""
        return self._grammar.forced_bytes(self._state)

    def copy(self) -> OutlinesMatcher:
        clone = OutlinesMatcher(self._grammar, self._state)
        clone._terminated = self._terminated
        clone._history = list(self._history)
        clone._tokens = list(self._tokens)
        return clone
