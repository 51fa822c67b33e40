"""Rollout-trainer mismatch: importance weights from the sampler's log-probs to the trainer's, and their metrics.

The sampler (a vLLM engine, another dtype, older weights under asynchronous collection) and the trainer give the
same tokens different log-probs. In the decoupled form of AReaL and verl, the trainer's log-probs of the batch's
tokens under the weights at the start of the training step (one teacher-forced forward, ``keys.TRAINER_LOG_PROB``)
are the PPO ratio's old log-probs, and an importance weight ``w = p_trainer / p_sampler``, per token or per
sequence, corrects the rest: truncated at a cap (TIS: ``min(w, cap)``) or masked outside ``[low, cap]`` (MIS /
IcePop: ``w`` inside, 0 outside). The weights go to ``keys.LOSS_WEIGHT`` (multiplying one already there), which
:class:`~tokengym.transforms.WeightedLoss` applies to the per-token loss of TorchRL's ``ClipPPOLoss`` / ``GRPOLoss``.

Metrics (over valid tokens): ``mismatch_k3``, the k3 estimate of KL(sampler || trainer), ``mean(w - 1 - log w)``;
``mismatch_abs_log_ratio_mean`` / ``_max``, ``|log p_trainer - log p_sampler|``; ``mismatch_ratio_q05`` / ``_q50`` /
``_q95`` / ``_max``, quantiles of ``w`` at the correction level (tokens or sequences); ``mismatch_truncated_fraction``
(``w > cap``) and ``mismatch_masked_fraction`` (``w`` outside ``[low, cap]``) of those units, whatever the mode;
``mismatch_weight_mean``, the mean weight written over valid tokens (1 in mode ``"none"``).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, StrEnum

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import (
    check_number,
    require,
    sequence_index,
    set_loss_weight,
    squeeze_last,
    valid_mask,
)

__all__ = ["CorrectionLevel", "CorrectionMode", "MismatchCorrection", "mismatch_metrics", "mismatch_weights"]

_QUANTILES = (0.05, 0.5, 0.95)
_METRIC_NAMES = ("mismatch_k3", "mismatch_abs_log_ratio_mean", "mismatch_abs_log_ratio_max", "mismatch_ratio_q05",
                "mismatch_ratio_q50", "mismatch_ratio_q95", "mismatch_ratio_max", "mismatch_truncated_fraction",
                "mismatch_masked_fraction", "mismatch_weight_mean")  # fmt: skip


class CorrectionMode(StrEnum):
    """What :class:`MismatchCorrection` does with the importance weight ``w = p_trainer / p_sampler``."""

    TRUNCATE = "truncate"  # TIS: min(w, cap)
    MASK = "mask"  # MIS / IcePop: w inside [low, cap], 0 outside
    NONE = "none"  # measure only: no weight written


class CorrectionLevel(StrEnum):
    """Where :class:`MismatchCorrection` takes the importance weight."""

    TOKEN = "token"  # each token's own ratio
    SEQUENCE = "sequence"  # the product of the ratios of a sequence's tokens, on all of them


def _enum(kind: type[Enum], value, name: str):
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"unknown {name} {value!r}; use one of {[m.value for m in kind]}") from None


def _check_bounds(cap, low) -> tuple[float, float]:
    cap = check_number("cap", cap, low=0.0, low_open=True, fix="TIS caps the weight at e.g. cap=2.0.")
    low = check_number("low", low, low=0.0, high=cap, fix=f"Pass 0 <= low <= cap ({cap}); IcePop uses low=0.5.")
    return cap, low


def _unit_log_ratio(delta: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None,
                    level: CorrectionLevel) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(per step, per unit)`` log-ratios: a token's own, or its sequence's sum (units: valid tokens or sequences)."""
    if level is CorrectionLevel.TOKEN:
        return delta, delta[mask]
    if sequence_ids is None:  # one sequence per row
        sequence_ids = torch.where(mask, torch.arange(mask.shape[0], device=mask.device)[:, None], -1)
    seq = sequence_ids[mask]
    num = int(seq.max()) + 1 if seq.numel() else 0
    per_seq = delta.new_zeros(num).index_add_(0, seq, delta[mask])
    has_steps = torch.zeros(num, dtype=torch.bool, device=mask.device).index_fill_(0, seq, True)
    return per_seq[sequence_ids.clamp(min=0)], per_seq[has_steps]


