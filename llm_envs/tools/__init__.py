"""Tools for multi-turn envs: parsing ``<tool>NAME: ARGUMENT</tool>`` calls, a registry, a ``turn_fn``, sandboxes.

Modules: ``calls`` (the call format), ``safe_arithmetic`` (``calculator``),
``python_sandbox`` (``run_python`` under bubblewrap or rlimits, the ``python`` tool),
``registry`` (``ToolRegistry``), ``tool_turns`` (``ToolTurns``), ``escaping``
(special tokens in tool output).

Example:
    >>> ToolRegistry.default().run_text("<tool>python: print(3 * 14)</tool>")
    '42\\n'
"""

from tokengym.llm_envs.tools.calls import TOOL_STOP, ToolCall, find_tool_call
from tokengym.llm_envs.tools.escaping import escape_special_tokens, special_token_strings
from tokengym.llm_envs.tools.python_sandbox import PythonResult, Sandbox, python_tool, run_python
from tokengym.llm_envs.tools.registry import ToolRegistry
from tokengym.llm_envs.tools.safe_arithmetic import calculator
from tokengym.llm_envs.tools.tool_turns import ToolTurns

__all__ = [
    "TOOL_STOP",
    "PythonResult",
    "Sandbox",
    "ToolCall",
    "ToolRegistry",
    "ToolTurns",
    "calculator",
    "escape_special_tokens",
    "find_tool_call",
    "python_tool",
    "run_python",
    "special_token_strings",
]
