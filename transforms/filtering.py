"""Filtering and per-token weights: DAPO dynamic sampling of zero-variance groups, clip-filter weights."""

from __future__ import annotations

from enum import Enum

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import check_number, require, squeeze_last, valid_mask
from tokengym.transforms.group_advantages import group_stats, sequence_scores
from tokengym.transforms.scoring import check_trajectory_rows

__all__ = ["FilterMode", "ZeroStdGroupFilter", "clip_filter_weights", "ClipFilterWeights"]


class FilterMode(str, Enum):  # noqa: UP042 (StrEnum needs python 3.11; we support 3.10)
    """What :class:`ZeroStdGroupFilter` does with a filtered group."""

    DROP = "drop"  # remove its rows (TRAJECTORIES batches)
    MASK = "mask"  # keep the rows, set keys.MASK False on their steps


class ZeroStdGroupFilter(BatchTransform):
    """DAPO dynamic sampling: filter groups whose trajectory scores all equal (no learning signal).

    A group of a single sample counts as zero-variance. :attr:`filtered_fraction` (and
    :meth:`metrics`) reports the fraction of groups filtered from the last batch.

    Args:
        mode: ``"drop"`` (rows removed; TRAJECTORIES batches) or ``"mask"`` (``keys.MASK`` set False).
        eps: a group whose score std is <= eps is filtered.
        reward_key: the reward summed into the score.

    Example:
        >>> from tensordict import TensorDict
        >>> done = torch.tensor([[[True]]] * 4)
        >>> b = TensorDict({keys.REWARD: done.float() * torch.tensor([1.0, 1.0, 0.0, 1.0])[:, None, None], keys.DONE: done,
        ...                 keys.GROUP_ID: torch.tensor([[0], [0], [1], [1]]), keys.TRAJ_ID: torch.arange(4)[:, None],
        ...                 keys.RESPONSE_LEN: torch.zeros(4, 1, dtype=torch.long)}, [4, 1])
        >>> f = ZeroStdGroupFilter("drop")
        >>> f(b)[keys.GROUP_ID].flatten().tolist(), f.filtered_fraction
        ([1, 1], 0.5)
    """

    def __init__(self, mode: str | FilterMode = "mask", *, eps: float = 0.0, reward_key=keys.REWARD) -> None:
        try:
            self.mode = FilterMode(mode)
        except ValueError:
            raise ValueError(f"unknown filter mode {mode!r}; use one of {[m.value for m in FilterMode]}") from None
        self.eps = check_number("eps", eps, low=0.0)
        self.reward_key = reward_key
        self.filtered_fraction = float("nan")
        super().__init__(in_keys=[reward_key, keys.GROUP_ID, keys.TRAJ_ID, keys.DONE, keys.RESPONSE_LEN],
                         out_keys=[keys.MASK])  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """``{"filtered_fraction": ...}`` of the last batch."""
        return {"filtered_fraction": self.filtered_fraction}

    def _apply_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        if self.mode is FilterMode.DROP:
            check_trajectory_rows(td, owner)
        seq, scores, groups = sequence_scores(td, reward_key=self.reward_key, owner=owner)
        _, std, count = group_stats(scores, groups)
        flat = (std <= self.eps) | (count < 2)  # per sequence
        unique, inverse = torch.unique(groups, return_inverse=True)
        per_group = torch.zeros(len(unique), dtype=torch.bool, device=flat.device)
        per_group[inverse] = flat
        self.filtered_fraction = float(per_group.float().mean()) if len(unique) else 0.0
        steps_filtered = flat[seq.clamp(min=0)] & (seq >= 0)
        if self.mode is FilterMode.MASK:
            td.set(keys.MASK, valid_mask(td) & ~steps_filtered)
            return td
        return td[~steps_filtered.any(-1)]


def clip_filter_weights(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, mask: torch.Tensor, *,
                        low: float, high: float) -> torch.Tensor:  # fmt: skip
    """LightRFT-style clip filter: weight 1 where ``low <= exp(log_prob - behaviour) <= high``, else 0.

    Example:
        >>> lp, old = torch.tensor([0.0, 1.0, -1.0]), torch.zeros(3)
        >>> clip_filter_weights(lp, old, torch.ones(3, dtype=torch.bool), low=0.5, high=2.0).tolist()
        [1.0, 0.0, 0.0]
    """
    low = check_number("low", low, low=0.0)
    high = check_number("high", high, low=low, fix="Pass low <= high.")
    if not (log_prob.shape == behaviour_log_prob.shape == mask.shape):
        raise ValueError(f"log_prob, behaviour_log_prob and mask must share a shape, got {tuple(log_prob.shape)}, "
                         f"{tuple(behaviour_log_prob.shape)} and {tuple(mask.shape)}")  # fmt: skip
    ratio = (log_prob.float() - behaviour_log_prob.float()).exp()
    return (mask.bool() & (ratio >= low) & (ratio <= high)).float()


class ClipFilterWeights(BatchTransform):
    """Write ``keys.LOSS_WEIGHT`` [N, T]: 0 on padding and on tokens whose ratio leaves ``[low, high]``.

    The ratio compares ``log_prob_key`` (e.g. the trainer's log-prob) with ``behaviour_key`` (the
    sampler's, ``keys.ACTION_LOG_PROB``), as when the generation engine and the trainer disagree.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.RAW_LOG_PROB: torch.tensor([[0.0, 2.0]]), keys.ACTION_LOG_PROB: torch.zeros(1, 2)}, [1, 2])
        >>> ClipFilterWeights(low=0.5, high=2.0)(b)[keys.LOSS_WEIGHT].tolist()
        [[1.0, 0.0]]
    """

    def __init__(self, *, low: float, high: float, log_prob_key=keys.RAW_LOG_PROB,
                 behaviour_key=keys.ACTION_LOG_PROB) -> None:  # fmt: skip
        self.low = check_number("low", low, low=0.0)
        self.high = check_number("high", high, low=self.low, fix="Pass low <= high.")
        self.log_prob_key, self.behaviour_key = log_prob_key, behaviour_key
        super().__init__(in_keys=[log_prob_key, behaviour_key], out_keys=[keys.LOSS_WEIGHT])

    def _apply_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        mask = valid_mask(td)
        lp = squeeze_last(require(td, self.log_prob_key, owner), mask.shape)
        old = squeeze_last(require(td, self.behaviour_key, owner), mask.shape)
        td.set(keys.LOSS_WEIGHT, clip_filter_weights(lp, old, mask, low=self.low, high=self.high))
        return td