def mismatch_weights(trainer_log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, mask: torch.Tensor, *,
                     mode: CorrectionMode | str = "truncate", level: CorrectionLevel | str = "token", cap: float = 2.0,
                     low: float = 0.0, sequence_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Importance weights (N, T) from the sampler's log-probs to the trainer's, truncated or masked; 0 on padding.

    Args:
        trainer_log_prob: the trainer's log-prob of each token (N, T), teacher-forced.
        sampler_log_prob: the sampler's (``keys.ACTION_LOG_PROB``).
        mask: bool (N, T), the valid tokens.
        mode: ``"truncate"`` (``min(w, cap)``), ``"mask"`` (``w`` inside ``[low, cap]``, else 0) or ``"none"`` (``w``).
        level: ``"token"`` or ``"sequence"`` (``w`` is the product over the sequence's tokens).
        cap: the upper bound (> 0).
        low: the lower bound of ``"mask"`` (0 <= low <= cap).
        sequence_ids: int64 (N, T), the sequence of each step (-1 on padding); ``None``: one sequence per row.

    Example:
        >>> trainer, sampler = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[-1.0, -1.0, -1.0]])
        >>> mask = torch.tensor([[True, True, False]])
        >>> [round(w, 3) for w in mismatch_weights(trainer, sampler, mask, cap=2.0)[0].tolist()]  # e, 1, padding
        [2.0, 1.0, 0.0]
        >>> mismatch_weights(trainer, sampler, mask, mode="mask", low=0.5, cap=2.0)[0].tolist()
        [0.0, 1.0, 0.0]
        >>> round(mismatch_weights(trainer, sampler, mask, mode="none", level="sequence")[0, 0].item(), 3)  # e * 1
        2.718
    """
    weights, _ = _weights(trainer_log_prob, sampler_log_prob, mask, _enum(CorrectionMode, mode, "mode"),
                          _enum(CorrectionLevel, level, "level"), *_check_bounds(cap, low), sequence_ids)  # fmt: skip
    return weights


def _weights(trainer_log_prob, sampler_log_prob, mask, mode, level, cap, low, sequence_ids):
    """The weights (N, T) and ``(delta, unit_ratio)``: the token log-ratios and the ratios of the level's units."""
    if not (trainer_log_prob.shape == sampler_log_prob.shape == mask.shape):
        raise ValueError(f"trainer_log_prob, sampler_log_prob and mask must share a shape, got "
                         f"{tuple(trainer_log_prob.shape)}, {tuple(sampler_log_prob.shape)} and {tuple(mask.shape)}")  # fmt: skip
    mask = mask.bool()
    delta = torch.where(mask, trainer_log_prob.float() - sampler_log_prob.float(), 0.0)  # (N, T) log w per token
    step_log_ratio, unit_log_ratio = _unit_log_ratio(delta, mask, sequence_ids, level)
    ratio = step_log_ratio.exp()
    if mode is CorrectionMode.TRUNCATE:
        weights = ratio.clamp(max=cap)
    elif mode is CorrectionMode.MASK:
        weights = torch.where((ratio >= low) & (ratio <= cap), ratio, 0.0)
    else:
        weights = ratio
    return torch.where(mask, weights, 0.0), (delta, unit_log_ratio.exp())


