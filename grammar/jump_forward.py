"""Jump-forward: append what the grammar forces without a decode step per token.

``forced_continuation`` reads the forced tokens (and text, where the backend knows it) off a
matcher. Appending forced tokens as-is can leave an unnatural token boundary (the model would
have merged the last generated token with the forced text), so ``retokenize_forced`` re-encodes
the last few generated tokens together with the forced text and returns an edit: drop
``num_rollback`` tokens from the end, then append ``token_ids``. The caller applies the same edit
to its matcher (``apply_edit``) and to its KV cache (the dropped tokens' KV must be discarded).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.grammar.base import GrammarMatcher
from radixlm.grammar.vocab import TokenizerVocab


@dataclass(frozen=True)
class ForcedContinuation:
    token_ids: tuple[int, ...]
    text: str | None  # the forced text (valid UTF-8 prefix), None where nothing is known


@dataclass(frozen=True)
class JumpForwardEdit:
    num_rollback: int  # generated tokens to drop from the end
    token_ids: tuple[int, ...]  # tokens to append after the drop

    @property
    def is_empty(self) -> bool:
        return self.num_rollback == 0 and not self.token_ids


def _utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is complete UTF-8 text."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def forced_continuation(
    matcher: GrammarMatcher, vocab: TokenizerVocab, max_tokens: int | None = None
) -> ForcedContinuation:
    """The tokens (and text) the grammar forces next, at most ``max_tokens`` tokens and the
    text they spell (None: what the backend computes; pass the request's remaining token
    budget, since a grammar may force text forever); empty when nothing is forced."""
    if max_tokens is not None and max_tokens <= 0:
        return ForcedContinuation((), None)
    token_ids = tuple(matcher.forced_tokens(max_tokens))
    if max_tokens is not None and len(token_ids) >= max_tokens:
        data = vocab.decode_bytes(list(token_ids))  # cut: only the text of these tokens
    else:
        data = matcher.forced_bytes() or vocab.decode_bytes(list(token_ids))
    text = _utf8_prefix(data)
    return ForcedContinuation(token_ids, text or None)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _try_lookback(
    matcher: GrammarMatcher, vocab: TokenizerVocab, tail: list[int], forced: bytes
) -> JumpForwardEdit | None:
    tail_bytes = vocab.decode_bytes(tail)
    try:
        text = (tail_bytes + forced).decode("utf-8")
    except UnicodeDecodeError:
        return None
    new_ids = vocab.encode(text)
    if any(t in vocab.special_token_ids for t in new_ids):
        return None
    if vocab.decode_bytes(new_ids) != tail_bytes + forced:
        return None
    trial = matcher.copy()
    trial.rollback(len(tail))
    if not new_ids or not trial.accept_tokens(new_ids):
        return None
    keep = _common_prefix_len(tail, new_ids)
    return JumpForwardEdit(len(tail) - keep, tuple(new_ids[keep:]))


def retokenize_forced(
    matcher: GrammarMatcher,
    vocab: TokenizerVocab,
    generated_ids: list[int],
    forced_text: str,
    lookback: int = 4,
    max_tokens: int | None = None,
) -> JumpForwardEdit:
    """An edit whose result decodes to ``generated + forced_text`` and which ``matcher`` accepts.

    ``matcher`` must have accepted ``generated_ids`` (at least their last ``lookback`` tokens).
    Tries re-encoding the last ``lookback``, ``lookback - 1``, ... 0 generated tokens together
    with the forced text; falls back to the backend's forced token ids. With ``max_tokens``
    the edit adds at most that many tokens net (its tokens are cut: a prefix of an accepted
    sequence is accepted), so the result may decode to a prefix of ``generated + forced_text``.
    """
    if not forced_text or (max_tokens is not None and max_tokens <= 0):
        return JumpForwardEdit(0, ())
    edit = _retokenize(matcher, vocab, generated_ids, forced_text.encode("utf-8"), lookback)
    if max_tokens is not None and len(edit.token_ids) - edit.num_rollback > max_tokens:
        edit = JumpForwardEdit(edit.num_rollback, edit.token_ids[: edit.num_rollback + max_tokens])
    return edit


def _retokenize(
    matcher: GrammarMatcher,
    vocab: TokenizerVocab,
    generated_ids: list[int],
    forced: bytes,
    lookback: int,
) -> JumpForwardEdit:
    longest = min(lookback, len(generated_ids), matcher.num_accepted_tokens)
    for k in range(longest, -1, -1):
        tail = list(generated_ids[len(generated_ids) - k :]) if k else []
        edit = _try_lookback(matcher, vocab, tail, forced)
        if edit is not None:
            return edit
    return JumpForwardEdit(0, tuple(matcher.forced_tokens()))


def apply_edit(matcher: GrammarMatcher, edit: JumpForwardEdit) -> bool:
    """Applies ``edit`` to ``matcher``; False (matcher unchanged) if it is not accepted."""
    trial = matcher.copy()
    trial.rollback(edit.num_rollback)
    if not trial.accept_tokens(list(edit.token_ids)):
        return False
    matcher.rollback(edit.num_rollback)
    accepted = matcher.accept_tokens(list(edit.token_ids))
    assert accepted, "a matcher disagreed with its own copy"
    return True
