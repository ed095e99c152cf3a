"""Chained page keys and the model fingerprint that scopes them.

A page is ``page_size`` consecutive tokens. Its key is the 16-byte xxh3_128 digest of

    parent key (16 bytes; 16 zero bytes for the first page of a sequence)
    namespace  (b"\\x00" for None; b"\\x01" + uint32 little-endian byte length + UTF-8 text)
    token ids  (each as a little-endian int64)

so page i's key depends on every token before it and on the namespace: two sequences share a
page key only if they share the whole prefix up to that page's end. Every field before the
token ids has a self-delimiting encoding, so no two different inputs hash the same bytes.

Keys say nothing about the model: a store keeps pages of one model layout only, selected by
``model_fingerprint`` (model, dtype, shapes, page size, ``LAYOUT_VERSION``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import numpy as np
import xxhash

KEY_BYTES = 16
ROOT_PARENT = bytes(KEY_BYTES)  # the "parent" of a sequence's first page
# Bump when the byte layout of a page payload (or of the key scheme) changes: old pages are
# then looked up in another folder and never matched.
LAYOUT_VERSION = 1


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64 bytes (the form hashed and stored on disk)."""
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
    return array.astype("<i8", copy=False).tobytes()


def _encode_namespace(namespace: str | None) -> bytes:
    if namespace is None:
        return b"\x00"
    text = namespace.encode("utf-8")
    return b"\x01" + len(text).to_bytes(4, "little") + text


def _check_parent(parent: bytes | None) -> bytes:
    if parent is None:
        return ROOT_PARENT
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a parent key has {KEY_BYTES} bytes, got {len(parent)}")
    return bytes(parent)


def _key(parent: bytes, namespace_bytes: bytes, token_bytes: bytes) -> bytes:
    return xxhash.xxh3_128_digest(parent + namespace_bytes + token_bytes)


def page_key(parent: bytes | None, namespace: str | None, token_ids: Sequence[int]) -> bytes:
    """The key of the page holding ``token_ids`` that follows the page keyed ``parent``
    (None: the first page of a sequence)."""
    if len(token_ids) == 0:
        raise ValueError("a page holds at least one token")
    return _key(_check_parent(parent), _encode_namespace(namespace), encode_token_ids(token_ids))


def page_keys(
    token_ids: Sequence[int],
    page_size: int,
    namespace: str | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """The chained keys of every whole page of ``token_ids`` (a trailing partial page gets
    none); ``parent`` is the key of the page before ``token_ids[0]``, if any."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    token_bytes = encode_token_ids(token_ids)
    namespace_bytes = _encode_namespace(namespace)
    page_bytes = 8 * page_size
    key = _check_parent(parent)
    keys = []
    for start in range(0, len(token_ids) // page_size * page_bytes, page_bytes):
        key = _key(key, namespace_bytes, token_bytes[start : start + page_bytes])
        keys.append(key)
    return keys


def model_fingerprint(fields: Mapping[str, object]) -> tuple[str, dict]:
    """(16 hex chars of xxh3_64, the dict hashed) over ``fields`` plus ``layout_version``.

    Callers pass whatever makes two payloads of the same page key differ: model name or path,
    dtype, num_layers, num_kv_heads, head_dim, page_size, and the tensor-parallel rank and size
    when each rank stores its own shard. Values that are not JSON types are hashed as ``str()``.
    """
    if "layout_version" in fields:
        raise ValueError("layout_version is added by model_fingerprint; do not pass it")
    canonical = json.dumps(
        {**fields, "layout_version": LAYOUT_VERSION},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return xxhash.xxh3_64_hexdigest(canonical.encode("utf-8")), json.loads(canonical)
