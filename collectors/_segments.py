"""Where a trajectory recorder's finished trajectories are (segments: a wave's own tensors, or the packed row
store; chains: the pieces of a trajectory that went on across waves) and how a batch is assembled from them
(split episodes' parts given their episode's reward)."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import F_ACTIVE, F_DONE, F_GROUP, F_RESP, F_TRAJ, Cells, Packer, flat_name
from tokengym.llm_envs import keys

__all__ = ["Chain", "Segment", "assemble", "give_parts_their_reward", "open_rows", "wave_rows"]

F_REWARD = flat_name(keys.REWARD)


class Segment:
    """Where finished trajectories' steps are: a wave's own (B, Tn, ...) tensors by flat name (``is_packed``
    False; zero past each row's end), a wave's real steps (n, ...) by flat name (``starts``: each row's first
    step, see :class:`~tokengym.collectors._packing.Cells`), or the recorder's packed row store
    (dtype -> (R, T_max, n))."""

    __slots__ = ("tensors", "is_packed", "starts")

    def __init__(self, tensors: dict, *, is_packed: bool = False, starts: list[int] | None = None) -> None:
        self.tensors, self.is_packed, self.starts = tensors, is_packed, starts

    def offset(self, row: int) -> int:
        """Where row ``row``'s first step is in the flattened (unpacked) tensors, in steps."""
        return self.starts[row] if self.starts is not None else row * next(iter(self.tensors.values())).shape[1]

    @property
    def lead(self) -> int:
        """Leading dims of the tensors before each step's own shape: 1 for real steps, 2 for rows."""
        return 1 if self.starts is not None else 2


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


def wave_rows(chunk: dict) -> tuple[Segment, dict]:
    """A wave's segment and, per slot (B,): ``live`` (in the wave), ``counts`` (its steps), ``ends`` (its trajectory
    ends in the wave) and its first step's response length, group, trajectory and sample ids (by flat name; any
    value for a slot not live). ``chunk``: the wave's (B, Tn, ...) tensors, or its real steps (:class:`Cells`)."""
    names = (F_RESP, F_GROUP, F_TRAJ, keys.SAMPLE_ID)
    if isinstance(chunk, Cells):
        counts, done = chunk.counts, chunk[F_DONE].reshape(-1)
        first = torch.tensor(chunk.starts).clamp(max=len(done) - 1)  # a slot without steps: any step, not read
        out = {name: chunk[name].index_select(0, first) for name in names}
        live = counts > 0
        out.update(live=live, counts=counts, ends=live & done.index_select(0, (first + counts - 1).clamp(min=0)))
        return Segment(chunk, starts=chunk.starts), out
    active = chunk[F_ACTIVE]  # (B, Tn): zero past each row's end
    out = {name: chunk[name][:, 0] for name in names}
    out.update(live=active[:, 0], counts=active.sum(1), ends=chunk[F_DONE].reshape(active.shape).any(1))
    return Segment(chunk), out


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
            at[1].append(piece.offset(row))
            at[2].append(offset)
            at[3].append(steps)
            offset += steps
    if not stored and len(cells) == 1 and next(iter(cells.values()))[0].starts is None:
        seg, sources, _, _ = next(iter(cells.values()))
        B, Tn = next(iter(seg.tensors.values())).shape[:2]
        if B == len(take) and Tn >= width and sources == list(range(0, B * Tn, Tn)):
            return {name: v[:, :width] for name, v in seg.tensors.items()}  # the wave, as it is
    is_alone = len(stored) == 1 and not cells
    pieces = [(where, _store_rows(seg, rows, width, mask[where], packer, clone=is_alone))
              for seg, where, rows in stored.values()]  # fmt: skip
    if is_alone:  # the batch is rows of the store
        return {name: v if v.shape[1] == width else _pad(v, width) for name, v in pieces[0][1].items()}
    model = next(iter(cells.values()))[0] if not pieces else None  # each name's dtype and trailing shape
    names, lead = (pieces[0][1], 2) if model is None else (model.tensors, model.lead)
    out = {name: first.new_zeros(len(take), width, *first.shape[lead:]) for name, first in names.items()}
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
