"""Task-reward shaping: clipping, scale and bias, DAPO soft overlong penalty, missing-EOS penalty.

Each shapes the reward of a trajectory's done step (where the task reward sits) and leaves the
other steps alone; :class:`ScaleReward` shapes the last step of every turn (where a multi-turn env
puts each turn's reward), as AReaL scales every turn. They work on collected batches [N, T] and,
step by step, inside a ``TransformedEnv``. Apply them before
:class:`~tokengym.transforms.KLRewardTransform` so the penalties it writes are not clipped or scaled.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import check_number, next_valid, require, valid_mask

__all__ = ["ClipReward", "ScaleReward", "OverlongPenalty", "MissingEOSPenalty"]


def _inner(key: tuple) -> tuple:
    """The part of a ``("next", ...)`` key inside the next tensordict."""
    return key[1:]


class _DoneStepShaping(BatchTransform):
    """Shapes ``keys.REWARD`` on the valid done steps; subclasses implement :meth:`_new_reward`."""

    extra_keys: tuple = ()

    def __init__(self) -> None:
        super().__init__(in_keys=[keys.REWARD, keys.DONE, *self.extra_keys], out_keys=[keys.REWARD])

    def _new_reward(self, root: TensorDictBase, nxt: TensorDictBase, reward: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _targets(self, root: TensorDictBase, nxt: TensorDictBase, mask: torch.Tensor, done: torch.Tensor,
                 is_batch: bool) -> torch.Tensor:  # fmt: skip
        """Bool, shaped like ``done``: the steps whose reward is shaped."""
        return done & mask.reshape(done.shape)

    def _shape(self, root: TensorDictBase, nxt: TensorDictBase, mask: torch.Tensor, is_batch: bool) -> None:
        owner = type(self).__name__
        reward = require(nxt, _inner(keys.REWARD), owner)
        done = require(nxt, _inner(keys.DONE), owner).bool()
        where = self._targets(root, nxt, mask, done, is_batch)
        new = self._new_reward(root, nxt, reward).to(reward.dtype)
        nxt.set(_inner(keys.REWARD), torch.where(where, new, reward))

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        self._shape(td, td.get(keys.REWARD[0]), valid_mask(td), True)
        return td

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        active = tensordict.get(keys.ACTIVE, None)
        mask = torch.ones(next_tensordict.batch_size, dtype=torch.bool) if active is None else active.bool()
        self._shape(tensordict, next_tensordict, mask, False)
        return next_tensordict


class ClipReward(_DoneStepShaping):
    """Clip the task reward to ``[low, high]``.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[0.0], [5.0]]]), keys.DONE: torch.tensor([[[False], [True]]])}, [1, 2])
        >>> ClipReward(-1.0, 1.0)(b)[keys.REWARD].flatten().tolist()
        [0.0, 1.0]
    """

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = check_number("low", low), check_number("high", high)
        if self.low > self.high:
            raise ValueError(f"ClipReward needs low <= high, got low={low}, high={high}; swap them")
        super().__init__()

    def _new_reward(self, root, nxt, reward):
        return reward.clamp(self.low, self.high)


class ScaleReward(_DoneStepShaping):
    """Scale every turn's reward: ``r <- (r - bias) * scale``, or AReaL's ``((r - 0.5) * 2 - bias) * scale``.

    The reward of the last step of every turn is shaped (a single-turn trajectory has one turn,
    ending at its done step); the other steps keep theirs. A step ends a turn if it is done or the
    turn index changes after it: ``("next", keys.TURN) != keys.TURN`` when the batch (or env step)
    holds ``("next", keys.TURN)``, as collected batches do; else the next valid step of the same
    trajectory has another ``keys.TURN``. Without ``keys.TURN`` only done steps are shaped.

    Args:
        scale: multiplies the reward.
        bias: subtracted before scaling.
        use_success_sign: first map a 0/1 success to -1/+1 with ``(r - 0.5) * 2``, as AReaL's
            multi-turn agent does (AReaL's ``reward_scaling`` is ``scale``, ``reward_bias`` is ``bias``).

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[0.0], [1.0]]]), keys.DONE: torch.tensor([[[False], [True]]])}, [1, 2])
        >>> ScaleReward(scale=10.0, bias=0.5)(b)[keys.REWARD].flatten().tolist()
        [0.0, 5.0]
        >>> b[keys.TURN] = torch.tensor([[0, 1]]); b[keys.REWARD] = torch.zeros(1, 2, 1)  # two turns, success [0, 0]
        >>> ScaleReward(use_success_sign=True)(b)[keys.REWARD].flatten().tolist()
        [-1.0, -1.0]
    """

    def __init__(self, *, scale: float = 1.0, bias: float = 0.0, use_success_sign: bool = False) -> None:
        self.scale, self.bias = check_number("scale", scale), check_number("bias", bias)
        self.use_success_sign = bool(use_success_sign)
        super().__init__()

    def _new_reward(self, root, nxt, reward):
        if self.use_success_sign:
            reward = (reward - 0.5) * 2
        return (reward - self.bias) * self.scale

    def _targets(self, root, nxt, mask, done, is_batch):
        where = super()._targets(root, nxt, mask, done, is_batch)
        turn, next_turn = root.get(keys.TURN, None), nxt.get(keys.TURN, None)  # nxt: the step's "next" part
        if turn is None:
            return where
        if next_turn is None and is_batch:  # the turn of the next valid step of the same trajectory
            mask = mask.reshape(turn.shape)
            following = next_valid(mask)
            at = following.clamp(min=0)
            traj = root.get(keys.TRAJ_ID, None)
            same = following >= 0
            if traj is not None:
                same &= traj.gather(-1, at) == traj
            ends = same & (turn.gather(-1, at) != turn)
        elif next_turn is None:
            return where
        else:
            ends = next_turn != turn
        ends = ends.reshape(done.shape) & mask.reshape(done.shape)
        return where | ends

    def __repr__(self) -> str:
        return f"ScaleReward(scale={self.scale}, bias={self.bias}, use_success_sign={self.use_success_sign})"


class OverlongPenalty(_DoneStepShaping):
    """DAPO soft overlong punishment, added to the task reward from the response length ``L``.

    ``0`` if ``L <= max_length - cache``; ``(max_length - cache - L) / cache`` (from 0 down to -1)
    if ``L <= max_length``; ``-1`` beyond. Scaled by ``factor``. ``L`` = ``keys.RESPONSE_LEN`` + 1
    at the done step.

    Args:
        max_length: the response budget ``L_max`` (> 0).
        cache: length of the soft zone ``L_cache`` (0 < cache <= max_length).
        factor: penalty scale (>= 0).

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.ones(3, 1, 1), keys.DONE: torch.ones(3, 1, 1, dtype=torch.bool),
        ...                 keys.RESPONSE_LEN: torch.tensor([[5], [7], [9]])}, [3, 1])
        >>> OverlongPenalty(max_length=10, cache=4)(b)[keys.REWARD].flatten().tolist()  # L = 6, 8, 10
        [1.0, 0.5, 0.0]
    """

    extra_keys = (keys.RESPONSE_LEN,)

    def __init__(self, *, max_length: int, cache: int, factor: float = 1.0) -> None:
        self.max_length = check_number("max_length", max_length, low=0, low_open=True,
                                       fix="Use the env's max_new_tokens.")  # fmt: skip
        self.cache = check_number("cache", cache, low=0, low_open=True, high=self.max_length,
                                  fix="DAPO uses cache = max_length / 4 or so.")  # fmt: skip
        self.factor = check_number("factor", factor, low=0.0)
        super().__init__()

    def _new_reward(self, root, nxt, reward):
        length = require(root, keys.RESPONSE_LEN, type(self).__name__).reshape(reward.shape).float() + 1
        soft = self.max_length - self.cache
        penalty = ((soft - length) / self.cache).clamp(-1.0, 0.0)
        return reward + self.factor * penalty


class MissingEOSPenalty(_DoneStepShaping):
    """Add ``penalty`` to the reward of responses that were truncated without ending (no EOS/stop).

    Example:
        >>> from tensordict import TensorDict
        >>> t = torch.tensor([[[True]], [[False]]])
        >>> b = TensorDict({keys.REWARD: torch.ones(2, 1, 1), keys.DONE: torch.ones(2, 1, 1, dtype=torch.bool),
        ...                 keys.TRUNCATED: t, keys.TERMINATED: ~t}, [2, 1])
        >>> MissingEOSPenalty(-1.0)(b)[keys.REWARD].flatten().tolist()
        [0.0, 1.0]
    """

    extra_keys = (keys.TRUNCATED, keys.TERMINATED)

    def __init__(self, penalty: float = -1.0) -> None:
        self.penalty = check_number("penalty", penalty)
        super().__init__()

    def _new_reward(self, root, nxt, reward):
        owner = type(self).__name__
        truncated = require(nxt, _inner(keys.TRUNCATED), owner).bool().reshape(reward.shape)
        terminated = require(nxt, _inner(keys.TERMINATED), owner).bool().reshape(reward.shape)
        return reward + self.penalty * (truncated & ~terminated)
