"""Chat messages -> prompt text and token ids, off the event loop.

Special-token text inside message content (``<|im_end|>``, ``<|im_start|>assistant``) is
tokenized as plain text by default: only the chat template may produce control tokens, so a
user cannot end their turn and write the assistant's or the system's part (vLLM and SGLang
parse it as control tokens unless told otherwise). ``--allow-special-tokens-in-chat`` restores
that. Content without special-token text is tokenized with the whole prompt, exactly as before.
"""

from __future__ import annotations

from typing import Any

from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.server.openai_protocol import ChatMessage


def message_dict(msg: ChatMessage) -> dict[str, Any]:
    out = msg.model_dump(exclude_none=True)
    out["role"] = "system" if msg.role == "developer" else msg.role
    if isinstance(msg.content, list):
        parts = []
        for part in msg.content:
            if part.type != "text":
                raise GenerateError(
                    f"content parts of type {part.type!r} are not supported; send text",
                    400,
                    "messages",
                )
            parts.append(part.text or "")
        out["content"] = "".join(parts)
    elif msg.content is None:
        out["content"] = ""
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template's own raise_exception, or a malformed history
        raise GenerateError(f"cannot apply the chat template: {e}", 400, "messages") from None


def special_texts(tokenizer: Any) -> list[str]:
    """The texts that tokenize to control tokens (the added vocabulary)."""
    return [t for t in tokenizer.get_added_vocab() if t]


def _content_spans(prompt: str, contents: list[str]) -> list[tuple[int, int]]:
    """Where each content sits in the rendered prompt, in order."""
    spans, cursor = [], 0
    for content in contents:
        at = prompt.find(content, cursor)
        if at < 0:
            raise GenerateError(
                "a message holds special-token text that this model's chat template rewrites, "
                "so it cannot be kept as plain text; remove the special-token text",
                400,
                "messages",
            )
        spans.append((at, at + len(content)))
        cursor = at + len(content)
    return spans


def tokenize_chat(tm: TokenizerManager, prompt: str, contents: list[str]) -> list[int]:
    """Blocking: the prompt's token ids; content holding special-token text is tokenized with
    those texts split into ordinary tokens."""
    specials = special_texts(tm.tokenizer)
    risky = [c for c in contents if any(s in c for s in specials)]
    if tm.cfg.allow_special_tokens_in_chat or not risky:
        return tm.tokenize(prompt, add_special_tokens=False)
    ids: list[int] = []
    cursor = 0
    for start, end in _content_spans(prompt, risky):
        ids += tm.tokenizer.encode(prompt[cursor:start], add_special_tokens=False)
        ids += tm.tokenizer.encode(
            prompt[start:end], add_special_tokens=False, split_special_tokens=True
        )
        cursor = end
    ids += tm.tokenizer.encode(prompt[cursor:], add_special_tokens=False)
    return ids


async def chat_input_ids(
    tm: TokenizerManager, messages: list[ChatMessage]
) -> tuple[str, list[int]]:
    """The templated prompt and its token ids. The content's size is checked before the
    template runs; templating and tokenization run on the tokenizer pool."""
    if not getattr(tm.tokenizer, "chat_template", None):
        raise GenerateError("this model has no chat template; use /v1/completions", 400)
    if len(messages) > tm.context_length:  # every template spends tokens on each message
        raise GenerateError(
            f"{len(messages)} messages cannot fit the {tm.context_length}-token context",
            400,
            "messages",
        )
    dicts = [message_dict(m) for m in messages]
    contents = [d["content"] for d in dicts if isinstance(d.get("content"), str)]
    tm.check_prompt_chars(sum(len(c) for c in contents), "messages")
    prompt = await tm.run_blocking(render, tm.tokenizer, dicts)
    tm.check_prompt_chars(len(prompt), "messages")
    ids = await tm.run_blocking(tokenize_chat, tm, prompt, contents)
    return prompt, ids
