"""The prefix tree of the rows of one pack (private to :mod:`tokengym.transforms.shared_prefix`)."""

from __future__ import annotations

import torch


def prefix_tree(rows: torch.Tensor, seq: torch.Tensor, lengths: torch.Tensor) -> dict:
    """The prefix tree of one pack's rows (``seq`` (k, D), -1 after each row's tokens), segments in packed order.

    Rows are inserted in order: a row leaves the tree at its longest common prefix ``d`` with the rows before it
    (a segment holding depth ``d`` splits there) and adds a segment of its remaining tokens.

    Returns:
        per segment, parents first: ``start`` (depth of its first token), ``length``, ``parent`` (-1: the root),
        ``src`` (a row holding its tokens); per row: ``leaf`` (its last segment); and ``rows``.
    """
    lens = lengths.tolist()
    start, end, parent, src, leaf = [0], [lens[0]], [-1], [0], [0]
    for r in range(1, len(lens)):
        differ = torch.cat([seq[:r] != seq[r], torch.ones(r, 1, dtype=torch.bool)], dim=1)
        lcp = differ.int().argmax(-1).minimum(lengths[:r]).clamp(max=lens[r])
        q = int(lcp.argmax())
        d, s = int(lcp[q]), leaf[q]
        while start[s] >= d:  # up row q's path to the segment holding depth d - 1
            s = parent[s]
        if d < end[s]:  # split s at d: its tail becomes a child holding s's children and rows
            t = len(start)  # the index _add gives the tail
            parent[:] = [t if p == s else p for p in parent]
            leaf[:] = [t if x == s else x for x in leaf]
            _add(start, end, parent, src, (d, end[s], s, src[s]))
            end[s] = d
        if lens[r] > d:
            s = _add(start, end, parent, src, (d, lens[r], s, r))
        leaf.append(s)
    order = _preorder(parent)
    new = {old: i for i, old in enumerate(order)}
    return {"start": [start[o] for o in order], "length": [end[o] - start[o] for o in order],
            "parent": [new[parent[o]] if parent[o] >= 0 else -1 for o in order],
            "src": rows[[src[o] for o in order]], "leaf": [new[x] for x in leaf], "rows": rows}  # fmt: skip


def _add(start: list, end: list, parent: list, src: list, segment: tuple) -> int:
    """Append a segment (start depth, end depth, parent, source row); returns its index."""
    for column, value in zip((start, end, parent, src), segment, strict=True):
        column.append(value)
    return len(start) - 1


def _preorder(parent: list[int]) -> list[int]:
    """The segments parent-first, depth-first (children in insertion order)."""
    children: list[list[int]] = [[] for _ in parent]
    for seg, p in enumerate(parent):
        if p >= 0:
            children[p].append(seg)
    order, stack = [], [parent.index(-1)]
    while stack:
        seg = stack.pop()
        order.append(seg)
        stack.extend(reversed(children[seg]))
    return order
