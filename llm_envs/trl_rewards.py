"""TRL reward functions as tokengym reward functions.

TRL's ``GRPOTrainer`` calls ``reward_func(completions=..., prompts=..., **columns) -> list[float]``,
where ``columns`` are the dataset's other columns, one list each, and a ``None`` in the result means
"not applicable to this sample" (it adds nothing to the weighted sum of reward functions).
:func:`from_trl_reward` wraps such a function so that it runs unchanged as a
:class:`~tokengym.llm_envs.token_env.TokenEnv` ``reward_fn``: the prompt's metadata fields become
the keyword columns, the prompt texts go in ``prompts=``. TRL's ``completion_ids`` and
``trainer_state`` are not passed (a TRL reward function takes them through ``**kwargs``).

Example:
    >>> def exact(completions, solution, **kwargs):  # a TRL reward function
    ...     return [float(c.strip() == s) for c, s in zip(completions, solution)]
    >>> reward_fn = from_trl_reward(exact)
    >>> reward_fn(["19", "20"], ["12+7=", "12+7="], [{"solution": "19"}, {"solution": "19"}])
    tensor([1., 0.])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["TRLReward", "from_trl_reward"]

_RESERVED = ("completions", "prompts")


class TRLReward:
    """A TRL-convention reward function (``f(completions, **columns) -> list[float]``) as a ``reward_fn``.

    Args:
        fn: the TRL reward function.
        conversational: pass each completion as TRL's conversational format,
            ``[{"role": "assistant", "content": text}]``, for functions written for chat datasets
            (they read ``completion[0]["content"]``). Prompts are passed as texts either way (after
            the chat template, if any).
        none_value: the reward given where ``fn`` returns ``None`` (TRL ignores those samples in
            its weighted sum, which is 0 here).

    Raises:
        TypeError: at construction if ``fn`` is not callable; at call time if it returns something
            other than a list of numbers or ``None``.
        ValueError: at call time if it returns the wrong number of values, or a metadata field is
            named ``completions`` or ``prompts``.
    """

    def __init__(self, fn: Callable, *, conversational: bool = False, none_value: float = 0.0) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be a TRL reward function f(completions, **columns) -> list[float], got {fn!r}")
        if not isinstance(conversational, bool):
            raise TypeError(f"conversational must be a bool, got {conversational!r}")
        if isinstance(none_value, bool) or not isinstance(none_value, int | float) or not math.isfinite(none_value):
            raise TypeError(f"none_value must be a finite number, got {none_value!r}")
        self.fn, self.conversational, self.none_value = fn, conversational, float(none_value)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __repr__(self) -> str:
        return f"TRLReward({self.__name__})"

    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        completions = [[{"role": "assistant", "content": r}] for r in responses] if self.conversational else list(responses)
        values = self.fn(completions=completions, prompts=list(prompts), **_columns(metadata))
        if values is None or isinstance(values, str | bytes) or not hasattr(values, "__len__"):
            raise TypeError(f"TRL reward function {self.__name__} must return a list of floats, got {values!r:.80}")
        if len(values) != len(responses):
            raise ValueError(
                f"TRL reward function {self.__name__} returned {len(values)} values for {len(responses)} "
                "completions; return one per completion (None where it does not apply)"
            )
        out = []
        for v in values:
            if v is None:
                out.append(self.none_value)
            elif isinstance(v, bool) or not isinstance(v, int | float | torch.Tensor):
                raise TypeError(f"TRL reward function {self.__name__} returned {v!r}; return floats or None")
            else:
                out.append(float(v))
        return torch.tensor(out, dtype=torch.float32)


def _columns(metadata: list[dict]) -> dict[str, list]:
    """Metadata rows -> one list per field (TRL's dataset columns); a field a row lacks is ``None`` there."""
    names = list(dict.fromkeys(name for meta in metadata for name in meta))
    clash = [n for n in names if n in _RESERVED]
    if clash:
        raise ValueError(
            f"metadata field {clash[0]!r} would hide TRL's {clash[0]!r} argument; rename the column in the "
            "prompts (e.g. 'reference')"
        )
    return {name: [meta.get(name) for meta in metadata] for name in names}


def from_trl_reward(fn: Callable, *, conversational: bool = False, none_value: float = 0.0) -> TRLReward:
    """Wrap a TRL reward function so it runs unchanged as a TokenEnv ``reward_fn``; see :class:`TRLReward`.

    Example:
        >>> def length_penalty(completions, **kwargs):
        ...     return [-len(c[0]["content"]) / 10 for c in completions]
        >>> from_trl_reward(length_penalty, conversational=True)(["abc", ""], ["", ""], [{}, {}])
        tensor([-0.3000,  0.0000])
    """
    return TRLReward(fn, conversational=conversational, none_value=none_value)
