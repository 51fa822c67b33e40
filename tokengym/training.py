"""One RL training loop: collect a batch, a few optimizer epochs of a TorchRL loss, publish the weights, log a row;
and the check of a batch against a loss (:func:`check_loss_inputs`) that it runs on its first batch."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping

import torch
from tensordict import TensorDictBase

from tokengym import _ranks
from tokengym._loss_checks import check_loss_inputs
from tokengym._micro_batches import micro_batches, mini_batch_rows, trainer_mode
from tokengym.collectors import AsyncCollector
from tokengym.collectors.policies.protocol import weights_of
from tokengym.transforms.batch_statistics import across_ranks, all_reduce_floats, is_across_group

__all__ = ["TrainOptions", "check_loss_inputs", "train", "train_step"]


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How :func:`train` optimizes on each collected batch."""

    epochs: int = 1
    """Passes over each batch (PPO-style reuse of the batch)."""
    max_grad_norm: float | None = 1.0
    """Clip the total gradient norm over the optimizer's parameters to this; None does not clip."""
    mini_batches: int = 1
    """Optimizer steps per epoch, each on a shuffled 1/mini_batches of the rows (PPO mini-batches); 1: one step on the
    whole batch."""
    micro_batch_rows: int | None = None
    """Rows per forward/backward: the gradient of each optimizer step is accumulated over micro-batches of at most
    this many rows, scaled so that it equals the whole (mini-)batch's. None: one forward over the whole batch."""
    micro_batch_tokens: int | None = None
    """A token budget per forward/backward instead: rows sorted by length and packed into micro-batches of at most
    this many padded tokens (rows x the longest); a row longer than the budget goes alone. What bounds memory at long
    sequences (verl's ``ppo_max_token_len_per_gpu``)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (``model.gradient_checkpointing_enable()`` on the
    loss's actor model, for the optimizer steps only; off again after them): activations of one layer at a time
    instead of all, for about a third more compute."""

    def __post_init__(self) -> None:
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be a positive int, got {self.epochs!r}. Use epochs=1 for one step per batch.")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, int | float) or not norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0 or None, got {norm!r}. Use None to turn clipping off.")
        for name, fix in (("mini_batches", "1 for one optimizer step per epoch"), ("micro_batch_rows", "None"),
                          ("micro_batch_tokens", "None, or e.g. 16384")):  # fmt: skip
            value = getattr(self, name)
            if (value is not None or name == "mini_batches") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):  # fmt: skip
                raise ValueError(f"{name} must be a positive int, got {value!r}. Use {name}={fix}.")
        if self.micro_batch_rows is not None and self.micro_batch_tokens is not None:
            raise ValueError(f"give micro_batch_rows ({self.micro_batch_rows}) or micro_batch_tokens "
                             f"({self.micro_batch_tokens}), not both: rows fix the count per micro-batch, a token "
                             "budget their size")  # fmt: skip
        if not isinstance(self.gradient_checkpointing, bool):
            raise TypeError(f"gradient_checkpointing must be a bool, got {self.gradient_checkpointing!r}")


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

    Under ``torchrun`` (a ``torch.distributed`` process group initialized) every rank calls it with its own collector
    (its share of the prompts, :func:`tokengym.distributed.shard_prompts`) and the ranks take the one-process step
    on the union of their batches: the gradients are summed over the ranks (an FSDP2 model's in its backward, a whole
    model's in one all-reduce per step), batch statistics (whitening, a KL controller's measure) are every rank's,
    and every rank gets the same global rows. See the guide "Training across GPUs".

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
        weights: returns the trained model's weights to send (``model.state_dict``), for a collector holding its own
            copy (Ray workers, ``AsyncCollector``, a policy built on another copy of the model); not the policy's
            own (``sampler.state_dict``). None: the collector's policy trains in place (its ``model`` must hold the
            optimizer's parameters; not behind an ``AsyncCollector``).
        device: the trainer's device (the trained model's, e.g. ``"cuda"``): the prepared batch moves there before
            the loss; None leaves it on the host (a model on the CPU). One this machine has (not ``"meta"``).

    Raises:
        ValueError, TypeError: a bad argument, before the first batch: a ``device`` this machine does not have
            (``"cuda"`` without CUDA, ``"meta"``); without ``weights``, a collector that needs them (Ray workers,
            ``AsyncCollector``) or a policy whose model holds none of the optimizer's parameters (its weights would
            never change); an ``AsyncCollector`` whose policy generates with the trained model (it needs its own
            copy). Before the first update: ``weights()`` giving the policy's own weights (``sampler.state_dict``).
            On every prepared batch, before the loss, what :func:`check_loss_inputs` refuses (a layout the loss's
            actor does not score, no advantage, loss weights the loss does not read). KeyError: a loss without
            ``loss_*`` terms. Under ``torchrun``, on every rank: ranks set up differently, a policy generating with
            an FSDP2-sharded model; RuntimeError when another rank failed.

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
    needs = getattr(collector, "needs_weights_because", "")
    if weights is None and isinstance(needs, str) and needs:
        raise ValueError(f"train() got no weights= but {type(collector).__name__} needs them ({needs}): pass the "
                         "trained model's weights, train(..., weights=model.state_dict)")  # fmt: skip
    _check_async_copy(collector, params)
    if weights is None:
        _check_trained_in_place(collector, params)
    across = is_across_group()
    if across:  # the first collective: the same error on every rank where their setups differ
        _ranks.check_same_setup(_setup(collector, loss, optimizer, iterations, options, prepare, weights))
        _check_not_sampling_sharded(collector, loss)
        _ranks.warn_if_same_prompts(_prompt_fingerprint(collector))
    rows: list[dict] = []
    modes = {module: module.training for module in loss.modules()}  # left as found (train/eval)
    batches = iter(collector)
    try:
        for i in itertools.count():
            data = _next_prepared(batches, prepare, device, loss, across)
            if data is None:
                break
            scalars = train_step(data, loss, optimizer, options=options, scheduler=scheduler)
            loss.eval()  # the policy may generate with the trained model: no dropout while collecting
            sent = None if weights is None else weights()  # None: trained in place
            if i == 0 and sent is not None:
                _check_weights_sent(sent, collector, params)
            collector.update_policy_weights_(sent)
            m, nan = collector.metrics, float("nan")
            row = {"iter": i, "reward": m["mean_reward"], "kl": m.get("kl", nan), "beta": m.get("beta", nan),
                   "tokens_per_s": m["tokens_per_s"], **scalars}  # fmt: skip
            if across:  # the global row on every rank (each rank's batch has as many rows): rank 0 logs it
                row = _ranks.global_row(row, mean=("reward", "kl", "beta"), total=("tokens_per_s",))
            rows.append(row)
            if on_iteration is not None:
                on_iteration(rows[-1], data)
            if i + 1 >= iterations:
                break
    finally:
        for module, was_training in modes.items():
            module.train(was_training)
    return rows


