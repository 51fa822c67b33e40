"""check_loss_inputs: a batch, a TorchRL loss and the loss's actor checked against each other before the loss runs.

TorchRL's losses refuse a batch in their own terms ("Action key ('tokens', 'full') not in tensordict.",
"get_dist() got an unexpected keyword argument 'logits_key'"); these name the tokengym call that gives what is
missing. Two layouts reach a loss: a TRAJECTORIES step batch [N, T] (``keys.ACTION``, ``keys.PROMPTS``), which
``SequenceActor`` scores under ``ClipPPOLoss``, and the padded layout [N, L] of ``to_padded`` (``keys.TOKENS``,
``keys.ACTION_MASK``...), which ``PaddedSequenceActor`` and ``SharedPrefixActor`` score under ``GRPOLoss``,
``ClipPPOLoss`` or ``WeightedLoss``. The docs' errors reference has the symptom -> fix table.
"""

from __future__ import annotations

import sys

import torch
from tensordict import TensorDictBase

from tokengym.collectors.policies import PaddedSequenceActor, SequenceActor
from tokengym.llm_envs import keys
from tokengym.transforms import WeightedLoss
from tokengym.transforms._checks import found_keys

__all__ = ["check_loss_inputs"]

_TO_PADDED = "lay the batch out with tokengym.transforms.to_padded(batch) (in train(): prepare=lambda b: to_padded(GroupAdvantage('grpo')(b)))"
_ADVANTAGE_FIX = {  # the layout -> the call that writes keys.ADVANTAGE in it
    False: "GroupAdvantage('grpo')(batch) (groups of group_size samples), or GAEAdvantage() over a critic's "
           "values (PPO); in train(): prepare=GroupAdvantage('grpo')",
    True: "run it on the step batch before the layout: to_padded(GroupAdvantage('grpo')(batch)) (to_padded carries "
          "the advantage over); in train(): prepare=lambda b: to_padded(GroupAdvantage('grpo')(b))",
}  # fmt: skip
_PROVIDERS = {  # a key a loss may read -> the tokengym call that writes it
    keys.ACTION_LOG_PROB: "a tokengym collector writes it with every sampled token (a TokenCollector batch)",
    keys.LOG_PROBS: "to_padded writes it from the collected batch's action_log_prob",
    keys.TRAINER_LOG_PROB: "run MismatchCorrection(trainer=actor.log_prob) on the batch first (train(prepare=...))",
    keys.REF_LOG_PROBS: "collect with PolicyWithReference(policy, reference) or postproc=KLRewardTransform(ref_model="
                        "ref_model, beta=0.0), then to_padded(batch) lays keys.REF_LOG_PROB out under this key",
}  # fmt: skip


def check_loss_inputs(batch: TensorDictBase, loss: torch.nn.Module) -> None:
    """Check that ``loss`` (a TorchRL loss, or ``WeightedLoss`` around one) can read ``batch``: the layout its actor
    scores, an actor the loss can call, and the advantage and log-probs it reads, and that loss weights the batch
    carries (``keys.LOSS_WEIGHT``) are read; raise naming the tokengym call that provides what is missing.
    :func:`~tokengym.training.train` runs it on every prepared batch, before the loss. In a loop of your own, call it
    before the loss: ``check_loss_inputs(data, loss); out = loss(data)``.

    The layouts: ``SequenceActor`` scores a TRAJECTORIES step batch [N, T] (``ClipPPOLoss``);
    ``PaddedSequenceActor`` and ``SharedPrefixActor`` the padded layout of
    :func:`~tokengym.transforms.to_padded` (``GRPOLoss``, ``ClipPPOLoss``, ``WeightedLoss``). ``GRPOLoss`` calls
    ``get_dist(..., logits_key=)`` and needs one of the padded actors. A loss without TorchRL's ``tensor_keys`` (your
    own) is not checked; a loss with a critic may compute its advantage itself.

    Args:
        batch: what the loss is called on (the prepared batch).
        loss: the loss module.

    Raises:
        TypeError: ``batch`` is not a TensorDict; an actor the loss cannot call (``GRPOLoss(SequenceActor(model))``).
        ValueError: a layout the actor does not score (a step batch for ``PaddedSequenceActor``, a padded one for
            ``SequenceActor``), no advantage, no log-probs the loss reads; ``keys.LOSS_WEIGHT`` in the batch (even all
            ones) for a loss not wrapped in :class:`~tokengym.transforms.WeightedLoss`, which alone reads them.

    Example:
        >>> from torchrl.objectives.llm import GRPOLoss
        >>> from tokengym.collectors.policies import PaddedSequenceActor
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage, to_padded
        >>> loss = GRPOLoss(PaddedSequenceActor(tiny_model(tiny_tokenizer())), entropy_bonus=False)
        >>> batch = GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1], group_size=2))
        >>> check_loss_inputs(to_padded(batch), loss)  # what GRPOLoss reads: no error
        >>> check_loss_inputs(batch, loss)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: GRPOLoss(PaddedSequenceActor) reads the padded layout [N, L] (('tokens', 'full'), 'action_mask'), but got a step batch of shape [4, 4] ...
    """
    if not isinstance(batch, TensorDictBase):
        raise TypeError(f"check_loss_inputs reads a TensorDict batch, got {type(batch).__name__}")
    inner = loss.loss if isinstance(loss, WeightedLoss) else loss
    tensor_keys = getattr(inner, "tensor_keys", None)
    if tensor_keys is None:  # not a TorchRL loss: what it reads is unknown
        return
    actor = getattr(inner, "actor_network", None)
    owner = f"{type(inner).__name__}({type(actor).__name__})" if actor is not None else type(inner).__name__
    _check_actor(batch, inner, actor, owner)
    _check_action(batch, getattr(tensor_keys, "action", None), owner)
    _check_advantage(batch, inner, tensor_keys.advantage, owner)
    _check_read(batch, getattr(tensor_keys, "sample_log_prob", None), owner, "the sampler's log-probs")
    if (getattr(inner, "kl_to_ref_coeff", None) or 0) > 0:
        _check_read(batch, getattr(tensor_keys, "ref_log_probs", None), f"{owner} with kl_to_ref_coeff",
                    "the reference log-probs")  # fmt: skip
    if inner is loss:  # not a WeightedLoss: nothing reads keys.LOSS_WEIGHT
        _check_weights_read(batch, inner, owner)


