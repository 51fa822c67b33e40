"""Per-token loss weights into the gradient: ``keys.LOSS_WEIGHT`` applied to the per-token loss of a TorchRL loss.

No TorchRL loss reads a per-token weight: ``ClipPPOLoss(reduction="none")`` and ``GRPOLoss(aggregation="none")``
return the per-token terms instead (0 on masked tokens). :class:`WeightedLoss` runs such a loss, multiplies its
``loss_objective`` by the batch's ``keys.LOSS_WEIGHT`` (written by :class:`~tokengym.transforms.MismatchCorrection`,
:class:`~tokengym.transforms.RatioWindowWeights`, :class:`~tokengym.transforms.ClipFilterLikeWeights`) and
reduces every per-token term over the valid tokens, so the objective is

    loss_objective = sum_t mask_t * w_t * l_t / sum_t mask_t            ("token_mean", verl's token-mean)

or the mean over sequences of each sequence's weighted token mean (``"sequence_mean"``). The normaliser counts
tokens, not weights: a masked-out token lowers the loss's scale as it does in verl and TRL.
"""

from __future__ import annotations

from enum import StrEnum

import torch
from tensordict import TensorDict, TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._checks import found_keys, squeeze_last

__all__ = ["LossAggregation", "WeightedLoss"]


class LossAggregation(StrEnum):
    """How :class:`WeightedLoss` reduces a per-token term."""

    TOKEN_MEAN = "token_mean"  # sum over valid tokens / their number
    SEQUENCE_MEAN = "sequence_mean"  # each row's mean over its valid tokens, then the mean over rows with any


class WeightedLoss(torch.nn.Module):
    """A TorchRL loss whose per-token objective is weighted by ``keys.LOSS_WEIGHT``; what :func:`~tokengym.training.train`
    and a plain loop call in place of the loss.

    Returns a TensorDict with every scalar the loss returned (``clip_fraction``, ``kl_approx``...) and its ``loss_*``
    terms reduced over the valid tokens (``keys.MASK``, else ``keys.ACTION_MASK``): ``loss_objective`` weighted, the
    others (entropy, critic) not. A batch without ``keys.LOSS_WEIGHT`` has weight 1.

    Args:
        loss: ``ClipPPOLoss(..., reduction="none")`` on a step batch or ``GRPOLoss(..., aggregation="none")`` on the
            padded layout of ``to_padded`` (any TorchRL loss returning per-token ``loss_*`` terms).
        aggregation: ``"token_mean"`` or ``"sequence_mean"`` (:class:`LossAggregation`).
        is_decoupled: the PPO ratio's old log-probs are the trainer's (``keys.TRAINER_LOG_PROB``, written by
            :class:`~tokengym.transforms.MismatchCorrection`), as in AReaL's decoupled PPO: sets the loss's
            ``sample_log_prob`` key to it. Without it the ratio is against the sampler's log-probs.

    Raises:
        ValueError: a loss that reduces its terms itself.

    Example:
        >>> from torchrl.objectives.llm import GRPOLoss
        >>> from tokengym.collectors.policies import PaddedSequenceActor
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage, RatioWindowWeights, to_padded
        >>> actor = PaddedSequenceActor(tiny_model(tiny_tokenizer()))
        >>> batch = GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1], group_size=2))
        >>> data = to_padded(batch)
        >>> data = data.set(keys.RAW_LOG_PROB, actor.log_prob(data).detach())  # e.g. the trainer's log-probs
        >>> data = RatioWindowWeights(low=0.5, high=2.0)(data)  # 0 where the sampler and the trainer disagree
        >>> loss = WeightedLoss(GRPOLoss(actor, entropy_bonus=False, aggregation="none"))
        >>> out = loss(data); out["loss_objective"].backward(); out["loss_objective"].shape
        torch.Size([])
    """

    def __init__(self, loss: torch.nn.Module, *, aggregation: LossAggregation | str = "token_mean",
                 is_decoupled: bool = False) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(loss, torch.nn.Module):
            raise TypeError(f"loss must be a TorchRL loss module (ClipPPOLoss, GRPOLoss...), got {type(loss).__name__}")
        if getattr(loss, "aggregation", None) != "none" and getattr(loss, "reduction", None) != "none":
            raise ValueError(f"WeightedLoss weights the per-token loss, but {type(loss).__name__} reduces it itself "
                             f"(reduction={getattr(loss, 'reduction', None)!r}); build it with reduction='none' "
                             "(ClipPPOLoss(..., reduction='none')) or aggregation='none' (GRPOLoss(..., aggregation='none'))")  # fmt: skip
        try:
            self.aggregation = LossAggregation(aggregation)
        except ValueError:
            raise ValueError(f"unknown aggregation {aggregation!r}; use one of {[m.value for m in LossAggregation]}") from None
        self.loss, self.is_decoupled = loss, bool(is_decoupled)
        if self.is_decoupled:
            loss.set_keys(sample_log_prob=keys.TRAINER_LOG_PROB)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """The loss on ``tensordict``: its scalars, and its ``loss_*`` terms reduced (``loss_objective`` weighted)."""
        if self.is_decoupled and tensordict.get(keys.TRAINER_LOG_PROB, None) is None:
            raise KeyError(f"WeightedLoss(is_decoupled=True) reads the trainer's log-probs {keys.TRAINER_LOG_PROB!r} "
                           f"(tokengym.llm_envs.keys) but got keys {found_keys(tensordict)}; run "
                           "MismatchCorrection(trainer=actor.log_prob) on the batch first")  # fmt: skip
        out = self.loss(tensordict)
        mask = _valid_tokens(tensordict)
        weight = tensordict.get(keys.LOSS_WEIGHT, None)
        weight = None if weight is None else squeeze_last(weight, mask.shape).float()
        result = {}
        for name in list(out.keys()):
            value = out.get(name)
            if value is None:
                continue
            if isinstance(name, str) and name.startswith("loss_") and value.numel() > 1:
                value = self._reduce(name, value, mask, weight if name == "loss_objective" else None)
            result[name] = value
        return TensorDict(result, [])

    def _reduce(self, name: str, value: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if value.numel() != mask.numel():
            raise ValueError(f"{type(self.loss).__name__} returned {name} of shape {tuple(value.shape)}, not one value "
                             f"per token of the batch {tuple(mask.shape)}")  # fmt: skip
        per_token = value.reshape(mask.shape)
        keep = mask if weight is None else mask & (weight != 0)
        if weight is not None:
            per_token = per_token * weight
        per_token = torch.where(keep, per_token, 0.0)  # select: a dropped token may hold a non-finite value
        if self.aggregation is LossAggregation.TOKEN_MEAN:
            return per_token.sum() / mask.sum().clamp(min=1)
        counts = mask.sum(-1)
        rows = counts > 0
        return (per_token.sum(-1)[rows] / counts[rows]).sum() / rows.sum().clamp(min=1)


def _valid_tokens(tensordict: TensorDictBase) -> torch.Tensor:
    """The tokens a loss term counts: ``keys.MASK`` (step batches, and token-aligned in a padded layout), else
    ``keys.ACTION_MASK``, else all."""
    for key in (keys.MASK, keys.ACTION_MASK):
        mask = tensordict.get(key, None)
        if mask is not None:
            return squeeze_last(mask, tensordict.batch_size).bool()
    return torch.ones(tensordict.batch_size, dtype=torch.bool, device=tensordict.device)
