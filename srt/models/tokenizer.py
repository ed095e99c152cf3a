"""A model folder's tokenizer, and a decode-only copy of it for the detokenizer process.

``load_tokenizer`` returns the transformers tokenizer (chat template, encoding, special tokens).
Importing transformers imports torch, about 5 s of CPU per process; the detokenizer only
decodes. ``export_decoder`` takes what decoding needs from a loaded tokenizer whose decoding is
the tokenizers library's own (its backend, serialised) and ``IdDecoder`` rebuilds it with the
tokenizers library alone, so the detokenizer process starts without transformers or torch. A
tokenizer that decodes in Python (a slow tokenizer, a class overriding ``_decode``, the WordPiece
clean-up of spaces before punctuation) exports nothing: its detokenizer loads it as before. The
export is checked where it is made: the copy must decode a probe text and a spread of ids,
special ones included, exactly as the tokenizer does.

This module imports neither torch nor transformers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# decoding these is where transformers' clean-up of tokenization spaces would change the text
_PROBE_TEXT = "a . b , c ! d ? e n't f 'm g 's h 've i 're j ' k\n  l\tm ü 字 🙂"
_PROBE_IDS = 512  # ids spread over the vocabulary, besides the probe text and the special ids


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Any:
    """The transformers tokenizer of a local folder with its chat template, if it has one, or
    ``chat_template`` (``--chat-template``: a Jinja file's path or the template text)."""
    from transformers import AutoTokenizer

    from radixlm.srt.config import read_chat_template

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model_dir}: {e}") from e
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


class IdDecoder:
    """``decode(ids, skip_special_tokens)`` of an exported tokenizer backend (the tokenizers
    library only)."""

    def __init__(self, backend_json: str) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_str(backend_json)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def _decodes_in_the_backend(tokenizer: Any) -> bool:
    """Whether the tokenizer's class decodes through its tokenizers backend unchanged (its
    ``decode`` and ``_decode`` are transformers' generic ones for fast tokenizers)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    generic = (
        "tokenization_utils_tokenizers",
        "tokenization_utils_fast",
        "tokenization_utils_base",
    )
    for name in ("decode", "_decode"):
        owner = next((c for c in type(tokenizer).__mro__ if name in vars(c)), None)
        if owner is None or owner.__module__.rsplit(".", 1)[-1] not in generic:
            return False
    return True


def _probe_ids(tokenizer: Any) -> list[list[int]]:
    vocab_size = len(tokenizer)
    step = max(1, vocab_size // _PROBE_IDS)
    spread = list(range(0, vocab_size, step))
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size]
    text = tokenizer.encode(_PROBE_TEXT, add_special_tokens=False)
    return [text, spread, special + text + special, text[::-1] + spread[:16]]


def export_decoder(tokenizer: Any) -> str | None:
    """The serialised backend of ``tokenizer`` for ``IdDecoder``, or None where the copy would
    not decode exactly as the tokenizer does."""
    if not _decodes_in_the_backend(tokenizer):
        return None
    try:
        backend_json = tokenizer.backend_tokenizer.to_str()
        copy = IdDecoder(backend_json)
        for ids in _probe_ids(tokenizer):
            for skip in (False, True):
                if copy.decode(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                    return None
    except Exception:  # an exotic tokenizer: decode it the slow, sure way
        return None
    return backend_json
