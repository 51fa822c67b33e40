"""TrajectoryRecorder: finished trajectories, released by whole groups as right-padded (N, T) batches."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.collectors._packing import (
    F_ACTIVE,
    F_DONE,
    F_GROUP,
    F_MASK,
    F_RESP,
    F_TRAJ,
    F_VERSION,
    Packer,
    Step,
    flat_name,
    to_tensordict,
)
from tokengym.collectors._segments import (
    Chain,
    Segment,
    assemble,
    give_parts_their_reward,
    open_rows,
    wave_rows,
)
from tokengym.collectors._step_chunks import DeferredSteps, segment_rows
from tokengym.collectors.dynamic_sampling import DynamicSampling, SpreadFilter
from tokengym.llm_envs import keys

__all__ = ["TrajectoryRecorder"]

F_SAMPLE = keys.SAMPLE_ID


class TrajectoryRecorder:
    """Finished trajectories, right-padded to (N, T), released by whole groups.

    A finished trajectory is a reference ``(segment, row, length, group, traj, score)``, never a copy:

    - a wave's rows that hold whole trajectories (single-turn waves) stay in the wave's own tensors;
    - a trajectory whose turns go on across waves is a :class:`~tokengym.collectors._segments.Chain` of references
      to its rows in those waves (copied once, into the batch);
    - a trajectory built step by step (the step source) is written into a row of a packed store (one tensor per
      dtype), and keeps that row once it ends: its slot moves on to a free row. The store grows when every row is
      taken (bounded: live slots plus waiting trajectories).

    Finished trajectories wait per group until the group's ``group_size`` samples are in; complete
    groups are released in the order they completed, and a batch's tensors are assembled once, in
    :meth:`peek` (no copy at all when the batch is one wave's rows in order). Waiting is bounded: every
    waiting group has a sample in a slot or in the prompt source (a group that can no longer complete
    is dropped with :meth:`drop_groups`), so at most ``(B + 1) * (group_size - 1)`` trajectories wait.
    With ``dynamic_sampling``, a group is judged when it completes (:class:`SpreadFilter`): one whose rewards
    do not spread is dropped there (its store rows freed), so the queue holds only groups that go into batches.

    Args:
        batch_size: ``N``, trajectories per batch (a multiple of ``group_size``).
        max_steps: the longest trajectory (the env's ``max_new_tokens``).
        group_size: samples per group; 1 releases every trajectory as it finishes.
        is_fixed_width: pad every batch to ``max_steps`` (batches then stack in a replay buffer).
        dynamic_sampling: keep only groups whose rewards spread (a :class:`DynamicSampling`; ``group_size >= 2``).
    """

    def __init__(self, batch_size: int, max_steps: int, *, group_size: int = 1, is_fixed_width: bool = True,
                 dynamic_sampling: DynamicSampling | None = None) -> None:  # fmt: skip
        if batch_size % group_size:
            raise ValueError(f"batch_size={batch_size} is not a multiple of group_size={group_size}")
        if dynamic_sampling is not None and group_size < 2:
            raise ValueError(f"dynamic_sampling needs group_size >= 2, got group_size={group_size}")
        self.sampling = None if dynamic_sampling is None else SpreadFilter(dynamic_sampling, batch_size // group_size)
        self._score_name: str | None = None  # the flat name of the reward a trajectory's score sums
        self._score_column: tuple | None = None  # where it is in the packed store: (dtype, column)
        self.batch_size, self.max_steps, self.is_fixed_width = batch_size, max_steps, is_fixed_width
        self.group_size = group_size
        self.store: Segment | None = None  # packed rows of trajectories written step by step
        self.row_of_slot: torch.Tensor | None = None  # (B,) the store row each slot writes into
        self.open: dict[int, list[tuple]] | None = None  # waves: slot -> pieces of its trajectory going on
        self._slots = 0  # waves: how many slots they have
        self._live: Segment | None = None  # a checkpoint's live rows: where restored trajectories going on begin
        self.free: list[int] = []
        self._packer: Packer | None = None
        self._id_columns: tuple | None = None  # where group, trajectory and sample ids are in the store: (dtype, column) x 3
        self.ready: list[tuple] = []  # (segment, row, length, group, traj, score, sample, is_part) of complete groups
        self.waiting: dict[int, list[tuple]] = {}  # group -> its finished trajectories so far
        # split episodes: trajectories the env said end as parts, and finished parts held until the episode's last
        # trajectory (by (group, sample)); released with it, just before it, with its reward (see peek)
        self.parts: set[int] = set()
        self.held: dict[tuple[int, int], list[tuple]] = {}
        self.ready_parts = 0  # parts among the ready entries
        self.counters = {"dropped_groups": 0, "dropped_trajectories": 0}
        self.links: dict[int, tuple[int, int]] = {}  # trees: branch trajectory -> (parent trajectory, fork step)
        self.is_tree = False  # batches are trees' leaves: they carry the tree keys (BRANCH_ID, PARENT_ID, FORK_INDEX)
        self._peeked = 0  # ready trajectories the last peek() gave
        # single steps are kept as they come and written as one chunk when they may complete a batch (or are many):
        # every reader below writes them first (flush)
        self.deferred = DeferredSteps()

    # -- writing --
    def write(self, chunk: dict) -> None:
        """Record k steps (B, k, ...) (or a :class:`Step`); trajectories that end are queued by group."""
        if isinstance(chunk, Step):
            if self.deferred.add(chunk, self._could_fill) or chunk.forks:
                self.flush()
            if chunk.forks:
                self.fork(chunk.forks)
            return None
        self.flush()
        seg, wave = wave_rows(chunk)
        live, counts, ends = wave["live"], wave["counts"], wave["ends"]
        starts = live & (wave[F_RESP] == 0)
        whole = starts & ends  # the wave holds the whole trajectory
        if self.open is None:
            self.open, self._slots = {}, live.shape[0]
        if not bool(whole.all()) and bool((live & ~whole).any()):
            self._write_pieces(seg, wave, (live & ~whole).nonzero().squeeze(-1), starts)
        if bool(whole.any()):
            rows = whole.nonzero().squeeze(-1)
            self._finish([seg] * len(rows), rows, counts[rows], wave[F_GROUP][rows], wave[F_TRAJ][rows],
                         wave[F_SAMPLE][rows])  # fmt: skip
        forks = getattr(chunk, "forks", None)
        if forks:
            self._fork_chains(forks)

    @property
    def continues_turns(self) -> bool:
        """Whether trajectories went on across waves (then waves are best given as their real steps, see
        :class:`~tokengym.collectors._packing.Cells`: a batch copies them anyway)."""
        return bool(self.open)

    def _write_pieces(self, seg: Segment, wave: dict, rows: torch.Tensor, starts) -> None:
        """Keep the wave rows ``rows`` of trajectories going on across waves as pieces of their slots' chains (by
        reference); queue the chains that end (``wave``: per slot, see :func:`wave_rows`)."""
        steps, resp = wave["counts"][rows].tolist(), wave[F_RESP][rows].tolist()
        is_start, is_end = starts[rows].tolist(), wave["ends"][rows].tolist()
        finished = []
        for slot, n, before, start, end in zip(rows.tolist(), steps, resp, is_start, is_end, strict=True):
            if start:
                self.open[slot] = []
            elif slot not in self.open:  # restored from a checkpoint: its steps so far are the live row's
                self.open[slot] = [(self._live, slot, before)]
            self.open[slot].append((seg, slot, n))
            if end:
                finished.append((slot, Chain(self.open.pop(slot)), before + n))
        if finished:
            index = torch.tensor([f[0] for f in finished])
            self._finish([f[1] for f in finished], index, torch.tensor([f[2] for f in finished]),
                         wave[F_GROUP][index], wave[F_TRAJ][index], wave[F_SAMPLE][index])  # fmt: skip

    def _take_rows(self, n: int) -> torch.Tensor:
        """``n`` free rows of the store (it doubles when none are left)."""
        if n == 1 and self.free:
            return torch.tensor([self.free.pop(0)], dtype=torch.int64)
        if len(self.free) < n:
            size = next(iter(self.store.tensors.values())).shape[0]
            grow = max(size, n)
            self.store.tensors = {dt: torch.cat([v, v.new_zeros(grow, *v.shape[1:])]) for dt, v in self.store.tensors.items()}
            self.free += range(size, size + grow)
        rows, self.free = self.free[:n], self.free[n:]
        return torch.tensor(rows, dtype=torch.int64)

    def flush(self) -> None:
        """Write the steps kept so far (see :class:`~tokengym.collectors._step_chunks.DeferredSteps`)."""
        chunk = self.deferred.take()
        if chunk is not None:
            self._write_step_chunk(chunk)

    def _could_fill(self, finished: dict[int, int]) -> bool:
        """Whether trajectories finished in kept steps (counts by group) may complete a batch once written; with
        dynamic sampling, whether they may complete a group (a group is judged, and counted against the draw bound
        checked between steps, when it completes: the counts stay exact)."""
        ready, g = len(self.ready) - self.ready_parts, self.group_size
        if g == 1:
            return ready + sum(finished.values()) >= self.batch_size
        complete = sum(g for group, n in finished.items() if n + len(self.waiting.get(group, ())) >= g)
        return complete > 0 if self.sampling is not None else ready + complete >= self.batch_size

    def _write_step_chunk(self, chunk: dict) -> None:
        """Write consecutive steps (B, k, ...) of the step source: a slot may end a trajectory and start the next
        within them (the next goes to a free row); finished ones are queued in the order stepping finished them."""
        active = chunk[F_ACTIVE]  # (B, k)
        done = chunk[F_DONE].reshape(active.shape) & active
        cell, packed = self._pack_cells(chunk, active)
        n_ended = int(done.sum())
        new_rows = self._take_rows(n_ended) if n_ended else torch.zeros(0, dtype=torch.int64)
        cell_rows, e_slots, e_steps, e_rows, self.row_of_slot = segment_rows(done, self.row_of_slot, new_rows)
        pos = chunk[F_RESP].reshape(-1).index_select(0, cell).clamp(max=self.max_steps - 1)
        dst = cell_rows.reshape(-1).index_select(0, cell) * self.max_steps + pos  # (store row, position), flat
        for dt, v in packed.items():  # one index_copy_ per dtype
            self.store.tensors[dt].view(-1, v.shape[-1]).index_copy_(0, dst, v)
        if n_ended:
            lengths = chunk[F_RESP][e_slots, e_steps].clamp(max=self.max_steps - 1) + 1
            self._queue_rows(e_rows, lengths)

    def _pack_cells(self, chunk: dict, sel: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The cells ``sel`` (B, k) of ``chunk`` as flat indices (slot * k + step) and packed (one tensor per dtype):
        gathered per key with one flat index, then packed, so the interleaving copy runs over them only. The store
        exists afterwards."""
        if self._packer is None:
            self._packer = Packer(chunk)
        slots, cols = sel.nonzero(as_tuple=True)
        cell = slots * sel.shape[1] + cols
        packed = self._packer.pack(Step({name: v.reshape(-1, *v.shape[2:]).index_select(0, cell)
                                         for name, v in chunk.items()}))  # fmt: skip
        if self.store is None:
            B = sel.shape[0]
            self.store = Segment({dt: v.new_zeros(B, self.max_steps, v.shape[-1]) for dt, v in packed.items()}, is_packed=True)
            self.row_of_slot, self.free = torch.arange(B), []
        return cell, packed

    def _queue_rows(self, finished: torch.Tensor, lengths: torch.Tensor) -> None:
        """Queue finished trajectories by their store rows (ids read from each row's last step: a tree's branch
        holds its ancestors' steps first)."""
        if self._id_columns is None:
            self._id_columns = tuple(self._packer.column(f) for f in (F_GROUP, F_TRAJ, F_SAMPLE))
        last = lengths - 1
        groups, trajs, samples = (self.store.tensors[dt][finished, last, col] for dt, col in self._id_columns)
        self._finish([self.store] * len(finished), finished, lengths, groups, trajs, samples)

    def fork(self, forks: list[tuple]) -> None:
        """Branches forked after the last step written (``(parent slot, parent traj, child slot, child traj, at)``):
        each child's row starts as a copy of its parent's first ``at`` steps (the parent going on in its slot, or
        ended at that step: then its row is queued), and the child's parent and fork step are kept for its batch."""
        for p_slot, p_traj, c_slot, c_traj, at in forks:
            src = self._row_of(p_slot, p_traj)
            dst = int(self.row_of_slot[c_slot])
            for v in self.store.tensors.values():
                v[dst, :at] = v[src, :at]
            self.links[c_traj] = (p_traj, at)

    def _fork_chains(self, forks: list[tuple]) -> None:
        """Waves: branches forked after the wave just written (as :meth:`fork` has them). Each child's trajectory
        starts as a chain of references to its parent's first ``at`` steps (the parent going on in its slot, or ended
        in the wave: queued); the child's own steps join it from the next wave on."""
        for p_slot, p_traj, c_slot, c_traj, at in forks:
            self.open[c_slot] = self._prefix(p_slot, p_traj, at)
            self.links[c_traj] = (p_traj, at)

    def _prefix(self, slot: int, traj: int, at: int) -> list[tuple]:
        """The pieces of trajectory ``traj``'s first ``at`` steps: queued (it ended) or going on in ``slot``."""
        if at == 0:
            return []
        pieces = None
        for members in self.waiting.values():
            for e in members:
                if e[4] == traj:
                    pieces = e[0].pieces if isinstance(e[0], Chain) else [(e[0], e[1], e[2])]
        if pieces is None:  # going on; restored from a checkpoint and not yet in a wave: the live row
            pieces = self.open[slot] if slot in self.open else [(self._live, slot, at)]
        out, n = [], 0
        for seg, row, steps in pieces:
            if n >= at:
                break
            out.append((seg, row, min(steps, at - n)))
            n += out[-1][2]
        return out

    def _row_of(self, slot: int, traj: int) -> int:
        """The store row of trajectory ``traj``: queued (it ended) or going on in ``slot``."""
        for members in self.waiting.values():
            for e in members:
                if e[4] == traj and e[0] is self.store:
                    return e[1]
        return int(self.row_of_slot[slot])

    def hold_parts(self, trajs) -> None:
        """Trajectories that end as parts of an episode going on in a new trajectory (``TokenEnv.pop_parts``): held
        until the episode's last trajectory is released, which carries them into its batch."""
        self.parts.update(int(t) for t in trajs)

    def _finish(self, segs: list, rows, lengths, groups, trajs, samples) -> None:
        scores = [None] * len(rows) if self.sampling is None else self._scores(segs, rows, lengths)
        entries = zip(segs, rows.tolist(), lengths.tolist(), groups.tolist(), trajs.tolist(), scores,
                      samples.tolist(), [False] * len(rows), strict=True)  # fmt: skip
        is_split = bool(self.parts or self.held)
        if is_split:
            entries = self._with_parts(entries)
        if self.group_size == 1:
            self.ready.extend(entries)
            if is_split:
                self.ready_parts += sum(e[7] for e in entries)
            return
        for entry in entries:
            members = self.waiting.setdefault(entry[3], [])
            members.append(entry)
            if sum(not e[7] for e in members) == self.group_size:
                group = self.waiting.pop(entry[3])
                if self.sampling is None or self.sampling.keep([e[5] for e in group if not e[7]]):
                    self.ready.extend(group)
                    self.ready_parts += sum(e[7] for e in group)
                else:  # no reward spread: dropped here, counted by the filter
                    self.free += [e[1] for e in group if e[0] is self.store]

    def _with_parts(self, entries) -> list[tuple]:
        """Hold the entries that are parts of an episode going on; put the held parts before their episode's last
        trajectory (marked as parts: they do not count as trajectories of a group or a batch)."""
        out = []
        for e in entries:
            if e[4] in self.parts:
                self.parts.discard(e[4])
                self.held.setdefault((e[3], e[6]), []).append((*e[:7], True))
                continue
            out += self.held.pop((e[3], e[6]), [])
            out.append(e)
        return out

    def _scores(self, segs: list, rows: torch.Tensor, lengths: torch.Tensor) -> list[float]:
        """The finished trajectories' rewards summed over their steps (a view of the rewards, no copy first)."""
        seg = segs[0]  # one segment for all, or a chain each
        if self._score_name is None:
            names = set(seg.tensors) if not seg.is_packed else {n for ns in self._packer.groups.values() for n, _ in ns}
            self._score_name = self.sampling.score_name(names)
        if isinstance(seg, Chain):
            return [sum(self._scores([piece], torch.tensor([row]), torch.tensor([n]))[0] for piece, row, n in c.pieces)
                    for c in segs]  # fmt: skip
        if seg.is_packed:
            if self._score_column is None:
                self._score_column = self._packer.column(self._score_name)
            dtype, column = self._score_column
            rewards = seg.tensors[dtype][:, :, column]  # (R, T_max): older steps past each end are not summed
        elif seg.starts is not None:  # a wave's real steps: each row's run of them
            rewards = seg.tensors[self._score_name].reshape(-1)
            return [float(rewards[seg.starts[r] : seg.starts[r] + n].sum(dtype=torch.float64))
                    for r, n in zip(rows.tolist(), lengths.tolist(), strict=True)]  # fmt: skip
        else:
            rewards = seg.tensors[self._score_name]
            rewards = rewards.reshape(rewards.shape[0], rewards.shape[1])  # (B, Tn), a view
        return self.sampling.scores(rewards, rows, lengths)

    def drop_groups(self, groups) -> int:
        """Drop the waiting trajectories of ``groups`` (groups that can no longer complete); returns how many."""
        self.flush()
        n = 0
        for g in groups:
            for key in [k for k in self.held if k[0] == int(g)]:
                self.free += [e[1] for e in self.held.pop(key) if e[0] is self.store]
            members = self.waiting.pop(int(g), None)
            if members:
                n += len(members)
                self.counters["dropped_groups"] += 1
                self.counters["dropped_trajectories"] += len(members)
                self.free += [e[1] for e in members if e[0] is self.store]
        return n

    # -- reading --
    @property
    def is_full(self) -> bool:
        return len(self.ready) - self.ready_parts >= self.batch_size

    @property
    def num_ready(self) -> int:
        """Trajectories ready for the batch (whole groups; parts of split episodes not counted)."""
        return len(self.ready) - self.ready_parts

    @property
    def num_waiting(self) -> int:
        """Finished trajectories waiting for the rest of their group."""
        self.flush()
        return sum(len(m) for m in self.waiting.values())

    def peek(self, *, partial: bool = False) -> TensorDict | None:
        """Right-padded (N, T) tensors of the first ``batch_size`` ready trajectories (in the order they became
        ready), with mask and versions, zeros past each trajectory's end; they stay queued until :meth:`commit`.
        ``partial``: the ready ones when fewer (a last batch; unfinished groups keep waiting). ``None``: none."""
        self.flush()
        n = self.batch_size if self.is_full else len(self.ready) if partial else 0
        if n == 0:
            return None
        if self.ready_parts and n == self.batch_size:  # N episodes' last trajectories, each after its parts
            finals = n = 0
            while finals < self.batch_size:
                finals += not self.ready[n][7]
                n += 1
        self._peeked = n
        take = self.ready[:n]
        lengths = torch.tensor([e[2] for e in take])
        width = self.max_steps if self.is_fixed_width else int(lengths.max())
        mask = torch.arange(width)[None, :] < lengths[:, None]
        out = assemble(take, width, mask, self._packer)
        out[F_MASK] = mask
        if any(e[7] for e in take):
            give_parts_their_reward(out, take, lengths)
        if self.is_tree:
            self._tree_columns(out, take, mask)
        version, last = out[F_VERSION], (lengths - 1)[:, None]
        out[flat_name(keys.VERSION_START)] = version[:, :1].expand_as(version).clone()
        out[flat_name(keys.VERSION_END)] = version.gather(1, last).expand_as(version).clone()
        return to_tensordict(out, mask.shape)

    def _tree_columns(self, out: dict, take: list[tuple], mask: torch.Tensor) -> None:
        """A tree's leaves: ``keys.BRANCH_ID`` the trajectory that generated each step (the steps as recorded), the
        row's own trajectory and sample ids on every step, its parent and fork step (``keys.PARENT_ID``,
        ``keys.FORK_INDEX``; -1 and 0 for a root)."""
        trajs = torch.tensor([e[4] for e in take])[:, None]
        links = [self.links.get(e[4], (-1, 0)) for e in take]
        out[flat_name(keys.BRANCH_ID)] = out[F_TRAJ].clone()
        out[F_TRAJ] = torch.where(mask, trajs, 0)
        out[F_SAMPLE] = torch.where(mask, torch.tensor([e[6] for e in take])[:, None], 0)
        out[flat_name(keys.PARENT_ID)] = torch.where(mask, torch.tensor([p for p, _ in links])[:, None], 0)
        out[flat_name(keys.FORK_INDEX)] = torch.where(mask, torch.tensor([a for _, a in links])[:, None], 0)

    def commit(self) -> None:
        """Drop the trajectories :meth:`peek` gave (they were delivered); their store rows are free again."""
        take, self.ready = self.ready[: self._peeked], self.ready[self._peeked :]
        if self.links:
            for e in take:
                self.links.pop(e[4], None)
        self.free += [e[1] for e in take if e[0] is self.store]
        parts = sum(e[7] for e in take) if self.ready_parts else 0
        self.ready_parts -= parts
        if self.sampling is not None:
            self.sampling.commit(self._peeked - parts, self.batch_size)
        self._peeked = 0

    def check_draws(self) -> None:
        """With dynamic sampling, raise :class:`~tokengym.errors.DynamicSamplingError` once the draw bound is
        reached before the batch is full (call it between source advances)."""
        if self.sampling is not None:  # no flush: steps are kept only while no group they finish can complete
            self.sampling.check_bound(len(self.ready) // self.group_size)

    @property
    def num_held(self) -> int:
        """Finished parts of episodes still going on."""
        self.flush()
        return sum(len(p) for p in self.held.values())

    def queued_trajectories(self) -> list[int]:
        """Trajectory ids finished but not yet popped."""
        return [e[4] for e in self._entries()]

    def queued_groups(self) -> list[int]:
        return [e[3] for e in self._entries()]

    def _entries(self) -> list[tuple]:
        self.flush()
        return (self.ready + [e for members in self.waiting.values() for e in members]
                + [e for parts in self.held.values() for e in parts])  # fmt: skip

    # -- checkpoints --
    def state_dict(self) -> dict:
        """Plain data by flat name (checkpoints do not depend on the packing): each slot's live row, and the
        queued trajectories' rows, one (n, T, ...) tensor per key, in queue order."""
        entries = self._entries()
        if not entries:
            queued = None
        else:
            width = max(self.max_steps, max(e[2] for e in entries))
            mask = torch.arange(width)[None, :] < torch.tensor([e[2] for e in entries])[:, None]
            queued = {name: v.clone() for name, v in assemble(entries, width, mask, self._packer).items()}
        live = None
        if self.open is not None:  # waves: each slot's trajectory going on
            live = open_rows(self.open, self._slots, self.max_steps, self._packer)
        elif self.store is not None:
            live = self._packer.unpack({dt: v[self.row_of_slot] for dt, v in self.store.tensors.items()})
        return {"live": live, "queued": queued, "entries": [list(e[2:]) for e in entries],
                "num_ready": len(self.ready), "num_waiting": len(entries) - len(self.ready) - self.num_held,
                "parts": sorted(self.parts), "counters": dict(self.counters),
                "links": [[c, p, a] for c, (p, a) in self.links.items()],
                "sampling": None if self.sampling is None else self.sampling.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.store, self.row_of_slot, self.free, self._packer, self._id_columns = None, None, [], None, None
        self.open, self._live = None, None
        self.deferred.clear()
        self._score_column = None
        self._peeked = 0
        if state["live"] is not None:
            self._packer = Packer(state["live"])  # (B, T_max, ...) per key
            packed = self._packer.pack(state["live"])
            self.store = Segment(packed, is_packed=True)
            self.row_of_slot = torch.arange(packed[next(iter(packed))].shape[0])
            self._live = Segment(dict(state["live"]))  # waves go on from these rows
        seg = None if state["queued"] is None else Segment(state["queued"])
        # (length, group, traj, score, sample, is_part): older checkpoints lack the last (three)
        entries = [(seg, i, *e, *(None, -1, False)[len(e) - 3 :]) for i, e in enumerate(state["entries"])]
        n_ready = state["num_ready"]
        n_waiting = state.get("num_waiting", len(entries) - n_ready)
        self.ready, self.waiting, self.held = entries[:n_ready], {}, {}
        for e in entries[n_ready : n_ready + n_waiting]:
            self.waiting.setdefault(e[3], []).append(e)
        for e in entries[n_ready + n_waiting :]:
            self.held.setdefault((e[3], e[6]), []).append(e)
        self.parts = set(state.get("parts", []))
        self.links = {int(c): (int(p), int(a)) for c, p, a in state.get("links", [])}
        self.ready_parts = sum(bool(e[7]) for e in self.ready)
        self.counters.update(state.get("counters", {}))
        if self.sampling is not None and state.get("sampling") is not None:
            self.sampling.load_state_dict(state["sampling"])
