"""Single-turn scoring: a reward function scores each finished response and the episode ends."""

from __future__ import annotations

import torch

from tokengym.llm_envs._env_checks import check_arguments, check_rewards
from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.trl_rewards import as_reward_fn
from tokengym.llm_envs.turns.protocol import FinishedTurns, TurnHandler

__all__ = ["RewardTurns"]


class RewardTurns(TurnHandler):
    """The turn handler of a single-turn env: ``reward_fn(responses, prompts, metadata)`` scores, the episode ends.

    ``reward_fn`` is called once per step (or wave) for all finished slots. A TRL reward function
    ``f(prompts, completions, **columns)`` is detected and called as TRL calls it
    (:func:`~tokengym.llm_envs.from_trl_reward`); one declaring ``takes_token_ids = True`` gets the response ids,
    undecoded. ``None`` scores 0.

    Example:
        >>> from tokengym.llm_envs.turns.protocol import FinishedTurns
        >>> from tokengym.llm_envs.prompts import Prompt
        >>> import torch
        >>> turns = FinishedTurns([0], [0], [Prompt(torch.tensor([1]), "q", {}, 0, 0, 0)], [torch.tensor([5])], [True],
        ...                       [0], decode=lambda rows: ["42"], history=lambda b: torch.tensor([1, 5]))
        >>> RewardTurns(lambda r, p, m: [float(x == "42") for x in r]).end_turns(turns)
        tensor([1.])
    """

    name = "reward_fn"

    def __init__(self, reward_fn=None) -> None:
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable(responses, prompts, metadata), got {reward_fn!r}")
        self.reward_fn = as_reward_fn(reward_fn)
        if self.reward_fn is not None:
            check_arguments(self.reward_fn, "reward_fn", ("responses", "prompts", "metadata"), "one float per response",
                            "; a TRL reward function names its parameters: f(prompts, completions, **kwargs)")  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """The reward function's own counts (e.g. ``reward_errors`` of a verifier), if it keeps any."""
        return dict(getattr(self.reward_fn, "counts", {}))

    def describe(self) -> str:
        fn = self.reward_fn
        return "None" if fn is None else getattr(fn, "__name__", type(fn).__name__)

    def end_turns(self, turns: FinishedTurns) -> torch.Tensor:
        """The rewards of the finished turns, one (n,) float tensor (every episode ends)."""
        fn = self.reward_fn
        if fn is None:
            return torch.zeros(len(turns))
        ids = turns.response_ids
        responses = ids if getattr(fn, "takes_token_ids", False) else turns.responses
        prompts = turns.prompts
        trl = {}  # a TRL-style reward function also gets the completion ids and the chat messages, as in TRL
        if getattr(fn, "use_trl_inputs", False):
            trl = {"completion_ids": [row.tolist() for row in ids], "chat_prompts": [p.messages for p in prompts]}
        try:
            values = fn(responses, [p.text for p in prompts], [p.metadata for p in prompts], **trl)
        except Exception as err:
            raise RewardFunctionError(
                f"reward_fn raised {type(err).__name__}: {err} while scoring slots {turns.slots} "
                f"(first: {turns.describe()}); the env state is unchanged, fix the reward function and step again"
            ) from err
        return check_rewards(values, turns.slots, prompts)


def turn_handler(reward_fn, turns: TurnHandler | None) -> TurnHandler:
    """The turn handler of an env built with ``reward_fn`` or ``turns=`` (one of them; neither: rewards of 0)."""
    if turns is None:
        return RewardTurns(reward_fn)
    if reward_fn is not None:
        raise ValueError("pass reward_fn or turns=, not both: the turn handler rewards (score inside it, or "
                         "turns=RewardTurns(reward_fn))")  # fmt: skip
    if not isinstance(turns, TurnHandler):
        raise TypeError(f"turns must be a TurnHandler (tokengym.llm_envs.turns), got {type(turns).__name__}")
    return turns
