"""Static buffers for :class:`~tokengym.collectors.policies.kv_cache.SlotKVCache`: every decode step the same shapes.

:class:`StaticSlotKVCache` (``TransformersPolicy(decode="static")`` and ``"graph"``) keeps SlotKVCache's layout (each
row's tokens right-aligned in a window of columns, one column appended per decode step, refills, forks, prefix sharing,
waiting rows and multi-turn extensions as there) but holds the window inside buffers of ``capacity`` columns allocated
once: keys and values (B, H, capacity, D) per layer and the attention mask (B, capacity). The window slides right by a
column per decode step; dropping front columns zeroes their mask; when the window reaches the end of the buffers it is
copied back to the front, once every ``capacity - window`` steps at most (outside any graph). A decode step writes its
new column in place at a position held on the device and attends over all ``capacity`` columns through a 4-D mask
(columns outside the window are masked), so its inputs and outputs keep their shapes and addresses from step to step:
what :class:`~tokengym.collectors.policies.graph_decode.GraphDecode` captures.

The buffers grow (a copy, and a new graph) only when a window outgrows them, which the default capacity
(:func:`static_capacity`: the env's token buffer plus a quarter) leaves to waiting rows that gather many holes
(self-play).

SlotKVCache does the bookkeeping (lengths, spans, trajectories, prefix sharing); this module overrides only its
storage hooks (:meth:`~SlotKVCache.setup_storage`, :meth:`~SlotKVCache.replace_columns`,
:meth:`~SlotKVCache.append_columns`, :meth:`~SlotKVCache.resize_columns`), the ``kv`` and ``mask`` views, and the
decode step.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tokengym.collectors.policies.kv_cache import SlotKVCache

__all__ = ["StaticSlotKVCache", "static_capacity"]


def static_capacity(max_length: int) -> int:
    """The columns a static cache allocates for an env of ``max_length`` tokens per slot: a quarter more, so the
    window slides a quarter of ``max_length`` steps at least between two copies back to the front."""
    return int(max_length) + max(16, int(max_length) // 4)


class _Column:
    """The device position (1,) a decode step writes its column at, shared by every layer of one cache."""

    def __init__(self, device: torch.device) -> None:
        self.index = torch.zeros(1, dtype=torch.int64, device=device)


class _ColumnLayer(CacheLayerMixin):
    """One layer's keys and values (B, H, capacity, D): ``update`` writes the step's new column in place at
    ``column.index`` and hands the model the whole buffers (the 4-D mask says which columns count)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: _Column) -> None:
        super().__init__()
        self.keys, self.values, self.column = keys, values, column
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.column.index, key_states)
        self.values.index_copy_(2, self.column.index, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self, *args) -> int:
        return 0  # the positions are given per row; nothing reads this during a decode step

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class StaticSlotKVCache(SlotKVCache):
    """:class:`SlotKVCache` whose columns live in buffers of ``capacity`` columns allocated once.

    Example:
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> model = tiny_model(tiny_tokenizer())
        >>> cache = StaticSlotKVCache(model, 2, capacity=8)
        >>> tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
        >>> seq_len, active = torch.tensor([3, 2]), torch.tensor([True, True])
        >>> cache.sync(tokens, seq_len, torch.tensor([0, 1]), active)
        >>> cache.length.tolist(), cache.columns, cache.capacity
        ([2, 1], 2, 8)
        >>> cache.decode(torch.tensor([7, 9]), active).shape, cache.columns
        (torch.Size([2, 512]), 3)
    """

    def __init__(self, model, batch_size: int, *, capacity: int, **kwargs) -> None:
        if not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"capacity must be an int >= 2 (columns per slot), got {capacity!r}")
        self.capacity = capacity
        self.moves = 0
        """Times the window was copied back to the front of the buffers."""
        self.layout = 0
        """Bumped whenever the buffers are allocated anew (a grown window): a captured graph of the old ones is
        stale."""
        super().__init__(model, batch_size, **kwargs)

    # -- the buffers and the window [start, end) --
    def setup_storage(self, empty: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Buffers of ``capacity`` columns for every layer, an empty window at their front."""
        self._start = self._end = 0
        self._column = _Column(self.device)
        self._allocate(self.capacity, [(k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device) for k, v in empty])
        self.cache = Cache(layers=self._layers)

    def _allocate(self, capacity: int, shapes) -> None:
        B = self.batch_size
        with torch.inference_mode(False):  # ordinary tensors: written in place in and out of inference mode
            self._layers = [_ColumnLayer(torch.zeros(B, h, capacity, dk, dtype=dtype, device=device),
                                         torch.zeros(B, h, capacity, dv, dtype=dtype, device=device), self._column)
                            for h, dk, dv, dtype, device in shapes]  # fmt: skip
            self._mask = torch.zeros(B, capacity, dtype=torch.int64, device=self.device)
        self.capacity = capacity
        self.layout += 1

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Keys and values of every layer, (B, H, C, D) each: views of the window (writes land in the buffers)."""
        s, e = self._start, self._end
        return [(layer.keys[:, :, s:e], layer.values[:, :, s:e]) for layer in self._layers]

    @property
    def mask(self) -> torch.Tensor:
        """The attention mask (B, C) of the window: a view (writes land in the buffer)."""
        return self._mask[:, self._start : self._end]

    @property
    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The whole key and value buffers (B, H, capacity, D) of every layer."""
        return [(layer.keys, layer.values) for layer in self._layers]

    def step_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode step writes in place besides :attr:`buffers`: the whole attention mask (B, capacity) and the
        column position (1,) every layer writes at (kept until the buffers are allocated anew)."""
        return self._mask, self._column.index

    def _move(self, start: int, width: int | None = None) -> None:
        """Copy the window to begin at column ``start`` (growing the buffers when ``width`` columns from there do
        not fit); the columns it leaves are masked."""
        width = self.columns if width is None else width
        if start + width > self.capacity:
            self._grow(start + width)
        s, e = self._start, self._end
        if start != s:
            n = e - s
            for layer in self._layers:
                layer.keys[:, :, start : start + n] = layer.keys[:, :, s:e].clone()
                layer.values[:, :, start : start + n] = layer.values[:, :, s:e].clone()
            window = self._mask[:, s:e].clone()
            self._mask.zero_()
            self._mask[:, start : start + n] = window
            self._start, self._end = start, start + n
            self.moves += 1

    def reserve(self, columns: int) -> None:
        """Buffers of at least ``columns`` columns (new ones, a new :attr:`layout`, when they are narrower)."""
        if columns > self.capacity:
            self._grow(columns)

    def _grow(self, needed: int) -> None:
        """New buffers of at least ``needed`` columns, the window copied to their front (a new layout)."""
        old, window, s, e = self._layers, self.mask.clone(), self._start, self._end
        shapes = [(k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device) for k, v in self.buffers]
        self._allocate(max(needed, self.capacity + self.capacity // 2), shapes)
        for new, layer in zip(self._layers, old, strict=True):
            new.keys[:, :, : e - s] = layer.keys[:, :, s:e]
            new.values[:, :, : e - s] = layer.values[:, :, s:e]
        self._mask[:, : e - s] = window
        self._start, self._end = 0, e - s
        self.cache.layers = self._layers

    # -- SlotKVCache's storage hooks, in place --
    def replace_columns(self, kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Copy ``kv`` and ``mask`` into the buffers as the window (growing them when it does not fit)."""
        width = mask.shape[1]
        if width > self.capacity:
            self._grow(width)
        start = min(self._start, self.capacity - width)
        for layer, (k, v) in zip(self._layers, kv, strict=True):
            layer.keys[:, :, start : start + width] = k
            layer.values[:, :, start : start + width] = v
        self._mask.zero_()
        self._mask[:, start : start + width] = mask
        self._start, self._end = start, start + width

    def append_columns(self, width: int) -> None:
        """Widen the window by ``width`` masked columns (copying it to the front when they do not fit)."""
        if self._end + width > self.capacity:
            self._move(0, self.columns + width)
        self._end += width  # the new columns are masked: outside the window, the mask is 0

    def resize_columns(self, keep: int) -> None:
        """Make the window ``keep`` columns wide: its first columns masked and left, or holes before it."""
        drop = self.columns - keep
        if drop >= 0:
            self._mask[:, self._start : self._start + drop] = 0
            self._start += drop
            return
        if self._start < -drop:  # no room before the window: move it right
            self._move(-drop, keep)
        self._start += drop  # holes: masked columns

    # -- stepping --
    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """:meth:`SlotKVCache.decode` with fixed shapes: the new column written in place, attention over the whole
        buffers (:meth:`step_logits`)."""
        step = self.step_inputs(tokens, live).to(self.device, non_blocking=True)  # one host-to-device copy
        logits = self.step_logits(step)
        self.advance(live)
        return logits

    def step_inputs(self, tokens: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """The host's inputs (B, 4) of the next decode step: token, position, live, the column it writes (the same in
        every row); makes room for that column first (a copy back to the front when the window reached the end)."""
        if self._end >= self.capacity:
            self._move(0, self.columns + 1)
        column = torch.full_like(self.length, self._end)
        return torch.stack([tokens, self.length, live.to(torch.int64), column], 1)

    def step_logits(self, step: torch.Tensor) -> torch.Tensor:
        """One decode step from its inputs ``step`` (B, 4) on the device (:meth:`step_inputs`): the next-token logits
        (B, V). Fixed shapes and addresses, no host read: what a CUDA graph captures."""
        column = step[:1, 3]
        self._column.index.copy_(column)  # where every layer writes its new key and value
        self._mask.index_fill_(1, column, 1)  # during the step every row attends to its new column
        out = self.model(input_ids=step[:, :1], attention_mask=self.decode_mask(self._mask),
                         position_ids=step[:, 1:2], past_key_values=self.cache)  # fmt: skip
        self._mask.index_copy_(1, column, step[:, 2:3])  # then live rows only keep it
        return out.logits[:, -1]

    def advance(self, live: torch.Tensor) -> None:
        """The host's side of a decode step taken (:meth:`step_logits`): the window and the live rows' lengths."""
        self._end += 1
        self.length += live

    def nbytes(self) -> int:
        """Bytes of the key and value buffers (all ``capacity`` columns)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.buffers)
