"""One RL training loop: collect a batch, a few optimizer epochs of a TorchRL loss, publish the weights, log a row;
and the check of a batch against a loss (:func:`check_loss_inputs`) that it runs on its first batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from tensordict import TensorDictBase

from tokengym._loss_checks import check_loss_inputs

__all__ = ["TrainOptions", "check_loss_inputs", "train"]


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How :func:`train` optimizes on each collected batch."""

    epochs: int = 1
    """Optimizer steps on each batch (PPO-style reuse of the batch)."""
    max_grad_norm: float | None = 1.0
    """Clip the total gradient norm over the optimizer's parameters to this; None does not clip."""

    def __post_init__(self) -> None:
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}. Use epochs=1 for one step per batch.")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, int | float) or not norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0 or None, got {norm!r}. Use None to turn clipping off.")


def train(collector, loss: torch.nn.Module, optimizer: torch.optim.Optimizer, *, iterations: int,
          options: TrainOptions = TrainOptions(), prepare: Callable | None = None,
          on_iteration: Callable[[dict, TensorDictBase], None] | None = None,
          scheduler=None, weights: Callable[[], Mapping] | None = None,
          device: torch.device | str | None = None) -> list[dict]:  # fmt: skip
    """Train ``loss`` on ``iterations`` batches of ``collector``; returns one row of metrics per iteration.

    Each iteration: ``prepare`` the batch (on the host, where collectors yield it); move it to ``device``;
    ``options.epochs`` optimizer steps on the sum of the loss's
    ``loss_*`` terms (TorchRL's convention), the loss module in train mode, the gradient clipped; then
    ``collector.update_policy_weights_``. A row holds ``iter``, ``reward`` (the collector's ``mean_reward``),
    ``kl`` and ``beta`` (a KL transform's, else NaN), ``tokens_per_s``, ``loss`` (the summed terms) and every
    scalar the loss returned (``loss_objective``, ``clip_fraction``...), those of the last epoch.

    Args:
        collector: a ``TokenCollector``, ``RayTokenCollector`` or ``AsyncCollector`` (not shut down here).
        loss: a TorchRL loss module (``ClipPPOLoss``, ``GRPOLoss``...) whose actor holds the trained model.
        optimizer: a ``torch.optim.Optimizer`` over the trained parameters.
        iterations: collected batches to train on (fewer if the collector ends first).
        options: epochs per batch and gradient clipping (:class:`TrainOptions`).
        prepare: batch -> what the loss reads (advantages, a padded layout); default: the batch itself.
        on_iteration: called with each row (keys added to it are kept) and the prepared batch once the
            weights went out: evaluate, print, train a value head.
        scheduler: a learning-rate scheduler, stepped after every optimizer step (a warm-up).
        weights: returns the weights to send (``model.state_dict``), for a collector holding its own copy
            (Ray workers, ``AsyncCollector``, a policy built on another copy of the model); None: the collector's
            policy trains in place (its ``model`` must hold the optimizer's parameters).
        device: the trainer's device (the trained model's, e.g. ``"cuda"``): the prepared batch moves there before
            the loss; None leaves it on the host (a model on the CPU).

    Raises:
        ValueError, TypeError: a bad argument, before the first batch; without ``weights``, a policy whose model holds
            none of the optimizer's parameters (its weights would never change); on the first prepared batch, before
            the first loss call, what :func:`check_loss_inputs` refuses (a layout the loss's actor does not score, no
            advantage). KeyError: a loss without ``loss_*`` terms.

    Example:
        >>> from torchrl.objectives import ClipPPOLoss
        >>> from tokengym.collectors import TokenCollector
        >>> from tokengym.collectors.policies import SequenceActor, TransformersPolicy
        >>> from tokengym.llm_envs import TokenEnv
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage
        >>> tok = tiny_tokenizer(); model = tiny_model(tok)
        >>> reward = lambda responses, prompts, metadata: torch.arange(4.0)  # differs within each group
        >>> env = TokenEnv(["1+1=", "2+3="], tok, reward, batch_size=4, max_new_tokens=2, group_size=2,
        ...                model_config=model.config)
        >>> collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4)
        >>> loss = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)
        >>> rows = train(collector, loss, torch.optim.Adam(model.parameters(), lr=1e-3), iterations=2,
        ...              options=TrainOptions(epochs=2), prepare=GroupAdvantage("grpo"))
        >>> [row["iter"] for row in rows], rows[0]["loss"] == rows[0]["loss_objective"]
        ([0, 1], True)
    """
    _check(collector, loss, optimizer, iterations, options, scheduler,
           {"prepare": prepare, "on_iteration": on_iteration, "weights": weights})  # fmt: skip
    device = _check_device(device)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if weights is None:
        _check_trained_in_place(collector, params)
    rows: list[dict] = []
    for i, batch in enumerate(collector):
        if batch is None:
            raise TypeError("the collector yielded None (it writes to a sink); train() needs the batches: drop sink=")
        data = batch if prepare is None else prepare(batch)
        if device is not None:
            data = data.to(device)  # one copy of the prepared batch (its non-tensor prompt table travels as it is)
        if i == 0:  # the layout, actor and advantage the loss reads, named before TorchRL's own errors
            check_loss_inputs(data, loss)
        loss.train()
        for _ in range(options.epochs):
            out = loss(data)
            total = _total_loss(out)
            optimizer.zero_grad()
            total.backward()
            if options.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        loss.eval()
        collector.update_policy_weights_(None if weights is None else weights())  # None: trained in place
        m, nan = collector.metrics, float("nan")
        rows.append({"iter": i, "reward": m["mean_reward"], "kl": m.get("kl", nan), "beta": m.get("beta", nan),
                     "tokens_per_s": m["tokens_per_s"], "loss": float(total.detach())})  # fmt: skip
        rows[-1].update({k: float(v.detach()) for k, v in out.items() if isinstance(v, torch.Tensor) and v.numel() == 1})
        if on_iteration is not None:
            on_iteration(rows[-1], data)
        if i + 1 >= iterations:
            break
    return rows


