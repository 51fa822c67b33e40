"""KL reward shaping: ``r_t <- r_t - beta * kl_t`` on every generated token, with k1/k2/k3/abs estimators."""

from __future__ import annotations

from enum import StrEnum

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.transforms._base import BatchTransform
from tokengym.transforms._checks import (
    check_batch,
    check_number,
    require,
    sequence_index,
    squeeze_last,
    valid_mask,
)
from tokengym.transforms.batch_statistics import sum_across_ranks
from tokengym.transforms.kl_control import ConstantKLController, KLController
from tokengym.transforms.sequences import step_log_probs

__all__ = ["KLEstimator", "K3Clamp", "kl_estimate", "KLRewardTransform"]


class KLEstimator(StrEnum):
    """Per-token KL estimators of KL(policy || reference) from one sample (Schulman, "Approximating KL")."""

    K1 = "k1"  # logp - ref: unbiased, high variance, can be negative
    K2 = "k2"  # (logp - ref)^2 / 2: low variance, biased
    K3 = "k3"  # exp(ref - logp) - (ref - logp) - 1: unbiased, low variance, >= 0
    ABS = "abs"  # |logp - ref|


class K3Clamp(StrEnum):
    """How the ``k3`` estimate is kept finite."""

    OUTPUT = "output"  # clamp the k3 value to [-clamp, clamp] (OpenRLHF, verl, LightRFT); at most `clamp`
    LOG_RATIO = "log_ratio"  # clamp ref - logp to [-clamp, clamp] before exp; up to exp(clamp) - clamp - 1


def _k3_clamp(value) -> K3Clamp:
    try:
        return K3Clamp(value)
    except ValueError:
        raise ValueError(f"unknown k3 clamp mode {value!r}; use one of {[e.value for e in K3Clamp]}") from None


def _estimator(value) -> KLEstimator:
    try:
        return KLEstimator(value)
    except ValueError:
        names = [e.value for e in KLEstimator]
        raise ValueError(f"unknown KL estimator {value!r}; use one of {names}") from None


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: str | KLEstimator = "k1", *,
                clamp: float = 10.0, clamp_mode: str | K3Clamp = "output") -> torch.Tensor:  # fmt: skip
    """Per-token KL estimate from the sampled token's log-prob under the policy and the reference.

    ``k3`` is kept finite by ``clamp``: by default its value is clamped to ``[0, clamp]`` as the seeds
    do (OpenRLHF / verl / LightRFT clamp it to [-10, 10]; k3 >= 0), so one token's penalty is at most
    ``beta * clamp``. ``clamp_mode="log_ratio"`` clamps ``ref - logp`` before ``exp`` instead, which
    lets a token's k3 reach ``exp(clamp) - clamp - 1`` (about 2.2e4 for 10).

    Args:
        log_prob: log-prob of the sampled tokens under the policy.
        ref_log_prob: their log-prob under the reference, same shape.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"`` (a :class:`KLEstimator`).
        clamp: the bound of the ``k3`` clamp (> 0).
        clamp_mode: ``"output"`` (default) or ``"log_ratio"`` (a :class:`K3Clamp`).

    Example:
        >>> lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])
        >>> kl_estimate(lp, ref, "k1").tolist(), kl_estimate(lp, ref, "k2").tolist()
        ([1.0, 0.0], [0.5, 0.0])
        >>> round(kl_estimate(lp, ref, "k3")[0].item(), 4)  # exp(-1) + 1 - 1
        0.3679
        >>> lp, ref = torch.tensor([-15.0]), torch.tensor([0.0])
        >>> kl_estimate(lp, ref, "k3").item(), round(kl_estimate(lp, ref, "k3", clamp_mode="log_ratio").item())
        (10.0, 22015)
    """
    estimator = _estimator(estimator)
    clamp_mode = _k3_clamp(clamp_mode)
    clamp = check_number("clamp", clamp, low=0.0, low_open=True, fix="The seeds use clamp=10.")
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"log_prob and ref_log_prob must share a shape, got {tuple(log_prob.shape)} and "
            f"{tuple(ref_log_prob.shape)}"
        )
    diff = log_prob.float() - ref_log_prob.float()
    if estimator is KLEstimator.K1:
        return diff
    if estimator is KLEstimator.K2:
        return diff.square() / 2
    if estimator is KLEstimator.ABS:
        return diff.abs()
    if clamp_mode is K3Clamp.LOG_RATIO:
        log_ratio = (-diff).clamp(-clamp, clamp)
        return (log_ratio.exp() - log_ratio - 1).clamp(min=0.0)  # >= 0 exactly, despite rounding
    # |log_ratio| >= clamp + 1 gives k3 >= clamp either way: bounding it first changes no clamped value
    # and keeps inf - inf (a -inf log-prob) from turning into NaN
    log_ratio = (-diff).clamp(-clamp - 1.0, clamp + 1.0)
    return (log_ratio.exp() - log_ratio - 1).clamp(0.0, clamp)


