"""What :func:`~tokengym.train` does across the ranks of a ``torch.distributed`` process group (private to training).

Each rank collects and prepares its own rows; the loss's micro-batches are scaled by their share of every rank's
batch (:func:`~tokengym._micro_batches.micro_batches` with ``across_ranks``), so summing the ranks' gradients gives
the one-process gradient of the union batch. A model sharded with FSDP2 (``fully_shard``) reduces them in its own
backward (a reduce-scatter that averages: each rank's terms are scaled by the world size first); an unsharded model
gets one bucketed all-reduce per optimizer step (what ``DistributedDataParallel`` does, after the micro-batches
instead of overlapped with backward). A process group of one (vLLM's in-process engine initializes one) is one
process (``is_across_group``).
Every collective here is entered by every rank in the same order: the setup check comes first and raises the same
error on every rank, so a mismatch is an error and never a rank waiting alone.
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tokengym.llm_envs.errors import TokenGymWarning
from tokengym.transforms.batch_statistics import all_reduce_floats

__all__ = ["check_same_setup", "global_row", "pad_micro_batches", "reduce_gradients", "sharded", "warn_if_same_prompts"]


def sharded(module: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules (``fully_shard``) in ``module``."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def check_same_setup(setup: dict[str, object]) -> None:
    """Raise the same ValueError on every rank when the ranks' ``setup`` (their collectors', losses' and options'
    descriptions) differ, naming each differing entry and what each rank has."""
    world = torch.distributed.get_world_size()
    found: list = [None] * world
    torch.distributed.all_gather_object(found, setup)
    differ = [name for name in setup if any(other.get(name) != setup[name] for other in found)]
    differ += [name for other in found for name in other if name not in setup and name not in differ]
    if differ:
        lines = "; ".join(f"{name}: " + ", ".join(f"rank {r} {other.get(name)!r}" for r, other in enumerate(found))
                          for name in differ)  # fmt: skip
        raise ValueError(f"train() under torch.distributed needs every rank set up alike, but the {world} ranks differ "
                         f"in {lines}. Build each rank's env, collector, loss and options from the same settings; only "
                         "the prompts differ (tokengym.distributed.shard_prompts) and the seed may")  # fmt: skip


def warn_if_same_prompts(fingerprint: dict | None) -> None:
    """Warn on every rank when every rank's env holds the same prompts (their fingerprints equal): prompts sharded
    before the process group was up (``shard_prompts`` sees one rank then) or not sharded, so the ranks' batches repeat
    each other's prompts."""
    world = torch.distributed.get_world_size()
    found: list = [None] * world
    torch.distributed.all_gather_object(found, fingerprint)
    if fingerprint is not None and all(other == fingerprint for other in found):
        warnings.warn(TokenGymWarning(
            f"every one of the {world} ranks collects from the same {fingerprint.get('count')} prompts (first "
            f"{fingerprint.get('first')!r}): each rank's batch draws from the whole set, so a step may hold one prompt's "
            "group from several ranks. Give each rank its share, tokengym.distributed.shard_prompts(prompts), called "
            "after torch.distributed.init_process_group (before it, it sees one rank and returns every prompt); "
            "ignore this where every rank is meant to draw from the whole set (fewer prompts than ranks)"),
            stacklevel=3)  # fmt: skip


def reduce_gradients(params: list[torch.Tensor]) -> None:
    """Sum the gradients of an unsharded model's ``params`` over the ranks: one all-reduce per dtype and device
    (flattened buckets); a parameter without a gradient on every rank keeps None, one with a gradient on some rank
    gets the sum (zeros where a rank had none)."""
    params = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
    if not params:
        return
    has = all_reduce_floats([float(p.grad is not None) for p in params])
    live = [p for p, n in zip(params, has, strict=True) if n > 0]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p in live:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    nccl = torch.distributed.get_backend() == "nccl"
    for (_, device), grads in buckets.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        moved = flat if nccl or device.type == "cpu" else flat.cpu()  # gloo reduces on the host
        torch.distributed.all_reduce(moved)
        flat = moved.to(device)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def pad_micro_batches(parts: list, zero) -> list:
    """``parts`` and copies of its last micro-batch scaled by 0 (``zero(part)``), as many as make every rank's count
    the largest rank's: an FSDP2 model gathers its parameters in each forward, a collective every rank must enter."""
    (most,) = all_reduce_floats([len(parts)], op="max")
    return parts + [zero(parts[-1])] * (int(most) - len(parts))


def global_row(values: dict[str, float], *, mean: tuple[str, ...] = (), total: tuple[str, ...] = ()) -> dict[str, float]:
    """``values`` with the keys in ``mean`` averaged and those in ``total`` summed over the ranks (the others as
    given); every rank gets the same row."""
    names = [k for k in (*mean, *total) if k in values]
    if not names:
        return dict(values)
    sums = all_reduce_floats([values[k] for k in names])
    world = torch.distributed.get_world_size()
    return {**values, **{k: s / world if k in mean else s for k, s in zip(names, sums, strict=True)}}
