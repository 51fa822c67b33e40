"""The queue of a trajectory recorder: finished trajectories wait per group and are released as whole groups, with
the finished parts of split episodes held until their episode's last trajectory."""

from __future__ import annotations

from tokengym.collectors.dynamic_sampling import SpreadFilter

__all__ = ["GroupQueue"]


class GroupQueue:
    """Finished trajectories as entries ``(segment, row, length, group, traj, score, sample, is_part)`` (references
    to where their steps are), waiting per group until the group's ``group_size`` samples are in; complete groups
    are ready in the order they completed. A batch is the first ``batch_size`` ready trajectories: :meth:`peek` gives
    its entries, :meth:`commit` drops them.

    Split episodes: trajectories said to end as parts (:meth:`hold_parts`) are held once finished, by
    ``(group, sample)``, until the episode's last trajectory finishes; they go just before it (marked as parts: they
    do not count as trajectories of a group or a batch). With dynamic sampling (``sampling``), a group is judged when
    it completes: one whose scores do not spread is dropped there.

    The entries leaving the queue (delivered or dropped) are returned to the caller, who frees their storage.
    """

    def __init__(self, batch_size: int, group_size: int, sampling: SpreadFilter | None) -> None:
        self.batch_size, self.group_size, self.sampling = batch_size, group_size, sampling
        self.ready: list[tuple] = []  # entries of complete groups, in the order they completed
        self.waiting: dict[int, list[tuple]] = {}  # group -> its finished trajectories so far
        self.parts: set[int] = set()  # trajectories that end as parts of an episode going on
        self.held: dict[tuple[int, int], list[tuple]] = {}  # (group, sample) -> its episode's finished parts
        self.ready_parts = 0  # parts among the ready entries
        self.counters = {"dropped_groups": 0, "dropped_trajectories": 0}
        self.peeked = 0  # ready entries the last peek() gave

    def add(self, entries) -> list[tuple]:
        """Queue finished trajectories' entries; returns those dropped (their group's scores do not spread)."""
        is_split = bool(self.parts or self.held)
        if is_split:
            entries = self._with_parts(entries)
        if self.group_size == 1:
            self.ready.extend(entries)
            if is_split:
                self.ready_parts += sum(e[7] for e in entries)
            return []
        dropped = []
        for entry in entries:
            members = self.waiting.setdefault(entry[3], [])
            members.append(entry)
            if sum(not e[7] for e in members) == self.group_size:
                group = self.waiting.pop(entry[3])
                if self.sampling is None or self.sampling.keep([e[5] for e in group if not e[7]]):
                    self.ready.extend(group)
                    self.ready_parts += sum(e[7] for e in group)
                else:  # no reward spread: dropped here, counted by the filter
                    dropped += group
        return dropped

    def _with_parts(self, entries) -> list[tuple]:
        """Hold the entries that are parts of an episode going on; put the held parts before their episode's last
        trajectory (marked as parts)."""
        out = []
        for e in entries:
            if e[4] in self.parts:
                self.parts.discard(e[4])
                self.held.setdefault((e[3], e[6]), []).append((*e[:7], True))
                continue
            out += self.held.pop((e[3], e[6]), [])
            out.append(e)
        return out

    def hold_parts(self, trajs) -> None:
        """Trajectories that end as parts of an episode going on in a new trajectory: held once finished."""
        self.parts.update(int(t) for t in trajs)

    def could_fill(self, finished: dict[int, int]) -> bool:
        """Whether trajectories about to finish (counts by group) may complete a batch; with dynamic sampling,
        whether they may complete a group (a group is judged, and counted against the draw bound, when it
        completes)."""
        ready, g = self.num_ready, self.group_size
        if g == 1:
            return ready + sum(finished.values()) >= self.batch_size
        complete = sum(g for group, n in finished.items() if n + len(self.waiting.get(group, ())) >= g)
        return complete > 0 if self.sampling is not None else ready + complete >= self.batch_size

    def find(self, traj: int) -> list[tuple]:
        """The waiting entries of trajectory ``traj`` (a branch's parent that ended: its steps are the branch's
        first)."""
        return [e for members in self.waiting.values() for e in members if e[4] == traj]

    def drop(self, groups) -> tuple[int, list[tuple]]:
        """Drop the waiting trajectories (and held parts) of ``groups``, which can no longer complete: how many
        trajectories, and the entries dropped."""
        n, dropped = 0, []
        for g in groups:
            for key in [k for k in self.held if k[0] == int(g)]:
                dropped += self.held.pop(key)
            members = self.waiting.pop(int(g), None)
            if members:
                n += len(members)
                self.counters["dropped_groups"] += 1
                self.counters["dropped_trajectories"] += len(members)
                dropped += members
        return n, dropped

    @property
    def num_ready(self) -> int:
        """Ready trajectories (parts not counted)."""
        return len(self.ready) - self.ready_parts

    @property
    def num_waiting(self) -> int:
        return sum(len(m) for m in self.waiting.values())

    @property
    def num_held(self) -> int:
        return sum(len(p) for p in self.held.values())

    def peek(self, *, partial: bool = False) -> list[tuple] | None:
        """The entries of the next batch (``batch_size`` trajectories, each episode's parts before its last one;
        ``partial``: the ready ones when fewer), left queued until :meth:`commit`; ``None`` when there is none."""
        n = self.batch_size if self.num_ready >= self.batch_size else len(self.ready) if partial else 0
        if n == 0:
            return None
        if self.ready_parts and n == self.batch_size:  # N episodes' last trajectories, each after its parts
            finals = n = 0
            while finals < self.batch_size:
                finals += not self.ready[n][7]
                n += 1
        self.peeked = n
        return self.ready[:n]

    def commit(self) -> list[tuple]:
        """Drop the entries :meth:`peek` gave (they were delivered); returns them."""
        take, self.ready = self.ready[: self.peeked], self.ready[self.peeked :]
        parts = sum(e[7] for e in take) if self.ready_parts else 0
        self.ready_parts -= parts
        if self.sampling is not None:
            self.sampling.commit(self.peeked - parts, self.batch_size)
        self.peeked = 0
        return take

    def check_draws(self) -> None:
        """With dynamic sampling, raise once the draw bound is reached before the batch is full."""
        if self.sampling is not None:
            self.sampling.check_bound(len(self.ready) // self.group_size)

    def entries(self) -> list[tuple]:
        """Every entry queued: ready, waiting, held (the order a checkpoint keeps)."""
        return (self.ready + [e for members in self.waiting.values() for e in members]
                + [e for parts in self.held.values() for e in parts])  # fmt: skip

    def load(self, entries: list[tuple], num_ready: int, num_waiting: int, parts, counters: dict) -> None:
        """Start over from a checkpoint's entries (ready, waiting, held, in that order)."""
        self.ready, self.waiting, self.held = entries[:num_ready], {}, {}
        for e in entries[num_ready : num_ready + num_waiting]:
            self.waiting.setdefault(e[3], []).append(e)
        for e in entries[num_ready + num_waiting :]:
            self.held.setdefault((e[3], e[6]), []).append(e)
        self.parts = set(parts)
        self.ready_parts = sum(bool(e[7]) for e in self.ready)
        self.counters.update(counters)
        self.peeked = 0
