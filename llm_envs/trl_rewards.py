"""TRL reward functions, called as TRL's ``GRPOTrainer`` calls them.

TRL calls ``reward_func(prompts=..., completions=..., completion_ids=..., **columns) -> list[float]``,
where ``columns`` are the dataset's other fields, one list each, and a ``None`` in the result means
"not applicable to this sample" (it adds nothing to the weighted sum of reward functions). For a
conversational dataset (chat-message prompts) ``prompts`` are the message lists and each completion is
``[{"role": "assistant", "content": text}]``; otherwise both are strings. TRL's ``trainer_state`` is not
passed (a TRL reward function takes it through ``**kwargs``).

Wherever tokengym accepts a reward function (``TokenEnv(reward_fn=...)``, the task builders,
:class:`~tokengym.llm_envs.rewards.CombinedReward`) a TRL-style function is detected by its signature
(:func:`is_trl_reward`: it has a parameter named ``completions``, TRL's name, or takes only ``**kwargs``)
and called the TRL way; anything else keeps tokengym's ``fn(responses, prompts, metadata)`` protocol.
:func:`from_trl_reward` wraps a function explicitly (e.g. to set ``none_value``).

Example:
    >>> def exact(prompts, completions, solution, **kwargs):  # a TRL reward function
    ...     return [float(c.strip() == s) for c, s in zip(completions, solution)]
    >>> is_trl_reward(exact)
    True
    >>> reward_fn = as_reward_fn(exact)  # what TokenEnv does with it
    >>> reward_fn(["19", "20"], ["12+7=", "12+7="], [{"solution": "19"}, {"solution": "19"}])
    tensor([1., 0.])
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch

__all__ = ["TRLReward", "as_reward_fn", "from_trl_reward", "is_trl_reward"]

_RESERVED = ("completions", "prompts", "completion_ids")


def is_trl_reward(fn: Callable) -> bool:
    """Whether ``fn`` is written for TRL's call: it has a parameter named ``completions``, or takes only ``**kwargs``.

    tokengym's own protocol names its first parameter ``responses``; TRL always passes ``completions=``
    by keyword, so its reward functions name it. A :class:`TRLReward` is already wrapped (False).

    Example:
        >>> is_trl_reward(lambda completions, **kw: [0.0]), is_trl_reward(lambda responses, prompts, metadata: [0.0])
        (True, False)
    """
    if isinstance(fn, TRLReward):
        return False
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: the native protocol
        return False
    if any(p.name == "completions" and p.kind is not p.VAR_POSITIONAL for p in params):
        return True
    return bool(params) and all(p.kind is p.VAR_KEYWORD for p in params)


def as_reward_fn(fn: Callable | None) -> Callable | None:
    """``fn`` ready for tokengym's call: a TRL-style function (:func:`is_trl_reward`) wrapped in :class:`TRLReward`.

    Example:
        >>> as_reward_fn(lambda prompts, completions, **kw: [1.0] * len(completions))(["a"], ["q"], [{}])
        tensor([1.])
    """
    if fn is None or not callable(fn):
        return fn
    return TRLReward(fn) if is_trl_reward(fn) else fn


class TRLReward:
    """A TRL-convention reward function (``f(prompts, completions, **columns) -> list[float]``) as a ``reward_fn``.

    The env calls it as ``reward(responses, prompts, metadata, completion_ids=..., chat_prompts=...)``
    (``use_trl_inputs``); called with the three tokengym arguments only, it passes the prompt texts
    and no ``completion_ids``.

    Args:
        fn: the TRL reward function.
        conversational: pass each completion as TRL's conversational format,
            ``[{"role": "assistant", "content": text}]``, for functions written for chat datasets
            (they read ``completion[0]["content"]``). ``None`` (the default) does what TRL does: the
            conversational format when every prompt was a chat message list.
        none_value: the reward given where ``fn`` returns ``None`` (TRL ignores those samples in
            its weighted sum, which is 0 here).

    Raises:
        TypeError: at construction if ``fn`` is not callable; at call time if it returns something
            other than a list of numbers or ``None``.
        ValueError: at call time if it returns the wrong number of values, or a metadata field is
            named ``completions``, ``prompts`` or ``completion_ids``.
    """

    use_trl_inputs = True  # the env passes completion_ids and chat_prompts as keywords

    def __init__(self, fn: Callable, *, conversational: bool | None = None, none_value: float = 0.0) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be a TRL reward function f(prompts, completions, **columns), got {fn!r}")
        if conversational is not None and not isinstance(conversational, bool):
            raise TypeError(f"conversational must be a bool or None (as the prompts are), got {conversational!r}")
        if isinstance(none_value, bool) or not isinstance(none_value, int | float) or not math.isfinite(none_value):
            raise TypeError(f"none_value must be a finite number, got {none_value!r}")
        self.fn, self.conversational, self.none_value = fn, conversational, float(none_value)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self._accepted = _accepted_names(fn)

    def __repr__(self) -> str:
        return f"TRLReward({self.__name__})"

    @property
    def counts(self) -> dict[str, int]:
        """The wrapped function's ``counts`` (e.g. ``reward_errors``), which ``TokenEnv.prompt_counts`` reports."""
        return dict(getattr(self.fn, "counts", {}))

    def __call__(
        self,
        responses: list[str],
        prompts: list[str],
        metadata: list[dict],
        *,
        completion_ids: list[list[int]] | None = None,
        chat_prompts: list[list[dict] | None] | None = None,
    ) -> torch.Tensor:
        is_chat = chat_prompts is not None and len(chat_prompts) > 0 and all(m is not None for m in chat_prompts)
        conversational = is_chat if self.conversational is None else self.conversational
        completions = [[{"role": "assistant", "content": r}] for r in responses] if conversational else list(responses)
        kwargs = {"prompts": list(chat_prompts) if is_chat else list(prompts), "completions": completions}
        if completion_ids is not None:
            kwargs["completion_ids"] = list(completion_ids)
        kwargs.update(_columns(metadata))
        if self._accepted is not None:  # no **kwargs: pass what it names (older TRL passed no completion_ids)
            kwargs = {k: v for k, v in kwargs.items() if k in self._accepted}
        return self._check(self.fn(**kwargs), len(responses))

    def _check(self, values, n: int) -> torch.Tensor:
        if values is None or isinstance(values, str | bytes) or not hasattr(values, "__len__"):
            raise TypeError(f"TRL reward function {self.__name__} must return a list of floats, got {values!r:.80}")
        if len(values) != n:
            raise ValueError(
                f"TRL reward function {self.__name__} returned {len(values)} values for {n} "
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


def _accepted_names(fn: Callable) -> frozenset[str] | None:
    """The keyword names ``fn`` takes, or ``None`` when it takes ``**kwargs`` (or has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


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


def from_trl_reward(fn: Callable, *, conversational: bool | None = None, none_value: float = 0.0) -> TRLReward:
    """Wrap a TRL reward function explicitly (TokenEnv detects one by itself); see :class:`TRLReward`.

    Example:
        >>> def length_penalty(completions, **kwargs):
        ...     return [-len(c[0]["content"]) / 10 for c in completions]
        >>> from_trl_reward(length_penalty, conversational=True)(["abc", ""], ["", ""], [{}, {}])
        tensor([-0.3000,  0.0000])
    """
    return TRLReward(fn, conversational=conversational, none_value=none_value)
