"""Training across ranks under ``torchrun``: each rank collects its own prompts and trains on its rows, the ranks'
gradients summed so that N ranks of B/N rows take the one-process step on B rows.

What a rank holds: its env, its policy (an unsharded copy of the model that generates) and its collector, like one
process; the trained model either whole on every rank (:func:`~tokengym.train` sums the gradients: data parallel) or
sharded with :func:`shard_model` (FSDP2: each rank holds 1/N of the parameters, gradients and optimizer state, and
:func:`full_state_dict` gathers the full weights for the policy after each step). The guide "Training across GPUs"
shows the whole program.

Example (one process here; under ``torchrun --nproc-per-node 2`` each rank gets half):
    >>> shard_prompts([f"{i}+1=" for i in range(6)])
    ['0+1=', '1+1=', '2+1=', '3+1=', '4+1=', '5+1=']
    >>> rank_batch_size(16, group_size=4)
    16
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from tokengym.transforms.batch_statistics import all_reduce_floats

__all__ = ["full_state_dict", "load_checkpoint", "rank_batch_size", "save_checkpoint", "shard_model", "shard_prompts"]


def _world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _fingerprint(prompts: Sequence) -> float:
    """Every prompt hashed (streamed), as a float that survives a float64 all-reduce exactly (48 bits)."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(repr(prompt).encode())
        digest.update(b"\0")
    return float(int.from_bytes(digest.digest()[:6], "big"))


def shard_prompts(prompts: Sequence) -> list:
    """This rank's prompts: every world-size-th one from its rank on (all of them without a process group). Each
    prompt's group (its ``group_size`` answers) is then collected on one rank, so group statistics need no other rank.

    Raises:
        ValueError: fewer prompts than ranks; ranks that were given different prompt lists (checked by a hash of every
            prompt, the same error on every rank).
    """
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a sequence (a list of prompts), got {type(prompts).__name__}")
    rank, world = _world()
    if world == 1:
        return list(prompts)
    if len(prompts) < world:
        raise ValueError(f"shard_prompts got {len(prompts)} prompts for {world} ranks: every rank needs at least one; "
                         "give at least as many prompts as ranks")  # fmt: skip
    mine = _fingerprint(prompts)
    (low,) = all_reduce_floats([-mine], op="max")
    (high,) = all_reduce_floats([mine], op="max")
    if -low != high:
        raise ValueError(f"shard_prompts: the {world} ranks were given different prompt lists (rank {rank}: "
                         f"{len(prompts)} prompts); give every rank the same list, in the same order (load it the same "
                         "way, with the same seed if it is shuffled), and each takes its own share")  # fmt: skip
    return list(prompts[rank::world])