def mismatch_metrics(trainer_log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, mask: torch.Tensor, *,
                     level: CorrectionLevel | str = "token", cap: float = 2.0, low: float = 0.0,
                     sequence_ids: torch.Tensor | None = None) -> dict[str, float]:  # fmt: skip
    """The mismatch metrics of a batch (module docstring) as a logger-friendly ``{name: float}``, NaN without tokens.

    Args: as :func:`mismatch_weights` (``mismatch_weight_mean`` is that of the truncated weights).

    Example:
        >>> trainer, sampler = torch.tensor([[0.0, -1.0, -2.0]]), torch.tensor([[-1.0, -1.0, -1.0]])
        >>> m = mismatch_metrics(trainer, sampler, torch.tensor([[True, True, False]]), cap=2.0)
        >>> round(m["mismatch_k3"], 4), m["mismatch_abs_log_ratio_max"], m["mismatch_truncated_fraction"]
        (0.3591, 1.0, 0.5)
    """
    level = _enum(CorrectionLevel, level, "level")
    cap, low = _check_bounds(cap, low)
    weights, stats = _weights(trainer_log_prob, sampler_log_prob, mask, CorrectionMode.TRUNCATE, level, cap, low,
                              sequence_ids)  # fmt: skip
    return _metrics(weights, stats, mask.bool(), cap, low)


def _quantiles(x: torch.Tensor, qs) -> list[torch.Tensor]:
    """Quantiles of the 1-D ``x`` with linear interpolation (``torch.quantile``'s), by selection: no full sort."""
    n, out = x.numel(), []
    for q in qs:
        pos = q * (n - 1)
        lo, hi = int(pos), min(int(pos) + 1, n - 1)
        low = x.kthvalue(lo + 1).values
        out.append(low if hi == lo or pos == lo else low + (x.kthvalue(hi + 1).values - low) * (pos - lo))
    return out


def _metrics(weights: torch.Tensor, stats, mask: torch.Tensor, cap: float, low: float) -> dict[str, float]:
    delta, unit_ratio = stats
    if unit_ratio.numel() == 0:
        return dict.fromkeys(_METRIC_NAMES, float("nan"))
    # delta and weights are 0 on padding: sums over the whole batch are sums over the valid tokens
    count = mask.sum()
    k3 = torch.expm1(delta) - delta  # w - 1 - log w, >= 0; expm1 keeps it exact near w = 1
    abs_d = delta.abs()
    values = torch.stack([k3.sum() / count, abs_d.sum() / count, abs_d.max(), *_quantiles(unit_ratio, _QUANTILES),
                          unit_ratio.max(), (unit_ratio > cap).float().mean(),
                          ((unit_ratio < low) | (unit_ratio > cap)).float().mean(), weights.sum() / count])  # fmt: skip
    return dict(zip(_METRIC_NAMES, values.tolist(), strict=True))  # one device sync


