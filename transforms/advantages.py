"""Token-level advantages: GAE over per-token rewards and values, and discounted returns (REINFORCE).

Trajectories end at their done step without bootstrapping (an LLM response truncated at its token
budget still gets its final reward), unless ``("next", keys.STATE_VALUE)`` is in the batch. A step
whose trajectory goes on after the batch ends (STEPS batches) bootstraps from
``("next", keys.STATE_VALUE)`` when present, else from 0.
"""

from __future__ import annotations

from enum import Enum

import torch
from tensordict import TensorDictBase
from torchrl.objectives.value.functional import generalized_advantage_estimate

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import check_number, require, sequence_index, squeeze_last

__all__ = ["AdvantageEstimator", "GAEAdvantage", "DiscountedReturns", "discounted_returns", "masked_whiten"]

_NEXT_VALUE = (keys.NEXT, keys.STATE_VALUE)


class AdvantageEstimator(str, Enum):  # noqa: UP042 (StrEnum needs python 3.11; we support 3.10)
    """Advantage estimators; each also accepts its string (``AdvantageEstimator("grpo")``)."""

    GAE = "gae"  # per-token GAE from rewards and a critic
    REINFORCE = "reinforce"  # per-token discounted return
    GRPO = "grpo"  # (r - group mean) / (group std + eps)
    DR_GRPO = "dr_grpo"  # r - group mean (no std)
    RLOO = "rloo"  # r - mean of the other samples of the group
    REINFORCE_PP = "reinforce_pp"  # REINFORCE++ baseline: r - group mean, then batch whitening

    @classmethod
    def parse(cls, value) -> AdvantageEstimator:
        """``cls(value)``, or a ValueError listing the valid names."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown advantage estimator {value!r}; use one of {[e.value for e in cls]}") from None


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the entries where ``mask`` is True; 0 elsewhere.

    Example:
        >>> out = masked_whiten(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False]))
        >>> [round(v, 4) for v in out.tolist()]
        [-0.7071, 0.7071, 0.0]
    """
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must share a shape, got {tuple(x.shape)} and {tuple(mask.shape)}")
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = ((x - mean).square() * mask).sum() / (n - 1).clamp(min=1)
    return torch.where(mask, (x - mean) / (var.sqrt() + eps), torch.zeros_like(x))


def _episode_ends(td: TensorDictBase, owner: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mask, stop, has_next)`` [N, T]: valid steps, steps after which the recursion stops, and
    steps whose successor in the same trajectory is the next column."""
    seq, mask, _ = sequence_index(td, owner)
    done = squeeze_last(require(td, keys.DONE, owner), mask.shape).bool()
    has_next = torch.zeros_like(mask)
    has_next[:, :-1] = (seq[:, 1:] == seq[:, :-1]) & mask[:, 1:] & mask[:, :-1]
    stop = done | ~has_next | ~mask
    return mask, stop, has_next


def discounted_returns(reward: torch.Tensor, stop: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` along the last dim, restarting after ``stop`` steps.

    One vectorized pass per time step (torchrl's ``reward2go`` loops over trajectories instead).

    Example:
        >>> discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[False, False, True]]), 0.5).tolist()
        [[1.5, 1.0, 2.0]]
    """
    out = torch.empty_like(reward)
    running = torch.zeros_like(reward[..., 0])
    keep = (~stop).to(reward.dtype) * gamma
    for t in range(reward.shape[-1] - 1, -1, -1):
        running = reward[..., t] + keep[..., t] * running
        out[..., t] = running
    return out


def _mask_out(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.unsqueeze(-1), x, torch.zeros_like(x))


