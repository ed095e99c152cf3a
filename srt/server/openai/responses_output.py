"""The Responses API's output side: chat deltas written as Responses output items and the
stream events that build them (``OutputBuilder``, one for the streamed and the plain route, so
both hold the same items), and the response object (``ResponseCall``)."""

from __future__ import annotations

import time
from typing import Any

import orjson

from radixlm.srt.server.chat.plan import OpenAIPlan, chat_logprobs, finish_reason
from radixlm.srt.server.chat.request import ChatCompletionRequest
from radixlm.srt.server.chat.tool_stream import ChoiceStream
from radixlm.srt.server.openai.responses_input import ResponsesRequest, new_id


class OutputBuilder:
    """Chat deltas (``reasoning_content``, ``content``, ``tool_calls``) in; Responses output
    items and the stream events that build them out. The non-streamed route feeds the whole
    output once, so both forms hold the same items."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._logprobs: list[dict[str, Any]] = []  # of tokens whose text has not come out yet

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.items) if it is item)

    def _ref(self, item: dict[str, Any]) -> dict[str, Any]:
        """The fields locating a content event: its item and the item's place in the output."""
        return {"item_id": item["id"], "output_index": self._index(item)}

    def _start(self, item: dict[str, Any]) -> None:
        self._close()
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        ref = self._ref(item)
        if item["type"] == "message":
            part = item["content"][0]
            self._emit(
                "response.output_text.done",
                **ref,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            )
            self._emit("response.content_part.done", **ref, content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            self._emit("response.reasoning_text.done", **ref, content_index=0, text=text)
        else:
            self._emit(
                "response.function_call_arguments.done",
                **ref,
                name=item["name"],
                arguments=item["arguments"],
            )
        item["status"] = status
        self._emit("response.output_item.done", output_index=ref["output_index"], item=item)

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> None:
        """One delta; ``logprobs`` of the tokens behind it wait for the next text (a parser may
        hold text back), and go with it."""
        self._logprobs += logprobs
        if delta.get("reasoning_content"):
            self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            self._text(delta["content"], self._logprobs)
            self._logprobs = []
        for call in delta.get("tool_calls", ()):
            self._call(call)

    def _reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": ""}],
                "status": "in_progress",
            }
            self._start(item)
        item["content"][0]["text"] += text
        self._emit(
            "response.reasoning_text.delta",
            **self._ref(item),
            content_index=0,
            delta=text,
        )

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            item = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._start(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            self._emit(
                "response.content_part.added",
                **self._ref(item),
                content_index=0,
                part=dict(part, logprobs=[]),
            )
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        self._emit(
            "response.output_text.delta",
            **self._ref(item),
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def _call(self, call: dict[str, Any]) -> None:
        item = self._calls.get(call["index"])
        function = call.get("function", {})
        if item is None:
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call["id"],
                "name": function.get("name", ""),
                "arguments": "",
            }
            self._calls[call["index"]] = item
            self._start(item)
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            self._emit(
                "response.function_call_arguments.delta",
                **self._ref(item),
                delta=arguments,
            )

    def finish(self, cut: bool) -> None:
        """Closes the item being written (``incomplete`` when the length limit cut it). Logprobs
        still waiting (the end-of-sequence token's) join the last message's text; with no
        message they were the calls' tokens, which carry none."""
        messages = [it for it in self.items if it["type"] == "message"]
        if messages and self._logprobs:
            messages[-1]["content"][0]["logprobs"] += self._logprobs
        self._logprobs = []
        self._close("incomplete" if cut else "completed")

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


# ---------------------------------------------------------------------- response object
class ResponseCall:
    """One Responses request in flight: its echo fields, plan and output."""

    def __init__(
        self, req: ResponsesRequest, model: str, plan: OpenAIPlan, chat: ChatCompletionRequest
    ) -> None:
        self.req = req
        self.plan = plan
        self.id = new_id("resp")
        self.created = int(time.time())
        self.model = model
        self.chat = chat
        self.builder = OutputBuilder()
        self.stream = ChoiceStream(plan.parsing)
        self.num_chars = 0
        self.num_logprobs = 0
        self.seq = 0

    def feed(self, out: dict[str, Any]) -> None:
        """One update of the output: its new text (and logprobs) through the parsers."""
        reason = finish_reason(out)
        text = out["text"][self.num_chars :]
        self.num_chars = len(out["text"])
        logprobs: list[dict[str, Any]] = []
        if self.chat.logprobs:
            meta = out["meta_info"]
            entries = meta.get("output_token_logprobs", [])[self.num_logprobs :]
            tops = meta["output_top_logprobs"][self.num_logprobs :]
            self.num_logprobs += len(entries)
            logprobs = chat_logprobs(entries, tops, self.plan.token_bytes)["content"]
        self.builder.feed(self.stream.feed(text), logprobs)
        if reason is not None:
            self.builder.feed(self.stream.flush(), [])
            self.builder.finish(cut=reason == "length")

    def body(self, status: str, out: dict[str, Any] | None) -> dict[str, Any]:
        req = self.req
        cut = out is not None and finish_reason(out) == "length"
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if cut else status,
            "completed_at": int(time.time()) if status == "completed" and not cut else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": self.builder.items if out is not None else [],
            "parallel_tool_calls": self.plan.parsing.parallel,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": fmt, "verbosity": (req.text or {}).get("verbosity")},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": [_echo_tool(t) for t in req.tools or ()],
            "top_logprobs": req.top_logprobs,
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": _usage(out) if out is not None else None,
            "user": req.user,
            "metadata": req.metadata or {},
            "background": False,
            "service_tier": "default",
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", True),
    }


def _usage(out: dict[str, Any]) -> dict[str, Any]:
    meta = out["meta_info"]
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    cached = meta.get("cached_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
