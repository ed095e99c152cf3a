"""The grammar alphabet: the exact bytes every token id decodes to, built from the tokenizer.

Handles byte-level BPE vocabularies (GPT-2 style, ``Ġ`` for a space and one printable character
per byte) and sentencepiece vocabularies (``▁`` for a space, ``<0xNN>`` byte-fallback tokens).
Special tokens (BOS, EOS, chat markers, ...) are outside the grammar alphabet; the EOS ids are
handled by the matchers, which allow them only where the grammar may end.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

_SP_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SP_SPACE = "\u2581"


@dataclass(frozen=True)
class TokenizerVocab:
    """Decoded bytes per token id plus the ids that end a generation.

    ``token_bytes[i]`` is None for special tokens and ids without a token. ``vocab_size`` is the
    width of the logits (and of the bitmask, in bits, rounded up to 32), which may exceed the
    tokenizer's length when the model pads its embedding.
    """

    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    special_token_ids: frozenset[int]
    fingerprint: str
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @cached_property
    def ids_by_bytes(self) -> dict[bytes, list[int]]:
        """Token ids per decoded byte string (several ids may share one string)."""
        table: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(self.token_bytes):
            if data:
                table.setdefault(data, []).append(token_id)
        return table

    @cached_property
    def max_token_len(self) -> int:
        return max((len(b) for b in self.token_bytes if b), default=1)

    def decode_bytes(self, token_ids: list[int]) -> bytes:
        """The grammar-level bytes of ``token_ids`` (special tokens contribute nothing)."""
        return b"".join(self.token_bytes[t] or b"" for t in token_ids)

    def encode(self, text: str) -> list[int]:
        """Tokenizes ``text`` with the model's tokenizer, without special tokens."""
        if self.tokenizer is None:
            raise ValueError("this vocabulary was built without a tokenizer object")
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def build_vocab(
    tokenizer: Any, eos_token_ids: list[int] | None = None, vocab_size: int | None = None
) -> TokenizerVocab:
    """Builds the grammar vocabulary from a transformers fast tokenizer (no hub access).

    ``eos_token_ids`` defaults to the tokenizer's EOS id; ``vocab_size`` to its length.
    """
    num_tokens = len(tokenizer)
    width = num_tokens if vocab_size is None else vocab_size
    if width < num_tokens:
        raise ValueError(f"vocab_size {width} is smaller than the tokenizer's {num_tokens} tokens")
    eos = _resolve_eos(tokenizer, eos_token_ids, width)
    special = _special_ids(tokenizer) | set(eos)
    decode_one = _token_decoder(tokenizer)
    literal = _literal_added_tokens(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(num_tokens)))
    token_bytes: list[bytes | None] = [None] * width
    for token_id, piece in enumerate(pieces):
        if piece is None or token_id in special:
            continue
        data = literal.get(token_id)
        token_bytes[token_id] = (data if data is not None else decode_one(piece)) or None
    fingerprint = _fingerprint(token_bytes, eos, width)
    return TokenizerVocab(
        token_bytes=tuple(token_bytes),
        eos_token_ids=eos,
        vocab_size=width,
        special_token_ids=frozenset(special),
        fingerprint=fingerprint,
        tokenizer=tokenizer,
    )


def _resolve_eos(tokenizer: Any, eos_token_ids: list[int] | None, width: int) -> tuple[int, ...]:
    if eos_token_ids is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token; pass eos_token_ids explicitly")
        eos_token_ids = [tokenizer.eos_token_id]
    eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
    if not eos or any(not 0 <= t < width for t in eos):
        raise ValueError(f"eos_token_ids must be non-empty ids below {width}, got {list(eos)}")
    return eos


def _special_ids(tokenizer: Any) -> set[int]:
    ids = {int(t) for t in getattr(tokenizer, "all_special_ids", []) if t is not None}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(i) for i, tok in decoder.items() if getattr(tok, "special", False))
    return ids


def _literal_added_tokens(tokenizer: Any) -> dict[int, bytes]:
    """Non-special added tokens are stored as plain text, not in the model's byte encoding."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {
        int(i): tok.content.encode("utf-8")
        for i, tok in decoder.items()
        if not getattr(tok, "special", False)
    }


def _decoder_json(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    return json.dumps(json.loads(backend.to_str()).get("decoder"), ensure_ascii=False)


def _token_decoder(tokenizer: Any):
    """Chooses how a vocabulary piece turns into bytes, from the tokenizer's decoder."""
    decoder = _decoder_json(tokenizer)
    if "ByteLevel" in decoder:
        return _byte_level_bytes
    if "ByteFallback" in decoder or "Metaspace" in decoder or _SP_SPACE in decoder:
        return _sentencepiece_bytes
    return lambda piece: tokenizer.convert_tokens_to_string([piece]).encode("utf-8")


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """The GPT-2 byte-to-printable-character table, inverted (character -> byte)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _byte_level_bytes(piece: str) -> bytes:
    table = _byte_level_table()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:  # a piece outside the byte alphabet is literal text
        return piece.encode("utf-8")


def _sentencepiece_bytes(piece: str) -> bytes:
    match = _SP_BYTE_TOKEN.match(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    return piece.replace(_SP_SPACE, " ").encode("utf-8")


def _fingerprint(token_bytes: list[bytes | None], eos: tuple[int, ...], width: int) -> str:
    digest = hashlib.sha256(f"v1|{width}|{list(eos)}|".encode())
    for data in token_bytes:
        if data is None:
            digest.update(b"\x00")
        else:
            digest.update(b"\x01" + len(data).to_bytes(4, "little") + data)
    return digest.hexdigest()[:32]
