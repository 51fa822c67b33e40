"""Tool calls parsed from generated text, a tool registry, and a multi-turn ``turn_fn`` that runs them.

Tool-call format: the model writes ``<tool>NAME: ARGUMENT</tool>``, e.g.
``<tool>calculator: (3 + 4) * 2</tool>`` or ``<tool>python: print(1 + 1)</tool>``. ``NAME`` is a
registered tool (letters, digits, ``_``, ``-``), the argument is everything after the first
``:`` (stripped). The first call in a response is run; build the env with
``stop_strings=["</tool>"]`` so a call ends the turn. The tool's result comes back as the next
message with role ``"tool"``: ``"<output>"`` on success, ``"error: <reason>"`` otherwise.

Malformed calls (``<tool>`` without ``</tool>``, no ``NAME:``), unknown tools, tools that raise,
time out, crash or print too much all become an ``error: ...`` message (counted in
:attr:`ToolRegistry.metrics`); nothing escapes to the env or the collector.

Built-in tools: ``calculator`` (arithmetic parsed with :mod:`ast`, never ``eval``) and ``python``
(a separate, resource-limited process; see :mod:`tokengym.llm_envs.python_sandbox` for what it
does and does not protect against).

Example:
    >>> registry = ToolRegistry.default()
    >>> registry.run_text("Let me compute. <tool>calculator: (3 + 4) * 2</tool>")
    '14'
    >>> registry.run_text("<tool>calculator: __import__('os')</tool>")
    'error: calculator: only numbers and + - * / // % ** ( ) are allowed'
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable

from tokengym.llm_envs.multi_turn_env import Turn, TurnFn
from tokengym.llm_envs.python_sandbox import run_python

__all__ = ["ToolCall", "ToolRegistry", "ToolTurns", "calculator", "find_tool_call", "python_tool", "TOOL_STOP"]

TOOL_STOP = "</tool>"  # pass stop_strings=[TOOL_STOP] to the env so a tool call ends the turn
_OPEN = "<tool>"
_CALL = re.compile(r"<tool>\s*([A-Za-z0-9_\-]+)\s*:(.*?)</tool>", re.DOTALL)
_MAX_RESULT = 10**100  # calculator: |intermediate result| bound
_MAX_POWER = 1000  # calculator: |exponent| bound


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


# -- calculator --
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > _MAX_POWER or abs(left) > _MAX_RESULT):
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POWER})")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > _MAX_RESULT:
            raise ValueError("the result is too large or not a real number")
        return value
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


def calculator(expression: str) -> str:
    """Evaluate arithmetic safely: numbers, ``+ - * / // % **``, unary ``-``, parentheses; nothing else.

    Raises:
        ValueError: on anything else (names, calls, attributes...), a bound exceeded, or bad syntax.

    Example:
        >>> calculator("2 ** 10 - 7 // 2"), calculator("1 / 4")
        ('1021', '0.25')
    """
    if len(expression) > 1000:
        raise ValueError("the expression is longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"bad syntax ({err.msg})") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large or not a real number") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def python_tool(*, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000) -> Callable[[str], str]:
    """The ``python`` tool: runs the argument with :func:`~tokengym.llm_envs.python_sandbox.run_python`.

    A non-zero exit, a timeout or a kill raises ``RuntimeError`` carrying the (truncated) output,
    so the registry reports it as a tool error.
    """

    def python(code: str) -> str:
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_chars=max_output_chars)
        output = result.output + (" [output truncated]" if result.is_truncated else "")
        if result.error is not None:
            raise RuntimeError(f"{result.error}" + (f"\n{output}" if output else ""))
        return output

    return python


class ToolRegistry:
    """Tools by name: each is ``callable(argument: str) -> str``.

    Args:
        tools: ``{name: callable}``.
        max_result_chars: results (and error messages) are cut to this many characters.

    Attributes:
        metrics: counts of ``calls``, ``errors``, ``malformed``, ``unknown_tool`` and ``tool_failures``.
    """

    def __init__(self, tools: dict[str, Callable[[str], str]] | None = None, *, max_result_chars: int = 2000) -> None:
        self.tools: dict[str, Callable[[str], str]] = {}
        self.max_result_chars = max_result_chars
        self.metrics = {"calls": 0, "errors": 0, "malformed": 0, "unknown_tool": 0, "tool_failures": 0}
        for name, fn in (tools or {}).items():
            self.register(name, fn)

    @classmethod
    def default(cls, *, python_timeout_s: float = 5.0, python_memory_mb: int = 512) -> ToolRegistry:
        """A registry with ``calculator`` and ``python``."""
        return cls({"calculator": calculator, "python": python_tool(timeout_s=python_timeout_s,
                                                                    memory_mb=python_memory_mb)})  # fmt: skip

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


class ToolTurns:
    """A ``turn_fn`` that runs tool calls and delegates other turns to ``answer_turn_fn``.

    A response containing ``<tool>`` gives ``Turn(tool_reward, feedback=result, role="tool")``; the
    episode goes on (until ``max_turns``). Other responses are scored by ``answer_turn_fn`` (called
    once per step with just those slots).

    Args:
        registry: the tools.
        answer_turn_fn: a ``turn_fn`` for final answers.
        tool_reward: reward of a tool turn (0 by default).

    Example:
        >>> fn = ToolTurns(ToolRegistry.default(), lambda r, p, m, t: [Turn(1.0) for _ in r])
        >>> fn(["<tool>calculator: 6*7</tool>", "42"], ["q", "q"], [{}, {}], [0, 1])
        [Turn(reward=0.0, feedback='42', role='tool'), Turn(reward=1.0, feedback=None, role='user')]
    """

    def __init__(self, registry: ToolRegistry, answer_turn_fn: TurnFn, *, tool_reward: float = 0.0) -> None:
        if not isinstance(registry, ToolRegistry):
            raise TypeError(f"registry must be a ToolRegistry, got {type(registry).__name__}")
        if not callable(answer_turn_fn):
            raise TypeError(f"answer_turn_fn must be callable(responses, prompts, metadata, turns), got {answer_turn_fn!r}")
        self.registry, self.answer_turn_fn, self.tool_reward = registry, answer_turn_fn, float(tool_reward)

    @property
    def metrics(self) -> dict:
        return self.registry.metrics

    def __call__(self, responses, prompts, metadata, turns) -> list[Turn]:
        out: list[Turn | None] = [None] * len(responses)
        answers = []
        for i, text in enumerate(responses):
            call = find_tool_call(text)
            if call is None:
                answers.append(i)
            else:
                out[i] = Turn(self.tool_reward, feedback=self.registry.run(call), role="tool")
        if answers:
            pick = lambda xs: [xs[i] for i in answers]  # noqa: E731
            scored = list(self.answer_turn_fn(pick(responses), pick(prompts), pick(metadata), pick(turns)))
            if len(scored) != len(answers):
                raise ValueError(f"answer_turn_fn returned {len(scored)} turns for {len(answers)} responses")
            for i, turn in zip(answers, scored, strict=True):
                out[i] = turn
        return out
