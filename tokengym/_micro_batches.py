"""Micro-batches of a prepared batch with the whole batch's gradient, and PPO mini-batches (private to training).

A loss that averages over tokens (TorchRL's ``token_mean``, ``WeightedLoss``'s) gives each micro-batch the mean over
its own tokens; summed, those means are not the whole batch's mean. Each micro-batch's loss is scaled by its share of
the whole batch's normalizer (its tokens, or its rows for a per-sequence mean), so the accumulated gradient is the
whole batch's, as verl and AReaL scale theirs. Rows keep their order inside a micro-batch; a micro-batch drops the
padding columns after its longest row (responses are right-padded), which is what a token budget saves.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import NamedTuple

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms import WeightedLoss
from tokengym.transforms.batch_statistics import all_reduce_floats

__all__ = ["MicroBatch", "micro_batches", "mini_batch_rows", "trainer_mode"]


_PER_ELEMENT_TERMS = ("loss_kl_to_ref", "loss_kl_to_inference")  # GRPOLoss: a mean over every (row, column)


class MicroBatch(NamedTuple):
    """A micro-batch and the factors its loss terms are scaled by: ``share`` (its part of the whole batch's
    normalizer) for every term, ``element_share`` (its rows x columns over the whole batch's) for the terms that
    ``GRPOLoss`` averages over every column (its KL penalties)."""

    data: TensorDictBase
    share: float
    element_share: float = 1.0

    def scale(self, loss: torch.nn.Module, name: str) -> float:
        """The factor of the loss term ``name`` of this micro-batch."""
        return self.element_share if name in _PER_ELEMENT_TERMS and _is_grpo(_inner(loss)) else self.share


def _inner(loss: torch.nn.Module) -> torch.nn.Module:
    return loss.loss if isinstance(loss, WeightedLoss) else loss


def _is_grpo(loss: torch.nn.Module) -> bool:
    llm = sys.modules.get("torchrl.objectives.llm")
    return llm is not None and isinstance(loss, llm.GRPOLoss)


def _token_mask(data: TensorDictBase) -> torch.Tensor:
    """bool [N, W]: the tokens a loss counts (``keys.MASK`` on step batches, else ``keys.ACTION_MASK``, else all)."""
    for key in (keys.MASK, keys.ACTION_MASK):
        mask = data.get(key, None)
        if mask is not None:
            return mask.reshape(data.batch_size).bool()
    return torch.ones(data.batch_size, dtype=torch.bool, device=data.device)


def check_micro_batchable(loss: torch.nn.Module, parts: str = "micro-batches") -> None:
    """Refuse a loss whose value on a micro-batch (or on one rank's rows: ``parts="ranks"``) cannot be scaled into the
    whole batch's (batch statistics)."""
    inner = _inner(loss)
    without = "train without micro-batches" if parts == "micro-batches" else "train in one process"
    if getattr(inner, "normalize_advantage", False):
        raise ValueError(f"{type(inner).__name__}(normalize_advantage=True) whitens the advantage over the batch it is "
                         f"called on, so {parts} would each use their own statistics: normalize the advantage "
                         "in the batch transform instead (GroupAdvantage('grpo') does) and build the loss with "
                         f"normalize_advantage=False, or {without}")  # fmt: skip
    if (getattr(inner, "kl_mask_threshold", None) or 0) > 0:
        raise ValueError(f"{type(inner).__name__}(kl_mask_threshold=...) masks tokens by their current log-probs, so "
                         f"the whole batch's token count is not known before the {parts} run: {without}, or drop "
                         "kl_mask_threshold")  # fmt: skip


def _loss_masks(inner: torch.nn.Module, data: TensorDictBase) -> torch.Tensor | None:
    """The masks TorchRL's reduction reads from the batch (``loss_mask_key``: ``"auto"`` reads
    ``torchrl.objectives.common.AUTO_LOSS_MASK_KEYS``), combined; None when none is there."""
    key = getattr(inner, "loss_mask_key", None)
    if key is None:
        return None
    if isinstance(key, str) and key == "auto":
        from torchrl.objectives.common import AUTO_LOSS_MASK_KEYS

        names = AUTO_LOSS_MASK_KEYS
    else:
        names = (key,)
    found = [data.get(name, None) for name in names]
    found = [m.reshape(data.batch_size).bool() for m in found if m is not None]
    if not found:
        return None
    mask = found[0]
    for other in found[1:]:
        mask = mask & other
    return mask


def normalizer(loss: torch.nn.Module, data: TensorDictBase) -> float:
    """What ``loss`` divides its summed terms by on ``data`` (as TorchRL's and ``WeightedLoss``'s reductions count):
    its tokens for a token mean, its rows for a per-row mean, 1 for a sum."""
    inner = _inner(loss)
    if isinstance(loss, WeightedLoss):
        mask = _token_mask(data)
        if loss.aggregation.value == "sequence_mean":
            return float((mask.sum(-1) > 0).sum())
        return float(mask.sum())
    if getattr(inner, "reduction", "mean") == "sum":
        return 1.0
    found = _loss_masks(inner, data)
    if _is_grpo(inner):
        if inner.aggregation == "prompt_mean":
            return float(data.batch_size[0])
        mask = data.get(keys.ACTION_MASK).bool()
        old = data.get(inner.tensor_keys.sample_log_prob, None)
        if old is not None:
            mask = mask & torch.isfinite(old.reshape(mask.shape))
        return float((mask if found is None else mask & found).sum())
    return float(data.batch_size.numel() if found is None else found.sum())


def _sums(loss: torch.nn.Module) -> bool:
    """Whether ``loss`` sums its terms (no normalizer: every part adds up)."""
    return not isinstance(loss, WeightedLoss) and getattr(_inner(loss), "reduction", "mean") == "sum"


def _counts_elements(loss: torch.nn.Module, data: TensorDictBase) -> bool:
    """Whether :func:`normalizer` counts every (row, column) of ``data`` (a mean without a mask), padding included."""
    inner = _inner(loss)
    return not (isinstance(loss, WeightedLoss) or _sums(loss) or _is_grpo(inner)) and _loss_masks(inner, data) is None


def _row_widths(data: TensorDictBase) -> torch.Tensor:
    """int64 [N]: the columns each row needs (up to its last valid column)."""
    valid = data.get(keys.ATTENTION_MASK, None)
    valid = _token_mask(data) if valid is None else valid.bool()
    cols = torch.arange(1, valid.shape[-1] + 1, device=valid.device)
    return torch.where(valid, cols, 0).amax(-1)


def _take(data: TensorDictBase, rows: torch.Tensor) -> TensorDictBase:
    """Rows ``rows`` of ``data``, cut after the last column any of them uses; non-tensor entries kept whole."""
    width = int(_row_widths(data)[rows].max()) if rows.numel() else 0
    width = max(width, 1)
    tensors = data.exclude(keys.PROMPTS, keys.RESPONSE_START)
    out = tensors[rows][:, :width] if width < data.batch_size[1] else tensors[rows]
    for key in (keys.PROMPTS, keys.RESPONSE_START):
        if key in data.keys(True):
            out.set_non_tensor(key, data.get_non_tensor(key))
    return out


def _groups_of_rows(rows: torch.Tensor, widths: torch.Tensor, budget_rows: int | None,
                    budget_tokens: int | None) -> list[torch.Tensor]:  # fmt: skip
    """Split ``rows`` (in order) into micro-batches of at most ``budget_rows`` rows, or of at most ``budget_tokens``
    padded tokens (rows x their widest), the rows sorted by width first so that like lengths share a micro-batch."""
    if budget_tokens is None:
        return list(rows.split(budget_rows))
    order = rows[widths[rows].argsort(descending=True, stable=True)]
    out, current, widest = [], [], 0
    for row in order.tolist():
        w = int(widths[row])
        if current and max(widest, w) * (len(current) + 1) > budget_tokens:
            out.append(torch.tensor(sorted(current)))
            current, widest = [], 0
        current.append(row)
        widest = max(widest, w)
    if current:
        out.append(torch.tensor(sorted(current)))
    return out


def micro_batches(data: TensorDictBase, loss: torch.nn.Module, rows: torch.Tensor | None = None, *,
                  max_rows: int | None = None, max_tokens: int | None = None,
                  across_ranks: bool = False) -> list[MicroBatch]:  # fmt: skip
    """The micro-batches of ``data[rows]`` (all rows by default) and their shares (summing to 1 over a batch with any
    token). Without ``max_rows`` and ``max_tokens``: one micro-batch, share 1.

    ``across_ranks``: ``data`` is one rank's part of a batch spread over the ranks of the process group (each calls
    this together): the shares are of every rank's whole batch (the normalizer summed over the ranks, the padded
    width their widest), so the ranks' micro-batches sum to the one-process gradient of the union batch."""
    split = max_rows is not None or max_tokens is not None
    if not split and not across_ranks:
        return [MicroBatch(data if rows is None else _take(data, rows), 1.0, 1.0)]
    if rows is None:
        rows = torch.arange(data.batch_size[0])
    if data.batch_dims != 2:
        raise ValueError(f"micro-batches {'and ranks ' if across_ranks else ''}split a batch of rows [N, T] or a "
                         f"padded layout [N, L], got batch_size {tuple(data.batch_size)}")  # fmt: skip
    check_micro_batchable(loss, "micro-batches" if split else "ranks")
    widths = _row_widths(data).cpu()
    groups = _groups_of_rows(rows, widths, max_rows, max_tokens) if split else [rows]
    parts = [_take(data, part) for part in groups]
    whole = _take(data, rows)
    total, elements = normalizer(loss, whole), whole.batch_size.numel()
    if across_ranks:
        total_sum, n_rows = all_reduce_floats([total, whole.batch_size[0]])
        # the union batch's rows x its width: a padded layout's prompts left-padded to the longest prompt of any rank
        # and its responses right-padded to the longest response (keys.RESPONSE_START: P)
        start = whole.get_non_tensor(keys.RESPONSE_START) if keys.RESPONSE_START in whole.keys() else 0
        start = start if isinstance(start, int) else 0
        prompt, response = all_reduce_floats([start, whole.batch_size[1] - start], op="max")
        elements = n_rows * (prompt + response)
        total = elements if _counts_elements(loss, whole) else total_sum
    out = []
    for part in parts:
        size = normalizer(loss, part)
        if across_ranks:
            share = 1.0 if _sums(loss) else (size / total if total else 0.0)
        else:
            share = 1.0 if total == 1.0 and size == 1.0 else (size / total if total else 0.0)  # a sum: each adds up
        out.append(MicroBatch(part, share, part.batch_size.numel() / elements if elements else 0.0))
    return out


def mini_batch_rows(n: int, mini_batches: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``mini_batches`` shuffled, near-equal sets of rows of ``range(n)`` (each sorted), for one epoch."""
    order = torch.randperm(n, generator=generator)
    return [part.sort().values for part in order.tensor_split(mini_batches)]


def _actor_model(loss: torch.nn.Module) -> torch.nn.Module | None:
    actor = getattr(_inner(loss), "actor_network", None)
    model = getattr(actor, "model", None)
    return model if isinstance(model, torch.nn.Module) else None


@contextlib.contextmanager
def trainer_mode(loss: torch.nn.Module, *, gradient_checkpointing: bool = False) -> Iterator[None]:
    """The loss (and its actor's model) in train mode, with gradient checkpointing when asked, inside; every module's
    mode and the model's checkpointing as found, after."""
    modes = {module: module.training for module in loss.modules()}
    model = _actor_model(loss) if gradient_checkpointing else None
    enabled = False
    if gradient_checkpointing:
        if model is None or not callable(getattr(model, "gradient_checkpointing_enable", None)):
            raise ValueError(f"gradient_checkpointing=True enables it on the loss's actor model, but "
                             f"{type(_inner(loss)).__name__}'s actor holds no transformers model "
                             f"({type(model).__name__ if model is not None else 'none'}): build the loss on a tokengym "
                             "actor (PaddedSequenceActor(model)...) or call model.gradient_checkpointing_enable() "
                             "yourself")  # fmt: skip
        if not getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            enabled = True
    loss.train()
    try:
        yield
    finally:
        if enabled:
            model.gradient_checkpointing_disable()
        for module, was_training in modes.items():
            module.train(was_training)