def _next(key: tuple) -> str | tuple:
    """The part of a ``("next", ...)`` key inside the next tensordict of an env step."""
    return key[1] if len(key) == 2 else key[1:]


class KLRewardTransform(BatchTransform):
    """Subtract ``beta * kl_t`` from the reward of every generated token; optionally adapt beta.

    Writes ``keys.REWARD_RAW`` (task reward), ``keys.REWARD_KL`` (``-beta * kl``), ``keys.KL`` and
    ``keys.REF_LOG_PROB``; ``keys.REWARD`` becomes their sum. Padding steps (``keys.MASK`` False) and
    inactive slots get no penalty. Reference log-probs come from either

    * ``ref_source == "td"`` (no ``ref_model``): ``keys.REF_LOG_PROB`` already in the data, written by
      a reference policy stepped alongside (in a ``TransformedEnv`` this shapes every step), or
    * ``ref_source == "model"``: one teacher-forced forward of ``ref_model`` per collected batch,
      using the batch's PromptTable (TRAJECTORIES batches).

    Calling it on a batch (e.g. as a collector ``postproc``) updates ``controller`` once with the
    mean summed KL per sequence and the number of sequences; sequences are told apart by
    ``keys.TRAJ_ID`` (a trajectory whose first step is masked is still its own sequence). A batch already holding ``keys.REWARD_KL`` was shaped step by step
    inside the env, so only the controller is updated.

    Args:
        beta: constant KL coefficient (>= 0; default 0.1); leave None when passing ``controller``.
        controller: a :class:`~tokengym.transforms.KLController` that owns beta.
        ref_model: reference causal LM scored once per batch; None reads ``keys.REF_LOG_PROB``.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"abs"``.
        log_prob_key: the policy log-prob ("logp"); ``keys.ACTION_LOG_PROB`` by default.
        pad_id: padding token id for the reference forward; ``None`` takes the batch's PromptTable's
            (the env tokenizer's ``pad_token_id``) and raises a ``ValueError`` when it records none.
        k3_clamp: ``"output"`` (default: a token's k3 is at most 10, as in the seeds) or ``"log_ratio"``
            (see :func:`kl_estimate`).

    Example:
        >>> from tensordict import TensorDict
        >>> b = TensorDict({keys.ACTION_LOG_PROB: torch.tensor([[-1.0, -1.0]]), keys.REF_LOG_PROB: torch.tensor([[-2.0, -1.0]]),
        ...                 keys.TRAJ_ID: torch.zeros(1, 2, dtype=torch.long), keys.REWARD: torch.tensor([[[0.0], [1.0]]])}, [1, 2])
        >>> t = KLRewardTransform(beta=0.5)
        >>> t(b)[keys.REWARD].squeeze(-1).tolist(), t.metrics()
        ([[-0.5, 1.0]], {'kl': 1.0, 'beta': 0.5, 'kl_per_token': 0.5})
    """

    def __init__(self, *, beta: float | None = None, controller: KLController | None = None, ref_model=None,
                 estimator: str | KLEstimator = "k1", log_prob_key=keys.ACTION_LOG_PROB, pad_id: int | None = None,
                 k3_clamp: str | K3Clamp = "output") -> None:  # fmt: skip
        if controller is not None and beta is not None:
            raise ValueError(f"pass either beta ({beta}) or controller ({controller!r}), not both; "
                             "the controller owns beta")  # fmt: skip
        if controller is None:
            controller = ConstantKLController(0.1 if beta is None else beta)
        if not isinstance(controller, KLController):
            raise TypeError(f"controller must be a KLController, got {type(controller).__name__}")
        if ref_model is not None and not callable(ref_model):
            raise TypeError(f"ref_model must be a causal LM (callable), got {type(ref_model).__name__}")
        self.estimator = _estimator(estimator)
        self.k3_clamp = _k3_clamp(k3_clamp)
        self.ref_source = "td" if ref_model is None else "model"
        in_keys = [keys.REWARD, log_prob_key] + ([keys.REF_LOG_PROB] if ref_model is None else [])
        super().__init__(in_keys=in_keys, out_keys=[keys.REWARD, keys.REWARD_RAW, keys.REWARD_KL, keys.KL,
                                                    keys.REF_LOG_PROB])  # fmt: skip
        self.controller = controller
        self.__dict__["ref_model"] = ref_model  # not a submodule: its weights stay out of state_dict
        self.log_prob_key = log_prob_key
        self.pad_id = pad_id
        self._metrics = {"kl": float("nan"), "beta": controller.beta, "kl_per_token": float("nan")}

    @property
    def beta(self) -> float:
        """The current KL coefficient (the controller's)."""
        return self.controller.beta

    def metrics(self) -> dict[str, float]:
        """Mean summed KL per sequence, the beta used and the mean per-token KL of the last batch."""
        return dict(self._metrics)

    def _kl(self, td: TensorDictBase, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logp = squeeze_last(require(td, self.log_prob_key, type(self).__name__), mask.shape)
        ref = squeeze_last(ref, mask.shape)
        kl = kl_estimate(logp, ref, self.estimator, clamp_mode=self.k3_clamp)
        return torch.where(mask, kl, torch.zeros_like(kl))

    def _shape(self, td: TensorDictBase, reward_td: TensorDictBase, reward_key, kl: torch.Tensor) -> None:
        reward = require(reward_td, reward_key, type(self).__name__)
        penalty = (-self.beta * kl).reshape(reward.shape).to(reward.dtype)
        raw_key, kl_key = (keys.REWARD_RAW, keys.REWARD_KL) if reward_td is td else (
            _next(keys.REWARD_RAW), _next(keys.REWARD_KL))  # fmt: skip
        reward_td.set(raw_key, reward.clone())
        reward_td.set(kl_key, penalty)
        reward_td.set(reward_key, reward + penalty)

    def transform_batch(self, td: TensorDictBase, prompts: PromptTable | None = None) -> TensorDictBase:
        name = type(self).__name__
        mask = valid_mask(td)
        active = td.get(keys.ACTIVE, None)
        mask = mask & active.bool() if active is not None else mask
        already_shaped = td.get(keys.REWARD_KL, None) is not None
        if already_shaped:
            kl = squeeze_last(require(td, keys.KL, name), mask.shape)
            kl = torch.where(mask, kl, torch.zeros_like(kl))
        else:
            if self.ref_source == "model":
                td.set(keys.REF_LOG_PROB, step_log_probs(self.ref_model, td, prompts, pad_id=self.pad_id))
            kl = self._kl(td, require(td, keys.REF_LOG_PROB, name), mask)
            td.set(keys.KL, kl)
            self._shape(td, td, keys.REWARD, kl)
        self._update_controller(td, kl, mask)
        return td

    def forward(self, tensordict: TensorDictBase, prompts: PromptTable | None = None) -> TensorDictBase:
        """Shape the rewards of a collected batch [N, T] in place, update the controller, return it."""
        check_batch(tensordict, type(self).__name__, self.in_keys)
        return self.transform_batch(tensordict, prompts)

    @torch.no_grad()
    def _update_controller(self, td: TensorDictBase, kl: torch.Tensor, mask: torch.Tensor) -> None:
        seq, _, num = sequence_index(td, type(self).__name__)
        valid = seq >= 0
        per_seq = torch.zeros(num, dtype=torch.float32, device=kl.device).index_add_(0, seq[valid], kl[valid])
        # every rank's sequences inside train() under torchrun (across_ranks), so each rank's controller moves alike
        kl_sum, seqs, kl_total, tokens = (float(v) for v in sum_across_ranks(
            per_seq.sum(), torch.tensor(num), kl.sum(), mask.sum()))  # fmt: skip
        mean_kl = kl_sum / seqs if seqs else 0.0
        self._metrics = {"kl": mean_kl, "beta": self.beta, "kl_per_token": kl_total / max(tokens, 1)}
        if seqs:
            self.controller.update(mean_kl, int(seqs))

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        """Inside a TransformedEnv: shape each step's reward from ``keys.REF_LOG_PROB`` in the step data."""
        if self.ref_source == "model":  # scored per batch instead; a forward per token would cost O(L)
            return next_tensordict
        ref = require(tensordict, keys.REF_LOG_PROB, type(self).__name__)
        active = tensordict.get(keys.ACTIVE, None)
        mask = active.bool() if active is not None else torch.ones(ref.shape, dtype=torch.bool, device=ref.device)
        kl = self._kl(tensordict, ref, mask)
        tensordict.set(keys.KL, kl)
        self._shape(tensordict, next_tensordict, _next(keys.REWARD), kl)
        return next_tensordict

    def transform_output_spec(self, output_spec):
        """Inside a TransformedEnv: declare ``reward_raw`` / ``reward_kl`` (float (B, 1)) as step outputs."""
        from torchrl.data import Unbounded

        output_spec = output_spec.clone()
        reward_spec = output_spec["full_reward_spec"][keys.REWARD[1]]
        obs = output_spec["full_observation_spec"]
        for key in (keys.REWARD_RAW[1], keys.REWARD_KL[1]):
            obs[key] = Unbounded(shape=reward_spec.shape, dtype=reward_spec.dtype, device=reward_spec.device)
        return output_spec

    def get_extra_state(self) -> dict:
        """Controller state, saved with ``state_dict()``."""
        return {"controller": self.controller.state_dict()}

    def set_extra_state(self, state: dict) -> None:
        """Restore the controller from ``load_state_dict()``."""
        self.controller.load_state_dict(state["controller"])

    def __repr__(self) -> str:
        return (f"KLRewardTransform(estimator={self.estimator.value}, k3_clamp={self.k3_clamp.value}, "
                f"ref_source={self.ref_source!r}, controller={self.controller!r}, log_prob_key={self.log_prob_key!r})")  # fmt: skip
