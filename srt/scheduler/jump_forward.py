"""Jump-forward inside the scheduler: the forced continuation of a request's grammar, bounded by
what the request may still generate, turned into an edit of its output and KV.

The bound matters for grammars that force an endless continuation (``root ::= "a" root``):
llguidance then computes forced tokens until its own item limit (25,000 bytes here) and leaves
the matcher it computed them on in an error state ("Too many items"), so every later token of
the request would be rejected. The forced continuation is therefore computed on a copy of the
request's matcher, and at most ``room`` tokens of it (the request's remaining
``max_new_tokens`` and context) are used; the request then ends with finish reason ``length``.
"""

from __future__ import annotations

import logging

from radixlm.grammar import (
    GrammarMatcher,
    JumpForwardEdit,
    TokenizerVocab,
    forced_continuation,
    retokenize_forced,
)
from radixlm.srt.scheduler.kv_manager import KVManager
from radixlm.srt.scheduler.req import Req

logger = logging.getLogger(__name__)

JUMP_FORWARD_LOOKBACK = 4  # output tokens re-encoded together with forced text
# Forced text kept per token of room: a token rarely decodes to more characters than this; a
# shorter cut only means the rest of the text is forced one step later.
FORCED_CHARS_PER_TOKEN = 16


def bounded_forced_edit(matcher: GrammarMatcher, vocab: TokenizerVocab, output_ids: list[int],
                        room: int, lookback: int) -> JumpForwardEdit | None:
    """The edit the grammar forces after ``output_ids``, adding at most ``room`` net tokens
    plus the one left to the model (see ``GrammarManager``), or None. ``matcher`` is only
    copied, never changed; a backend error while computing the continuation means no jump."""
    limit = room + lookback + 1
    try:
        forced = forced_continuation(matcher.copy(), vocab)
        if forced.text:
            text = forced.text[: FORCED_CHARS_PER_TOKEN * limit]
            edit = retokenize_forced(matcher.copy(), vocab, output_ids, text, lookback=lookback)
        elif forced.token_ids:
            edit = JumpForwardEdit(0, forced.token_ids)
        else:
            return None
    except Exception as e:  # the request's own matcher is intact: it decodes token by token
        logger.debug("no jump-forward: the forced continuation failed: %s", e)
        return None
    return JumpForwardEdit(edit.num_rollback, edit.token_ids[: room + edit.num_rollback + 1])


def max_rollback(req: Req, page_size: int) -> int:
    """Output tokens an edit may drop: never ones already streamed, never ones whose KV the
    prefix cache owns, and with pages larger than one token only the token sampled this step
    (its KV is not written yet)."""
    limit = min(JUMP_FORWARD_LOOKBACK, len(req.output_ids) - req.num_sent_tokens,
                req.fill_len - req.num_cached_prefix)
    if page_size > 1:
        limit = min(limit, req.fill_len - req.num_kv_tokens)
    return max(limit, 0)


def edit_output(req: Req, edit: JumpForwardEdit, kv: KVManager) -> int:
    """Applies ``edit`` to the request's output (the matcher has taken it already); returns
    the net number of tokens added."""
    keep = len(req.output_ids) - edit.num_rollback
    new_len = len(req.prompt_ids) + keep
    if req.num_kv_tokens > new_len:
        drop_kv_tail(kv, req, new_len)
    del req.output_ids[keep:]
    req.output_ids.extend(edit.token_ids)
    net = len(edit.token_ids) - edit.num_rollback
    req.num_forced_tokens += net
    return net


def drop_kv_tail(kv: KVManager, req: Req, new_len: int) -> None:
    """Frees the KV slots of the request's positions ``[new_len, num_kv_tokens)``: tokens a
    jump-forward edit dropped. They are never in the prefix cache (page size 1 here, or no
    written KV at all with larger pages)."""
    assert req.num_cached_prefix <= new_len < req.num_kv_tokens, (new_len, req.num_kv_tokens)
    slots = kv.req_to_token_pool.read(req.req_slot, req.num_kv_tokens, start=new_len).clone()
    kv.allocator.free(slots)
    req.num_kv_tokens = new_len
