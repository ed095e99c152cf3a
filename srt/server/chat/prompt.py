"""Chat messages -> prompt text and token ids, off the event loop.

Special-token text inside message content (``<|im_end|>``, ``<|im_start|>assistant``) is
tokenized as plain text by default: only the chat template may produce control tokens, so a
user cannot end their turn and write the assistant's or the system's part (vLLM and SGLang
parse it as control tokens unless told otherwise). ``--allow-special-tokens-in-chat`` restores
that. Content without special-token text is tokenized with the whole prompt, exactly as before.
Other client text the template lays out (tool definitions, the names and arguments of earlier
tool calls) may not hold special-token text at all: it is refused with a 400 naming the field.

Tools reach the template through a :class:`PromptLayout`: the tool-call parser's ``render``
rewrites the messages for the model's format and names the template's extra arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.srt.managers.tokenizer_manager import GenerateError, TokenizerManager
from radixlm.srt.server.chat.request import ChatMessage

# messages (OpenAI shape) -> (messages for the template, the template's extra arguments)
PromptLayout = Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], dict[str, Any]]]


def plain_layout(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    return messages, {}


def message_dict(msg: ChatMessage) -> dict[str, Any]:
    out = msg.model_dump(exclude_none=True)
    out["role"] = "system" if msg.role == "developer" else msg.role
    if isinstance(msg.content, list):
        parts = []
        for part in msg.content:
            if part.type == "refusal" and msg.role == "assistant":  # its text is what was said
                parts.append(part.refusal or "")
                continue
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


def render(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
) -> str:
    kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
    try:
        return tokenizer.apply_chat_template(messages, **kwargs, tokenize=False)
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


def check_no_special_text(tm: TokenizerManager, texts: list[tuple[str, str]]) -> None:
    """A 400 naming the first ``(param, text)`` whose text holds special-token text."""
    if tm.cfg.allow_special_tokens_in_chat:
        return
    specials = special_texts(tm.tokenizer)
    for param, text in texts:
        found = next((s for s in specials if s in text), None)
        if found is not None:
            raise GenerateError(
                f"{param} holds the special-token text {found!r}; remove it", 400, param
            )


def call_texts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """The names, ids and arguments of the history's tool calls, and the tool messages' ids."""
    out = []
    for i, m in enumerate(messages):
        if m.tool_call_id is not None:
            out.append((f"messages[{i}].tool_call_id", m.tool_call_id))
        for j, call in enumerate(m.tool_calls or ()):
            at = f"messages[{i}].tool_calls[{j}]"
            out.append((f"{at}.id", call.id))
            out.append((f"{at}.function.name", call.function.name))
            out.append((f"{at}.function.arguments", call.function.arguments))
    return out


async def chat_input_ids(
    tm: TokenizerManager,
    messages: list[ChatMessage],
    layout: PromptLayout = plain_layout,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """The templated prompt and its token ids. The content's size is checked before the
    template runs; ``layout`` (tools) and the client's ``template_kwargs`` feed the template;
    templating and tokenization run on the tokenizer pool."""
    if not getattr(tm.tokenizer, "chat_template", None):
        raise GenerateError(
            "this model has no chat template; use /v1/completions, or start the server with "
            "--chat-template FILE",
            400,
        )
    if len(messages) > tm.context_length:  # every template spends tokens on each message
        raise GenerateError(
            f"{len(messages)} messages cannot fit the {tm.context_length}-token context",
            400,
            "messages",
        )
    dicts = [message_dict(m) for m in messages]
    contents = [d["content"] for d in dicts if isinstance(d.get("content"), str)]
    tm.check_prompt_chars(sum(len(c) for c in contents), "messages")
    check_no_special_text(tm, call_texts(messages))
    try:
        laid_out, kwargs = layout(dicts)
    except ValueError as e:  # a history the tool format cannot lay out
        raise GenerateError(f"cannot lay out the messages: {e}", 400, "messages") from None
    kwargs = {**(template_kwargs or {}), **kwargs}
    prompt = await tm.run_blocking(render, tm.tokenizer, laid_out, kwargs)
    tm.check_prompt_chars(len(prompt), "messages")
    ids = await tm.run_blocking(tokenize_chat, tm, prompt, contents)
    return prompt, ids
