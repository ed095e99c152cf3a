"""Parsers of model outputs: tool calls (per model family) and reasoning blocks.

``registry.resolve_tool_parser`` picks a tool-call format from the chat template,
``registry.make_tool_parser`` builds one parser per response (tool_base.py states the
contract); ``reasoning.ReasoningParser`` splits ``<think>`` blocks off. Pure text functions:
nothing here imports torch or the rest of srt.
"""
