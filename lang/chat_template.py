"""Role prefixes and suffixes taken from a model's own chat template.

A program's text is append-only, so each role needs a fixed text before and after its content.
They are measured by rendering the tokenizer's template around a sentinel content: the part
before the sentinel is the prefix, the part after it the suffix. A message that opens the
conversation gets its own prefix, which holds whatever the template adds first (a default system
prompt, a BOS text). A conversation built from these pieces renders exactly as
``tokenizer.apply_chat_template(messages, tokenize=False)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixlm.lang.ir import ROLES

SENTINEL = "\x00SENTINEL-CONTENT\x00"
# Messages placed before the measured one (so that templates insisting on alternation accept it).
_CONTEXT = {
    "system": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    "user": [{"role": "system", "content": "a"}],
    "assistant": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}],
}


@dataclass(frozen=True)
class ChatTemplate:
    prefixes: Mapping[str, str]  # role -> text before the content of a later message
    first_prefixes: Mapping[str, str]  # role -> text before the content of the first message
    suffixes: Mapping[str, str]  # role -> text after the content
    name: str = "custom"

    def prefix(self, role: str, is_first: bool) -> str:
        return (self.first_prefixes if is_first else self.prefixes)[role]

    def suffix(self, role: str) -> str:
        return self.suffixes[role]

    def render(self, messages: list[dict[str, str]]) -> str:
        """The text of a whole conversation (what a program that built it holds)."""
        return "".join(
            self.prefix(m["role"], i == 0) + m["content"] + self.suffix(m["role"])
            for i, m in enumerate(messages)
        )

    @classmethod
    def chatml(cls) -> ChatTemplate:
        """ChatML, the fallback when the model's template is not available."""
        prefixes = {r: f"<|im_start|>{r}\n" for r in ROLES}
        return cls(prefixes, dict(prefixes), {r: "<|im_end|>\n" for r in ROLES}, "chatml")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate:
        """Measured from ``tokenizer.apply_chat_template``; ChatML when it has no template."""
        if not getattr(tokenizer, "chat_template", None):
            return cls.chatml()

        def render(messages: list[dict[str, str]]) -> str:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=False
            )

        return measure(render, name=getattr(tokenizer, "name_or_path", "tokenizer") or "tokenizer")


def _split(rendered: str, role: str) -> tuple[str, str]:
    if rendered.count(SENTINEL) != 1:
        raise ValueError(f"the chat template does not render the content of a {role} message once")
    before, after = rendered.split(SENTINEL)
    return before, after


def _measure_role(render: Any, role: str) -> tuple[str, str, str]:
    """(first prefix, later prefix, suffix) of one role."""
    first, suffix = _split(render([{"role": role, "content": SENTINEL}]), role)
    context = _CONTEXT[role]
    try:
        base = render(context)
        full = render([*context, {"role": role, "content": SENTINEL}])
    except Exception:  # a template that refuses this order: reuse the first-message form
        return first, first, suffix
    later, later_suffix = _split(full, role)
    if not later.startswith(base) or later_suffix != suffix:
        return first, first, suffix
    return first, later[len(base) :], suffix


def measure(render: Any, name: str = "custom") -> ChatTemplate:
    """A ChatTemplate from ``render(messages) -> str`` (no generation prompt)."""
    firsts, laters, suffixes = {}, {}, {}
    for role in ROLES:
        try:
            firsts[role], laters[role], suffixes[role] = _measure_role(render, role)
        except Exception as e:
            raise ValueError(
                f"cannot derive the {role} role from chat template {name!r}: {e}; "
                f"pass chat_template=ChatTemplate(...) to the backend"
            ) from e
    return ChatTemplate(laters, firsts, suffixes, name)