_ENDED = object()


def _next_prepared(batches, prepare, device, loss, across: bool) -> TensorDictBase | None:
    """The next batch, prepared, on ``device`` and checked against the loss; None once the collector ended. Across
    ranks every rank learns whether each rank got one: all stop when one ended, all raise when one failed."""
    batch, data = _ENDED, None
    try:
        # batch statistics (whitening, a KL controller's measure) over every rank's rows: in the collector's postproc
        # (run as it yields) and in prepare
        with across_ranks():
            batch = next(batches, _ENDED)
        if batch is None:
            raise TypeError("the collector yielded None (it writes to a sink); train() needs the batches: drop sink=")
        if batch is not _ENDED:
            with across_ranks():
                data = batch if prepare is None else prepare(batch)
            if device is not None:
                data = data.to(device)  # one copy of the prepared batch (its non-tensor prompt table travels as it is)
            # the layout, actor, advantage and loss weights the loss reads, named before TorchRL's own errors; on every
            # batch (a few key lookups), as loss weights may first appear later (AsyncCollector(stale_tokens="mask"))
            check_loss_inputs(data, loss)
    except Exception:
        if across:
            all_reduce_floats([2.0], op="max")  # 2: failed; the other ranks raise too instead of waiting for this one
        raise
    if across:
        (worst,) = all_reduce_floats([1.0 if batch is _ENDED else 0.0], op="max")  # 1: ended
        if worst == 2:
            raise RuntimeError("train(): another rank failed while collecting or preparing its batch (its error and "
                               "traceback are in that rank's output); this rank stops too")  # fmt: skip
        if worst == 1:
            return None
    return data


