"""Group-relative advantages (GRPO, Dr.GRPO, RLOO, REINFORCE++ baseline) over ``keys.GROUP_ID``.

Each trajectory's score is the sum of its rewards; its advantage is broadcast to every valid
generated token. Groups are the samples of one prompt found in the batch, and a batch must hold
whole groups (a ``TRAJECTORIES`` batch of a :class:`~tokengym.collectors.TokenCollector` does):
:class:`GroupAdvantage` raises a ValueError on a fragment (groups of unequal sizes, or sample ids
missing) rather than normalising over it. ``use_partial_groups=True`` estimates on the samples
present instead (a group of one sample then gets advantage 0). A batch whose groups all have one sample (an env's
default ``group_size=1``) gets advantages of 0 and a :class:`~tokengym.errors.TokenGymWarning`, once per transform.

Scores are summed and group statistics computed in float64, so a group whose scores are all equal
has a mean equal to that score and a std of exactly 0, and gets an advantage of exactly 0 (in
float32 the mean of seven 100.1s is one ulp off, and ``/ (std + eps)`` blew that up to ~0.9).
"""

from __future__ import annotations

import warnings

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import TokenGymWarning
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import (
    check_batch,
    check_complete,
    check_number,
    require,
    sequence_index,
    squeeze_last,
)
from tokengym.transforms.advantages import AdvantageEstimator, DiscountedReturns, GAEAdvantage, masked_whiten

__all__ = ["group_advantages", "group_stats", "sequence_scores", "GroupAdvantage", "make_advantage"]

_GROUPS_OF_ONE = (
    "{owner}: every group in the batch has one sample ({n} groups of group_size=1, the env's default), so every "
    "advantage is 0 and the loss trains on nothing; sample each prompt several times: TokenEnv(..., group_size=8) "
    "(or PromptSource(..., group_size=8))"
)
_GROUP_ESTIMATORS = (AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO, AdvantageEstimator.RLOO,
                     AdvantageEstimator.REINFORCE_PP)  # fmt: skip


