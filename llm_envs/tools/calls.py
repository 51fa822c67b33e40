"""Tool calls parsed from generated text: ``<tool>NAME: ARGUMENT</tool>``.

``NAME`` is a registered tool (letters, digits, ``_``, ``-``), the argument is everything after the
first ``:`` (stripped). The first call in a response is the one that runs; build the env with
``stop_strings=[TOOL_STOP]`` so a call ends the turn.

Example:
    >>> find_tool_call("Let me compute. <tool>calculator: (3 + 4) * 2</tool>")
    ('calculator', '(3 + 4) * 2')
"""

from __future__ import annotations

import re

__all__ = ["TOOL_STOP", "ToolCall", "find_tool_call"]

TOOL_STOP = "</tool>"  # pass stop_strings=[TOOL_STOP] to the env so a tool call ends the turn
_OPEN = "<tool>"
_CALL = re.compile(r"<tool>\s*([A-Za-z0-9_\-]+)\s*:(.*?)</tool>", re.DOTALL)


class ToolCall(tuple):
    """``(name, argument)`` of a parsed call; ``name`` is ``None`` for a malformed one (see ``argument``)."""

    __slots__ = ()

    def __new__(cls, name: str | None, argument: str):
        return super().__new__(cls, (name, argument))

    name = property(lambda self: self[0])
    argument = property(lambda self: self[1])


def find_tool_call(text: str) -> ToolCall | None:
    """The first tool call in ``text``; ``None`` if it has no ``<tool>``; a malformed call has ``name=None``.

    Example:
        >>> find_tool_call("x <tool>python: print(2)</tool> y")
        ('python', 'print(2)')
        >>> find_tool_call("no call") is None, find_tool_call("<tool>oops</tool>").name
        (True, None)
    """
    start = text.find(_OPEN)
    if start < 0:
        return None
    match = _CALL.match(text, start)
    if match is None:
        why = "missing </tool>" if TOOL_STOP not in text[start:] else "expected <tool>NAME: ARGUMENT</tool>"
        return ToolCall(None, why)
    return ToolCall(match.group(1), match.group(2).strip())
