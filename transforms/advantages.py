"""Token-level advantages: GAE over per-token rewards and values, and discounted returns (REINFORCE).

Trajectories end at their done step without bootstrapping (an LLM response truncated at its token
budget still gets its final reward), unless ``("next", keys.STATE_VALUE)`` is in the batch. A step
whose trajectory goes on after the batch ends (STEPS batches) bootstraps from
``("next", keys.STATE_VALUE)`` when present, else from 0.

Trajectories are told apart by ``keys.TRAJ_ID``. A step with ``keys.MASK`` False inside a trajectory
(a hole) is *skipped* by default (``masked_steps="skip"``): its reward and value are ignored, the
valid steps on either side are consecutive (one discount between them), and its own advantage is 0.
With gamma = lambda = 1 this equals the seeds (OpenRLHF / LightRFT multiply rewards and values by the
mask and recurse over every column): rewards [0, 0, 1] with mask [1, 0, 1] give advantages 1 on both
valid steps. With gamma < 1 the seeds also discount across the masked column; ``masked_steps="zero"``
does that (a hole is a step of reward 0 and value 0).
"""

from __future__ import annotations

from enum import StrEnum

import torch
from tensordict import TensorDictBase
from torchrl.objectives.value.functional import generalized_advantage_estimate

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import (
    check_number,
    next_valid,
    previous_valid,
    require,
    sequence_index,
    squeeze_last,
)
from tokengym.transforms.batch_statistics import sum_across_ranks

__all__ = ["AdvantageEstimator", "MaskedSteps", "GAEAdvantage", "DiscountedReturns", "discounted_returns",
           "masked_whiten"]  # fmt: skip

_NEXT_VALUE = (keys.NEXT, keys.STATE_VALUE)


class AdvantageEstimator(StrEnum):
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


class MaskedSteps(StrEnum):
    """What GAE and returns make of a masked step inside a trajectory (a hole)."""

    SKIP = "skip"  # not a step: its neighbours are consecutive (tokengym's default)
    ZERO = "zero"  # a step of reward 0 and value 0 that still discounts (OpenRLHF / LightRFT)

    @classmethod
    def parse(cls, value) -> MaskedSteps:
        """``cls(value)``, or a ValueError listing the valid names."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown masked_steps {value!r}; use one of {[e.value for e in cls]}") from None


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the entries where ``mask`` is True; 0 elsewhere.

    Mean and std are float64, so equal values whiten to exactly 0. Inside :func:`~tokengym.train` under
    ``torch.distributed`` (:func:`~tokengym.transforms.across_ranks`) they are every rank's rows'.

    Example:
        >>> out = masked_whiten(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False]))
        >>> [round(v, 4) for v in out.tolist()]
        [-0.7071, 0.7071, 0.0]
    """
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must share a shape, got {tuple(x.shape)} and {tuple(mask.shape)}")
    x64 = x.double()
    total, n = sum_across_ranks((x64 * mask).sum(), mask.sum())  # every rank's rows inside train() under torchrun
    mean = total / n.clamp(min=1)
    centred = x64 - mean
    (squares,) = sum_across_ranks((centred.square() * mask).sum())
    var = squares / (n - 1).clamp(min=1)
    out = torch.where(var > 0, centred / (var.sqrt() + eps), torch.zeros_like(centred))
    return torch.where(mask, out, torch.zeros_like(out)).to(x.dtype)