def rank_batch_size(total: int, *, group_size: int = 1) -> int:
    """The rows each rank collects for a step of ``total`` rows over the union batch (``total / world size``).

    Raises:
        ValueError: a ``total`` that does not split into whole groups per rank (``total / group_size`` groups not a
            multiple of the world size), naming the nearest totals that do.
    """
    for name, value in (("total", total), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _, world = _world()
    if total % group_size:
        raise ValueError(f"total={total} rows is not a whole number of groups of group_size={group_size}")
    groups = total // group_size
    if groups % world:
        lower, upper = groups // world * world, -(-groups // world) * world
        raise ValueError(f"a batch of {total} rows ({groups} groups of {group_size}) does not split into whole groups "
                         f"over {world} ranks (a group is never split across ranks): use total="
                         f"{upper * group_size}" + (f" or {lower * group_size}" if lower else ""))  # fmt: skip
    return total // world


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (``model.model.layers`` and the like), the FSDP2 unit."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return list(module)
    return []


def shard_model(model: torch.nn.Module, *, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True):  # fmt: skip
    """Shard ``model`` over the ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder layer one unit,
    the rest (embeddings, final norm, output layer) the root's. In place; returns the model.

    Each rank then holds 1/N of the parameters, their gradients and (for an optimizer built after this call) the
    optimizer state; a forward gathers one layer at a time. Build the optimizer on the sharded model and train it
    with :func:`~tokengym.train`, which sums the ranks' gradients in the sharded backward.

    Args:
        model: a transformers causal LM (any module with a list of repeated layers), on this rank's device.
        param_dtype: the dtype the gathered parameters compute in (mixed precision, e.g. ``torch.bfloat16``); None:
            the parameters' own.
        reduce_dtype: the dtype gradients are summed in (float32 by default).
        reshard_after_forward: free each layer's gathered parameters after its forward (gathered again in backward):
            less memory for one more gather per layer.

    Raises:
        ValueError: no process group initialized (``torch.distributed.init_process_group`` first), or a model without
            repeated layers.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError("shard_model needs a process group: run under torchrun and call "
                         "torch.distributed.init_process_group() (backend 'nccl' on GPUs, 'gloo' on the CPU) first")  # fmt: skip
    layers = _decoder_layers(model)
    if not layers:
        raise ValueError(f"shard_model found no list of repeated layers in {type(model).__name__} to shard one by one; "
                         "shard it yourself with torch.distributed.fsdp.fully_shard")  # fmt: skip
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in layers:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def full_state_dict(model: torch.nn.Module, *, adapters_only: bool = False) -> Mapping[str, torch.Tensor]:
    """The full weights of a sharded (or whole) model, on every rank: each parameter gathered on its own, so the extra
    memory is the full weights once (what the policy loads) plus one parameter being gathered. Pass it to
    :func:`~tokengym.train` as ``weights=lambda: full_state_dict(model)``; every rank must call it (a collective).

    ``adapters_only``: a PEFT LoRA model's adapter weights alone (its ``lora_`` entries: what a LoRA policy loads;
    the frozen base is not gathered)."""
    out = {}
    for name, value in model.state_dict().items():
        if adapters_only and "lora_" not in name:
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = full.detach()
    if adapters_only and not out:
        raise ValueError(f"full_state_dict(adapters_only=True) found no LoRA entries ('lora_' in a name) in "
                         f"{type(model).__name__}: pass a peft LoRA model, or adapters_only=False for every weight")  # fmt: skip
    return out


def _ranks_file(path) -> str:
    import os

    return os.path.join(os.fspath(path), "tokengym_ranks.json")


def save_checkpoint(path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, collector,
                    extra: Mapping | None = None) -> None:  # fmt: skip
    """Save a run under ``torchrun`` into the directory ``path``: the model and the optimizer with
    ``torch.distributed.checkpoint`` (each rank writes its shards; a model whole on every rank is written once), and
    each rank's collector state, torch random state and ``extra`` (a KL controller's state...) in a file of its own.
    Every rank calls it. :func:`load_checkpoint` resumes it exactly on as many ranks."""
    import json
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = _world()
    os.makedirs(os.fspath(path), exist_ok=True)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.fspath(path))
    own = {"collector_state": collector.state_dict(), "rng": torch.get_rng_state(), "extra": dict(extra or {})}
    torch.save(own, os.path.join(os.fspath(path), f"rank{rank}.pt"))
    if rank == 0:
        with open(_ranks_file(path), "w") as f:
            json.dump({"world_size": world}, f)
    if world > 1:
        torch.distributed.barrier()  # every rank's files are written when any rank returns


def load_checkpoint(path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, collector,
                    sampler: torch.nn.Module | None = None) -> dict:  # fmt: skip
    """Load what :func:`save_checkpoint` wrote into the same objects, built as before (the model sharded again with
    :func:`shard_model` where it was); returns this rank's ``extra``. Every rank calls it.

    ``sampler``: the model the collector's policy generates with where it is not ``model`` (its own whole copy beside
    a sharded ``model``): given the loaded full weights, its version left as saved.

    Raises:
        FileNotFoundError: no checkpoint of :func:`save_checkpoint` at ``path``.
        ValueError: a checkpoint written by another number of ranks (each rank's collector state is its prompts' and
            slots'): resume on as many ranks, naming both.
    """
    import json
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = _world()
    if not os.path.exists(_ranks_file(path)):
        raise FileNotFoundError(f"no tokengym run checkpoint at {os.fspath(path)!r} (its tokengym_ranks.json is "
                                "missing): save one with tokengym.distributed.save_checkpoint")  # fmt: skip
    with open(_ranks_file(path)) as f:
        saved = json.load(f)["world_size"]
    if saved != world:
        raise ValueError(f"the checkpoint at {os.fspath(path)!r} was saved by {saved} rank(s) and this run has {world}: "
                         f"each rank's collector state belongs to its share of the prompts, so a run resumes only on "
                         f"as many ranks; launch with torchrun --nproc-per-node {saved}")  # fmt: skip
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=os.fspath(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    own = torch.load(os.path.join(os.fspath(path), f"rank{rank}.pt"), weights_only=True)
    if sampler is not None:
        sampler.load_state_dict(full_state_dict(model))
    collector.load_state_dict(own["collector_state"])
    torch.set_rng_state(own["rng"])
    return own["extra"]
