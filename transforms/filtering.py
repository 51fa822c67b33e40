"""Filtering and per-token loss weights: DAPO dynamic sampling of zero-variance groups, LightRFT's
clip-filter-like group weights, and an importance-ratio window.

The weight transforms write ``keys.LOSS_WEIGHT`` [N, T] (0 on padding); when the batch already holds
one, they multiply it, so weight transforms compose. :class:`~tokengym.transforms.WeightedLoss` applies the
weights to the per-token loss of TorchRL's ``ClipPPOLoss`` / ``GRPOLoss``, so they reach the gradient.
"""

from __future__ import annotations

from enum import StrEnum

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import check_number, require, set_loss_weight, squeeze_last, valid_mask
from tokengym.transforms.group_advantages import group_stats, sequence_scores
from tokengym.transforms.sequences import check_trajectory_rows

__all__ = ["FilterMode", "ZeroStdGroupFilter", "clip_filter_like_weights", "ClipFilterLikeWeights",
           "ratio_window_weights", "RatioWindowWeights"]  # fmt: skip


class FilterMode(StrEnum):
    """What :class:`ZeroStdGroupFilter` does with a filtered group."""

    DROP = "drop"  # remove its rows (TRAJECTORIES batches)
    MASK = "mask"  # keep the rows, set keys.MASK False on their steps


class ZeroStdGroupFilter(BatchTransform):
    """DAPO dynamic sampling, the filter form: filter groups whose trajectory scores all equal (no learning signal).

    Dropped groups shrink the batch. The sampler form, which draws on until the batch holds ``N`` groups with
    reward spread (bounded, counted in the metrics), is a collector option:
    ``CollectorOptions(dynamic_sampling=DynamicSampling())`` (:class:`~tokengym.collectors.DynamicSampling`).
    A group of a single sample counts as zero-variance. Group statistics are float64, so a group of
    equal scores has a std of exactly 0 and is filtered with the default ``eps=0``. After
    :class:`~tokengym.transforms.KLRewardTransform`, pass ``reward_key=keys.REWARD_RAW``: the KL
    penalties make shaped scores differ. ``filtered_fraction`` (and :meth:`metrics`) reports the
    fraction of groups filtered from the last batch.

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

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        if self.mode is FilterMode.DROP:
            check_trajectory_rows(td, owner)
        seq, scores, groups = sequence_scores(td, reward_key=self.reward_key, owner=owner)
        flat, per_group = _zero_std(scores, groups, self.eps)  # per sequence, per group
        self.filtered_fraction = float(per_group.float().mean()) if len(per_group) else 0.0
        steps_filtered = flat[seq.clamp(min=0)] & (seq >= 0)
        if self.mode is FilterMode.MASK:
            td.set(keys.MASK, valid_mask(td) & ~steps_filtered)
            return td
        return td[~steps_filtered.any(-1)]


def _zero_std(scores: torch.Tensor, group_ids: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per sequence, per group)`` bool: the group's score std is <= eps, or it has one sample."""
    _, std, count = group_stats(scores, group_ids)
    per_seq = (std <= eps) | (count < 2)
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    per_group = torch.zeros(len(unique), dtype=torch.bool, device=per_seq.device)
    per_group[inverse] = per_seq
    return per_seq, per_group


def clip_filter_like_weights(scores: torch.Tensor, group_ids: torch.Tensor, *, clip_eps: float = 3.0,
                             lamda: float = 1.0) -> torch.Tensor:  # fmt: skip
    """LightRFT / CPGD clip-filter-like weights (M,), one per sequence, vectorized over groups.

    With ``n`` groups of which ``n_zero`` have zero score std (all scores equal): the sequences of a
    zero-std group get ``lamda``, the others ``min(n / (n - n_zero), clip_eps)``, so the loss keeps
    its scale when zero-variance groups are down-weighted. If every group has zero std, every weight
    is 1 (as in LightRFT's ``clip_filter_like_weight_func``). Differences from the seed, which takes
    a ``[groups, samples]`` reward tensor: groups may differ in size, and a group of one sample counts
    as zero-std (the seed's std of one sample is NaN, so it never does; GRPO gives such a group 0).

    Args:
        scores: one score per sequence (the task reward; see :class:`ClipFilterLikeWeights`).
        group_ids: its group (prompt) id.
        clip_eps: upper bound of the weight of the other groups (> 0; LightRFT's default 3.0).
        lamda: weight of the zero-std groups (>= 0; LightRFT's default 1.0, 0 drops them).

    Example:
        >>> r, g = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1, 2, 2])
        >>> clip_filter_like_weights(r, g, lamda=0.0).tolist()  # n = 3, n_zero = 1: 3 / 2
        [0.0, 0.0, 1.5, 1.5, 1.5, 1.5]
    """
    clip_eps = check_number("clip_eps", clip_eps, low=0.0, low_open=True, fix="LightRFT uses clip_eps=3.0.")
    lamda = check_number("lamda", lamda, low=0.0, fix="lamda is the weight of zero-std groups; 0 drops them.")
    per_seq, per_group = _zero_std(scores, group_ids, 0.0)
    n, n_zero = len(per_group), per_group.sum()
    other = (n / (n - n_zero).clamp(min=1)).clamp(max=clip_eps).float()
    weights = torch.where(per_seq, torch.full_like(other, lamda), other.expand(per_seq.shape))
    return torch.where(n_zero == n, torch.ones_like(weights), weights)  # no sync on the device


