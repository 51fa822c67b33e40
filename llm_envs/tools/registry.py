"""Tools by name, run from parsed calls; every failure becomes an ``error: ...`` message.

Malformed calls (``<tool>`` without ``</tool>``, no ``NAME:``), unknown tools, tools that raise,
time out, crash or print too much all become an ``error: ...`` message (counted in
:attr:`ToolRegistry.metrics`); nothing escapes to the env or the collector.

Example:
    >>> registry = ToolRegistry.default()
    >>> registry.run_text("Let me compute. <tool>calculator: (3 + 4) * 2</tool>")
    '14'
    >>> registry.run_text("<tool>calculator: __import__('os')</tool>")
    'error: calculator: only numbers and + - * / // % ** ( ) are allowed'
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tokengym.llm_envs.tools.calls import ToolCall, find_tool_call
from tokengym.llm_envs.tools.python_sandbox import Sandbox, python_tool
from tokengym.llm_envs.tools.safe_arithmetic import calculator

__all__ = ["ToolRegistry"]


class ToolRegistry:
    """Tools by name: each is ``callable(argument: str) -> str``.

    Args:
        tools: ``{name: callable}``.
        max_result_chars: results (and error messages) are cut to this many characters.

    Attributes:
        metrics: counts of ``calls``, ``errors``, ``malformed``, ``unknown_tool`` and ``tool_failures``.
    """

    def __init__(self, tools: dict[str, Callable[[str], str]] | None = None, *, max_result_chars: int = 2000) -> None:
        if isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int) or max_result_chars < 1:
            raise ValueError(f"max_result_chars must be an int >= 1, got {max_result_chars!r}")
        self.tools: dict[str, Callable[[str], str]] = {}
        self.max_result_chars = max_result_chars
        self.metrics = {"calls": 0, "errors": 0, "malformed": 0, "unknown_tool": 0, "tool_failures": 0}
        for name, fn in (tools or {}).items():
            self.register(name, fn)

    @classmethod
    def default(cls, *, python_timeout_s: float = 5.0, python_memory_mb: int = 512,
                python_sandbox: Sandbox | str = Sandbox.AUTO) -> ToolRegistry:  # fmt: skip
        """A registry with ``calculator`` and ``python`` (see :func:`~.python_sandbox.run_python`)."""
        python = python_tool(timeout_s=python_timeout_s, memory_mb=python_memory_mb, sandbox=python_sandbox)
        return cls({"calculator": calculator, "python": python})

    def register(self, name: str, fn: Callable[[str], str]) -> None:
        """Add a tool; ``name`` must match ``[A-Za-z0-9_-]+``."""
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-]+", name):
            raise ValueError(f"tool name must match [A-Za-z0-9_-]+, got {name!r}")
        if not callable(fn):
            raise TypeError(f"tool {name!r} must be callable(argument: str) -> str, got {fn!r}")
        self.tools[name] = fn

    def _error(self, kind: str, message: str) -> str:
        self.metrics["errors"] += 1
        self.metrics[kind] += 1
        return f"error: {message}"[: self.max_result_chars]

    def run(self, call: ToolCall) -> str:
        """Run a parsed call; any failure becomes an ``"error: ..."`` string (never raises)."""
        self.metrics["calls"] += 1
        if call.name is None:
            return self._error("malformed", f"malformed tool call ({call.argument})")
        fn = self.tools.get(call.name)
        if fn is None:
            return self._error("unknown_tool", f"unknown tool {call.name!r}; available: {sorted(self.tools)}")
        try:
            out = fn(call.argument)
        except Exception as err:  # a tool failing is an observation for the model, not a crash
            return self._error("tool_failures", f"{call.name}: {err}")
        return str(out)[: self.max_result_chars]

    def run_text(self, text: str) -> str | None:
        """Run the first call in ``text``; ``None`` if there is none."""
        call = find_tool_call(text)
        return None if call is None else self.run(call)
