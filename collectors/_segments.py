"""Where a trajectory recorder's finished trajectories are (segments: a wave's own tensors, or the packed row
store; chains: the pieces of a trajectory that went on across waves) and how a batch is assembled from them
(split episodes' parts given their episode's reward)."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import Packer, flat_name
from tokengym.llm_envs import keys

__all__ = ["Chain", "Segment", "assemble", "give_parts_their_reward", "open_rows"]

F_REWARD = flat_name(keys.REWARD)


class Segment:
    """Where finished trajectories' steps are: a wave's own (B, Tn, ...) tensors by flat name (``is_packed``
    False; zero past each row's end), or the recorder's packed row store (dtype -> (R, T_max, n))."""

    __slots__ = ("tensors", "is_packed")

    def __init__(self, tensors: dict, *, is_packed: bool = False) -> None:
        self.tensors, self.is_packed = tensors, is_packed


class Chain:
    """A trajectory that went on across waves, by reference: its ``pieces`` ``(segment, row, steps)`` in order, each
    the first ``steps`` steps of a row of an unpacked segment (a wave's tensors, or a checkpoint's live rows)."""

    __slots__ = ("pieces",)
    is_packed = False

    def __init__(self, pieces: list[tuple[Segment, int, int]]) -> None:
        self.pieces = pieces

    @property
    def tensors(self) -> dict:
        return self.pieces[0][0].tensors


def assemble(take: list[tuple], width: int, mask: torch.Tensor, packer: Packer) -> dict:
    """Per flat name, the rows of ``take`` (entries ``(segment or Chain, row, length, ...)``) in order, cut or
    zero-padded to ``width`` (``mask``: each row's steps).

    One wave's rows in order are the wave's tensors as they are. Otherwise the steps of a wave's row or of a chain's
    pieces are copied cell by cell: per segment, the flat indices of its cells there and in the batch, then per name
    one gather and one scatter over those cells only (padding is never copied). Rows of a packed store are gathered
    per dtype, cleared past each end, unpacked with ``packer`` and put in place."""
    stored: dict[int, tuple[Segment, list[int], list[int]]] = {}  # per packed store: batch rows, its rows
    cells: dict[int, tuple[Segment, list[int], list[int], list[int]]] = {}  # per segment: sources, targets, steps
    for i, e in enumerate(take):
        seg = e[0]
        if seg.is_packed:
            part = stored.setdefault(id(seg), (seg, [], []))
            part[1].append(i)
            part[2].append(e[1])
            continue
        offset, end = i * width, (i + 1) * width
        for piece, row, steps in seg.pieces if isinstance(seg, Chain) else ((seg, e[1], e[2]),):
            steps = min(steps, end - offset)  # a batch cut shorter than the trajectory keeps its first steps
            at = cells.setdefault(id(piece), (piece, [], [], []))
            at[1].append(row * next(iter(piece.tensors.values())).shape[1])
            at[2].append(offset)
            at[3].append(steps)
            offset += steps
    if not stored and len(cells) == 1:
        seg, sources, _, _ = next(iter(cells.values()))
        B, Tn = next(iter(seg.tensors.values())).shape[:2]
        if B == len(take) and Tn >= width and sources == list(range(0, B * Tn, Tn)):
            return {name: v[:, :width] for name, v in seg.tensors.items()}  # the wave, as it is
    is_alone = len(stored) == 1 and not cells
    pieces = [(where, _store_rows(seg, rows, width, mask[where], packer, clone=is_alone))
              for seg, where, rows in stored.values()]  # fmt: skip
    if is_alone:  # the batch is rows of the store
        return {name: v if v.shape[1] == width else _pad(v, width) for name, v in pieces[0][1].items()}
    names = pieces[0][1] if pieces else next(iter(cells.values()))[0].tensors  # each name's dtype, trailing shape
    out = {name: first.new_zeros(len(take), width, *first.shape[2:]) for name, first in names.items()}
    for where, flat in pieces:
        rows = torch.tensor(where, dtype=torch.int64)
        for name, src in flat.items():
            out[name][rows, : src.shape[1]] = src
    maps = [(seg, *_cell_map(sources, targets, steps)) for seg, sources, targets, steps in cells.values()]
    for name, v in out.items():
        k = v[0, 0].numel()  # elements per step
        flat = v.view(-1)
        for seg, src, dst in maps:
            if k != 1:
                src, dst = _per_element(src, k), _per_element(dst, k)
            flat.scatter_(0, dst, seg.tensors[name].reshape(-1).index_select(0, src))
    return out


def open_rows(chains: dict[int, list[tuple]], slots: int, width: int, packer: Packer) -> dict | None:
    """(slots, width, ...) tensors by flat name of each slot's trajectory going on (``chains``: slot -> its pieces),
    zeros where none; ``None`` when no slot has one."""
    entries = [(Chain(chains.get(b, [])), b, sum(p[2] for p in chains.get(b, []))) for b in range(slots)]
    if not any(e[2] for e in entries):
        return None
    mask = torch.arange(width)[None, :] < torch.tensor([e[2] for e in entries])[:, None]
    return assemble(entries, width, mask, packer)


def _store_rows(seg: Segment, rows: list[int], width: int, mask: torch.Tensor, packer: Packer, *, clone: bool) -> dict:
    """Rows of a packed store cut to ``width``, zero past each row's end (``mask``), unpacked (copies with
    ``clone``, else views of the gathered rows)."""
    index = torch.tensor(rows, dtype=torch.int64)
    packed = {dt: v[:, :width].index_select(0, index) for dt, v in seg.tensors.items()}
    for v in packed.values():
        v.masked_fill_(~mask[:, : v.shape[1], None], 0)  # store rows hold older steps past the end
    return packer.unpack(packed, clone=clone)


def _pad(v: torch.Tensor, width: int) -> torch.Tensor:
    out = v.new_zeros(v.shape[0], width, *v.shape[2:])
    out[:, : v.shape[1]] = v
    return out


def _cell_map(sources: list[int], targets: list[int], steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cell indices of runs of ``steps`` cells that start at ``sources`` (in a segment) and ``targets`` (in the
    batch)."""
    counts = torch.tensor(steps)
    within = torch.arange(int(counts.sum())) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    return (torch.tensor(sources).repeat_interleave(counts) + within,
            torch.tensor(targets).repeat_interleave(counts) + within)  # fmt: skip


def _per_element(cell: torch.Tensor, k: int) -> torch.Tensor:
    """Flat element indices of cells that hold ``k`` elements each."""
    return (cell[:, None] * k + torch.arange(k)).reshape(-1)


def give_parts_their_reward(out: dict, take: list[tuple], lengths: torch.Tensor) -> None:
    """Each part's last step in an assembled batch ``out`` gets its episode's reward: the summed reward of the episode's
    last trajectory in ``take`` (entries ``(segment, row, length, group, traj, score, sample, is_part)``; parts precede it). The reward a part had at its end (the handler's, at the split) is replaced."""
    reward = out[F_REWARD]  # (N, T, 1)
    totals = reward.reshape(reward.shape[0], -1).sum(1)
    final_of = {(e[3], e[6]): i for i, e in enumerate(take) if not e[7]}
    rows = [i for i, e in enumerate(take) if e[7] and (e[3], e[6]) in final_of]
    if rows:
        index = torch.tensor(rows)
        reward[index, lengths[index] - 1] = totals[[final_of[(take[i][3], take[i][6])] for i in rows]].reshape(-1, 1)
