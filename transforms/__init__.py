"""Transforms of collected batches (``tokengym.transforms``): KL reward shaping, KL control, reward
shaping, advantages (per group, per self-play role), filtering, rollout-trainer mismatch correction, per-token loss
weights and training layouts."""

from __future__ import annotations

from tokengym.transforms._base import BatchTransform
from tokengym.transforms.advantages import (
    AdvantageEstimator,
    DiscountedReturns,
    GAEAdvantage,
    MaskedSteps,
    discounted_returns,
    masked_whiten,
)
from tokengym.transforms.batch_statistics import across_ranks, all_reduce_floats, sum_across_ranks
from tokengym.transforms.decoding import decode
from tokengym.transforms.filtering import (
    ClipFilterLikeWeights,
    FilterMode,
    RatioWindowWeights,
    ZeroStdGroupFilter,
    clip_filter_like_weights,
    ratio_window_weights,
)
from tokengym.transforms.group_advantages import (
    GroupAdvantage,
    group_advantages,
    group_stats,
    make_advantage,
    sequence_scores,
)
from tokengym.transforms.kl_control import AdaptiveKLController, ConstantKLController, KLController
from tokengym.transforms.kl_reward import K3Clamp, KLEstimator, KLRewardTransform, kl_estimate
from tokengym.transforms.layouts import dpo_pairs, padded_to_steps, to_packed, to_padded
from tokengym.transforms.mismatch import (
    CorrectionLevel,
    CorrectionMode,
    MismatchCorrection,
    mismatch_metrics,
    mismatch_weights,
)
from tokengym.transforms.reward_shaping import ClipReward, MissingEOSPenalty, OverlongPenalty, ScaleReward
from tokengym.transforms.role_advantage import RoleAdvantage, trajectory_roles
from tokengym.transforms.sequences import (
    SequenceLayout,
    check_trajectory_rows,
    sequence_layout,
    sequence_log_probs,
    step_log_probs,
)
from tokengym.transforms.shared_prefix import SharedPrefixLayout, to_shared_prefix
from tokengym.transforms.token_log_probs import TokenScorer
from tokengym.transforms.trajectories import split_trajectories
from tokengym.transforms.tree_advantages import TreeAdvantage, tree_leaf_counts
from tokengym.transforms.turn_discount import TurnDiscount
from tokengym.transforms.weighted_loss import LossAggregation, WeightedLoss

__all__ = [
    "decode",
    "across_ranks",
    "all_reduce_floats",
    "sum_across_ranks",
    "SequenceLayout",
    "SharedPrefixLayout",
    "TokenScorer",
    "sequence_layout",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "BatchTransform",
    "ClipFilterLikeWeights",
    "ClipReward",
    "ConstantKLController",
    "CorrectionLevel",
    "CorrectionMode",
    "DiscountedReturns",
    "FilterMode",
    "GAEAdvantage",
    "GroupAdvantage",
    "K3Clamp",
    "KLController",
    "KLEstimator",
    "KLRewardTransform",
    "LossAggregation",
    "MaskedSteps",
    "MismatchCorrection",
    "MissingEOSPenalty",
    "RatioWindowWeights",
    "RoleAdvantage",
    "OverlongPenalty",
    "ScaleReward",
    "TreeAdvantage",
    "TurnDiscount",
    "WeightedLoss",
    "ZeroStdGroupFilter",
    "check_trajectory_rows",
    "clip_filter_like_weights",
    "discounted_returns",
    "dpo_pairs",
    "group_advantages",
    "group_stats",
    "kl_estimate",
    "make_advantage",
    "masked_whiten",
    "mismatch_metrics",
    "mismatch_weights",
    "padded_to_steps",
    "ratio_window_weights",
    "sequence_log_probs",
    "sequence_scores",
    "split_trajectories",
    "trajectory_roles",
    "step_log_probs",
    "to_packed",
    "to_shared_prefix",
    "to_padded",
    "tree_leaf_counts",
]
