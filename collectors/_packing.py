"""Shared pieces of the recorders: flat key names, one-step chunks and per-dtype packing of steps."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys

__all__ = ["Cells", "Packer", "Step", "chunk_width", "flat_name", "to_tensordict"]


def flat_name(key) -> str:
    """The flat name of a (possibly nested) key, as ``TensorDict.flatten_keys(".")`` writes it."""
    return ".".join(key) if isinstance(key, tuple) else key


F_MASK, F_ACTIVE, F_DONE, F_RESP = flat_name(keys.MASK), keys.ACTIVE, flat_name(keys.DONE), keys.RESPONSE_LEN
F_VERSION, F_TRAJ, F_GROUP = keys.POLICY_VERSION, keys.TRAJ_ID, keys.GROUP_ID


def to_tensordict(flat: dict, batch_size) -> TensorDict:
    """A TensorDict of ``flat`` (flat names -> tensors of leading shape ``batch_size``), nested at the dots: built
    directly (a tenth of ``TensorDict(flat).unflatten_keys(".")``'s time; the recorders' tensors need no checks)."""
    root: dict = {}
    for name, v in flat.items():
        *path, leaf = name.split(".")
        node = root
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = v
    return _nested(root, torch.Size(batch_size))


def _nested(tree: dict, batch_size: torch.Size) -> TensorDict:
    return TensorDict._new_unsafe({k: _nested(v, batch_size) if isinstance(v, dict) else v for k, v in tree.items()},
                                  batch_size=batch_size)  # fmt: skip


class Step(dict):
    """One env step of every slot: flat names to (B, ...) tensors (a chunk of width 1 without the
    (B, 1, ...) views, so a step source hands its tensors over as they are). ``ended``: the slots whose
    trajectory ended in the step, when the source knows them (``None``: read from the done flags); ``forks``: the
    branches forked after it (:class:`~tokengym.collectors.tree_source.TreeSource`)."""

    ended: list[int] | None = None
    forks: list[tuple] | None = None  # trees: (parent slot, parent traj, child slot, child traj, at) made after it


class Cells(dict):
    """A wave's real steps without padding: flat names to (n, ...) tensors, slot by slot (each slot's steps in
    order); ``counts`` (B,) each slot's number of steps, ``starts`` each slot's first step (a list)."""

    def __init__(self, tensors: dict, counts: torch.Tensor) -> None:
        super().__init__(tensors)
        self.counts = counts
        self.starts = (counts.cumsum(0) - counts).tolist()


def chunk_width(chunk: dict) -> int:
    return 1 if isinstance(chunk, Step) else next(iter(chunk.values())).shape[1]


def _stack_t(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).T


def _cat1(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(tensors, 1)


class Packer:
    """Packs a step's tensors into one tensor per dtype, so a chunk is written with a few copies."""

    def __init__(self, flat: dict) -> None:
        lead = 1 if isinstance(flat, Step) else 2
        self.groups: dict[torch.dtype, list[tuple[str, tuple]]] = {}
        for name, v in flat.items():
            self.groups.setdefault(v.dtype, []).append((name, tuple(v.shape[lead:])))
        # a step packs with one column_stack per dtype when every tensor is (B,) or (B, n)
        self.is_flat = all(len(trailing) <= 1 for names in self.groups.values() for _, trailing in names)
        # how a step packs per dtype, cheaper than column_stack's per-tensor reshape when the shapes allow it: all
        # (B,): stacked as rows, then transposed; all (B, 1): concatenated as columns
        self._step_pack = {dtype: _stack_t if all(not t for _, t in names) else _cat1 if all(t == (1,) for _, t in names)
                           else torch.column_stack for dtype, names in self.groups.items()}  # fmt: skip

    def pack(self, flat: dict, lead: int | None = None) -> dict[torch.dtype, torch.Tensor]:
        """One tensor per dtype: (B, n) for a :class:`Step`, (B, k, n) for a chunk (``lead`` leading dims)."""
        if isinstance(flat, Step) and self.is_flat:
            return {dtype: self._step_pack[dtype]([flat[name] for name, _ in names]) for dtype, names in self.groups.items()}
        lead = next(iter(flat.values())).shape[: lead or (1 if isinstance(flat, Step) else 2)]
        return {dtype: torch.cat([flat[name].reshape(*lead, -1) for name, _ in names], dim=-1)
                for dtype, names in self.groups.items()}  # fmt: skip

    def column(self, name: str) -> tuple[torch.dtype, int]:
        """Where a (B,)-shaped key lives in the packed tensors: (dtype, column)."""
        for dtype, names in self.groups.items():
            offset = 0
            for other, trailing in names:
                if other == name:
                    return dtype, offset
                offset += int(torch.Size(trailing).numel())
        raise KeyError(name)

    def unpack(self, packed: dict[torch.dtype, torch.Tensor], *, clone: bool = True) -> dict:
        """Flat names to tensors (copies, or views of ``packed`` with ``clone=False``)."""
        out = {}
        for dtype, names in self.groups.items():
            offset, data = 0, packed[dtype]
            for name, trailing in names:
                width = 1
                for d in trailing:
                    width *= d
                v = data[..., offset : offset + width].reshape(*data.shape[:-1], *trailing)
                out[name] = v.clone() if clone else v
                offset += width
        return out