class ClipFilterLikeWeights(BatchTransform):
    """Write LightRFT's clip-filter-like group weights to ``keys.LOSS_WEIGHT`` [N, T] (0 on padding).

    Each trajectory's weight (see :func:`clip_filter_like_weights`) goes to all its valid steps and
    multiplies a ``keys.LOSS_WEIGHT`` already in the batch. Needs complete trajectories. After
    :class:`~tokengym.transforms.KLRewardTransform`, pass ``reward_key=keys.REWARD_RAW`` (the seed
    weighs by the reward model's score, before KL shaping).

    Args:
        clip_eps: upper bound of the weight of groups with reward variance (> 0).
        lamda: weight of zero-std groups (>= 0).
        reward_key: the reward summed into each trajectory's score.

    Example:
        >>> from tensordict import TensorDict
        >>> done = torch.tensor([[[True]]] * 4)
        >>> b = TensorDict({keys.REWARD: done.float() * torch.tensor([1.0, 1.0, 0.0, 1.0])[:, None, None], keys.DONE: done,
        ...                 keys.GROUP_ID: torch.tensor([[0], [0], [1], [1]]), keys.TRAJ_ID: torch.arange(4)[:, None],
        ...                 keys.RESPONSE_LEN: torch.zeros(4, 1, dtype=torch.long)}, [4, 1])
        >>> ClipFilterLikeWeights(lamda=0.0)(b)[keys.LOSS_WEIGHT].flatten().tolist()
        [0.0, 0.0, 2.0, 2.0]
    """

    def __init__(self, *, clip_eps: float = 3.0, lamda: float = 1.0, reward_key=keys.REWARD) -> None:
        self.clip_eps = check_number("clip_eps", clip_eps, low=0.0, low_open=True, fix="LightRFT uses clip_eps=3.0.")
        self.lamda = check_number("lamda", lamda, low=0.0, fix="lamda is the weight of zero-std groups; 0 drops them.")
        self.reward_key = reward_key
        super().__init__(in_keys=[reward_key, keys.GROUP_ID, keys.TRAJ_ID, keys.DONE, keys.RESPONSE_LEN],
                         out_keys=[keys.LOSS_WEIGHT])  # fmt: skip

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        seq, scores, groups = sequence_scores(td, reward_key=self.reward_key, owner=type(self).__name__)
        weights = clip_filter_like_weights(scores, groups, clip_eps=self.clip_eps, lamda=self.lamda)
        valid = seq >= 0
        per_step = weights.new_zeros(seq.shape)
        per_step[valid] = weights[seq[valid]]
        set_loss_weight(td, per_step)
        return td


def ratio_window_weights(log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, mask: torch.Tensor, *,
                         low: float, high: float) -> torch.Tensor:  # fmt: skip
    """Importance-ratio window: weight 1 where ``low <= exp(log_prob - behaviour) <= high``, else 0.

    A per-token mask for when the sampler and the trainer disagree (e.g. a vLLM engine and the
    training model); not LightRFT's clip-filter-like weights (:func:`clip_filter_like_weights`).

    Example:
        >>> lp, old = torch.tensor([0.0, 1.0, -1.0]), torch.zeros(3)
        >>> ratio_window_weights(lp, old, torch.ones(3, dtype=torch.bool), low=0.5, high=2.0).tolist()
        [1.0, 0.0, 0.0]
    """
    low = check_number("low", low, low=0.0)
    high = check_number("high", high, low=low, fix="Pass low <= high.")
    if not (log_prob.shape == behaviour_log_prob.shape == mask.shape):
        raise ValueError(f"log_prob, behaviour_log_prob and mask must share a shape, got {tuple(log_prob.shape)}, "
                         f"{tuple(behaviour_log_prob.shape)} and {tuple(mask.shape)}")  # fmt: skip
    ratio = (log_prob.float() - behaviour_log_prob.float()).exp()
    return (mask.bool() & (ratio >= low) & (ratio <= high)).float()


class RatioWindowWeights(BatchTransform):
    """Write ``keys.LOSS_WEIGHT`` [N, T]: 0 on padding and on tokens whose importance ratio leaves ``[low, high]``.

    The ratio compares ``log_prob_key`` (e.g. the trainer's log-prob) with ``behaviour_key`` (the
    sampler's, ``keys.ACTION_LOG_PROB``), as when the generation engine and the trainer disagree.
    The weights multiply a ``keys.LOSS_WEIGHT`` already in the batch.

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.RAW_LOG_PROB: torch.tensor([[0.0, 2.0]]), keys.ACTION_LOG_PROB: torch.zeros(1, 2)}, [1, 2])
        >>> RatioWindowWeights(low=0.5, high=2.0)(b)[keys.LOSS_WEIGHT].tolist()
        [[1.0, 0.0]]
    """

    def __init__(self, *, low: float, high: float, log_prob_key=keys.RAW_LOG_PROB,
                 behaviour_key=keys.ACTION_LOG_PROB) -> None:  # fmt: skip
        self.low = check_number("low", low, low=0.0)
        self.high = check_number("high", high, low=self.low, fix="Pass low <= high.")
        self.log_prob_key, self.behaviour_key = log_prob_key, behaviour_key
        super().__init__(in_keys=[log_prob_key, behaviour_key], out_keys=[keys.LOSS_WEIGHT])

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        mask = valid_mask(td)
        lp = squeeze_last(require(td, self.log_prob_key, owner), mask.shape)
        old = squeeze_last(require(td, self.behaviour_key, owner), mask.shape)
        set_loss_weight(td, ratio_window_weights(lp, old, mask, low=self.low, high=self.high))
        return td
