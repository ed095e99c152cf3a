"""Jump-forward inside the scheduler: the forced continuation of a request's grammar, bounded by
what the request may still generate, turned into an edit of its output and KV.

The bound matters for grammars that force an endless continuation (``root ::= "a" root``
after a few free characters): at most ``room`` tokens are used (the request's remaining
``max_new_tokens`` and context, passed to the grammar library as ``max_tokens``), so the request
ends with finish reason ``length``. The continuation is computed on a copy of the request's
matcher: llguidance computes forced tokens up to its own item limit whatever ``max_tokens``
says, and a matcher that reaches the limit is left in an error state ("Too many items") that
would reject every later token of the request.
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

# Output tokens re-encoded together with forced text: only the one sampled this step. A stream
# (interval 1) has sent every earlier token, which an edit must not take back; re-encoding more
# for an unstreamed request made streamed and unstreamed greedy answers differ, and measured
# fewer steps saved (24 vs 29 of 31 on tests/srt/grammar_e2e's JSON workload).
JUMP_FORWARD_LOOKBACK = 1


def bounded_forced_edit(
    matcher: GrammarMatcher, vocab: TokenizerVocab, output_ids: list[int], room: int, lookback: int
) -> JumpForwardEdit | None:
    """The edit the grammar forces after ``output_ids``, adding at most ``room`` net tokens
    plus the one left to the model (see ``GrammarManager``), or None. ``matcher`` is only
    copied, never changed; a backend error while computing the continuation means no jump."""
    try:
        forced = forced_continuation(matcher.copy(), vocab, max_tokens=room + 1)
        if forced.text:
            return retokenize_forced(
                matcher.copy(),
                vocab,
                output_ids,
                forced.text,
                lookback=lookback,
                max_tokens=room + 1,
            )
        if forced.token_ids:
            return JumpForwardEdit(0, forced.token_ids)
    except Exception as e:  # the request's own matcher is intact: it decodes token by token
        logger.debug("no jump-forward: the forced continuation failed: %s", e)
    return None


def max_rollback(req: Req, page_size: int) -> int:
    """Output tokens an edit may drop: at most ``JUMP_FORWARD_LOOKBACK``, never ones already
    streamed, never ones whose KV the prefix cache owns, and with pages larger than one token
    only the token sampled this step (its KV is not written yet)."""
    limit = min(
        JUMP_FORWARD_LOOKBACK,
        len(req.output_ids) - req.num_sent_tokens,
        req.fill_len - req.num_cached_prefix,
    )
    if page_size > 1:
        limit = min(limit, req.fill_len - req.num_kv_tokens)
    return max(limit, 0)


def edit_output(req: Req, edit: JumpForwardEdit, kv: KVManager) -> int:
    """Applies ``edit`` to the request's output (the matcher has taken it already); returns
    the net number of tokens added."""
    keep = len(req.output_ids) - edit.num_rollback
    new_len = len(req.prompt_ids) + keep
    if req.num_kv_tokens > new_len:
        kv.truncate(req, new_len)
    del req.output_ids[keep:]
    req.output_ids.extend(edit.token_ids)
    return len(edit.token_ids) - edit.num_rollback
