"""Chained page keys and the model fingerprint."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from radixlm.hicache import page_hash
from radixlm.hicache.page_hash import model_fingerprint, page_key, page_keys

FIELDS = {
    "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "dtype": "bfloat16",
    "num_layers": 30,
    "num_kv_heads": 3,
    "head_dim": 64,
    "page_size": 4,
}


def random_tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_page_keys_are_the_chain_of_page_key() -> None:
    tokens = random_tokens(12)
    keys = page_keys(tokens, page_size=4, namespace="ns")
    expected, parent = [], None
    for start in range(0, 12, 4):
        parent = page_key(parent, "ns", tokens[start : start + 4])
        expected.append(parent)
    assert keys == expected
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert len(set(keys)) == 3


def test_a_trailing_partial_page_gets_no_key() -> None:
    tokens = random_tokens(11)
    assert len(page_keys(tokens, page_size=4)) == 2
    assert page_keys(tokens[:3], page_size=4) == []
    assert page_keys([], page_size=1) == []
    assert page_keys(tokens, page_size=4) == page_keys(tokens[:8], page_size=4)


def test_a_change_to_any_earlier_token_changes_every_later_key() -> None:
    tokens = random_tokens(16)
    keys = page_keys(tokens, page_size=4)
    for position in range(16):
        changed = list(tokens)
        changed[position] += 1
        other = page_keys(changed, page_size=4)
        page = position // 4
        assert other[:page] == keys[:page]
        assert all(a != b for a, b in zip(other[page:], keys[page:], strict=True))


def test_the_namespace_partitions_keys() -> None:
    tokens = random_tokens(8)
    by_namespace = {ns: page_keys(tokens, 4, namespace=ns) for ns in (None, "", "a", "b", "\x00")}
    all_keys = [key for keys in by_namespace.values() for key in keys]
    assert len(set(all_keys)) == len(all_keys)


def test_a_parent_continues_the_chain() -> None:
    tokens = random_tokens(12)
    keys = page_keys(tokens, 4, namespace="x")
    assert page_keys(tokens[4:], 4, namespace="x", parent=keys[0]) == keys[1:]
    assert page_keys(tokens[4:], 4, namespace="x") != keys[1:]


def test_page_size_changes_the_keys() -> None:
    tokens = random_tokens(8)
    assert page_keys(tokens, 8)[0] not in page_keys(tokens, 4)
    assert page_keys(tokens, 8)[0] != page_keys(tokens, 2)[-1]


def test_array_and_tensor_token_ids_hash_like_lists() -> None:
    tokens = random_tokens(8)
    expected = page_keys(tokens, 4)
    assert page_keys(np.array(tokens, dtype=np.int32), 4) == expected
    assert page_keys(torch.tensor(tokens), 4) == expected
    assert page_keys(tuple(tokens), 4) == expected


def test_token_ids_are_not_truncated_to_32_bits() -> None:
    assert page_key(None, None, [1]) != page_key(None, None, [1 + (1 << 32)])
    assert page_key(None, None, [-1]) != page_key(None, None, [(1 << 32) - 1])


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError):
        page_keys([1, 2], page_size=0)
    with pytest.raises(ValueError):
        page_key(b"short", None, [1])
    with pytest.raises(ValueError):
        page_key(None, None, [])
    with pytest.raises(ValueError):
        page_key(None, None, [1.5])
    with pytest.raises(ValueError):
        page_keys([[1, 2]], page_size=1)


def test_fingerprint_is_canonical_and_sensitive_to_every_field() -> None:
    digest, hashed = model_fingerprint(FIELDS)
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert hashed == {**FIELDS, "layout_version": page_hash.LAYOUT_VERSION}
    assert model_fingerprint(dict(reversed(list(FIELDS.items()))))[0] == digest
    for name, value in FIELDS.items():
        changed = {**FIELDS, name: value * 2}
        assert model_fingerprint(changed)[0] != digest, name
    assert model_fingerprint({**FIELDS, "tp_rank": 1})[0] != digest


def test_fingerprint_depends_on_the_layout_version(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = model_fingerprint(FIELDS)[0]
    monkeypatch.setattr(page_hash, "LAYOUT_VERSION", page_hash.LAYOUT_VERSION + 1)
    assert model_fingerprint(FIELDS)[0] != digest
    with pytest.raises(ValueError):
        model_fingerprint({**FIELDS, "layout_version": 7})


def test_fingerprint_accepts_non_json_values() -> None:
    digest, hashed = model_fingerprint({**FIELDS, "dtype": torch.bfloat16})
    assert hashed["dtype"] == "torch.bfloat16"
    json.dumps(hashed)
    assert digest != model_fingerprint({**FIELDS, "dtype": torch.float16})[0]
