"""A KV cache with one row per env slot, where each slot can be refilled or extended on its own.

Layout: every layer holds keys/values of shape (B, H, C, D) and an attention mask (B, C). A slot's
entries are the columns where its mask is 1, in order; other columns are holes. Each decode step
appends one column for all slots. Refilling a slot zeroes its mask row and appends its new
prefix (computed in a sub-batch forward over that slot's rows only); extending a slot (multi-turn:
env-inserted tokens) appends without zeroing. Holes are squeezed out (``compact``) when the
cache grows to twice the longest live row, so the amortized cost per step is O(1) in length.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["SlotKVCache"]


class SlotKVCache:
    """Per-slot KV cache for a transformers causal LM (DynamicCache layout underneath)."""

    def __init__(self, model, batch_size: int) -> None:
        self.model, self.batch_size = model, batch_size
        # one DynamicCache lives across steps: rebuilding it per step would copy every layer's KV
        self.cache = self._new_cache(self._empty_layers(batch_size))
        self.mask = torch.zeros(batch_size, 0, dtype=torch.int64)  # (B, C)
        self.length = torch.zeros(batch_size, dtype=torch.int64)  # tokens of each slot in the cache
        self.traj = torch.full((batch_size,), -1, dtype=torch.int64)  # trajectory each row holds

    def _empty_layers(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Probe the model once with one token to learn (H, D) and dtype per layer."""
        device = next(self.model.parameters()).device
        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.int64, device=device), past_key_values=cache)
        return [
            (layer.keys.new_zeros(rows, layer.keys.shape[1], 0, layer.keys.shape[3]),
             layer.values.new_zeros(rows, layer.values.shape[1], 0, layer.values.shape[3]))
            for layer in cache.layers
        ]  # fmt: skip

    def _new_cache(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
        return cache

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of every layer, (B, H, C, D) each."""
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    @kv.setter
    def kv(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k, v) in zip(self.cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v

    @property
    def columns(self) -> int:
        return self.mask.shape[1]

    def _cache(self, rows: torch.Tensor) -> DynamicCache:
        return self._new_cache([(k[rows], v[rows]) for k, v in self.kv])

    def sync(self, tokens: torch.Tensor, seq_len: torch.Tensor, traj: torch.Tensor, active: torch.Tensor) -> None:
        """Catch every live slot up with the env: prefill new trajectories, extend with env-inserted tokens.

        ``tokens`` is the env's (B, L) buffer. After this, each active slot caches all its tokens but
        the last, which the next :meth:`decode` feeds.
        """
        stale = (traj != self.traj) | (self.length < seq_len - 1)
        if not bool((stale & active).any()):  # the common step: one check, no Python per slot
            return
        is_new = active & (traj != self.traj)
        if bool(is_new.any()):
            self.reset_rows(is_new.nonzero().squeeze(-1))
            self.traj = torch.where(is_new, traj, self.traj)
        rows = (active & (is_new | (self.length < seq_len - 1))).nonzero().squeeze(-1)
        segments = [tokens[b, int(self.length[b]) : int(seq_len[b]) - 1] for b in rows.tolist()]
        self.extend(rows, segments)

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Forget the cached tokens of ``rows`` (their prefix will be extended from empty)."""
        self.mask[rows] = 0
        self.length[rows] = 0

    @torch.no_grad()
    def extend(self, rows: torch.Tensor, segments: list[torch.Tensor]) -> torch.Tensor:
        """Append ``segments[i]`` (1-D ids, may be empty) to row ``rows[i]``; returns last logits (n, V).

        Only the rows being extended go through the model; the others get masked columns.
        """
        n, width = len(segments), max(len(s) for s in segments)
        if width == 0:
            return torch.empty(0)
        device = self.mask.device
        ids = torch.zeros(n, width, dtype=torch.int64, device=device)
        seg_mask = torch.zeros(n, width, dtype=torch.int64, device=device)
        for i, seg in enumerate(segments):  # left-pad each segment (one copy per refill, not per step)
            if len(seg):
                ids[i, width - len(seg) :] = seg
                seg_mask[i, width - len(seg) :] = 1
        self._maybe_compact()  # refilled rows left holes: drop them before growing the cache
        positions = (self.length[rows, None] + seg_mask.cumsum(-1) - 1).clamp(min=0)
        attention = torch.cat([self.mask[rows], seg_mask], dim=1)
        sub = self._cache(rows)
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=sub)
        self._append_columns(width)
        for i, layer in enumerate(sub.layers):
            k, v = self.kv[i]
            k[rows], v[rows] = layer.keys, layer.values
        self.mask[rows] = attention
        self.length[rows] += seg_mask.sum(-1)
        return out.logits[:, -1]

    def _append_columns(self, width: int) -> None:
        self.kv = [
            (torch.cat([k, k.new_zeros(*k.shape[:2], width, k.shape[3])], 2),
             torch.cat([v, v.new_zeros(*v.shape[:2], width, v.shape[3])], 2))
            for k, v in self.kv
        ]  # fmt: skip
        self.mask = torch.cat([self.mask, self.mask.new_zeros(self.batch_size, width)], dim=1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Feed one token per slot (B,), appended where ``live``; returns next-token logits (B, V)."""
        new_col = live.to(self.mask.dtype)[:, None]
        attention = torch.cat([self.mask, new_col], dim=1)  # (B, C+1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=attention,
            position_ids=self.length[:, None],
            past_key_values=self.cache,
        )
        self.mask = attention
        self.length = self.length + live
        self._maybe_compact()
        return out.logits[:, -1]

    def _maybe_compact(self) -> None:
        # a compaction costs about one decode step's KV append, so squeezing holes once they pass 25%
        # keeps attention and appends near the live length for a negligible amortized price
        if self.columns > int(1.25 * int(self.length.max())) + 8:
            self.compact()

    def compact(self) -> None:
        """Squeeze out holes: right-align every row's valid columns (O(B * C), amortized O(1) per step)."""
        keep = int(self.length.max())
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, self.columns - keep :]  # (B, keep)
        self.mask = self.mask.gather(1, order)
        self.kv = [
            (k.gather(2, order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])),
             v.gather(2, order[:, None, :, None].expand(-1, v.shape[1], -1, v.shape[3])))
            for k, v in self.kv
        ]  # fmt: skip

    def state_dict(self) -> dict:
        """Keys, values, mask, lengths and trajectory ids (clones), for checkpoints."""
        return {"kv": [(k.clone(), v.clone()) for k, v in self.kv], "mask": self.mask.clone(),
                "length": self.length.clone(), "traj": self.traj.clone()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (of a cache with the same number of slots)."""
        rows = int(state["mask"].shape[0])
        if rows != self.batch_size:
            raise ValueError(f"this KV cache checkpoint holds {rows} slots, the cache has {self.batch_size}")
        self.kv = [(k.clone(), v.clone()) for k, v in state["kv"]]
        self.mask, self.length = state["mask"].clone(), state["length"].clone()
        self.traj = state["traj"].clone()

    def nbytes(self) -> int:
        """Bytes held by keys and values."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)