def train_step(data: TensorDictBase, loss: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
               options: TrainOptions = TrainOptions(), scheduler=None) -> dict[str, float]:  # fmt: skip
    """The optimizer steps :func:`train` takes on one prepared batch: ``options.epochs`` passes, each of
    ``options.mini_batches`` steps on shuffled rows, each step's gradient accumulated over micro-batches
    (``options.micro_batch_rows`` / ``micro_batch_tokens``) and equal to the whole (mini-)batch's; the loss in train mode
    (and its actor's model with gradient checkpointing if asked) during the steps, both as found after them.

    Exact gradients: each micro-batch's terms are scaled by its share of what the loss divides by on the whole
    batch (its tokens for a token mean, rows for a per-sequence mean, rows x columns for ``GRPOLoss``'s KL terms, 1 for a
    sum), so a token mean over micro-batches is the whole batch's token mean. A loss that uses batch statistics
    (``normalize_advantage=True``, ``kl_mask_threshold``) is refused with micro-batches.

    Under ``torchrun`` every rank calls it together on its part of the batch (collectives: the union batch's
    normalizer, the gradients, the scalars) and every rank steps as one process would on the union batch.

    Args:
        data: the prepared batch (what the loss reads), on the trainer's device.
        loss: a TorchRL loss or ``WeightedLoss`` returning ``loss_*`` terms.
        optimizer: over the trained parameters.
        options: epochs, mini- and micro-batches, clipping, checkpointing (:class:`TrainOptions`).
        scheduler: stepped after every optimizer step.

    Returns:
        ``loss`` (the summed ``loss_*`` terms) and every scalar the loss returned, over the whole batch (each
        micro-batch's weighted by its share), averaged over the last epoch's mini-batches.

    Example:
        >>> from torchrl.objectives.llm import GRPOLoss
        >>> from tokengym.collectors.policies import PaddedSequenceActor
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage, to_padded
        >>> model = tiny_model(tiny_tokenizer())
        >>> data = to_padded(GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1], group_size=2)))
        >>> loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
        >>> row = train_step(data, loss, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                  options=TrainOptions(micro_batch_rows=1))
        >>> sorted(row)[:3], model.training
        (['ESS', 'clip_fraction', 'kl_approx'], False)
    """
    if not isinstance(options, TrainOptions):
        raise TypeError(f"options must be a TrainOptions, got {type(options).__name__}: TrainOptions(epochs=2)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    split = {"max_rows": options.micro_batch_rows, "max_tokens": options.micro_batch_tokens}
    n = data.batch_size[0] if data.batch_dims else 1
    if options.mini_batches > n:
        raise ValueError(f"mini_batches={options.mini_batches} is more than the batch's {n} rows: use at most {n}")
    shuffle = torch.Generator().manual_seed(int(torch.randint(2**62, ())))  # from torch's seed: reproducible runs
    across = is_across_group()  # under torchrun: this rank's rows are its part of the union batch
    shards = _ranks.sharded(loss) if across else []
    with trainer_mode(loss, gradient_checkpointing=options.gradient_checkpointing):
        for _ in range(options.epochs):
            rows = [None] if options.mini_batches == 1 else mini_batch_rows(n, options.mini_batches, shuffle)
            epoch: list[dict[str, float]] = []
            for part in rows:
                optimizer.zero_grad()
                found = _accumulate(data, loss, part, split, across=across, padded=bool(shards))
                if across:  # the union batch's gradient (an unsharded model's; FSDP2 summed its own) and scalars
                    _ranks.reduce_gradients(params)
                    found = dict(zip(sorted(found), all_reduce_floats([found[k] for k in sorted(found)]), strict=True))
                epoch.append(found)
                if options.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(params, options.max_grad_norm)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
    return {key: sum(row[key] for row in epoch) / len(epoch) for key in epoch[0]}


def _accumulate(data: TensorDictBase, loss: torch.nn.Module, rows, split: dict, *, across: bool = False,
                padded: bool = False) -> dict[str, float]:  # fmt: skip
    """Backward over the micro-batches of ``data[rows]``; the whole (mini-)batch's loss and scalars (across ranks:
    this rank's part of the union batch's, and as many micro-batches as the rank with most where ``padded``)."""
    found: dict[str, float] = {}
    parts = micro_batches(data, loss, rows, **split, across_ranks=across)
    gain = 1.0  # FSDP2's reduce-scatter averages the ranks' gradients: their sum is the union batch's
    if padded:
        parts = _ranks.pad_micro_batches(parts, lambda part: part._replace(share=0.0, element_share=0.0))
        gain = float(torch.distributed.get_world_size())
    for part in parts:
        out = loss(part.data)
        names = _loss_terms(out)
        total = sum(out.get(name) * part.scale(loss, name) for name in names)
        (total if gain == 1.0 else total * gain).backward()
        found["loss"] = found.get("loss", 0.0) + float(total.detach())
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and value.ndim == 0:  # (ClipPPOLoss's ESS is per step: left out)
                scale = part.scale(loss, key) if key in names else part.share
                found[key] = found.get(key, 0.0) + float(value.detach()) * scale
    return found


def _setup(collector, loss, optimizer, iterations, options, prepare, weights) -> dict[str, object]:
    """What every rank must share for its step to be its part of one step (compared across the ranks)."""
    env = getattr(collector, "env", None)
    env = getattr(env, "base_env", env)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "collector": type(collector).__name__, "batch_size": getattr(collector, "batch_size", None),
        "mode": str(getattr(collector, "mode", None)), "env": type(env).__name__,
        "env group_size": getattr(env, "group_size", None), "env max_new_tokens": getattr(env, "max_new_tokens", None),
        "env slots": tuple(getattr(env, "batch_size", ())), "loss": type(loss).__name__,
        "optimizer": type(optimizer).__name__, "trained parameters": len(params),
        "trained shapes": hash(tuple(tuple(p.shape) for p in params)), "iterations": iterations,
        "options": dataclasses.astuple(options), "prepare": type(prepare).__name__, "weights": weights is None,
    }  # fmt: skip


