"""Prefix-shared training layout: the rows of a padded layout that share a prefix packed into one row, the prefix once.

A GRPO group is G samples of one prompt; the padded layout of :func:`~tokengym.transforms.to_padded` holds the prompt
in each of its G rows, so a forward over it computes the prompt G times. :func:`to_shared_prefix` packs the rows that
share a prompt into one row instead: the prompt once, then every sample's own tokens after it, each attending to the
prompt through a block attention mask and keeping the position ids of its padded row, so every token sees exactly
the context it sees in the padded layout (AReaL's tree training, verl's prefix tree, Unsloth's PrefixGrouper).

Inside a pack the tokens form a **prefix tree**: a segment is a run of tokens, the root segment is the prefix the
pack's rows share, and a segment's parent is the segment before it on every row through it. Rows that share more than
the prompt (multi-turn and agent trajectories whose first turns agree, samples of a tree) share their longest common
prefix: a segment splits where their tokens part. A row whose tokens end inside the tree (a prefix of another row)
adds no tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._checks import found_keys
from tokengym.transforms._prefix_tree import prefix_tree
from tokengym.transforms.layouts import to_padded

__all__ = ["SharedPrefixLayout", "to_shared_prefix"]

_NOT_PADDED = ("to_shared_prefix reads a padded layout (a TensorDict [N, L] with {tokens!r} and {mask!r}, "
               "tokengym.llm_envs.keys), but {problem}; lay a TRAJECTORIES batch out with "
               "tokengym.transforms.to_padded(batch) first")  # fmt: skip


class SharedPrefixLayout(NamedTuple):
    """Packed rows whose shared prefixes appear once, described as a prefix tree, and the map back to the padded layout.

    ``M`` packs (packed rows) of ``S`` columns, ``K`` segments; ``N, L`` the padded layout's shape. A flat packed
    index is ``pack * S + column``.

    Attributes:
        tokens: int64 (M, S): packed token ids, 0 on padding.
        position_ids: int64 (M, S): each token's position in its rows (their ``keys.POSITION_IDS``), 0 on padding.
        segment_ids: int64 (M, S): the segment of each packed token, -1 on padding.
        parents: int64 (K,): the parent segment of each segment, -1 for a pack's root (the prefix its rows share).
        starts: int64 (K,): the packed column of each segment's first token (a parent before its children).
        lengths: int64 (K,): tokens in each segment.
        packs: int64 (K,): the pack (packed row) of each segment.
        row_segments: int64 (N,): the last segment of each padded row; its path to the root holds the row's tokens.
        source: int64 (N, L): the flat packed index of the token at each padded ``(row, column)``, -1 on padding.
        predictor: int64 (N, L): the flat packed index whose logits score the token at ``(row, column)``: its
            predecessor's; -1 where there is none (padding, a row's first token).
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    parents: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    packs: torch.Tensor
    row_segments: torch.Tensor
    source: torch.Tensor
    predictor: torch.Tensor

    def path(self, row: int) -> list[int]:
        """The segments of padded row ``row``, from its pack's root to its last segment."""
        out, seg = [], int(self.row_segments[row])
        while seg >= 0:
            out.append(seg)
            seg = int(self.parents[seg])
        return out[::-1]

    def ancestors(self) -> torch.Tensor:
        """bool (K + 1, K + 1): ``[s, t]`` is True when segment ``t`` is ``s`` or one of its ancestors; index ``K``
        stands for padding (it sees only padding)."""
        k = len(self.parents)
        out = torch.eye(k + 1, dtype=torch.bool, device=self.parents.device)
        rows, cur = torch.arange(k, device=out.device), self.parents
        while bool((cur >= 0).any()):
            up = cur >= 0
            out[rows[up], cur[up]] = True
            cur = torch.where(up, self.parents[cur.clamp(min=0)], -1)
        return out

    def attention_mask(self, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """The 4-D block attention mask (M, 1, S, S) a transformers model takes as ``attention_mask``.

        A token attends to the tokens before it in its own segment and in its segment's ancestors; a padding token to
        the padding before it (no row of the mask is empty). ``torch.bool`` (True: attend) for SDPA; a float dtype
        gives the additive mask of eager attention (0, or the dtype's minimum).
        """
        seg = torch.where(self.segment_ids >= 0, self.segment_ids, len(self.parents))
        columns = torch.arange(seg.shape[1], device=seg.device)
        allowed = self.ancestors()[seg[:, :, None], seg[:, None, :]] & (columns[None, :] <= columns[:, None])
        if dtype == torch.bool:
            return allowed[:, None]
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=seg.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return blocked[:, None]

    def to(self, device) -> SharedPrefixLayout:
        """The layout with every tensor on ``device``."""
        return SharedPrefixLayout(*(t.to(device) for t in self))


def to_shared_prefix(padded: TensorDictBase, *, min_shared: int | None = None) -> SharedPrefixLayout:
    """The prefix-shared layout of a padded layout: rows that share a prefix packed into one row, the prefix once.

    Rows go into one pack when they share their prompt (the tokens before their first generated token,
    ``keys.ACTION_MASK``), or with ``min_shared`` their first ``min_shared`` tokens (rows with the same prompt from
    different groups share a pack; a row sharing its prompt with no other is a pack of its own). Inside a pack the rows
    share their longest common prefixes (a prefix tree, :class:`SharedPrefixLayout`). Packs are right-padded to the
    longest. The work is on the host (one copy of the tokens there); the result is on ``padded``'s device.

    Args:
        padded: the padded layout of :func:`~tokengym.transforms.to_padded` (``keys.TOKENS``, ``keys.ATTENTION_MASK``,
            ``keys.ACTION_MASK``): each row's real tokens one run of columns. A TRAJECTORIES batch is laid out with
            ``to_padded`` first (the maps then index ``to_padded(batch)``).
        min_shared: the prefix length rows must share to be packed together (>= 1); ``None``: their whole prompt.
            A small value packs rows that share only a system prompt: one longer row, whose dense attention mask
            costs more than the shared tokens save when they are few.

    Raises:
        ValueError: ``padded`` is not a padded layout (the message names ``to_padded``), or ``min_shared < 1``.

    Example:
        >>> from tensordict import TensorDict
        >>> tokens = torch.tensor([[0, 7, 8, 3, 4], [0, 7, 8, 3, 5], [6, 7, 8, 9, 0]])
        >>> mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
        >>> act = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]).bool()
        >>> lay = to_shared_prefix(TensorDict({keys.TOKENS: tokens, keys.ATTENTION_MASK: mask, keys.ACTION_MASK: act}, [3, 5]))
        >>> lay.tokens.tolist(), lay.position_ids.tolist()
        ([[7, 8, 3, 4, 5], [6, 7, 8, 9, 0]], [[0, 1, 2, 3, 3], [0, 1, 2, 3, 0]])
        >>> lay.parents.tolist(), lay.path(0), lay.path(1), lay.predictor[1].tolist()  # 7 8 3 shared, then 4 | 5
        ([-1, 0, 0, -1], [0, 1], [0, 2], [-1, -1, 0, 1, 2])
    """
    if min_shared is not None and (isinstance(min_shared, bool) or not isinstance(min_shared, int) or min_shared < 1):
        raise ValueError(f"min_shared must be an int >= 1 (tokens rows share to be packed together) or None (their "
                         f"prompt), got {min_shared!r}")  # fmt: skip
    if isinstance(padded, TensorDictBase) and padded.get(keys.TOKENS, None) is None and keys.ACTION in padded.keys():
        padded = to_padded(padded)
    tokens, mask, generated = _check_padded(padded)
    home = tokens.device
    tokens, mask, generated = tokens.cpu(), mask.cpu(), generated.cpu()
    starts, lengths = mask.int().argmax(-1), mask.sum(-1)
    seq = _depth_aligned(tokens, starts, lengths)  # (N, D): row i's real tokens from depth 0, -1 after them
    first_generated = torch.where(generated.any(-1), generated.int().argmax(-1) - starts, lengths)
    shared = first_generated.clamp(min=1) if min_shared is None else lengths.clamp(max=min_shared)
    pack_of_row = _packs(seq, shared)
    trees = [prefix_tree(rows, seq[rows], lengths[rows]) for rows in _rows_by_pack(pack_of_row)]
    return _assemble(trees, seq, starts, mask.shape).to(home)


def _check_padded(padded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``keys.TOKENS``, ``keys.ATTENTION_MASK`` and ``keys.ACTION_MASK`` of a padded layout, or a ValueError."""
    fmt = {"tokens": keys.TOKENS, "mask": keys.ATTENTION_MASK}
    if not isinstance(padded, TensorDictBase):
        raise ValueError(_NOT_PADDED.format(problem=f"got a {type(padded).__name__}", **fmt))
    missing = [k for k in (keys.TOKENS, keys.ATTENTION_MASK, keys.ACTION_MASK) if padded.get(k, None) is None]
    if missing or padded.batch_dims != 2:
        problem = (f"it lacks {missing} (keys {found_keys(padded)})" if missing
                   else f"its batch_size is {tuple(padded.batch_size)}")  # fmt: skip
        raise ValueError(_NOT_PADDED.format(problem=problem, **fmt))
    tokens, mask = padded.get(keys.TOKENS), padded.get(keys.ATTENTION_MASK).bool()
    columns = torch.arange(mask.shape[1], device=mask.device)
    starts, lengths = mask.int().argmax(-1), mask.sum(-1)
    run = (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])
    if bool((lengths == 0).any()) or not torch.equal(run, mask):
        row = int(((lengths == 0) | (run != mask).any(-1)).nonzero()[0])
        raise ValueError(_NOT_PADDED.format(problem=f"row {row}'s attention mask is not one run of real tokens", **fmt))
    return tokens, mask, padded.get(keys.ACTION_MASK).bool()


def _depth_aligned(tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    depth = torch.arange(int(lengths.max()))
    cols = (starts[:, None] + depth).clamp(max=tokens.shape[1] - 1)
    return torch.where(depth < lengths[:, None], tokens.gather(1, cols), -1)


def _packs(seq: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The pack of each row: rows with the same first ``shared`` tokens share one, numbered by their first row."""
    depth = torch.arange(int(shared.max()))
    key = torch.cat([shared[:, None], torch.where(depth < shared[:, None], seq[:, : len(depth)], -1)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(len(inverse))
    first = torch.full((int(inverse.max()) + 1,), len(inverse)).scatter_reduce(0, inverse, rows, "amin")
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(len(first))
    return rank[inverse]


def _rows_by_pack(pack_of_row: torch.Tensor) -> list[torch.Tensor]:
    order = pack_of_row.argsort(stable=True)
    return list(order.split(torch.bincount(pack_of_row).tolist()))


def _assemble(trees: list[dict], seq: torch.Tensor, starts: torch.Tensor, shape: torch.Size) -> SharedPrefixLayout:
    """The packed tensors of every pack's tree and the maps from the padded ``(row, column)`` to packed indices."""
    base = torch.tensor([0] + [len(t["start"]) for t in trees]).cumsum(0)
    depth0 = torch.tensor([d for t in trees for d in t["start"]], dtype=torch.int64)
    lengths = torch.tensor([n for t in trees for n in t["length"]], dtype=torch.int64)
    parents = torch.tensor([p + int(b) if p >= 0 else -1 for t, b in zip(trees, base, strict=False) for p in t["parent"]],
                           dtype=torch.int64)  # fmt: skip
    packs = torch.arange(len(trees)).repeat_interleave(base.diff())
    src = torch.cat([t["src"] for t in trees])
    starts_in_pack = _exclusive_cumsum(lengths) - _exclusive_cumsum(lengths)[base[:-1]].repeat_interleave(base.diff())
    width = int(torch.zeros(len(trees), dtype=torch.int64).index_add_(0, packs, lengths).max())
    seg_of_token = torch.arange(len(lengths)).repeat_interleave(lengths)
    within = torch.arange(int(lengths.sum())) - _exclusive_cumsum(lengths)[seg_of_token]
    flat = packs[seg_of_token] * width + starts_in_pack[seg_of_token] + within
    depth = depth0[seg_of_token] + within
    m = len(trees)
    tokens = torch.zeros(m * width, dtype=torch.int64).index_copy_(0, flat, seq[src[seg_of_token], depth])
    positions = torch.zeros(m * width, dtype=torch.int64).index_copy_(0, flat, depth)
    segment_ids = torch.full((m * width,), -1, dtype=torch.int64).index_copy_(0, flat, seg_of_token)
    row_segments = torch.empty(shape[0], dtype=torch.int64)
    for t, b in zip(trees, base, strict=False):
        row_segments[t["rows"]] = torch.tensor(t["leaf"], dtype=torch.int64) + b
    source = _source(row_segments, parents, depth0, lengths, packs * width + starts_in_pack, starts, shape)
    predictor = torch.full(shape, -1, dtype=torch.int64)
    predictor[:, 1:] = torch.where((source[:, 1:] >= 0) & (source[:, :-1] >= 0), source[:, :-1], -1)
    return SharedPrefixLayout(tokens.view(m, width), positions.view(m, width), segment_ids.view(m, width), parents,
                              starts_in_pack, lengths, packs, row_segments, source, predictor)  # fmt: skip


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0) - x


def _source(row_segments, parents, depth0, lengths, seg_flat, starts, shape) -> torch.Tensor:
    """(N, L): the flat packed index of each padded token, walking every row's path up its tree at once."""
    pair_rows, pair_segs = [], []
    rows, cur = torch.arange(shape[0]), row_segments
    while len(cur):
        pair_rows.append(rows), pair_segs.append(cur)
        up = parents[cur] >= 0
        rows, cur = rows[up], parents[cur][up]
    pair_rows, pair_segs = torch.cat(pair_rows), torch.cat(pair_segs)
    n_tok = lengths[pair_segs]
    pair = torch.arange(len(pair_segs)).repeat_interleave(n_tok)
    within = torch.arange(int(n_tok.sum())) - _exclusive_cumsum(n_tok)[pair]
    row, seg = pair_rows[pair], pair_segs[pair]
    source = torch.full(shape, -1, dtype=torch.int64)
    source[row, starts[row] + depth0[seg] + within] = seg_flat[seg] + within
    return source
