"""Waves' trajectories for a trajectory recorder: rows that hold whole trajectories stay in the wave's own tensors,
and a trajectory going on across waves is a chain of references to its rows in those waves (copied once, into the
batch)."""

from __future__ import annotations

import torch

from tokengym.collectors._packing import F_GROUP, F_RESP, F_TRAJ, Packer
from tokengym.collectors._segments import Chain, Segment, open_rows, wave_rows
from tokengym.llm_envs import keys

__all__ = ["WaveChains"]


class WaveChains:
    """The pieces of each slot's trajectory going on across waves, by reference.

    ``open``: slot -> the pieces ``(segment, row, steps)`` of its trajectory so far (``None`` until the first wave);
    ``slots``: how many slots the waves have; ``live``: a checkpoint's live rows, where restored trajectories going
    on begin.
    """

    def __init__(self) -> None:
        self.open: dict[int, list[tuple]] | None = None
        self.slots = 0
        self.live: Segment | None = None

    def write(self, chunk: dict) -> list[tuple]:
        """Take a wave (its (B, Tn, ...) tensors, or its real steps); returns its finished trajectories as batches
        ``(segments, rows, lengths, groups, trajs, samples)`` to queue in order: chains that end, then whole rows."""
        seg, wave = wave_rows(chunk)
        live, counts, ends = wave["live"], wave["counts"], wave["ends"]
        starts = live & (wave[F_RESP] == 0)
        whole = starts & ends  # the wave holds the whole trajectory
        if self.open is None:
            self.open, self.slots = {}, live.shape[0]
        out = []
        if not bool(whole.all()) and bool((live & ~whole).any()):
            out += self._extend(seg, wave, (live & ~whole).nonzero().squeeze(-1), starts)
        if bool(whole.any()):
            rows = whole.nonzero().squeeze(-1)
            out.append(([seg] * len(rows), rows, counts[rows], wave[F_GROUP][rows], wave[F_TRAJ][rows],
                        wave[keys.SAMPLE_ID][rows]))  # fmt: skip
        return out

    def _extend(self, seg: Segment, wave: dict, rows: torch.Tensor, starts) -> list[tuple]:
        """Keep the wave rows ``rows`` of trajectories going on across waves as pieces of their slots' chains (by
        reference); the chains that end, as one batch (none: an empty list). ``wave``: per slot, see
        :func:`~tokengym.collectors._segments.wave_rows`."""
        steps, resp = wave["counts"][rows].tolist(), wave[F_RESP][rows].tolist()
        is_start, is_end = starts[rows].tolist(), wave["ends"][rows].tolist()
        finished = []
        for slot, n, before, start, end in zip(rows.tolist(), steps, resp, is_start, is_end, strict=True):
            if start:
                self.open[slot] = []
            elif slot not in self.open:  # restored from a checkpoint: its steps so far are the live row's
                self.open[slot] = [(self.live, slot, before)]
            self.open[slot].append((seg, slot, n))
            if end:
                finished.append((slot, Chain(self.open.pop(slot)), before + n))
        if not finished:
            return []
        index = torch.tensor([f[0] for f in finished])
        return [([f[1] for f in finished], index, torch.tensor([f[2] for f in finished]), wave[F_GROUP][index],
                 wave[F_TRAJ][index], wave[keys.SAMPLE_ID][index])]  # fmt: skip

    def branch(self, slot: int, parent_slot: int, at: int, ended: list[tuple]) -> None:
        """Start ``slot``'s trajectory (a branch forked after the wave just written) as a chain of references to its
        parent's first ``at`` steps: the parent's queued entry when it ended (``ended``: the matches), else the
        parent going on in ``parent_slot``. The branch's own steps join it from the next wave on."""
        self.open[slot] = self._prefix(parent_slot, at, ended)

    def _prefix(self, slot: int, at: int, ended: list[tuple]) -> list[tuple]:
        if at == 0:
            return []
        pieces = None
        for e in ended:
            pieces = e[0].pieces if isinstance(e[0], Chain) else [(e[0], e[1], e[2])]
        if pieces is None:  # going on; restored from a checkpoint and not yet in a wave: the live row
            pieces = self.open[slot] if slot in self.open else [(self.live, slot, at)]
        out, n = [], 0
        for seg, row, steps in pieces:
            if n >= at:
                break
            out.append((seg, row, min(steps, at - n)))
            n += out[-1][2]
        return out

    def rows(self, width: int, packer: Packer | None) -> dict | None:
        """(slots, width, ...) tensors by flat name of each slot's trajectory going on (zeros where none); ``None``
        when no slot has one."""
        return open_rows(self.open, self.slots, width, packer)

    def load(self, live: dict | None) -> None:
        """Start over from a checkpoint's live rows (B, T_max, ...) by flat name: trajectories going on there go on
        from them."""
        self.open, self.live = None, None if live is None else Segment(dict(live))
