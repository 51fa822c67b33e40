"""Multi-turn math (AReaL's multi-turn math agent): wrong answers get feedback and another try.

Each episode is an arithmetic problem (``"12+7="``). After every turn the last number of the
response (or its ``\\boxed{}``) is compared with the answer:

* correct: reward ``correct`` (1.0) and the episode ends;
* wrong, with turns left: reward ``wrong`` (0.0, or a negative penalty) and the user message
  :data:`WRONG_FEEDBACK` ("Your answer is wrong. Please check your work and try again.");
* wrong on the last turn: reward ``wrong`` and the episode ends.

With ``tools=True`` the task also offers the ``calculator`` and ``python`` tools
(``<tool>calculator: 12+7</tool>``, see :mod:`tokengym.llm_envs.tools`); a tool call uses a turn.
Tool output is sandboxed (bubblewrap where it works) and its special tokens are defused.
"""

from __future__ import annotations

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv, Turn
from tokengym.llm_envs.rewards import extract_answer, normalize_answer
from tokengym.llm_envs.tasks._common import check_positive_int
from tokengym.llm_envs.tasks.arithmetic import arithmetic_prompts
from tokengym.llm_envs.token_env import TokenEnv

__all__ = ["MultiTurnMathFeedback", "make_multi_turn_math_env", "WRONG_FEEDBACK", "TOOL_HINT"]

WRONG_FEEDBACK = "Your answer is wrong. Please check your work and try again."
TOOL_HINT = " You can use a tool: <tool>calculator: EXPRESSION</tool> or <tool>python: CODE</tool>."


class MultiTurnMathFeedback:
    """The task's ``turn_fn``: exact match of the last number against ``metadata["answer"]``.

    Args:
        correct: reward of a correct turn (the episode ends).
        wrong: reward of a wrong turn (e.g. ``-0.1`` to penalise every retry).
        feedback: the user message after a wrong answer.

    Example:
        >>> fn = MultiTurnMathFeedback()
        >>> fn(["12", "The answer is 19"], ["12+7="] * 2, [{"answer": "19"}] * 2, [0, 1])
        [Turn(reward=0.0, feedback='Your answer is wrong. Please check your work and try again.', role='user', done=None), Turn(reward=1.0, feedback=None, role='user', done=None)]
    """

    def __init__(self, *, correct: float = 1.0, wrong: float = 0.0, feedback: str = WRONG_FEEDBACK) -> None:
        self.correct, self.wrong, self.feedback = float(correct), float(wrong), feedback

    def __call__(self, responses, prompts, metadata, turns) -> list[Turn]:
        out = []
        for text, meta in zip(responses, metadata, strict=True):
            answer = extract_answer(text)
            if answer is not None and normalize_answer(answer) == normalize_answer(meta["answer"]):
                out.append(Turn(self.correct))
            else:
                out.append(Turn(self.wrong, feedback=self.feedback))
        return out


def make_multi_turn_math_env(
    *,
    tokenizer,
    batch_size: int = 8,
    max_turns: int = 3,
    max_new_tokens: int = 48,
    tools: bool = False,
    seed: int = 0,
    n_prompts: int = 1000,
    max_operand: int = 20,
    wrong_reward: float = 0.0,
    python_timeout_s: float = 5.0,
    **env_kwargs,
) -> TokenEnv:
    """A multi-turn :class:`~tokengym.llm_envs.TokenEnv` (:func:`~tokengym.llm_envs.MultiTurnTokenEnv`) over arithmetic problems with retry feedback (and optionally tools).

    Args:
        tokenizer: the tokenizer of the model you train (``tokengym.testing.tiny_tokenizer()`` in tests).
        batch_size: parallel slots.
        max_turns: turns per episode.
        max_new_tokens: generated-token budget of a whole episode (all turns).
        tools: offer ``calculator`` and ``python`` (``stop_strings=["</tool>"]`` is added).
        seed: seed of the problems.
        n_prompts: number of problems.
        max_operand: largest operand.
        wrong_reward: reward of a wrong turn.
        python_timeout_s: wall-time limit of the ``python`` tool.
        **env_kwargs: forwarded to :func:`~tokengym.llm_envs.MultiTurnTokenEnv` (``max_length`` defaults to 512).

    Example:
        >>> import torch
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = make_multi_turn_math_env(tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=4)
        >>> td = env.reset(); tok = env.tokenizer
        >>> out = env.step(td.set("action", torch.tensor([tok.eos_token_id])))["next"]  # empty answer: wrong
        >>> out["turn"].item(), out["reward"].item(), out["done"].item()
        (1, 0.0, False)
    """
    check_positive_int("max_turns", max_turns)
    require_tokenizer("make_multi_turn_math_env", tokenizer)
    prompts = arithmetic_prompts(n_prompts, seed=seed, max_operand=max_operand)
    if getattr(tokenizer, "chat_template", None):
        hint = TOOL_HINT if tools else ""
        prompts = [{**p, "prompt": [{"role": "user", "content": p["prompt"] + hint}]} for p in prompts]
    turn_fn = MultiTurnMathFeedback(wrong=wrong_reward)
    if tools:
        from tokengym.llm_envs.tools import TOOL_STOP, ToolRegistry, ToolTurns

        registry = ToolRegistry.default(python_timeout_s=python_timeout_s)
        turn_fn = ToolTurns(registry, turn_fn, tokenizer=tokenizer)  # tool output cannot forge role tokens
        env_kwargs["stop_strings"] = [*env_kwargs.get("stop_strings", ()), TOOL_STOP]
    env_kwargs.setdefault("max_length", 512)
    return MultiTurnTokenEnv(prompts, tokenizer, turn_fn, max_turns=max_turns, batch_size=batch_size,
                             max_new_tokens=max_new_tokens, seed=seed, **env_kwargs)  # fmt: skip