class GAEAdvantage(BatchTransform):
    """Generalized advantage estimation over per-token rewards and critic values (Schulman et al. 2016).

    Reads ``keys.REWARD``, ``keys.STATE_VALUE`` (float [N, T, 1]) and ``keys.DONE``; writes
    ``keys.ADVANTAGE`` and ``keys.VALUE_TARGET`` (= advantage + value), 0 on padding.

    Args:
        gamma: discount in [0, 1] (LLM RL commonly uses 1.0).
        lmbda: GAE lambda in [0, 1].
        normalize: whiten the advantages over the valid tokens of the batch.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[0.0], [1.0]]]), keys.STATE_VALUE: torch.tensor([[[0.5], [0.5]]]),
        ...                 keys.DONE: torch.tensor([[[False], [True]]]), keys.TRAJ_ID: torch.zeros(1, 2, dtype=torch.long)}, [1, 2])
        >>> GAEAdvantage(gamma=1.0, lmbda=1.0)(b)[keys.ADVANTAGE].flatten().tolist()
        [0.5, 0.5]
    """

    def __init__(self, *, gamma: float = 1.0, lmbda: float = 0.95, normalize: bool = False) -> None:
        super().__init__(in_keys=[keys.REWARD, keys.STATE_VALUE, keys.DONE, keys.TRAJ_ID],
                         out_keys=[keys.ADVANTAGE, keys.VALUE_TARGET])  # fmt: skip
        self.gamma = check_number("gamma", gamma, low=0.0, high=1.0)
        self.lmbda = check_number("lmbda", lmbda, low=0.0, high=1.0)
        self.normalize = bool(normalize)

    def _apply_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        mask, stop, has_next = _episode_ends(td, owner)
        value = require(td, keys.STATE_VALUE, owner)
        if value.shape != (*mask.shape, 1):
            raise ValueError(f"{owner}: {keys.STATE_VALUE!r} must have shape {(*mask.shape, 1)}, got {tuple(value.shape)}")
        value = value.float()
        next_value = torch.zeros_like(value)
        next_value[:, :-1] = value[:, 1:]
        given = td.get(_NEXT_VALUE, None)
        boot = torch.zeros_like(value) if given is None else given.float()
        # no next value given: every done step is final (no bootstrap); else only terminated ones are
        end_key = keys.DONE if given is None else keys.TERMINATED
        terminal = squeeze_last(require(td, end_key, owner), mask.shape).bool()
        terminal = ((terminal & ~has_next) | ~mask).unsqueeze(-1)
        next_value = torch.where(has_next.unsqueeze(-1), next_value, boot)
        reward = _mask_out(require(td, keys.REWARD, owner).float(), mask)
        adv, _ = generalized_advantage_estimate(self.gamma, self.lmbda, value, next_value, reward,
                                             stop.unsqueeze(-1), terminal)  # fmt: skip
        adv = _mask_out(adv, mask)
        td.set(keys.VALUE_TARGET, _mask_out(adv + value, mask))
        if self.normalize:
            adv = masked_whiten(adv.squeeze(-1), mask).unsqueeze(-1)
        td.set(keys.ADVANTAGE, adv)
        return td


class DiscountedReturns(BatchTransform):
    """REINFORCE: the advantage of each token is its discounted return ``sum_k gamma^k r_{t+k}``.

    Writes ``keys.ADVANTAGE`` and ``keys.VALUE_TARGET`` (both the return), 0 on padding.

    Args:
        gamma: discount in [0, 1].
        normalize: whiten the advantages over the valid tokens of the batch.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[1.0], [0.0], [2.0]]]), keys.DONE: torch.tensor([[[False], [False], [True]]]),
        ...                 keys.TRAJ_ID: torch.zeros(1, 3, dtype=torch.long)}, [1, 3])
        >>> DiscountedReturns(gamma=0.5)(b)[keys.ADVANTAGE].flatten().tolist()
        [1.5, 1.0, 2.0]
    """

    def __init__(self, *, gamma: float = 1.0, normalize: bool = False) -> None:
        super().__init__(in_keys=[keys.REWARD, keys.DONE, keys.TRAJ_ID], out_keys=[keys.ADVANTAGE, keys.VALUE_TARGET])
        self.gamma = check_number("gamma", gamma, low=0.0, high=1.0)
        self.normalize = bool(normalize)

    def _apply_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        mask, stop, _ = _episode_ends(td, owner)
        reward = _mask_out(require(td, keys.REWARD, owner).float(), mask)
        returns = discounted_returns(reward.squeeze(-1), stop, self.gamma).unsqueeze(-1)
        td.set(keys.VALUE_TARGET, returns)
        adv = masked_whiten(returns.squeeze(-1), mask).unsqueeze(-1) if self.normalize else returns.clone()
        td.set(keys.ADVANTAGE, adv)
        return td
