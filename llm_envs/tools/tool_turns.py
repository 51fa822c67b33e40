"""A multi-turn ``turn_fn`` that runs tool calls and hands other turns to an answer scorer.

The tool's result comes back as the next message with role ``"tool"``: ``"<output>"`` on success,
``"error: <reason>"`` otherwise, with the tokenizer's special tokens defused
(:func:`~.escaping.escape_special_tokens`), so a tool cannot forge a role token.
"""

from __future__ import annotations

from tokengym.llm_envs.tools.calls import find_tool_call
from tokengym.llm_envs.tools.escaping import escape_special_tokens, special_token_strings
from tokengym.llm_envs.tools.registry import ToolRegistry
from tokengym.llm_envs.turns.feedback import FeedbackTurns, TurnFn
from tokengym.llm_envs.turns.protocol import Turn

__all__ = ["ToolTurns"]

# the registry's counters under the names a collector's metrics give them
_METRIC_NAMES = {"calls": "tool_calls", "errors": "tool_errors", "malformed": "malformed_tool_calls",
                 "unknown_tool": "unknown_tool_calls"}  # fmt: skip


class ToolTurns(FeedbackTurns):
    """A turn handler (and ``turn_fn``) that runs tool calls and delegates other turns to ``answer_turn_fn``.

    A response containing ``<tool>`` gives ``Turn(tool_reward, feedback=result, role="tool")``; the
    episode goes on (until ``max_turns``). Other responses are scored by ``answer_turn_fn`` (called
    once per step with just those slots).

    Args:
        registry: the tools.
        answer_turn_fn: a ``turn_fn`` for final answers.
        tool_reward: reward of a tool turn (0 by default).
        tokenizer: the env's tokenizer; its special and added tokens are defused in tool results.
            Without it, ``<|...|>`` markers are.

    Example:
        >>> fn = ToolTurns(ToolRegistry.default(), lambda r, p, m, t: [Turn(1.0) for _ in r])
        >>> fn(["<tool>calculator: 6*7</tool>", "42"], ["q", "q"], [{}, {}], [0, 1])
        [Turn(reward=0.0, feedback='42', role='tool', done=None), Turn(reward=1.0, feedback=None, role='user', done=None)]
        >>> fn.metrics()["tool_calls"]
        1
    """

    def __init__(self, registry: ToolRegistry, answer_turn_fn: TurnFn, *, tool_reward: float = 0.0,
                 tokenizer=None) -> None:  # fmt: skip
        if not isinstance(registry, ToolRegistry):
            raise TypeError(f"registry must be a ToolRegistry, got {type(registry).__name__}")
        if not callable(answer_turn_fn):
            raise TypeError(f"answer_turn_fn must be callable(responses, prompts, metadata, turns), got {answer_turn_fn!r}")
        super().__init__(self)  # a handler whose turn function is its own __call__
        self.registry, self.answer_turn_fn, self.tool_reward = registry, answer_turn_fn, float(tool_reward)
        self.special_tokens = None if tokenizer is None else special_token_strings(tokenizer)

    def metrics(self) -> dict[str, float]:
        """The tool registry's counts, named for a collector's metrics: ``tool_calls``, ``tool_errors`` (all the
        failures below), ``malformed_tool_calls``, ``unknown_tool_calls`` and ``tool_failures`` (a tool that raised,
        timed out or crashed)."""
        return {_METRIC_NAMES.get(name, name): n for name, n in self.registry.metrics.items()}

    def describe(self) -> str:
        return "tools"

    def __call__(self, responses, prompts, metadata, turns) -> list[Turn]:
        out: list[Turn | None] = [None] * len(responses)
        answers = []
        for i, text in enumerate(responses):
            call = find_tool_call(text)
            if call is None:
                answers.append(i)
            else:
                feedback = escape_special_tokens(self.registry.run(call), self.special_tokens)
                out[i] = Turn(self.tool_reward, feedback=feedback, role="tool")
        if answers:
            pick = lambda xs: [xs[i] for i in answers]  # noqa: E731
            scored = list(self.answer_turn_fn(pick(responses), pick(prompts), pick(metadata), pick(turns)))
            if len(scored) != len(answers):
                raise ValueError(f"answer_turn_fn returned {len(scored)} turns for {len(answers)} responses")
            for i, turn in zip(answers, scored, strict=True):
                out[i] = turn
        return out
