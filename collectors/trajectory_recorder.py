"""TrajectoryRecorder: finished trajectories, released by whole groups as right-padded (N, T) batches."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.collectors._group_queue import GroupQueue
from tokengym.collectors._packing import F_MASK, F_VERSION, Step, flat_name, to_tensordict
from tokengym.collectors._reward_sums import RewardSums
from tokengym.collectors._row_store import RowStore
from tokengym.collectors._segments import Segment, assemble, give_parts_their_reward
from tokengym.collectors._step_chunks import DeferredSteps
from tokengym.collectors._tree_links import TreeLinks
from tokengym.collectors._wave_chains import WaveChains
from tokengym.collectors.dynamic_sampling import DynamicSampling, SpreadFilter
from tokengym.llm_envs import keys

__all__ = ["TrajectoryRecorder"]


class TrajectoryRecorder:
    """Finished trajectories, right-padded to (N, T), released by whole groups.

    A finished trajectory is a reference ``(segment, row, length, group, traj, score)``, never a copy:

    - a wave's rows that hold whole trajectories (single-turn waves) stay in the wave's own tensors;
    - a trajectory whose turns go on across waves is a :class:`~tokengym.collectors._segments.Chain` of references
      to its rows in those waves (copied once, into the batch): :class:`~tokengym.collectors._wave_chains.WaveChains`;
    - a trajectory built step by step (the step source) is written into a row of a packed store (one tensor per
      dtype), and keeps that row once it ends: its slot moves on to a free row. The store grows when every row is
      taken (bounded: live slots plus waiting trajectories): :class:`~tokengym.collectors._row_store.RowStore`.

    Finished trajectories wait per group until the group's ``group_size`` samples are in; complete
    groups are released in the order they completed (:class:`~tokengym.collectors._group_queue.GroupQueue`, which
    also holds split episodes' parts until their episode's last trajectory), and a batch's tensors are assembled
    once, in :meth:`peek` (no copy at all when the batch is one wave's rows in order). Waiting is bounded: every
    waiting group has a sample in a slot or in the prompt source (a group that can no longer complete
    is dropped with :meth:`drop_groups`), so at most ``(B + 1) * (group_size - 1)`` trajectories wait.
    With ``dynamic_sampling``, a group is judged when it completes (:class:`SpreadFilter`, on the summed rewards of
    :class:`~tokengym.collectors._reward_sums.RewardSums`): one whose rewards do not spread is dropped there (its
    store rows freed), so the queue holds only groups that go into batches. Trees' branches keep their parent and
    fork step (:class:`~tokengym.collectors._tree_links.TreeLinks`) until delivered.

    Args:
        batch_size: ``N``, trajectories per batch (a multiple of ``group_size``).
        max_steps: the longest trajectory (the env's ``max_new_tokens``).
        group_size: samples per group; 1 releases every trajectory as it finishes.
        is_fixed_width: pad every batch to ``max_steps`` (batches then stack in a replay buffer).
        dynamic_sampling: keep only groups whose rewards spread (a :class:`DynamicSampling`; ``group_size >= 2``).
        is_tree: the trajectories are trees' leaves (a :class:`~tokengym.collectors.tree_source.TreeSource`): batches
            carry the tree keys (``keys.BRANCH_ID``, ``keys.PARENT_ID``, ``keys.FORK_INDEX``).
    """

    def __init__(self, batch_size: int, max_steps: int, *, group_size: int = 1, is_fixed_width: bool = True,
                 dynamic_sampling: DynamicSampling | None = None, is_tree: bool = False) -> None:  # fmt: skip
        if batch_size % group_size:
            raise ValueError(f"batch_size={batch_size} is not a multiple of group_size={group_size}")
        if dynamic_sampling is not None and group_size < 2:
            raise ValueError(f"dynamic_sampling needs group_size >= 2, got group_size={group_size}")
        sampling = None if dynamic_sampling is None else SpreadFilter(dynamic_sampling, batch_size // group_size)
        self.batch_size, self.max_steps, self.is_fixed_width = batch_size, max_steps, is_fixed_width
        self.group_size = group_size
        self.is_tree = is_tree
        self.queue = GroupQueue(batch_size, group_size, sampling)  # finished trajectories until delivered
        self.scores = None if sampling is None else RewardSums(sampling)  # what dynamic sampling judges
        self.rows = RowStore(max_steps)  # trajectories written step by step
        self.chains = WaveChains()  # waves' trajectories going on across waves
        self.tree = TreeLinks()  # branches' parents and fork steps
        # single steps are kept as they come and written as one chunk when they may complete a batch (or are many):
        # every reader below writes them first (flush)
        self.deferred = DeferredSteps()

    # -- the pieces' state, by its former names --
    @property
    def sampling(self) -> SpreadFilter | None:
        """The dynamic sampling filter (``None`` when off)."""
        return self.queue.sampling

    @property
    def ready(self) -> list[tuple]:
        """Entries ``(segment, row, length, group, traj, score, sample, is_part)`` of complete groups, in order."""
        return self.queue.ready

    @property
    def open(self) -> dict[int, list[tuple]] | None:
        """Waves: slot -> the pieces of its trajectory going on."""
        return self.chains.open

    # -- writing --
    def write(self, chunk: dict) -> None:
        """Record k steps (B, k, ...) (or a :class:`Step`); trajectories that end are queued by group."""
        if isinstance(chunk, Step):
            if self.deferred.add(chunk, self.queue.could_fill) or chunk.forks:
                self.flush()
            if chunk.forks:
                self.fork(chunk.forks)
            return None
        self.flush()
        for finished in self.chains.write(chunk):
            self._finish(*finished)
        forks = getattr(chunk, "forks", None)
        if forks:
            self._fork_chains(forks)

    @property
    def continues_turns(self) -> bool:
        """Whether trajectories went on across waves (then waves are best given as their real steps, see
        ``Cells``: a batch copies them anyway)."""
        return bool(self.chains.open)

    def flush(self) -> None:
        """Write the steps kept so far (see :class:`~tokengym.collectors._step_chunks.DeferredSteps`) into the store;
        queue the trajectories they finish, in the order stepping finished them."""
        chunk = self.deferred.take()
        if chunk is not None:
            finished = self.rows.write(chunk)
            if finished is not None:
                self._finish([self.rows.segment] * len(finished[0]), *finished)

    def fork(self, forks: list[tuple]) -> None:
        """Branches forked after the last step written (``(parent slot, parent traj, child slot, child traj, at)``):
        each child's row starts as a copy of its parent's first ``at`` steps (the parent going on in its slot, or
        ended at that step: then its row is queued), and the child's parent and fork step are kept for its batch."""
        for p_slot, p_traj, c_slot, c_traj, at in forks:
            self.rows.copy_prefix(self.rows.row(self.queue.find(p_traj), p_slot), c_slot, at)
            self.tree.add(c_traj, p_traj, at)

    def _fork_chains(self, forks: list[tuple]) -> None:
        """Waves: branches forked after the wave just written (as :meth:`fork` has them). Each child's trajectory
        starts as a chain of references to its parent's first ``at`` steps (the parent going on in its slot, or ended
        in the wave: queued); the child's own steps join it from the next wave on."""
        for p_slot, p_traj, c_slot, c_traj, at in forks:
            self.chains.branch(c_slot, p_slot, at, self.queue.find(p_traj) if at else [])
            self.tree.add(c_traj, p_traj, at)

    def hold_parts(self, trajs) -> None:
        """Trajectories that end as parts of an episode going on in a new trajectory (``TokenEnv.pop_parts``): held
        until the episode's last trajectory is released, which carries them into its batch."""
        self.queue.hold_parts(trajs)

    def _finish(self, segs: list, rows, lengths, groups, trajs, samples) -> None:
        """Queue finished trajectories as entries (with their scores under dynamic sampling); the store rows of
        groups dropped there are free again."""
        scores = [None] * len(rows) if self.scores is None else self.scores(segs, rows, lengths, self.rows.packer)
        entries = zip(segs, rows.tolist(), lengths.tolist(), groups.tolist(), trajs.tolist(), scores,
                      samples.tolist(), [False] * len(rows), strict=True)  # fmt: skip
        dropped = self.queue.add(entries)
        if dropped:
            self.rows.release(dropped)

    def waiting_groups(self) -> list[int]:
        """The groups with finished trajectories waiting for the rest of their samples."""
        self.flush()
        return list(self.queue.waiting)

    def drop_groups(self, groups) -> int:
        """Drop the waiting trajectories of ``groups`` (groups that can no longer complete); returns how many."""
        self.flush()
        n, dropped = self.queue.drop(groups)
        self.rows.release(dropped)
        return n

    # -- reading --
    @property
    def is_full(self) -> bool:
        return self.queue.num_ready >= self.batch_size

    @property
    def num_ready(self) -> int:
        """Trajectories ready for the batch (whole groups; parts of split episodes not counted)."""
        return self.queue.num_ready

    @property
    def num_waiting(self) -> int:
        """Finished trajectories waiting for the rest of their group."""
        self.flush()
        return self.queue.num_waiting

    @property
    def num_held(self) -> int:
        """Finished parts of episodes still going on."""
        self.flush()
        return self.queue.num_held

    def peek(self, *, partial: bool = False) -> TensorDict | None:
        """Right-padded (N, T) tensors of the first ``batch_size`` ready trajectories (in the order they became
        ready), with mask and versions, zeros past each trajectory's end; they stay queued until :meth:`commit`.
        ``partial``: the ready ones when fewer (a last batch; unfinished groups keep waiting). ``None``: none."""
        self.flush()
        take = self.queue.peek(partial=partial)
        if take is None:
            return None
        lengths = torch.tensor([e[2] for e in take])
        width = self.max_steps if self.is_fixed_width else int(lengths.max())
        mask = torch.arange(width)[None, :] < lengths[:, None]
        out = assemble(take, width, mask, self.rows.packer)
        out[F_MASK] = mask
        if any(e[7] for e in take):
            give_parts_their_reward(out, take, lengths)
        if self.is_tree:
            self.tree.columns(out, take, mask)
        version, last = out[F_VERSION], (lengths - 1)[:, None]
        out[flat_name(keys.VERSION_START)] = version[:, :1].expand_as(version).clone()
        out[flat_name(keys.VERSION_END)] = version.gather(1, last).expand_as(version).clone()
        return to_tensordict(out, mask.shape)

    def commit(self) -> None:
        """Drop the trajectories :meth:`peek` gave (they were delivered); their store rows are free again."""
        take = self.queue.commit()
        self.tree.release(take)
        self.rows.release(take)

    def counts(self) -> dict:
        """Groups and trajectories dropped, trajectories waiting, and dynamic sampling's counts when it is on."""
        out = {**self.queue.counters, "waiting_trajectories": self.num_waiting}
        if self.sampling is not None:
            out.update(self.sampling.counters)
        return out

    def check_draws(self) -> None:
        """With dynamic sampling, raise :class:`~tokengym.errors.DynamicSamplingError` once the draw bound is
        reached before the batch is full (call it between source advances)."""
        self.queue.check_draws()  # no flush: steps are kept only while no group they finish can complete

    def queued_trajectories(self) -> list[int]:
        """Trajectory ids finished but not yet popped."""
        return [e[4] for e in self._entries()]

    def queued_groups(self) -> list[int]:
        return [e[3] for e in self._entries()]

    def _entries(self) -> list[tuple]:
        self.flush()
        return self.queue.entries()

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
            queued = {name: v.clone() for name, v in assemble(entries, width, mask, self.rows.packer).items()}
        if self.chains.open is not None:  # waves: each slot's trajectory going on
            live = self.chains.rows(self.max_steps, self.rows.packer)
        else:
            live = self.rows.live()
        queue = self.queue
        return {"live": live, "queued": queued, "entries": [list(e[2:]) for e in entries],
                "num_ready": len(queue.ready), "num_waiting": len(entries) - len(queue.ready) - queue.num_held,
                "parts": sorted(queue.parts), "counters": dict(queue.counters), "links": self.tree.state_dict(),
                "sampling": None if self.sampling is None else self.sampling.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.rows.load(state["live"])  # the step source goes on in these rows
        self.chains.load(state["live"])  # waves go on from these rows
        self.deferred.clear()
        if self.scores is not None:
            self.scores.clear()
        seg = None if state["queued"] is None else Segment(state["queued"])
        # (length, group, traj, score, sample, is_part): older checkpoints lack the last (three)
        entries = [(seg, i, *e, *(None, -1, False)[len(e) - 3 :]) for i, e in enumerate(state["entries"])]
        n_ready = state["num_ready"]
        self.queue.load(entries, n_ready, state.get("num_waiting", len(entries) - n_ready), state.get("parts", []),
                        state.get("counters", {}))  # fmt: skip
        self.tree.load_state_dict(state.get("links", []))
        if self.sampling is not None and state.get("sampling") is not None:
            self.sampling.load_state_dict(state["sampling"])