def _generator(collector) -> torch.nn.Module | None:
    """The model the collector's policy generates with, where the policy shows it (``policy.model``), else None."""
    policy = getattr(collector, "policy", None)
    for _ in range(4):  # through wrappers that hold the policy (PolicyWithReference)
        model = getattr(policy, "model", None)
        if isinstance(model, torch.nn.Module):
            return model
        policy = getattr(policy, "policy", None)
    return None


def _check_trained_in_place(collector, params: list[torch.Tensor]) -> None:
    """Without ``weights=`` the policy must generate with the trained parameters: a policy built on another copy of
    the model would never change while its version advances (a PEFT model's parameters, base and adapter, count)."""
    model = _generator(collector)
    if model is None:
        return
    own = {id(p) for p in model.parameters()}
    if own and not any(id(p) in own for p in params):
        raise ValueError(
            f"train() without weights= expects the collector's policy to generate with the trained model, but its "
            f"{type(model).__name__} holds none of the optimizer's {len(params)} parameters (a second copy of the "
            "model, e.g. another from_pretrained): its weights would never change while policy.version advances. "
            "Build the policy on the trained model (TransformersPolicy(model, env)) or send the weights after each "
            "step: train(..., weights=model.state_dict)"
        )


def _total_loss(out) -> torch.Tensor:
    """The sum of the ``loss_*`` terms of a TorchRL loss output (a TensorDict or a tensorclass)."""
    names = [k for k in out.keys() if isinstance(k, str) and k.startswith("loss_")]
    if not names:
        raise KeyError(f"the loss returned no 'loss_*' term (keys: {sorted(map(str, out.keys()))}); train() "
                       "backpropagates the sum of the terms named loss_*, as TorchRL's losses name them")  # fmt: skip
    return sum((out.get(k) for k in names[1:]), out.get(names[0]))


def _check_device(device) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a torch.device, a string ('cuda', 'cuda:1', 'cpu') or None, got "
                        f"{type(device).__name__} {device!r}")  # fmt: skip
    try:
        return torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device={device!r} is not a device name ({error}); use 'cuda', 'cuda:0' or 'cpu'") from None


def _check(collector, loss, optimizer, iterations, options, scheduler, callbacks: dict) -> None:
    if not (callable(getattr(collector, "update_policy_weights_", None)) and hasattr(collector, "metrics")):
        raise TypeError(f"collector must have update_policy_weights_ and metrics (a TokenCollector, RayTokenCollector "
                        f"or AsyncCollector), got {type(collector).__name__}")  # fmt: skip
    if not isinstance(loss, torch.nn.Module):
        raise TypeError(f"loss must be a torch.nn.Module (a TorchRL loss: ClipPPOLoss, GRPOLoss...), got {type(loss).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                        "build one over the model: torch.optim.Adam(model.parameters(), lr=1e-5)")  # fmt: skip
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be a positive int, got {iterations!r}: the number of collected batches "
                         "to train on, e.g. iterations=100")  # fmt: skip
    if not isinstance(options, TrainOptions):
        raise TypeError(f"options must be a TrainOptions, got {type(options).__name__}: TrainOptions(epochs=2)")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"scheduler must have step() (a torch.optim.lr_scheduler), got {type(scheduler).__name__}")
    for name, value in callbacks.items():
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__} {value!r}")
