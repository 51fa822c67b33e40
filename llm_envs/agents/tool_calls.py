"""Native tool-call formats: parse a model's turn text into content and OpenAI-style ``tool_calls``.

A parser is any object with ``parse(text) -> ParsedTurn``; parsers are selected by name
(:func:`tool_parser`). A malformed call is never an error: the turn comes back as plain text and
:attr:`ParsedTurn.malformed` says why (the agent env counts it).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Protocol

__all__ = ["HermesToolParser", "ParsedTurn", "ToolCallParser", "tool_parser"]


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A turn's text split into what the user reads and the tool calls it makes.

    Attributes:
        content: the text outside the tool calls (the whole text when it holds no well-formed call).
        tool_calls: OpenAI chat ``tool_calls`` entries (``{"id", "type": "function", "function": {"name",
            "arguments"}}``, ``arguments`` a JSON string), or ``[]``.
        malformed: why the text's tool calls were not accepted (``None`` when well formed or absent).
    """

    content: str
    tool_calls: list[dict] = dataclasses.field(default_factory=list)
    malformed: str | None = None


class ToolCallParser(Protocol):
    """Splits a turn's text into content and tool calls."""

    def parse(self, text: str) -> ParsedTurn:
        """The turn's content and tool calls; a malformed call leaves the text as content."""


class HermesToolParser:
    """Hermes / Qwen2.5 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more.

    Example:
        >>> turn = HermesToolParser().parse('Let me add.<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
        >>> turn.content, turn.tool_calls[0]["function"]
        ('Let me add.', {'name': 'add', 'arguments': '{"a": 2}'})
        >>> HermesToolParser().parse("<tool_call>{oops</tool_call>").malformed is not None
        True
    """

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
    open_tag = "<tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        if self.open_tag not in text:
            return ParsedTurn(text)
        bodies = self._CALL.findall(text)
        if len(bodies) != text.count(self.open_tag):
            return ParsedTurn(text, malformed="a <tool_call> without its closing </tool_call>")
        calls = []
        for body in bodies:
            try:
                call = json.loads(body)
            except json.JSONDecodeError as err:
                return ParsedTurn(text, malformed=f"a tool call that is not JSON ({err.msg})")
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return ParsedTurn(text, malformed='a tool call without a "name" string')
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return ParsedTurn(text, malformed=f"tool call {call['name']!r} has arguments that are not JSON")
            if not isinstance(arguments, dict):
                return ParsedTurn(text, malformed=f"tool call {call['name']!r} has arguments that are not an object")
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(arguments)}})  # fmt: skip
        return ParsedTurn(self._CALL.sub("", text).strip(), calls)


_PARSERS = {"hermes": HermesToolParser, "qwen2.5": HermesToolParser, "qwen": HermesToolParser}


def tool_parser(name: str | ToolCallParser | None) -> ToolCallParser | None:
    """The parser of ``name`` (``"hermes"``, ``"qwen2.5"``), a parser object as is, or ``None`` (no tool calls)."""
    if name is None or callable(getattr(name, "parse", None)):
        return name
    if not isinstance(name, str) or name.lower() not in _PARSERS:
        raise ValueError(f"tool_parser must be one of {sorted(_PARSERS)}, a parser with parse(text), or None; "
                         f"got {name!r}")  # fmt: skip
    return _PARSERS[name.lower()]()