class _Compact:
    """The kept steps of each row moved to the front, so each trajectory's steps are adjacent columns.

    ``keep`` is the valid steps (``SKIP``) or the valid steps plus the holes between the valid steps
    of one trajectory (``ZERO``). :meth:`pack` maps ``[N, T, ...]`` to ``[N, W, ...]``, :meth:`unpack`
    back (0 on the steps not kept). Without holes or padding inside rows both are the identity.
    """

    def __init__(self, td: TensorDictBase, owner: str, masked_steps: MaskedSteps) -> None:
        seq, mask, _ = sequence_index(td, owner)
        if masked_steps is MaskedSteps.ZERO:
            prev, nxt = previous_valid(mask), next_valid(mask)
            before = seq.gather(-1, prev.clamp(min=0))
            after = seq.gather(-1, nxt.clamp(min=0))
            hole = ~mask & (prev >= 0) & (nxt >= 0) & (before == after)
            seq = torch.where(hole, before, seq)
            keep = mask | hole
        else:
            keep = mask
        self.mask, self.keep = mask, keep
        counts = keep.sum(-1)
        width = int(counts.max()) if counts.numel() else 0
        self.kept = torch.arange(width, device=keep.device) < counts[:, None]  # (N, W)
        self.identity = width == keep.shape[-1] and torch.equal(self.kept, keep)
        self.seq = self.pack(seq, fill=-1)

    def pack(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        if self.identity:
            return x
        out = torch.full((*self.kept.shape, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
        out[self.kept] = x[self.keep]
        return out

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        if self.identity:
            out = y
        else:
            out = y.new_zeros((*self.keep.shape, *y.shape[2:]))
            out[self.keep] = y[self.kept]
        mask = self.mask.reshape(*self.mask.shape, *([1] * (y.ndim - 2)))
        return torch.where(mask, out, torch.zeros_like(out))


def _episode_ends(td: TensorDictBase, owner: str, masked_steps: MaskedSteps):
    """``(compact, stop, has_next)``: the packed layout, then [N, W] the steps after which the recursion
    stops, and the steps whose successor in the trajectory is the next column."""
    compact = _Compact(td, owner, masked_steps)
    seq, kept = compact.seq, compact.kept
    done = compact.pack(squeeze_last(require(td, keys.DONE, owner), compact.mask.shape).bool() & compact.mask)
    has_next = torch.zeros_like(kept)
    has_next[:, :-1] = (seq[:, 1:] == seq[:, :-1]) & kept[:, 1:] & kept[:, :-1]
    stop = done | ~has_next | ~kept
    return compact, stop, has_next


def discounted_returns(reward: torch.Tensor, stop: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` along the last dim, restarting after ``stop`` steps.

    One vectorized pass per time step (torchrl's ``reward2go`` loops over trajectories instead).

    Example:
        >>> discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[False, False, True]]), 0.5).tolist()
        [[1.5, 1.0, 2.0]]
    """
    out = torch.empty_like(reward)
    running = reward.new_zeros(reward.shape[:-1])
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
    ``keys.ADVANTAGE`` and ``keys.VALUE_TARGET`` (= advantage + value), 0 on masked steps.

    Args:
        gamma: discount in [0, 1] (LLM RL commonly uses 1.0).
        lmbda: GAE lambda in [0, 1].
        normalize: whiten the advantages over the valid tokens of the batch.
        masked_steps: a masked step inside a trajectory is ``"skip"``-ped (default) or a ``"zero"``
            reward, zero value step (the seeds' convention); see the module docstring.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[0.0], [1.0]]]), keys.STATE_VALUE: torch.tensor([[[0.5], [0.5]]]),
        ...                 keys.DONE: torch.tensor([[[False], [True]]]), keys.TRAJ_ID: torch.zeros(1, 2, dtype=torch.long)}, [1, 2])
        >>> GAEAdvantage(gamma=1.0, lmbda=1.0)(b)[keys.ADVANTAGE].flatten().tolist()
        [0.5, 0.5]
    """

    def __init__(self, *, gamma: float = 1.0, lmbda: float = 0.95, normalize: bool = False,
                 masked_steps: str | MaskedSteps = "skip") -> None:  # fmt: skip
        super().__init__(in_keys=[keys.REWARD, keys.STATE_VALUE, keys.DONE, keys.TRAJ_ID],
                         out_keys=[keys.ADVANTAGE, keys.VALUE_TARGET])  # fmt: skip
        self.gamma = check_number("gamma", gamma, low=0.0, high=1.0)
        self.lmbda = check_number("lmbda", lmbda, low=0.0, high=1.0)
        self.normalize = bool(normalize)
        self.masked_steps = MaskedSteps.parse(masked_steps)

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        compact, stop, has_next = _episode_ends(td, owner, self.masked_steps)
        mask = compact.mask
        value = require(td, keys.STATE_VALUE, owner)
        if value.shape != (*mask.shape, 1):
            raise ValueError(f"{owner}: {keys.STATE_VALUE!r} must have shape {(*mask.shape, 1)}, got {tuple(value.shape)}")
        value = compact.pack(_mask_out(value.float(), mask))
        next_value = torch.zeros_like(value)
        next_value[:, :-1] = value[:, 1:]
        given = td.get(_NEXT_VALUE, None)
        boot = torch.zeros_like(value) if given is None else compact.pack(_mask_out(given.float(), mask))
        # no next value given: every done step is final (no bootstrap); else only terminated ones are
        end_key = keys.DONE if given is None else keys.TERMINATED
        terminal = compact.pack(squeeze_last(require(td, end_key, owner), mask.shape).bool() & mask)
        terminal = ((terminal & ~has_next) | ~compact.kept).unsqueeze(-1)
        next_value = torch.where(has_next.unsqueeze(-1), next_value, boot)
        reward = compact.pack(_mask_out(require(td, keys.REWARD, owner).float(), mask))
        adv, _ = generalized_advantage_estimate(self.gamma, self.lmbda, value, next_value, reward,
                                             stop.unsqueeze(-1), terminal)  # fmt: skip
        td.set(keys.VALUE_TARGET, compact.unpack(adv + value))
        adv = compact.unpack(adv)
        if self.normalize:
            adv = masked_whiten(adv.squeeze(-1), mask).unsqueeze(-1)
        td.set(keys.ADVANTAGE, adv)
        return td


class DiscountedReturns(BatchTransform):
    """REINFORCE: the advantage of each token is its discounted return ``sum_k gamma^k r_{t+k}``.

    Writes ``keys.ADVANTAGE`` and ``keys.VALUE_TARGET`` (both the return), 0 on masked steps.

    Args:
        gamma: discount in [0, 1].
        normalize: whiten the advantages over the valid tokens of the batch.
        masked_steps: ``"skip"`` (default) or ``"zero"``, as for :class:`GAEAdvantage`.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[1.0], [0.0], [2.0]]]), keys.DONE: torch.tensor([[[False], [False], [True]]]),
        ...                 keys.TRAJ_ID: torch.zeros(1, 3, dtype=torch.long)}, [1, 3])
        >>> DiscountedReturns(gamma=0.5)(b)[keys.ADVANTAGE].flatten().tolist()
        [1.5, 1.0, 2.0]
    """

    def __init__(self, *, gamma: float = 1.0, normalize: bool = False, masked_steps: str | MaskedSteps = "skip") -> None:
        super().__init__(in_keys=[keys.REWARD, keys.DONE, keys.TRAJ_ID], out_keys=[keys.ADVANTAGE, keys.VALUE_TARGET])
        self.gamma = check_number("gamma", gamma, low=0.0, high=1.0)
        self.normalize = bool(normalize)
        self.masked_steps = MaskedSteps.parse(masked_steps)

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        compact, stop, _ = _episode_ends(td, owner, self.masked_steps)
        mask = compact.mask
        reward = compact.pack(_mask_out(require(td, keys.REWARD, owner).float(), mask).squeeze(-1))
        returns = compact.unpack(discounted_returns(reward, stop, self.gamma).unsqueeze(-1))
        td.set(keys.VALUE_TARGET, returns)
        adv = masked_whiten(returns.squeeze(-1), mask).unsqueeze(-1) if self.normalize else returns.clone()
        td.set(keys.ADVANTAGE, adv)
        return td
