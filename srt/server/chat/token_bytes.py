"""The raw bytes of a token, for the ``bytes`` field of OpenAI's chat logprobs.

A token's display text (``tokenizer.decode([id])``) loses the bytes of a token that holds only
part of a UTF-8 character: it decodes to U+FFFD. OpenAI's ``bytes`` are the token's own bytes,
so that joining them over a reply rebuilds its text. They are read from the vocabulary piece:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of the piece stands for one
  byte (GPT-2's printable-byte alphabet);
- SentencePiece (Llama 2, Mistral): a byte-fallback piece ``<0xE2>`` is that byte, any other
  piece is its text with ``▁`` read as a space;
- added and special tokens: the UTF-8 of their text;
- tokenizers of any other kind: the UTF-8 of the display text.

``token_bytes_for(tokenizer)`` is the one table of a tokenizer; it fills in an id the first time
the id is asked for, so it never holds more entries than the vocabulary has.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from typing import Any

SPIECE_SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_TEXT, _BYTE_LEVEL, _SENTENCEPIECE = "text", "byte_level", "sentencepiece"


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: piece character -> the byte it stands for.
    Printable Latin-1 bytes stand for themselves; the others (controls, space, 0x7F-0xA0,
    0xAD) take the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


def _decoder_spec(tokenizer: Any) -> dict[str, Any]:
    """The JSON form of a fast tokenizer's decoder; empty for any other tokenizer."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        spec = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return {}
    return spec if isinstance(spec, dict) else {}


def _decoder_steps(spec: dict[str, Any]) -> list[dict[str, Any]]:
    if spec.get("type") == "Sequence":
        return [step for sub in spec.get("decoders", []) for step in _decoder_steps(sub)]
    return [spec] if spec else []


def _piece_kind(tokenizer: Any) -> tuple[str, bool]:
    """(how pieces map to bytes, whether ``<0xHH>`` pieces are bytes)."""
    steps = _decoder_steps(_decoder_spec(tokenizer))
    types = {step.get("type") for step in steps}
    if "ByteLevel" in types:
        return _BYTE_LEVEL, False
    replaces_space = any(
        step.get("type") == "Replace" and step.get("pattern", {}).get("String") == SPIECE_SPACE
        for step in steps
    )
    if "Metaspace" in types or replaces_space:
        return _SENTENCEPIECE, "ByteFallback" in types
    return _TEXT, False


class TokenBytes:
    """Token id -> its raw bytes, for one tokenizer (``None``: every token's bytes are its
    display text's UTF-8). An entry is computed the first time its id is asked for and kept in a
    table of one slot per vocabulary id; ids outside the vocabulary are not kept. Called from
    the event loop only."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = _weak(tokenizer)  # the table of _TABLES must not keep its key alive
        no_pieces = (_TEXT, False)
        self._kind, self._byte_fallback = no_pieces if tokenizer is None else _piece_kind(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._table: list[bytes | None] = [None] * _vocab_len(tokenizer)

    @property
    def num_cached(self) -> int:
        return sum(entry is not None for entry in self._table)

    def of(self, token_id: int, text: str | None) -> list[int]:
        """The bytes of ``token_id``, whose display text is ``text``."""
        if not 0 <= token_id < len(self._table):
            return list((text or "").encode("utf-8"))
        raw = self._table[token_id]
        if raw is None:
            raw = self._table[token_id] = self._compute(token_id, text)
        return list(raw)

    def _compute(self, token_id: int, text: str | None) -> bytes:
        display = (text or "").encode("utf-8")
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        tokenizer = self._tokenizer()
        if self._kind == _TEXT or tokenizer is None:
            return display
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return display
        if self._kind == _BYTE_LEVEL:
            alphabet = byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
            return display
        match = _BYTE_PIECE.fullmatch(piece) if self._byte_fallback else None
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(SPIECE_SPACE, " ").encode("utf-8")


def _weak(obj: Any) -> Any:
    """A weak reference to ``obj`` where it takes one, else a strong one with the same call."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _vocab_len(tokenizer: Any | None) -> int:
    try:
        return len(tokenizer) if tokenizer is not None else 0
    except TypeError:
        return 0


TEXT_BYTES = TokenBytes(None)  # no tokenizer at hand: the display text's UTF-8
_TABLES: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()


def token_bytes_for(tokenizer: Any) -> TokenBytes:
    """The table of ``tokenizer``, made on first use and kept while the tokenizer lives."""
    try:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = TokenBytes(tokenizer)
    except TypeError:  # not hashable or not weakly referenceable: a table for this call
        table = TokenBytes(tokenizer)
    return table
