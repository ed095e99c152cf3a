"""Accumulates one request's BatchStrOut entries into SGLang's ``/generate`` response shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.srt.messages import BatchStrOut


@dataclass
class RequestResult:
    rid: str
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    return_token_ids_logprob: bool = False  # the request sent token_ids_logprob
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[list[list[Any]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[list[Any]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[Any]]] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: BatchStrOut, i: int) -> None:
        """Folds entry ``i`` of a BatchStrOut (which must be this request's) into the result."""
        t = out.token_out
        self.text += out.text_delta[i]
        self.output_ids += t.new_token_ids[i]
        self.finish_reason = t.finish_reason[i]
        self.prompt_tokens = t.prompt_tokens[i]
        self.completion_tokens = t.completion_tokens[i]
        self.cached_tokens = t.cached_tokens[i]
        if t.output_token_logprobs[i]:
            self.output_token_logprobs += t.output_token_logprobs[i]
        if t.output_top_logprobs[i]:
            self.output_top_logprobs += t.output_top_logprobs[i]
        if t.input_token_logprobs[i]:
            self.input_token_logprobs = t.input_token_logprobs[i]
        if t.input_top_logprobs[i]:
            self.input_top_logprobs = t.input_top_logprobs[i]
        if t.output_token_ids_logprobs and t.output_token_ids_logprobs[i]:
            self.output_token_ids_logprobs += t.output_token_ids_logprobs[i]
        if t.input_token_ids_logprobs and t.input_token_ids_logprobs[i]:
            self.input_token_ids_logprobs = t.input_token_ids_logprobs[i]

    def to_dict(self, decode=None) -> dict[str, Any]:
        """The response body. ``decode(token_id) -> str`` adds token texts to logprob entries
        when ``return_text_in_logprobs`` is set."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.return_logprob:
            fmt = self._format_entries(decode)

            def rows(positions: list[list[list[Any]]]) -> list[list[list[Any]] | None]:
                return [fmt(p) if p else None for p in positions]

            meta["input_token_logprobs"] = fmt(self.input_token_logprobs)
            meta["output_token_logprobs"] = fmt(self.output_token_logprobs)
            meta["input_top_logprobs"] = rows(self.input_top_logprobs)
            meta["output_top_logprobs"] = rows(self.output_top_logprobs)
            if self.return_token_ids_logprob:  # SGLang's keys, only when asked for
                meta["input_token_ids_logprobs"] = rows(self.input_token_ids_logprobs)
                meta["output_token_ids_logprobs"] = rows(self.output_token_ids_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def _format_entries(self, decode):
        want_text = self.return_text_in_logprobs and decode is not None

        def fmt(entries: list[list[Any]]) -> list[list[Any]]:
            return [[lp, tok, decode(tok) if want_text else None] for lp, tok in entries]

        return fmt
