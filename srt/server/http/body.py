"""What the request bodies of every dialect are read with: the strict base model, and cheap
size checks on the decoded JSON, among them the most sequences one request may ask for."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from radixlm.srt.managers.generate_call import MAX_SEQUENCES_PER_REQUEST
from radixlm.srt.managers.tokenizer_manager import TokenizerManager

# A client's ids (rids, session ids): visible ASCII, no spaces, bounded. A rid names every
# sequence of its request (``rid_0``, ``rid_1``, ...) and a session turn, so its length is
# what a body could otherwise multiply; the caller's namespace is joined to it with a newline
# (managers/caller_scope.py), which no id holds.
MAX_RID_CHARS = 128
MAX_SESSION_ID_CHARS = 256
_CLIENT_ID = re.compile(r"[!-~]+")


def check_client_id(value: Any, name: str, max_chars: int) -> Any:
    """``value`` (a string, or a batch's list of them) is 1 to ``max_chars`` visible ASCII
    characters each; ValueError naming ``name`` otherwise. None passes."""
    for one in value if isinstance(value, list) else [value]:
        if not isinstance(one, str):
            continue  # the model's type check answers
        if not one:
            raise ValueError(f"{name} must be a non-empty string (or left out)")
        if len(one) > max_chars or not _CLIENT_ID.fullmatch(one):
            shown = repr(one[:40]) + ("..." if len(one) > 40 else "")
            raise ValueError(
                f"{name} must be 1 to {max_chars} visible ASCII characters (letters, digits, "
                f"punctuation; no spaces), got {shown} ({len(one)} characters)"
            )
    return value


def check_rid(rid: Any) -> Any:
    """A client's rid (or a batch's list of them): never empty (``/abort_request`` reads an
    empty rid as none, so a request sent with one could not be aborted), bounded."""
    return check_client_id(rid, "rid", MAX_RID_CHARS)


def check_session_id(session_id: Any) -> Any:
    return check_client_id(session_id, "session_id", MAX_SESSION_ID_CHARS)


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


# ---------------------------------------------------------------------- cheap size checks
# Run on the decoded JSON before model validation, which holds the GIL for a while on
# hundreds of thousands of items (and so would stall every other request).
Precheck = Callable[[dict[str, Any]], None]


def check_list_len(value: Any, limit: int, name: str) -> None:
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"{name} has {len(value)} entries; at most {limit}")


# The most tools one request may offer, in every dialect (OpenAI chat, Responses, Anthropic
# Messages and count_tokens, /parse_function_call): OpenAI's own limit. Checked on the decoded
# JSON, before any per-tool work (each tool's schema is checked, ~1 ms each, on the event loop).
MAX_TOOLS = 128


def check_tool_count(tools: Any) -> None:
    """``tools`` (a body's list, as decoded) holds at most MAX_TOOLS entries; ValueError."""
    check_list_len(tools, MAX_TOOLS, "tools")


def precheck_batch(data: dict[str, Any], max_items: int, context_length: int) -> None:
    """Batches (``text``, ``input_ids`` lists of prompts, ``prompt`` lists) are bounded, and
    so is each token-id prompt (by the context length)."""
    for name in ("text", "input_ids", "prompt"):
        value = data.get(name)
        if not isinstance(value, list) or not value:
            continue
        is_flat_ids = not isinstance(value[0], (list, str))
        if not is_flat_ids:  # a batch: of texts or of token-id lists
            check_list_len(value, max_items, name)
        rows = [value] if is_flat_ids else value
        longest = max((len(r) for r in rows if isinstance(r, list)), default=0)
        if longest >= context_length:
            raise ValueError(
                f"{name} has a prompt of {longest} token ids; the context holds "
                f"{context_length} tokens"
            )


def batch_precheck(tm: TokenizerManager) -> Callable[[dict[str, Any]], None]:
    return lambda data: precheck_batch(data, MAX_SEQUENCES_PER_REQUEST, tm.context_length)
