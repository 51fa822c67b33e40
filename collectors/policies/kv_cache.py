"""A KV cache with one row per env slot, where each slot can be refilled or extended on its own.

Layout: every layer holds keys/values of shape (B, H, C, D) and an attention mask (B, C). A live
slot's tokens are the last ``length`` columns of its row, in order; columns before them are holes
(masked). Each decode step appends one column for all slots, so the layout is kept for free.
Refilling slots (new trajectories) prefills their prompts in one forward over those rows only, with
a fresh cache and last-position logits only, and writes the result into the last columns of their
rows; before that, the columns no live slot needs any more are dropped from the front (a view, no
copy: the next decode step's concatenation copies the cache anyway). So a refill never copies the
cache and the cache stays as wide as the longest live slot. Extending slots with env-inserted tokens
(multi-turn) appends columns for all rows and then right-aligns every row again (``compact``).

Waiting slots (self-play: a player whose slot holds its tokens while another moves) are idle rows that keep their
trajectory: a decode step still appends a column to their row, masked (only live rows attend to their new column
later), so a waiting row's tokens are followed by holes until it is extended again (its wake) and realigned. The
host keeps where each row's first cached column is, so a refill of other rows never drops a waiting row's columns.

Placement: keys, values and the attention mask live on the model's devices; the bookkeeping (each row's cached length
and trajectory id) lives on the host beside the env's slot state, so deciding what to prefill never waits for the
device. A decode step sends the fed tokens and their positions in one host-to-device copy, a refill its prompts in
one more; nothing here copies from the device to the host.

Vision-language models (Qwen2-VL's M-RoPE): a prefill takes the images of its rows (``images(row)``, the env's
:class:`~tokengym.llm_envs.image_inputs.ImageInputs` of the slot's prompt) and their multimodal positions
(:func:`~tokengym.llm_envs.mrope_positions`); the host keeps each row's rope delta, so a later token at length ``n``
sits at position ``n + delta`` (a decode step's or an extension's text tokens, given as 1-D positions that the model
uses in its three sections). A prompt with images is shared (group, prefix store) only with the same images.

The forwards and the cache's own writes run under ``torch.inference_mode()`` (a tenth less per decode step of a
small model than ``no_grad``); the keys and values are inference tensors, but the logits a decode returns feed
functional ops only, so what a policy hands out, and a checkpoint's clones, are ordinary tensors.

Storage: where the columns live is behind a few public hooks (:meth:`SlotKVCache.setup_storage`,
:meth:`~SlotKVCache.replace_columns`, :meth:`~SlotKVCache.append_columns`, :meth:`~SlotKVCache.resize_columns`, with
the ``kv`` and ``mask`` views); the bookkeeping above does not depend on it. Static buffers
(``TransformersPolicy(decode="static")`` and ``"graph"``, every decode step the same shapes) override them:
:class:`~tokengym.collectors.policies.static_kv_cache.StaticSlotKVCache`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from tokengym.collectors.policies.prefix_store import DEFAULT_PREFIX_CACHE_BYTES, PrefixStore, group_by_prompt
from tokengym.llm_envs.devices import input_device
from tokengym.llm_envs.image_inputs import ImageInputs
from tokengym.llm_envs.vision import is_vision_model, mrope_positions

__all__ = ["SlotKVCache"]


class SlotKVCache:
    """Per-slot KV cache for a transformers causal LM (DynamicCache layout underneath).

    Example:
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> model = tiny_model(tiny_tokenizer())
        >>> cache = SlotKVCache(model, 2)
        >>> tokens = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])  # the env's buffer: prompts of 3 and 2 tokens
        >>> seq_len, active = torch.tensor([3, 2]), torch.tensor([True, True])
        >>> cache.sync(tokens, seq_len, torch.tensor([0, 1]), active)  # prefills all but each last token
        >>> cache.length.tolist()
        [2, 1]
        >>> cache.decode(torch.tensor([7, 9]), active).shape  # feeds the last tokens: next-token logits
        torch.Size([2, 512])
    """

    def __init__(self, model, batch_size: int, *, share_prefixes: bool = True,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES, images=None) -> None:  # fmt: skip
        self.model, self.batch_size = model, batch_size
        self.images = images
        """``images(row) -> ImageInputs | None``: the images of the trajectory a row is refilled with (a
        vision-language model's; ``None``: no row has images)."""
        config = model.config
        self.vision = (int(config.image_token_id), int(config.vision_config.spatial_merge_size)) if is_vision_model(
            config) else None  # fmt: skip
        """(image token id, merge size) of a vision-language model, else ``None``."""
        self.share_prefixes = bool(share_prefixes)
        self.prefixes = PrefixStore(prefix_cache_bytes if share_prefixes else 0)
        """Prompts prefilled lately, for the later samples of their groups (:class:`PrefixStore`)."""
        self.device = input_device(model)  # where the ids, positions and mask go (keys/values: each layer's device)
        self.setup_storage(self._empty_layers(batch_size))
        # host bookkeeping, beside the env's slot state: reading it never synchronizes with the device
        self.length = torch.zeros(batch_size, dtype=torch.int64)  # cached tokens per slot
        self.traj = torch.full((batch_size,), -1, dtype=torch.int64)  # trajectory per row
        # where each row's first cached token sits, in a column numbering that dropping front columns does not move:
        # column c of the cache is number `_base + c`; a right-aligned row starts at `_base + columns - length`
        self.first = torch.zeros(batch_size, dtype=torch.int64)
        self.delta = torch.zeros(batch_size, dtype=torch.int64)  # M-RoPE: position of the next token minus its index
        self._base = 0
        self._one = torch.ones(batch_size, dtype=torch.int64)
        self._new_column = torch.ones(batch_size, 1, dtype=torch.int64, device=self.device)
        self._seen: tuple = (None, None)  # the (traj_id, active) tensors of the last sync
        self._unmasked_when_dense = _full_attention(model.config)
        """Whether a decode step without padding may go without a mask (every layer attends to all its tokens: no
        sliding window, which the model builds from a missing mask but a given one leaves out)."""

    def _empty_layers(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Probe the model once with one token to learn (H, D) and dtype per layer."""
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.int64, device=self.device), past_key_values=cache,
                       logits_to_keep=1)  # fmt: skip
        return [
            (layer.keys.new_zeros(rows, layer.keys.shape[1], 0, layer.keys.shape[3]),
             layer.values.new_zeros(rows, layer.values.shape[1], 0, layer.values.shape[3]))
            for layer in cache.layers
        ]  # fmt: skip

    # -- column storage: the hooks a subclass keeping the columns elsewhere overrides (StaticSlotKVCache) --
    def setup_storage(self, empty: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Storage hook, one of four a subclass that keeps the columns elsewhere overrides (with
        :meth:`replace_columns`, :meth:`append_columns`, :meth:`resize_columns`, and the ``kv`` and ``mask`` views):
        the cache the decode steps go through (``self.cache``) and the attention mask (B, C), both 0 columns wide.
        ``empty`` holds every layer's keys and values (B, H, 0, D). Called once, by ``__init__``."""
        # one DynamicCache lives across steps: rebuilding it per step would copy every layer's KV
        self.cache = self._new_cache(empty)
        self.mask = torch.zeros(self.batch_size, 0, dtype=torch.int64, device=self.device)  # (B, C)

    def replace_columns(self, kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Storage hook (a subclass may override it): make ``kv`` and ``mask`` (as wide as one another) the cache's
        columns."""
        self.kv, self.mask = kv, mask

    def append_columns(self, width: int) -> None:
        """Storage hook (a subclass may override it): ``width`` masked columns after the last one, in every row."""
        self.kv = [(torch.cat([k, k.new_zeros(*k.shape[:2], width, k.shape[3])], 2),
                    torch.cat([v, v.new_zeros(*v.shape[:2], width, v.shape[3])], 2)) for k, v in self.kv]  # fmt: skip
        self.mask = torch.cat([self.mask, self.mask.new_zeros(self.batch_size, width)], 1)

    def resize_columns(self, keep: int) -> None:
        """Storage hook (a subclass may override it): make the cache ``keep`` columns wide, dropping the first
        columns (a view) or prepending holes (a copy). The caller renumbers the columns (:meth:`span`)."""
        drop = self.columns - keep
        if drop > 0:
            self.kv = [(k[:, :, drop:], v[:, :, drop:]) for k, v in self.kv]
            self.mask = self.mask[:, drop:]
        elif drop < 0:
            self.kv = [(torch.cat([k.new_zeros(*k.shape[:2], -drop, k.shape[3]), k], 2),
                        torch.cat([v.new_zeros(*v.shape[:2], -drop, v.shape[3]), v], 2)) for k, v in self.kv]  # fmt: skip
            self.mask = torch.cat([self.mask.new_zeros(self.batch_size, -drop), self.mask], 1)

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

    def span(self) -> torch.Tensor:
        """Columns (B,) from each row's first cached token to the last column: its length, plus the masked columns
        decode steps appended while it waited (0 rows: meaningless)."""
        return self._base + self.columns - self.first

    # -- catching up with the env --
    def sync(self, tokens: torch.Tensor, seq_len: torch.Tensor, traj: torch.Tensor, active: torch.Tensor) -> None:
        """Catch every live slot up with the env: prefill new trajectories, extend with env-inserted tokens.

        ``tokens`` is the env's (B, L) buffer. After this, each active slot caches all its tokens but
        the last, which the next :meth:`decode` feeds.
        """
        # A TokenEnv replaces its trajectory-id and active tensors when it refills a slot and never
        # writes them in place: the same objects as last time mean no new trajectory. What remains is a
        # live slot whose length moved other than by the one decoded token (env-inserted tokens, or a
        # step the env rolled back and is retried): two ops when every slot is live, four otherwise.
        if traj is self._seen[0] and active is self._seen[1]:
            gap = seq_len - self.length  # (B,) 1 for every slot in step with the cache
            if torch.equal(gap, self._one) or not bool(((gap != 1) & active).any()):
                return
        self._seen = (traj, active)
        # a new trajectory, or a cache ahead of the env (a step rolled back after a reward error): prefill
        stale = active & ((traj != self.traj) | (self.length >= seq_len))
        if bool(stale.any()):
            # live or waiting rows keep their columns; a vacated slot (seq_len 0: a finished tree left it idle) does not
            held = ~stale & (traj == self.traj) & (self.length > 0) & (seq_len > 0)
            self.traj = torch.where(stale, traj, self.traj)
            self._refill(stale.nonzero().squeeze(-1), tokens, seq_len, held)
        grown = active & (self.length < seq_len - 1)
        if bool(grown.any()):
            rows = grown.nonzero().squeeze(-1)
            self.extend(rows, [tokens[b, int(self.length[b]) : int(seq_len[b]) - 1] for b in rows.tolist()])

    @torch.inference_mode()
    def _refill(self, rows: torch.Tensor, tokens: torch.Tensor, seq_len: torch.Tensor, held: torch.Tensor) -> None:
        """Start ``rows`` over with the prefixes ``tokens[row, : seq_len - 1]``; the rows ``held`` (B,) keep their
        cached tokens (live slots, and waiting ones: idle rows of the same trajectory).

        Rows with the same prefix (a group's samples) share it: one row of each is prefilled, in one forward over
        those rows, and the others copy its cache rows (:meth:`copy_rows`); a prefix the :class:`PrefixStore` holds
        (an earlier sample of the group) is written from there, without a forward.
        """
        # rows neither held nor refilled (an idle slot that moved on to a new trajectory) forget their tokens
        forget = ~held
        forget[rows] = True
        self.length[forget] = 0
        lens = seq_len[rows] - 1  # (n,) tokens to prefill; the last one is fed by decode
        width = int(lens.max())
        # the columns any held row still needs (a waiting row's span: its tokens and the holes after them); the
        # refilled rows need `width`
        keep = max(int(torch.where(held, self.span(), 0).max()), width)
        self._base += self.columns - keep  # dropped columns keep their numbers
        self.resize_columns(keep)
        # not `mask[rows] = 0`: a host scalar copied to the device waits for it
        self.mask.index_fill_(0, forget.nonzero().squeeze(-1).to(self.device, non_blocking=True), 0)
        self.first[rows] = self._base + keep - lens
        if width == 0:  # one-token prompts: nothing to prefill
            return
        at_rows = rows.tolist()
        images = self._row_images(at_rows, tokens, lens)
        if self.share_prefixes:  # rows by prefix: a group's samples share one
            prefixes = group_by_prompt(tokens[r, :n] for r, n in zip(at_rows, lens.tolist(), strict=True))
            groups = {ids: [at_rows[i] for i in members] for ids, members in prefixes.items()}
            if images:  # the same ids with other images are another prefix
                split: dict[tuple[int, ...], list[int]] = {}
                for ids, members in groups.items():
                    for m in members:
                        split.setdefault(ids + _digest_key(images.get(m)), []).append(m)
                groups = split
        else:
            groups = {(r,): [r] for r in at_rows}
        held = {ids: self.prefixes.get(ids) for ids in groups}  # before any put can evict one
        first = [members[0] for ids, members in groups.items() if held[ids] is None]
        if first:
            at = torch.isin(rows, torch.tensor(first))
            self._prefill(rows[at], lens[at], tokens, keep, images)
        for ids, members in groups.items():
            if held[ids] is not None:
                self._write_prefix(members, held[ids], keep)
                self.prefixes.hits += len(members)
            elif self.share_prefixes:
                self.prefixes.put(ids, self._row_kv(members[0]))
        pairs = [(members[0], r) for members in groups.values() for r in members[1:] if members[0] in first]
        if pairs:
            self.copy_rows(*(torch.tensor(side, dtype=torch.int64) for side in zip(*pairs, strict=True)))

    def _row_images(self, rows: list[int], tokens: torch.Tensor, lens: torch.Tensor) -> dict:
        """The images of refilled ``rows`` (row -> (ImageInputs, positions (3, n))), each row's rope delta set; an empty
        dict for a text model or rows without images."""
        if self.vision is None:
            return {}
        self.delta[rows] = 0
        out = {}
        for r, n in zip(rows, lens.tolist(), strict=True):
            held = self.images(r) if self.images is not None else None
            if held is None:
                continue
            positions, delta = mrope_positions(tokens[r, :n], held.image_grid_thw, image_token_id=self.vision[0],
                                               merge_size=self.vision[1])  # fmt: skip
            self.delta[r] = delta
            out[r] = (held, positions)
        return out

    def _prefill(self, rows: torch.Tensor, lens: torch.Tensor, tokens: torch.Tensor, keep: int,
                 images: dict | None = None) -> None:  # fmt: skip
        """Prefill ``rows`` with ``tokens[row, :lens]`` in one forward, right-aligned into the last columns (with the
        rows' ``images``: row -> (ImageInputs, M-RoPE positions))."""
        width = int(lens.max())
        # the rows, the right-aligned prefixes and their mask in one host-to-device copy
        cols = torch.arange(width)
        seg_mask = cols[None, :] >= (width - lens)[:, None]  # (n, width) each prefix right-aligned
        src = (cols[None, :] - (width - lens)[:, None]).clamp_(min=0)
        ids = torch.where(seg_mask, tokens[rows[:, None], src], 0)
        packed = torch.cat([rows[:, None], ids, seg_mask.long()], 1).to(self.device, non_blocking=True)
        rows_d, ids, seg_mask = packed[:, 0], packed[:, 1 : width + 1], packed[:, width + 1 :]
        self.length[rows] = lens
        if width == 0:  # one-token prompts: nothing to prefill
            return
        sub = DynamicCache(config=self.model.config)
        positions, extra = (seg_mask.cumsum(-1) - 1).clamp_(min=0), {}
        held = [images[r] for r in rows.tolist() if r in images] if images else []
        if held:  # M-RoPE positions (3, n, width), right-aligned as the ids; the rows' images in row order
            positions = positions.expand(3, -1, -1).clone()
            for i, r in enumerate(rows.tolist()):
                if r in images:
                    positions[:, i, width - int(lens[i]) :] = images[r][1].to(positions.device)
            extra = ImageInputs.cat([h for h, _ in held]).model_inputs(self.device)
        self.model(input_ids=ids, attention_mask=self._block_mask(seg_mask), position_ids=positions,
                   past_key_values=sub, logits_to_keep=1, **extra)  # fmt: skip
        start = keep - width
        for (k, v), layer in zip(self.kv, sub.layers, strict=True):
            at = rows_d.to(k.device, non_blocking=True)  # a device_map model: each layer on its own device
            k[at, :, start:] = layer.keys
            v[at, :, start:] = layer.values
        self.mask[rows_d, start:] = seg_mask

    def _row_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the keys and values (H, length, D) of ``row``'s cached tokens, per layer."""
        n = int(self.length[row])
        return [(k[row, :, self.columns - n :].clone(), v[row, :, self.columns - n :].clone()) for k, v in self.kv]

    def _write_prefix(self, rows: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], keep: int) -> None:
        """Write a held prompt's keys and values into the last columns of ``rows``."""
        n = kv[0][0].shape[1]
        at = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        for (k, v), (pk, pv) in zip(self.kv, kv, strict=True):
            here = at.to(k.device, non_blocking=True)
            k[here, :, keep - n :] = pk
            v[here, :, keep - n :] = pv
        self.mask[:, keep - n :].index_fill_(0, at, 1)
        self.length[rows] = n

    @torch.inference_mode()
    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, upto: torch.Tensor | None = None) -> None:
        """Copy the cached tokens of rows ``src`` into rows ``dst`` (host int64 (n,)): the first ``upto`` tokens of
        each (default: all it holds), right-aligned as every row is; what ``dst`` held is dropped.

        The primitive a group's samples share their prompt with (and a sequence forks with: the branch keeps the
        parent's first ``upto`` tokens). A copy costs one gather of the rows' columns per layer, no forward.
        """
        upto = self.length[src].clone() if upto is None else upto.to(torch.int64)
        if bool((upto > self.length[src]).any()) or bool((upto < 0).any()):
            raise ValueError(f"copy_rows: upto {upto.tolist()} must be within the source rows' cached tokens "
                             f"{self.length[src].tolist()}")  # fmt: skip
        if bool((self.span()[src] != self.length[src]).any()):  # a waiting source row: holes follow its tokens
            self.compact()
        C = self.columns
        cols = torch.arange(C)
        # source token t sits at column C - length + t; its copy at C - upto + t: a shift of length - upto columns
        index = (cols[None, :] - (self.length[src] - upto)[:, None]).clamp_(min=0)  # (n, C)
        kept = (cols[None, :] >= (C - upto)[:, None]).long()
        packed = torch.cat([src[:, None], dst[:, None], index, kept], 1).to(self.device, non_blocking=True)
        src_d, dst_d, index, kept = packed[:, 0], packed[:, 1], packed[:, 2 : C + 2], packed[:, C + 2 :]
        for k, v in self.kv:
            here, order = (src_d.to(k.device), dst_d.to(k.device)), _expand(index.to(k.device), k)
            k[here[1]] = k[here[0]].gather(2, order)
            v[here[1]] = v[here[0]].gather(2, order)
        self.mask[dst_d] = kept
        self.length[dst] = upto
        self.delta[dst] = self.delta[src]
        self.first[dst] = self._base + C - upto

    def fork(self, src: list[int], dst: list[int], lengths: list[int], trajs: list[int]) -> None:
        """Rows ``dst`` continue copies of rows ``src`` as trajectories ``trajs`` (a tree's branches), whose sequences
        are ``lengths`` tokens long: each copies its parent's first ``length - 1`` cached tokens (what a live slot
        caches; fewer when the parent's row holds fewer) and the next :meth:`sync` prefills only what is missing.
        A parent row that caches another trajectory (not synced yet) gives nothing: the branch is prefilled."""
        pairs = [(a, b, n - 1, t) for a, b, n, t in zip(src, dst, lengths, trajs, strict=True)
                 if int(self.length[a]) > 0]  # fmt: skip
        if pairs:
            a, b, n, t = (torch.tensor(side, dtype=torch.int64) for side in zip(*pairs, strict=True))
            self.copy_rows(a, b, torch.minimum(n, self.length[a]))
            self.traj[b] = t
        copied = {p[1] for p in pairs}
        for b in dst:
            if b not in copied:
                self.length[b] = 0

    @torch.inference_mode()
    def extend(self, rows: torch.Tensor, segments: list[torch.Tensor]) -> None:
        """Append ``segments[i]`` (1-D ids, may be empty) to the cached tokens of row ``rows[i]``.

        Only the rows being extended go through the model; the others get masked columns, and then
        every row is right-aligned again (:meth:`compact`).
        """
        n, width = len(segments), max(len(s) for s in segments)
        if width == 0:
            return
        ids = torch.zeros(n, width, dtype=torch.int64)
        seg_mask = torch.zeros(n, width, dtype=torch.int64)
        for i, seg in enumerate(segments):  # left-pad each segment (one copy per extension, not per step)
            if len(seg):
                ids[i, width - len(seg) :] = seg
                seg_mask[i, width - len(seg) :] = 1
        positions = (self.length[rows, None] + self.delta[rows, None] + seg_mask.cumsum(-1) - 1).clamp(min=0)
        shown = self._segment_images(rows, segments, positions) if self.vision is not None else None
        self.length[rows] += seg_mask.sum(-1)
        # rows, ids, positions and mask in one host-to-device copy
        packed = torch.cat([rows[:, None], ids, positions, seg_mask], 1).to(self.device, non_blocking=True)
        rows, ids = packed[:, 0], packed[:, 1 : width + 1]
        positions, seg_mask = packed[:, width + 1 : 2 * width + 1], packed[:, 2 * width + 1 :]
        extra = {}
        if shown is not None:  # feedback with images: their M-RoPE positions and pixels
            positions, extra = shown[0].to(self.device), shown[1].model_inputs(self.device)
        attention = torch.cat([self.mask[rows], seg_mask], dim=1)
        sub = self._new_cache([(k[rows.to(k.device)], v[rows.to(v.device)]) for k, v in self.kv])
        self.model(input_ids=ids, attention_mask=self._block_mask(attention, width), position_ids=positions,
                   past_key_values=sub, logits_to_keep=1, **extra)  # fmt: skip
        self.append_columns(width)
        for i, layer in enumerate(sub.layers):
            k, v = self.kv[i]
            at = rows.to(k.device)
            k[at], v[at] = layer.keys, layer.values
        self.mask[rows] = attention
        self.compact()

    def _segment_images(self, rows: torch.Tensor, segments: list[torch.Tensor], positions: torch.Tensor):
        """Segments that show images (multi-turn feedback): (M-RoPE positions (3, n, width) of every segment, the new
        images' inputs in row order), each such row's delta moved past its images; ``None`` when no segment has an
        image token (``positions``, their text positions, stay)."""
        image_id, merge = self.vision
        width = positions.shape[1]
        out, new = None, []
        for i, (r, seg) in enumerate(zip(rows.tolist(), segments, strict=True)):
            is_image = seg == image_id
            runs = int((is_image[1:] & ~is_image[:-1]).sum()) + int(bool(is_image[:1].any())) if len(seg) else 0
            if not runs:
                continue
            held = self.images(r) if self.images is not None else None
            if held is None or held.num_images < runs:
                raise ValueError(f"row {r}'s new tokens hold {runs} image(s) but its slot has "
                                 f"{0 if held is None else held.num_images}: feedback image tokens without their images")  # fmt: skip
            grids = held.image_grid_thw[held.num_images - runs :]
            patches = int(grids.prod(-1).sum())
            inputs = ImageInputs.of(held.pixel_values[held.pixel_values.shape[0] - patches :], grids)
            seg_positions, delta = mrope_positions(seg, grids, image_token_id=image_id, merge_size=merge)
            if out is None:
                out = positions.expand(3, -1, -1).clone()
            start = int(self.length[r] + self.delta[r])
            out[:, i, width - len(seg) :] = seg_positions + start
            self.delta[r] += delta
            new.append(inputs)
        return None if out is None else (out, ImageInputs.cat(new))

    # -- stepping --
    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Feed one token per slot (B,), appended where ``live``; returns next-token logits (B, V).

        Every row attends to its new column (idle rows to their own token), so no row is ever fully
        masked; only live rows count it as a cached token, and keep it unmasked: an idle row's column is a hole (a
        waiting slot's later tokens must not attend to it).

        When every row caches a token in every column (known on the host: each row's ``length`` is the width), the
        step has no padding and the forward gets no mask, as ``generate`` does then: the attention needs no mask (nor
        a copy of the keys per query head for it).
        """
        is_dense = self._unmasked_when_dense and int(self.length.min()) == self.columns
        at = self.length if self.vision is None else self.length + self.delta  # a token's (M-RoPE) position
        if self.device.type == "cpu":  # the ids and positions are host tensors already: no copy
            ids, positions, kept = tokens.view(-1, 1), at.view(-1, 1), live
        else:  # (B, 3): one host-to-device copy
            step = torch.stack([tokens, at, live.to(torch.int64)], 1).to(self.device, non_blocking=True)
            ids, positions, kept = step[:, :1], step[:, 1:2], step[:, 2]
        if is_dense:
            out = self.model(input_ids=ids, position_ids=positions, past_key_values=self.cache)
            self.mask = torch.cat([self.mask, kept.view(-1, 1)], dim=1)  # the new column: attended by live rows only
        else:
            attention = torch.cat([self.mask, self._new_column], dim=1)  # (B, C+1)
            out = self.model(input_ids=ids, attention_mask=self.decode_mask(attention), position_ids=positions,
                             past_key_values=self.cache)  # fmt: skip
            attention[:, -1] = kept  # after the forward: the new column stays attended by live rows only
            self.mask = attention
        self.length += live  # after the forward: ``positions`` may be a view of it
        return out.logits[:, -1]

    def decode_mask(self, attention: torch.Tensor) -> torch.Tensor:
        """The attention mask (B, C+1) of a one-token step, as the model's attention takes it without a host read
        (for a subclass's own decode step too).

        Given a 2-D mask, transformers asks the host whether every column is attended (to skip the mask), one
        synchronization per forward on an accelerator; a 4-D mask (B, 1, 1, C+1) goes to the attention as it is. A
        new token attends to every cached column of its row, so the padding mask is the whole mask: bool for SDPA,
        additive for eager; other kernels (flash attention) take the 2-D mask.
        """
        return self._as_4d(attention.bool()[:, None, None, :], attention)

    def _block_mask(self, attention: torch.Tensor, queries: int | None = None) -> torch.Tensor:
        """The 4-D mask (n, 1, q, K) of ``q`` new tokens (the last ``q`` of the ``K`` columns of ``attention``, (n, K)):
        causal, padding columns masked; a padding query attends to itself alone (no fully masked row, whose attention
        SDPA would make NaN and carry into the cache's values)."""
        n, K = attention.shape
        q = K if queries is None else queries
        cols = torch.arange(K, device=attention.device)
        query_cols = cols[K - q :, None]  # (q, 1)
        allowed = (cols[None, :] <= query_cols) & attention.bool()[:, None, :]  # (n, q, K)
        allowed |= cols[None, :] == query_cols
        return self._as_4d(allowed[:, None], attention)

    def _as_4d(self, allowed: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        kind = getattr(self.model.config, "_attn_implementation", None)
        if kind == "sdpa":
            return allowed
        if kind == "eager":
            dtype = self.kv[0][0].dtype
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, torch.finfo(dtype).min)  # fmt: skip
        return attention

    def compact(self) -> None:
        """Right-align every row: its cached tokens become the last ``length`` columns (O(B * C))."""
        keep = int(self.length.max())
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, self.columns - keep :]  # (B, keep)
        self.replace_columns([(k.gather(2, _expand(order.to(k.device), k)), v.gather(2, _expand(order.to(v.device), v)))
                               for k, v in self.kv], self.mask.gather(1, order))  # fmt: skip
        self.first.copy_(self._base + keep - self.length)

    def clear(self) -> None:
        """Forget every slot (after a weight update, say): the next :meth:`sync` prefills every live slot.

        Cheaper than a new cache, which probes the model once to learn its layer shapes.
        """
        self.replace_columns([(k.new_zeros(*k.shape[:2], 0, k.shape[3]), v.new_zeros(*v.shape[:2], 0, v.shape[3]))
                               for k, v in self.kv], self.mask.new_zeros(self.batch_size, 0))  # fmt: skip
        self.length = torch.zeros_like(self.length)
        self.delta = torch.zeros_like(self.delta)
        self.traj = torch.full_like(self.traj, -1)
        self.first, self._base = torch.zeros_like(self.first), 0
        self._seen = (None, None)
        self.prefixes.clear()  # held prompts: their keys and values belong to the old weights

    # -- checkpoints --
    def state_dict(self) -> dict:
        """Keys, values, mask, lengths, spans and trajectory ids (clones), for checkpoints."""
        return {"kv": [(k.clone(), v.clone()) for k, v in self.kv], "mask": self.mask.clone(),
                "length": self.length.clone(), "span": self.span(), "traj": self.traj.clone(),
                "delta": self.delta.clone(), "prefixes": self.prefixes.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (of a cache with the same number of slots)."""
        rows = int(state["mask"].shape[0])
        if rows != self.batch_size:
            raise ValueError(f"this KV cache checkpoint holds {rows} slots, the cache has {self.batch_size}")
        # a checkpoint loaded with map_location="cpu" goes back to the model's devices (and dtype: a checkpoint of a
        # float32 run resumed on a bfloat16 model); bookkeeping to the host
        self.replace_columns([(k.to(mine.device, mine.dtype, copy=True), v.to(mine_v.device, mine_v.dtype, copy=True))
                               for (k, v), (mine, mine_v) in zip(state["kv"], self.kv, strict=True)],
                              state["mask"].to(self.device, copy=True))  # fmt: skip
        self.length, self.traj = state["length"].to("cpu", copy=True), state["traj"].to("cpu", copy=True)
        self.delta = state.get("delta", torch.zeros_like(self.length)).to("cpu", copy=True)
        self._base = 0  # a checkpoint without spans (older) holds right-aligned rows
        self.first = self.columns - state.get("span", self.length).to("cpu", copy=True)
        self._seen = (None, None)
        self.prefixes.load_state_dict(state.get("prefixes", []), [(k.device, v.device) for k, v in self.kv])

    def nbytes(self) -> int:
        """Bytes held by keys and values."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


def _full_attention(config) -> bool:
    """Whether every layer of a model of ``config`` attends to all earlier tokens (no sliding-window layer)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


def _digest_key(held) -> tuple[int, ...]:
    """What a prefix key adds for its images: their digest as two negative ints (no token id is negative)."""
    if held is None:
        return ()
    value = int(held[0].digest, 16)
    return (-(value >> 32) - 1, -(value & 0xFFFFFFFF) - 1)


def _expand(order: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Column indices (B, C') expanded to gather keys or values (B, H, C', D)."""
    return order[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3])
