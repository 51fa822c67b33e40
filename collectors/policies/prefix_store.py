"""PrefixStore: the keys and values of recently prefilled prompts, so a group's later samples start without a forward.

A GRPO group's ``group_size`` samples share their prompt. When they start together the KV cache prefills it once
and copies the rows; when they start at different times (slots free up one by one) the prompt's keys and values
are taken from here, if it is still held. Entries are keyed by the prompt's token ids (positions start at 0 for
every prefix, so an entry fits any row), bounded by bytes and evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["DEFAULT_PREFIX_CACHE_BYTES", "PrefixStore", "group_by_prompt"]

DEFAULT_PREFIX_CACHE_BYTES = 256 * 2**20
"""Bytes of prompt keys and values kept for later samples of a group (256 MiB: ~21k tokens of Qwen2.5-0.5B in
bfloat16, 12 KiB per token)."""

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values (H, P, D) of one prompt


class PrefixStore:
    """Prompt keys and values (per layer (H, P, D)) by prompt ids, at most ``max_bytes`` in all (0 keeps none).

    Example:
        >>> store = PrefixStore(max_bytes=64)
        >>> store.put((5, 6), [(torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))])  # 64 bytes: kept
        >>> store.get((5, 6))[0][0].shape, store.get((7,)), store.nbytes
        (torch.Size([1, 2, 4]), None, 64)
        >>> store.put((7,), [(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))])  # evicts (5, 6), the oldest
        >>> list(store.entries)
        [(7,)]
    """

    def __init__(self, max_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an int >= 0 (0 keeps no prompt for later samples), got "
                             f"{max_bytes!r}")  # fmt: skip
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        """Rows that started from a held prompt instead of a forward (cumulative)."""

    def get(self, ids: tuple[int, ...]) -> KV | None:
        """The keys and values of prompt ``ids``, or ``None``; a hit becomes the most recently used."""
        kv = self.entries.get(ids)
        if kv is not None:
            self.entries.move_to_end(ids)
        return kv

    def put(self, ids: tuple[int, ...], kv: KV) -> None:
        """Keep ``kv`` (owned: the caller passes copies) for prompt ``ids``, evicting the oldest beyond the bound."""
        size = _nbytes(kv)
        if size > self.max_bytes or ids in self.entries:
            return
        while self.entries and self.nbytes + size > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= _nbytes(old)
        self.entries[ids] = kv
        self.nbytes += size

    def clear(self) -> None:
        """Drop every prompt (after a weight update: their keys and values belong to the old weights)."""
        self.entries.clear()
        self.nbytes = 0

    def state_dict(self) -> list:
        """The held prompts as plain data (ids tensor, keys and values per layer), oldest first, for checkpoints."""
        return [(torch.tensor(ids, dtype=torch.int64), [(k.clone(), v.clone()) for k, v in kv])
                for ids, kv in self.entries.items()]  # fmt: skip

    def load_state_dict(self, state: list, devices: list[tuple[torch.device, torch.device]]) -> None:
        """Restore :meth:`state_dict`, each layer's tensors on ``devices`` (the cache's layers')."""
        self.clear()
        for ids, kv in state:
            self.put(tuple(ids.tolist()), [(k.to(dk, copy=True), v.to(dv, copy=True))
                                           for (k, v), (dk, dv) in zip(kv, devices, strict=True)])  # fmt: skip


def group_by_prompt(prompts) -> dict[tuple[int, ...], list[int]]:
    """The positions of ``prompts`` (1-D id tensors) grouped by their ids, in order: a group's samples share one.

    Example:
        >>> group_by_prompt([torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([5, 6])])
        {(5, 6): [0, 2], (7,): [1]}
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(prompts):
        groups.setdefault(tuple(ids.tolist()), []).append(i)
    return groups


def _nbytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
