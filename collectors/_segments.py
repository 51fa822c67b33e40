"""Where a trajectory recorder's finished trajectories are (segments: a wave's own tensors, or the packed row
store) and how a batch is assembled from them (split episodes' parts given their episode's reward)."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import Packer, flat_name
from tokengym.llm_envs import keys

__all__ = ["Segment", "assemble", "give_parts_their_reward"]

F_REWARD = flat_name(keys.REWARD)


class Segment:
    """Where finished trajectories' steps are: a wave's own (B, Tn, ...) tensors by flat name (``is_packed``
    False; zero past each row's end), or the recorder's packed row store (dtype -> (R, T_max, n))."""

    __slots__ = ("tensors", "is_packed")

    def __init__(self, tensors: dict, *, is_packed: bool = False) -> None:
        self.tensors, self.is_packed = tensors, is_packed


def assemble(take: list[tuple], width: int, mask: torch.Tensor, packer: Packer) -> dict:
    """Per flat name, the rows of ``take`` (entries whose first two fields are a segment and a row) in order, cut or
    zero-padded to ``width`` (``mask``: each row's steps): the wave's tensors as they are when ``take`` is one
    wave's rows in order, else one gather per segment (per dtype for a packed store, unpacked with ``packer``)."""
    parts: dict[int, tuple[Segment, list[int], list[int]]] = {}
    for i, e in enumerate(take):
        part = parts.setdefault(id(e[0]), (e[0], [], []))
        part[1].append(i)
        part[2].append(e[1])
    pieces = []
    for seg, where, rows in parts.values():
        index = torch.tensor(rows, dtype=torch.int64)
        if seg.is_packed:
            packed = {dt: v[:, :width].index_select(0, index) for dt, v in seg.tensors.items()}
            m = mask[where] if len(parts) > 1 else mask
            for v in packed.values():
                v.masked_fill_(~m[:, : v.shape[1], None], 0)  # store rows hold older steps past the end
            flat = packer.unpack(packed, clone=len(parts) == 1)  # several pieces: copied into place below
        elif rows == list(range(len(rows))) and len(rows) == next(iter(seg.tensors.values())).shape[0]:
            flat = {name: v[:, :width] for name, v in seg.tensors.items()}  # the wave, as it is
        else:
            flat = {name: v[:, :width].index_select(0, index) for name, v in seg.tensors.items()}
        pieces.append((where, flat))
    out = {}
    rows_of = [torch.tensor(where, dtype=torch.int64) for where, _ in pieces]  # once, not per key
    for name, first in pieces[0][1].items():
        if len(pieces) == 1 and first.shape[1] == width:
            out[name] = first
            continue
        is_covered = all(flat[name].shape[1] == width for _, flat in pieces)  # every cell is written below
        v = (first.new_empty if is_covered else first.new_zeros)(len(take), width, *first.shape[2:])
        for rows, (_, flat) in zip(rows_of, pieces, strict=True):
            src = flat[name]
            if len(pieces) == 1:
                v[:, : src.shape[1]] = src
            elif src.shape[1] == width:
                v.index_copy_(0, rows, src)  # whole rows: cheaper than (rows, columns) indexing
            else:
                v[rows, : src.shape[1]] = src
        out[name] = v
    return out


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