def _has(batch: TensorDictBase, key) -> bool:
    return batch.get(key, None) is not None


def _is_padded(batch: TensorDictBase) -> bool:
    return _has(batch, keys.TOKENS) and _has(batch, keys.ACTION_MASK)


def _is_grpo(loss: torch.nn.Module) -> bool:
    """A ``torchrl.objectives.llm.GRPOLoss`` (or DAPO, CISPO): looked up where loaded, as importing it costs seconds
    and a loss of that class cannot exist before it is imported."""
    llm = sys.modules.get("torchrl.objectives.llm")
    return llm is not None and isinstance(loss, llm.GRPOLoss)


def _check_actor(batch: TensorDictBase, loss: torch.nn.Module, actor, owner: str) -> None:
    shape = list(batch.batch_size)
    if isinstance(actor, SequenceActor) and _is_grpo(loss):
        raise TypeError(
            f"{owner}: {type(loss).__name__} scores the padded layout through its actor's get_dist(..., logits_key=), "
            "which SequenceActor (the step batch's actor) does not take: TorchRL's 'get_dist() got an unexpected "
            f"keyword argument' error. Build {type(loss).__name__}(PaddedSequenceActor(model)) (or "
            "SharedPrefixActor(model)) and call it on to_padded(batch), or keep SequenceActor under "
            "ClipPPOLoss(SequenceActor(model), critic_network=None) on the step batch"
        )
    if isinstance(actor, PaddedSequenceActor) and not _is_padded(batch):
        raise ValueError(
            f"{owner} reads the padded layout [N, L] ({keys.TOKENS!r}, {keys.ACTION_MASK!r}), but got a step batch "
            f"of shape {shape} without them (keys {found_keys(batch)}): {_TO_PADDED}"
        )
    if isinstance(actor, SequenceActor) and _is_padded(batch):
        raise ValueError(
            f"{owner} scores a TRAJECTORIES step batch [N, T], but got the padded layout of to_padded (shape {shape}, "
            f"{keys.TOKENS!r}): call the loss on the batch before to_padded, or score the padded layout with "
            f"{type(loss).__name__}(PaddedSequenceActor(model))"
        )


def _check_weights_read(batch: TensorDictBase, loss: torch.nn.Module, owner: str) -> None:
    """A TorchRL loss reads no ``keys.LOSS_WEIGHT``: a batch that carries weights (all ones included) needs
    ``WeightedLoss`` around the loss, or it trains on every token with weight 1."""
    if not _has(batch, keys.LOSS_WEIGHT):
        return
    reduce = "aggregation='none'" if _is_grpo(loss) else "reduction='none'"
    raise ValueError(
        f"the batch carries per-token loss weights {keys.LOSS_WEIGHT!r}, which {owner} does not read: it would train "
        "on every token with weight 1 (the stale tokens of AsyncCollector(stale_tokens='mask'), each shared token of "
        "TreeAdvantage(weight_shared=True) once per leaf that holds it, the tokens MismatchCorrection or a weight "
        f"filter left out). Wrap the loss: WeightedLoss(loss) (tokengym.transforms.WeightedLoss, the loss built with "
        f"{reduce}); to train without the weights on purpose, drop them: batch.exclude({keys.LOSS_WEIGHT!r})"
    )


def _check_action(batch: TensorDictBase, key, owner: str) -> None:
    if not isinstance(key, str | tuple) or _has(batch, key):
        return
    fix = _TO_PADDED if key == keys.TOKENS else "a tokengym collector writes keys.ACTION with every step"
    raise ValueError(f"{owner} reads the actions under {key!r}, which the batch of shape {list(batch.batch_size)} "
                     f"does not hold (keys {found_keys(batch)}): {fix}")  # fmt: skip


def _check_advantage(batch: TensorDictBase, loss: torch.nn.Module, key, owner: str) -> None:
    # a loss with a critic computes the advantage itself (its value estimator)
    if _has(batch, key) or getattr(loss, "critic_network", None) is not None:
        return
    raise ValueError(
        f"{owner} reads the advantage {key!r}, but the batch holds none (keys {found_keys(batch)}) and the loss has "
        f"no critic to compute it: write it with an advantage transform: {_ADVANTAGE_FIX[_is_padded(batch)]}"
    )


def _check_read(batch: TensorDictBase, key, owner: str, what: str) -> None:
    if not isinstance(key, str | tuple) or _has(batch, key):
        return
    fix = _PROVIDERS.get(key, f"write them under {key!r}, or point the loss at your key with loss.set_keys()")
    raise ValueError(f"{owner} reads {what} under {key!r}, which the batch does not hold (keys {found_keys(batch)}): "
                     f"{fix}")  # fmt: skip