def _prompt_fingerprint(collector) -> dict | None:
    """The fingerprint of the prompts the collector's env draws from (None where the env shows none)."""
    env = getattr(collector, "env", None)
    source = getattr(getattr(env, "base_env", env), "source", None)
    fingerprint = getattr(source, "fingerprint", None)
    return fingerprint() if callable(fingerprint) else None


def _check_not_sampling_sharded(collector, loss) -> None:
    """A policy generating with an FSDP2-sharded model gathers its parameters in every decode step, a collective that
    the ranks (stepping their own slots) would enter different numbers of times."""
    model = _generator(collector)
    if model is not None and _ranks.sharded(model):
        raise ValueError(f"the collector's policy generates with an FSDP2-sharded {type(model).__name__} "
                         "(fully_shard): every forward gathers its parameters across the ranks, which step their "
                         "slots independently. Build the policy on an unsharded copy of the model, shard the trained "
                         "one (tokengym.distributed.shard_model) and send its full weights after each step: "
                         "train(..., weights=lambda: tokengym.distributed.full_state_dict(model))")  # fmt: skip


def _generator(collector) -> torch.nn.Module | None:
    """The model the collector's policy generates with, where the policy shows it (``policy.model``; behind an
    ``AsyncCollector``, its ``collector``'s), else None."""
    if isinstance(collector, AsyncCollector):
        collector = collector.collector
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