class MismatchCorrection(BatchTransform):
    """Write the trainer's log-probs (``keys.TRAINER_LOG_PROB``) and the importance weights from the sampler's log-probs
    to them (``keys.LOSS_WEIGHT``, multiplying one already there), and keep the mismatch metrics (:meth:`metrics`).

    Run it once per training step, before the first optimizer step (``train(prepare=...)``), with ``trainer`` the
    actor's ``log_prob``: the trainer's log-probs are then those of the weights at the step's start (with
    ``AsyncCollector`` these are newer than the sampler's, so staleness is corrected too), and they are the PPO
    ratio's old log-probs: build the loss with ``WeightedLoss(..., is_decoupled=True)``. Works on a step batch
    (N, T) and on the padded layout of ``to_padded`` (N, L), whose step keys are token-aligned.

    Args:
        mode: ``"truncate"`` (TIS), ``"mask"`` (MIS / IcePop) or ``"none"`` (metrics only); see :class:`CorrectionMode`.
        level: ``"token"`` or ``"sequence"`` (sequences by ``keys.TRAJ_ID``, else one per row).
        cap: the weight's upper bound (truncated to it, or masked above it).
        low: the lower bound of ``"mask"`` (IcePop: 0.5; 0 masks above ``cap`` only, as TRL's ``token_mask``).
        trainer: ``batch -> (N, T)`` log-probs of the batch's tokens, called under ``torch.no_grad()`` (e.g.
            ``SequenceActor(model).log_prob``, ``PaddedSequenceActor(model).log_prob`` on a padded layout); ``None``
            reads ``keys.TRAINER_LOG_PROB`` from the batch. The transform keeps a reference: use it in the training
            loop, not as a collector ``postproc``.
        sampler_key: the sampler's log-probs.

    Example:
        >>> from torchrl.objectives import ClipPPOLoss
        >>> from tokengym.collectors.policies import SequenceActor
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage, WeightedLoss
        >>> model = tiny_model(tiny_tokenizer()); actor = SequenceActor(model)
        >>> batch = GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1], group_size=2))  # random sampler log-probs
        >>> correction = MismatchCorrection("truncate", cap=2.0, trainer=actor.log_prob)
        >>> batch = correction(batch)  # one teacher-forced forward: keys.TRAINER_LOG_PROB and keys.LOSS_WEIGHT
        >>> loss = WeightedLoss(ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False,
        ...                                 reduction="none"), is_decoupled=True)
        >>> out = loss(batch); out["loss_objective"].backward()
        >>> float(out["clip_fraction"]), bool(batch[keys.LOSS_WEIGHT].max() <= 2.0)  # ratio 1 on the first step
        (0.0, True)
        >>> sorted(correction.metrics())[:3]
        ['mismatch_abs_log_ratio_max', 'mismatch_abs_log_ratio_mean', 'mismatch_k3']
    """

    def __init__(self, mode: CorrectionMode | str = "truncate", *, level: CorrectionLevel | str = "token",
                 cap: float = 2.0, low: float = 0.0, trainer: Callable[[TensorDictBase], torch.Tensor] | None = None,
                 sampler_key=keys.ACTION_LOG_PROB) -> None:  # fmt: skip
        self.mode = _enum(CorrectionMode, mode, "mode")
        self.level = _enum(CorrectionLevel, level, "level")
        self.cap, self.low = _check_bounds(cap, low)
        if trainer is not None and not callable(trainer):
            raise TypeError(f"trainer must be callable (batch -> log-probs, e.g. SequenceActor(model).log_prob) or None, "
                            f"got {type(trainer).__name__}")  # fmt: skip
        self.trainer, self.sampler_key = trainer, sampler_key
        self.last_metrics = dict.fromkeys(_METRIC_NAMES, float("nan"))
        in_keys = [sampler_key] if trainer is not None else [sampler_key, keys.TRAINER_LOG_PROB]
        out_keys = [keys.TRAINER_LOG_PROB] if self.mode is CorrectionMode.NONE else [keys.TRAINER_LOG_PROB, keys.LOSS_WEIGHT]
        super().__init__(in_keys=in_keys, out_keys=out_keys)

    def metrics(self) -> dict[str, float]:
        """The mismatch metrics of the last batch (module docstring); NaN before the first."""
        return dict(self.last_metrics)

    def transform_batch(self, td: TensorDictBase) -> TensorDictBase:
        owner = type(self).__name__
        mask = valid_mask(td)
        sampler = squeeze_last(require(td, self.sampler_key, owner), mask.shape)
        if self.trainer is not None:
            with torch.no_grad():
                trainer = self.trainer(td)
            if not isinstance(trainer, torch.Tensor) or trainer.numel() != mask.numel():
                raise ValueError(f"{owner}: trainer(batch) must return the log-prob of every step of the batch, "
                                 f"shape {tuple(mask.shape)}, got {getattr(trainer, 'shape', type(trainer).__name__)}")  # fmt: skip
            td.set(keys.TRAINER_LOG_PROB, trainer.reshape(mask.shape).float().to(mask.device))  # the batch's device
        trainer = squeeze_last(require(td, keys.TRAINER_LOG_PROB, owner), mask.shape)
        sequence_ids = None
        if self.level is CorrectionLevel.SEQUENCE and keys.TRAJ_ID in td.keys():
            sequence_ids = sequence_index(td, owner)[0]
        weights, stats = _weights(trainer, sampler, mask, self.mode, self.level, self.cap, self.low, sequence_ids)
        if self.mode is not CorrectionMode.NONE:
            set_loss_weight(td, weights)
        else:
            weights = mask.float()
        self.last_metrics = _metrics(weights, stats, mask, self.cap, self.low)
        return td