def _stats64(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if scores.ndim != 1 or group_ids.shape != scores.shape:
        raise ValueError(
            f"scores and group_ids must be 1-D of one length, got {tuple(scores.shape)} and {tuple(group_ids.shape)}"
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    scores = scores.double()
    sums = torch.zeros(len(counts), dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    mean = (sums / counts)[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, (scores - mean).square())
    std = (sq / (counts - 1).clamp(min=1)).sqrt()[inverse]
    return mean, std, counts[inverse]


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence ``(group mean, group std (unbiased; 0 for one sample), group count)`` (M,) each.

    Computed in float64 (returned as float32, or float64 for float64 scores): the mean of equal scores
    is that score exactly, so their std is exactly 0.

    Example:
        >>> mean, std, n = group_stats(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([7, 7, 9]))
        >>> mean.tolist(), n.tolist()
        ([2.0, 2.0, 5.0], [2, 2, 1])
        >>> group_stats(torch.full((7,), 100.1), torch.zeros(7, dtype=torch.long))[1].tolist()  # equal: exactly 0
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    mean, std, count = _stats64(scores, group_ids)
    dtype = torch.float64 if scores.dtype == torch.float64 else torch.float32
    return mean.to(dtype), std.to(dtype), count


def group_advantages(scores: torch.Tensor, group_ids: torch.Tensor, estimator: str | AdvantageEstimator = "grpo",
                     *, eps: float = 1e-6) -> torch.Tensor:  # fmt: skip
    """Sequence-level advantages (M,) float32 from scores (M,) and group ids (M,), vectorized over groups.

    Computed in float64; a group whose scores are all equal gets exactly 0 (also with ``eps=0``).

    Args:
        scores: one score per sequence.
        group_ids: its group (prompt) id.
        estimator: ``"grpo"`` (r - mean) / (std + eps), ``"dr_grpo"`` r - mean,
            ``"rloo"`` r - mean of the others, ``"reinforce_pp"`` r - mean.
        eps: added to the std (GRPO).

    Example:
        >>> r, g = torch.tensor([1.0, 0.0, 0.0, 2.0]), torch.tensor([0, 0, 0, 1])
        >>> [round(a, 4) for a in group_advantages(r, g, "rloo").tolist()]  # 1 - mean(0, 0); 0 - mean(1, 0); lone -> 0
        [1.0, -0.5, -0.5, 0.0]
    """
    estimator = AdvantageEstimator.parse(estimator)
    if estimator not in _GROUP_ESTIMATORS:
        raise ValueError(f"{estimator.value!r} is not a group estimator; use one of {[e.value for e in _GROUP_ESTIMATORS]}")
    eps = check_number("eps", eps, low=0.0)
    mean, std, count = _stats64(scores, group_ids)
    scores = scores.double()
    centred = scores - mean
    if estimator is AdvantageEstimator.GRPO:
        # std == 0 only for equal scores (centred == 0 exactly); keep 0 / 0 at 0 when eps == 0
        adv = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    elif estimator is AdvantageEstimator.RLOO:
        # leave-one-out baseline: the mean of the other samples of the group, (sum - r) / (n - 1)
        adv = scores - (mean * count - scores) / (count - 1).clamp(min=1)
    else:
        adv = centred
    return torch.where(count > 1, adv, torch.zeros_like(adv)).float()


def sequence_scores(td: TensorDictBase, *, reward_key=keys.REWARD, owner: str = "sequence_scores"):
    """Score (summed reward) and group id of every complete trajectory of a batch.

    Returns ``(seq, scores, group_ids)``: ``seq`` int64 [N, T] maps each step to its trajectory
    (-1 on masked steps); ``scores`` float32 (M,), the sum of the rewards of its valid steps (summed
    in float64); ``group_ids`` int64 (M,).

    Trajectories are told apart by ``keys.TRAJ_ID`` (not by the mask): a trajectory whose first step
    is masked is still its own trajectory, and still complete if that step is response step 0.

    Raises:
        ValueError: if a trajectory is incomplete (STEPS batches: it began before or ends after the batch).
    """
    check_batch(td, owner, (reward_key, keys.GROUP_ID, keys.TRAJ_ID, keys.DONE, keys.RESPONSE_LEN))
    seq, mask, num = sequence_index(td, owner)
    check_complete(td, seq, mask, num, owner)
    reward = squeeze_last(require(td, reward_key, owner), mask.shape).double()
    flat = seq[mask]
    scores = torch.zeros(num, dtype=torch.float64, device=reward.device).index_add_(0, flat, reward[mask]).float()
    groups = torch.zeros(num, dtype=torch.int64, device=reward.device)
    groups[flat] = td.get(keys.GROUP_ID)[mask]
    return seq, scores, groups


def _episodes(td: TensorDictBase, seq: torch.Tensor, groups: torch.Tensor) -> torch.Tensor | None:
    """Each trajectory's episode (M,) when some trajectories are parts of one episode (same group and sample id:
    an agent episode split at a history rewrite), else ``None``."""
    if keys.SAMPLE_ID not in td.keys() or not len(groups):
        return None
    mask = seq >= 0
    sample = torch.zeros_like(groups)
    sample[seq[mask]] = td.get(keys.SAMPLE_ID)[mask]
    pairs, episode = torch.unique(torch.stack([groups, sample], 1), dim=0, return_inverse=True)
    return None if len(pairs) == len(groups) else episode


class GroupAdvantage(BatchTransform):
    """Group-relative advantage per trajectory, broadcast to its tokens under ``keys.ADVANTAGE`` [N, T, 1].

    Works on TRAJECTORIES batches and on STEPS batches whose trajectories are complete.

    Args:
        estimator: ``"grpo"``, ``"dr_grpo"``, ``"rloo"`` or ``"reinforce_pp"`` (an :class:`AdvantageEstimator`).
        eps: added to the group std (GRPO).
        normalize: whiten the token advantages over the batch; default True for ``"reinforce_pp"`` only.
        group_size: samples per group; a group with another number of samples raises ValueError.
            ``None``: every group must have the size of the largest group in the batch, with sample
            ids ``0 .. size - 1`` (when the batch holds ``keys.SAMPLE_ID``).
        use_partial_groups: estimate on the samples present, whole group or not (groups split across
            batches, unequal sizes) instead of raising.
        reward_key: the reward summed into the score (``keys.REWARD``; use ``keys.REWARD_RAW`` to
            ignore KL shaping).

    Example:
        >>> from tensordict import TensorDict
        >>> z = torch.zeros(2, 2, dtype=torch.long)
        >>> b = TensorDict({keys.REWARD: torch.tensor([[[0.0], [1.0]], [[0.0], [0.0]]]), keys.GROUP_ID: z, keys.RESPONSE_LEN: torch.tensor([[0, 1], [0, 1]]),
        ...                 keys.TRAJ_ID: torch.tensor([[0, 0], [1, 1]]), keys.DONE: torch.tensor([[[False], [True]]] * 2)}, [2, 2])
        >>> GroupAdvantage("dr_grpo")(b)[keys.ADVANTAGE].squeeze(-1).tolist()
        [[0.5, 0.5], [-0.5, -0.5]]
    """

    def __init__(self, estimator: str | AdvantageEstimator = "grpo", *, eps: float = 1e-6, normalize: bool | None = None,
                 group_size: int | None = None, reward_key=keys.REWARD, use_partial_groups: bool = False) -> None:  # fmt: skip
        self.estimator = AdvantageEstimator.parse(estimator)
        if self.estimator not in _GROUP_ESTIMATORS:
            raise ValueError(f"GroupAdvantage takes a group estimator {[e.value for e in _GROUP_ESTIMATORS]}, got "
                             f"{self.estimator.value!r}; use make_advantage({self.estimator.value!r}) instead")  # fmt: skip
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size must be an int >= 1 or None, got {group_size!r}")
        super().__init__(in_keys=[reward_key, keys.GROUP_ID, keys.TRAJ_ID, keys.DONE, keys.RESPONSE_LEN],
                         out_keys=[keys.ADVANTAGE])  # fmt: skip
        self.eps = check_number("eps", eps, low=0.0)
        self.normalize = self.estimator is AdvantageEstimator.REINFORCE_PP if normalize is None else bool(normalize)
        self.group_size, self.use_partial_groups = group_size, bool(use_partial_groups)
        self.reward_key = reward_key
        self._has_warned = False

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        seq, scores, groups = sequence_scores(td, reward_key=self.reward_key, owner=owner)
        episode = _episodes(td, seq, groups)
        if episode is not None:  # parts of split episodes: one score per episode, its advantage to every part
            seq = torch.where(seq >= 0, episode[seq.clamp(min=0)], seq)
            first = torch.full((int(episode.max()) + 1,), len(episode), dtype=torch.int64)
            first.scatter_reduce_(0, episode, torch.arange(len(episode)), reduce="amin")
            scores, groups = scores[first], groups[first]
        if not self.use_partial_groups and len(groups):
            self._check_whole(td, seq, groups)
        self._warn_groups_of_one(td, seq, groups)
        adv_seq = group_advantages(scores, groups, self.estimator, eps=self.eps)
        mask = seq >= 0
        adv = adv_seq[seq.clamp(min=0)] * mask
        if self.normalize:
            adv = masked_whiten(adv, mask)
        td.set(keys.ADVANTAGE, adv.unsqueeze(-1))
        return td

    def _warn_groups_of_one(self, td: TensorDictBase, seq: torch.Tensor, groups: torch.Tensor) -> None:
        """Warn (once) when every group of the batch is one sample of a prompt sampled once: all advantages are 0."""
        if self._has_warned or not len(groups) or len(torch.unique(groups)) != len(groups):
            return
        if keys.SAMPLE_ID in td.keys() and bool((td.get(keys.SAMPLE_ID)[seq >= 0] > 0).any()):
            return  # fragments of larger groups (use_partial_groups): other batches hold the rest
        self._has_warned = True
        warnings.warn(_GROUPS_OF_ONE.format(owner=type(self).__name__, n=len(groups)), TokenGymWarning, stacklevel=3)

    def _check_whole(self, td: TensorDictBase, seq: torch.Tensor, groups: torch.Tensor) -> None:
        owner = type(self).__name__
        ids, inverse, counts = torch.unique(groups, return_inverse=True, return_counts=True)
        size = self.group_size if self.group_size is not None else int(counts.max())
        fix = ("collect whole groups (TokenCollector TRAJECTORIES batches hold them by default) or pass "
               f"{owner}(use_partial_groups=True) to estimate on the samples present")  # fmt: skip
        if bool((counts != size).any()):
            bad = int(ids[(counts != size).nonzero()[0, 0]])
            raise ValueError(f"{owner}: the batch holds a fragment of a group: group {bad} has "
                             f"{int(counts[ids == bad][0])} samples, expected {size} (sizes found "
                             f"{sorted(set(counts.tolist()))}); {fix}")  # fmt: skip
        if keys.SAMPLE_ID in td.keys():
            mask = seq >= 0
            sample = torch.zeros(len(groups), dtype=torch.int64, device=groups.device)
            sample[seq[mask]] = td.get(keys.SAMPLE_ID)[mask]
            if bool((sample >= size).any()):
                bad = int(groups[(sample >= size).nonzero()[0, 0]])
                raise ValueError(f"{owner}: group {bad} holds sample id {int(sample.max())} but only {size} samples "
                                 f"are in the batch: the group is split across batches; {fix}")  # fmt: skip

    def __repr__(self) -> str:
        return f"GroupAdvantage(estimator={self.estimator.value!r}, normalize={self.normalize})"


def make_advantage(estimator: str | AdvantageEstimator, **kwargs) -> BatchTransform:
    """The advantage transform for ``estimator`` (any :class:`AdvantageEstimator`), built with ``kwargs``.

    Example:
        >>> make_advantage("rloo"), type(make_advantage("gae", lmbda=1.0)).__name__
        (GroupAdvantage(estimator='rloo', normalize=False), 'GAEAdvantage')
    """
    estimator = AdvantageEstimator.parse(estimator)
    if estimator is AdvantageEstimator.GAE:
        return GAEAdvantage(**kwargs)
    if estimator is AdvantageEstimator.REINFORCE:
        return DiscountedReturns(**kwargs)
    return GroupAdvantage(estimator, **kwargs)