def _storages(tensors) -> set[tuple[torch.device, int]]:
    """Where the tensors' data lives (device, storage address): a state_dict's tensors share their parameters'."""
    return {(t.device, t.untyped_storage().data_ptr()) for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel()}  # fmt: skip


def _check_async_copy(collector, params: list[torch.Tensor]) -> None:
    """An ``AsyncCollector`` generates in a background thread while the trainer steps: a policy built on the trained
    model samples from weights the optimizer is writing, under a version that names none of them."""
    if not isinstance(collector, AsyncCollector):
        return
    model = _generator(collector)
    if model is None or not _storages(model.parameters()) & _storages(params):
        return
    raise ValueError(
        f"the AsyncCollector's policy generates with the trained {type(model).__name__} (it holds the optimizer's "
        "parameters): it samples in a background thread while the optimizer writes into those weights, so its "
        "log-probs match no published version. Give the policy its own copy, "
        "TransformersPolicy(copy.deepcopy(model), env), and publish the trained weights with "
        "train(..., weights=model.state_dict)"
    )


def _check_weights_sent(sent, collector, params: list[torch.Tensor]) -> None:
    """``weights()`` must give the trained model's weights: the generator's own (``sampler.state_dict``) would load
    the policy into itself, advancing its version while nothing changes."""
    model = _generator(collector)
    if model is None:
        return
    tensors = list(weights_of(sent).values())
    sent_at = _storages(tensors)
    if sent_at & _storages(model.parameters()) and not sent_at & _storages(params):
        raise ValueError(
            f"weights() returned the collector's policy's own weights (its {type(model).__name__}'s tensors, none of "
            f"the optimizer's {len(params)} parameters), e.g. weights=sampler.state_dict: publishing them loads the "
            "policy into itself, so policy.version would advance while its weights never change. Pass the trained "
            "model's: train(..., weights=model.state_dict), where model holds the optimizer's parameters"
        )


def _loss_terms(out) -> list[str]:
    """The names of the ``loss_*`` terms of a TorchRL loss output (a TensorDict or a tensorclass)."""
    names = [k for k in out.keys() if isinstance(k, str) and k.startswith("loss_")]
    if not names:
        raise KeyError(f"the loss returned no 'loss_*' term (keys: {sorted(map(str, out.keys()))}); train() "
                       "backpropagates the sum of the terms named loss_*, as TorchRL's losses name them")  # fmt: skip
    return names


def _check_device(device) -> torch.device | None:
    """The trainer's device, checked before the first batch: one this machine has (torch's own errors, an
    ``AssertionError`` "Torch not compiled with CUDA enabled", come at the first batch and name no fix)."""
    if device is None:
        return None
    if not isinstance(device, torch.device | str):
        raise TypeError(f"device must be a torch.device, a string ('cuda', 'cuda:1', 'cpu') or None, got "
                        f"{type(device).__name__} {device!r}")  # fmt: skip
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device={device!r} is not a device name ({error}); use 'cuda', 'cuda:0' or 'cpu'") from None
    if device.type == "meta":
        raise ValueError("device='meta' holds no data (shapes only): a batch moved there cannot be trained on. Pass the "
                         "trained model's device, e.g. device='cuda', or None for a model on the CPU")  # fmt: skip
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but this machine has no usable CUDA device "
                             f"(torch.cuda.is_available() is False; torch {torch.__version__}, built for CUDA "
                             f"{torch.version.cuda}): train on the host with device=None (or 'cpu'), or run where "
                             "a GPU and a CUDA build of torch are installed")  # fmt: skip
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r} but this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1}): pick one of them, e.g. "
                             "device='cuda:0', or the device the trained model is on")  # fmt: skip
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device='mps' but torch.backends.mps.is_available() is False: use device=None (or 'cpu')")
    return device


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
