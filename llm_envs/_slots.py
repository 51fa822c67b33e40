"""A token env's slots (token buffer, per-slot state, prompts, done flags) and the writes of prompts into them."""

from __future__ import annotations

import collections
import dataclasses

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys
from tokengym.llm_envs.image_inputs import ImageInputs
from tokengym.llm_envs.prompts import Prompt

__all__ = ["Slots", "write_prompts"]

_KEYS = (keys.TOKEN, keys.SEQ_LEN, keys.PROMPT_LEN, keys.RESPONSE_LEN, keys.TURN, keys.TRAJ_ID, keys.GROUP_ID,
         keys.SAMPLE_ID, keys.ACTIVE)  # fmt: skip


_INT_KEYS = _KEYS[:-1]  # every key but ``active`` (bool): one (K, B) int64 table, its rows the state's tensors
_ROW = {key: i for i, key in enumerate(_INT_KEYS)}  # a key's row of that table
_SMALL = 8  # at most this many prompts: one slice write each (cheaper than building row/column index tensors)


def write_prompts(tokens: torch.Tensor, state: dict, loaded: list[tuple[int, Prompt]], first_traj: int,
                  table: torch.Tensor | None = None) -> None:  # fmt: skip
    """Put ``loaded`` (slot, prompt) pairs into ``tokens`` (B, L) and ``state`` ((B,) tensors by key), with
    trajectory ids ``first_traj, first_traj + 1, ...``: a few vectorized writes, not a dozen per slot.

    ``table``: the (K, B) int64 tensor whose rows are ``state``'s integer tensors (see :meth:`Slots.copy_on_write`):
    then every slot's integer state is written with one column write.
    The prompts must fit and hold in-vocabulary ids (the env checks both first).

    Example:
        >>> from tokengym.llm_envs.prompts import Prompt
        >>> tokens = torch.zeros(2, 4, dtype=torch.int64)
        >>> state = {k: torch.zeros(2, dtype=torch.bool if k == keys.ACTIVE else torch.int64) for k in _KEYS}
        >>> write_prompts(tokens, state, [(1, Prompt(torch.tensor([5, 6]), "", {}, 0, 3, 0))], 7)
        >>> tokens[1].tolist(), state[keys.SEQ_LEN].tolist(), state[keys.TRAJ_ID].tolist(), state[keys.TOKEN].tolist()
        ([5, 6, 0, 0], [0, 2], [0, 7], [0, 6])
    """
    columns = []  # per prompt, its integer state in _INT_KEYS order
    for i, (b, prompt) in enumerate(loaded):
        n = prompt.ids.numel()
        if len(loaded) <= _SMALL:
            tokens[b, :n] = prompt.ids
        columns.append((int(prompt.ids[n - 1]), n, n, 0, 0, first_traj + i, prompt.group_id, prompt.sample_id))
    if len(loaded) > _SMALL:
        ids = torch.cat([p.ids for _, p in loaded])
        lens = torch.tensor([c[1] for c in columns])
        starts = lens.cumsum(0) - lens
        rows = torch.repeat_interleave(torch.tensor([b for b, _ in loaded]), lens)
        tokens[rows, torch.arange(len(ids)) - torch.repeat_interleave(starts, lens)] = ids
    if len(loaded) == 1:
        b = loaded[0][0]
        if table is not None:
            table[:, b] = torch.tensor(columns[0])
        else:
            for key, value in zip(_INT_KEYS, columns[0], strict=True):
                state[key][b] = value
        state[keys.ACTIVE][b] = True
        return
    slots = torch.tensor([b for b, _ in loaded])
    values = torch.tensor(columns).T
    if table is not None:
        table[:, slots] = values
    else:
        for key, row in zip(_INT_KEYS, values, strict=True):
            state[key][slots] = row
    state[keys.ACTIVE][slots] = True


class Slots:
    """The B slots of a token env: the ``(B, L)`` token buffer, the per-slot state (``(B,)`` tensors by key),
    the prompt each slot works on, done flags and the finished multi-turn sequences.

    Tensors handed out in observations are never written afterwards: a refill or a turn change copies
    the state first (:meth:`copy_on_write`), a step replaces the tensors it changes. Plain attributes of a
    plain object (an ``nn.Module``'s ``__setattr__`` costs microseconds per step).
    """

    def __init__(self, batch_size: int, max_length: int) -> None:
        B = batch_size
        self.tokens = torch.zeros(B, max_length, dtype=torch.int64)  # (B, L) the sequences, written once
        self.flat = self.tokens.view(-1)  # the same buffer, indexed by row * L + position (one index, no pairs)
        self.row_start = torch.arange(B) * max_length
        self.state: dict[str, torch.Tensor] = {}
        self.table = torch.zeros(len(_INT_KEYS), B, dtype=torch.int64)  # (K, B): the integer state, a tensor per row
        self._use_table(self.table, torch.zeros(B, dtype=torch.bool))
        self.done = torch.zeros(B, dtype=torch.bool)
        self.prompts: list[Prompt | None] = [None] * B
        # each slot's images so far (a vision-language prompt's, then any its feedback showed), and those of finished
        # trajectories whose feedback showed images, until a collector takes them
        self.images: list[ImageInputs | None] = [None] * B
        self.finished_images: dict[int, ImageInputs] = {}
        self.is_reset = False
        self.any_done = False  # True while a slot is done and not refilled: kept with ``done``
        self.flags: tuple = ()  # (done, terminated, truncated) (B, 1) of the last step, as its "next" holds them
        self.next_traj = 0
        # the lengths at which slots reach a limit (None: recompute, slots changed), that of the budget and
        # context alone, and whether every slot is live (then a step needs no masking)
        self.deadline: torch.Tensor | None = None
        self.budget_deadline: torch.Tensor | None = None
        self.all_active = False
        self.steps_left = 0  # steps before the first live slot can reach its deadline (counted down by commit)
        self.done_slots: list[int] = []  # slots whose episode ended at the last step
        # full token sequences (prompt, turns, feedback) of finished multi-turn episodes, by trajectory id,
        # until a collector takes them (bounded: the oldest go first)
        self.finished: dict[int, torch.Tensor] = {}
        self.max_finished = 4096
        self.log_probs: torch.Tensor | None = None  # (B, L) sampling log-prob of each generated token, if kept
        self.parts: list[int] = []  # trajectories that ended as parts of an episode going on, until a collector takes them
        # each slot's episode id (kept across a split episode's trajectories and a restart), and the next one to give
        self.episodes: list[int] = [-1] * B
        self.next_episode = 0
        # the next trajectories of split episodes (prompt, episode id), loaded before new draws at the next refill
        self.continuations: collections.deque[tuple[Prompt, int]] = collections.deque()
        # (slot, error) of episodes a turn handler failed, raised at the next refill
        self.failures: list[tuple[int, Exception]] = []
        # slots that hold an episode but wait (inactive, not done) until the turn handler wakes them, and the length
        # at which a woken slot's last turn ends (one token after its wake)
        self.waiting: set[int] = set()
        self.closing: dict[int, int] = {}

    def pop_failures(self) -> list[tuple[int, Exception]]:
        """The (slot, error) of the episodes failed since the last call."""
        failures, self.failures = self.failures, []
        return failures

    def new_episode(self) -> int:
        """The id of an episode starting now."""
        self.next_episode += 1
        return self.next_episode - 1

    def keep_log_probs(self) -> None:
        """Keep each generated token's sampling log-prob beside it (a turn handler that replies with them)."""
        self.log_probs = torch.zeros(self.tokens.shape)

    def write_log_probs(self, pos: torch.Tensor, log_probs: torch.Tensor) -> None:
        """Write log-probs at flat positions ``pos`` (as the tokens of a step)."""
        self.log_probs.view(-1).index_copy_(0, pos, log_probs.detach().reshape(-1).float())

    def write_wave_log_probs(self, start: torch.Tensor, end: torch.Tensor, log_probs: torch.Tensor) -> None:
        """Write a wave's (B, T) log-probs at positions ``start[b] .. end[b]`` of each slot."""
        for b, (s, e) in enumerate(zip(start.tolist(), end.tolist(), strict=True)):
            if e > s:
                self.log_probs[b, s:e] = log_probs[b, : e - s]

    def copy_on_write(self) -> None:
        """Replace the state tensors by copies before writing slots (earlier observations keep theirs)."""
        self.deadline, self.all_active = None, False  # slots change: recomputed (set_deadlines) before a step
        s = self.state
        self._use_table(torch.stack([s[k] for k in _INT_KEYS]), s[keys.ACTIVE].clone())  # two copies, not nine
        self.done = self.done.clone()

    def _use_table(self, table: torch.Tensor, active: torch.Tensor) -> None:
        """Make ``table``'s rows (and ``active``) the state's tensors: writes to ``table`` are writes to the state,
        until a step replaces a row's tensor (then the next :meth:`copy_on_write` stacks a new table)."""
        self.table = table
        self.state = dict(zip(_INT_KEYS, table.unbind(0), strict=True))
        self.state[keys.ACTIVE] = active

    def observation(self, done, terminated, truncated, reward=None) -> TensorDict:
        """The state as a TensorDict, with the flags (and reward) given: the state tensors are shared."""
        out = dict(self.state)
        out[keys.DONE_NAME], out[keys.TERMINATED_NAME], out[keys.TRUNCATED_NAME] = done, terminated, truncated
        if reward is not None:
            out[keys.REWARD_NAME] = reward
        return TensorDict._new_unsafe(out, batch_size=self.done.shape)

    def reset_observation(self) -> TensorDict:
        """The observation after a (partial) reset: done only where a slot could not be loaded."""
        self.any_done = bool(self.done.any())
        zeros = torch.zeros(self.done.shape[0], 1, dtype=torch.bool)
        return self.observation(self.done.unsqueeze(-1).clone(), zeros, zeros.clone())

    def load(self, loaded: list[tuple[int, Prompt]]) -> None:
        """Put prompts into slots (one write per key), under the next trajectory ids; the slots are not done."""
        write_prompts(self.tokens, self.state, loaded, self.next_traj, table=self._live_table())
        for b, prompt in loaded:
            self.prompts[b] = prompt
            self.images[b] = prompt.images
            self.done[b] = False
        self.next_traj += len(loaded)
        if self.waiting or self.closing:
            self._forget_waits([b for b, _ in loaded])

    def _forget_waits(self, slots) -> None:
        for b in slots:
            self.waiting.discard(b)
            self.closing.pop(b, None)

    def _live_table(self) -> torch.Tensor | None:
        """:attr:`table` while its rows are still the state's tensors (right after :meth:`copy_on_write`), else None."""
        base, row, s = self.table.data_ptr(), self.table.stride(0) * self.table.element_size(), self.state
        is_live = all(s[key].data_ptr() == base + i * row for i, key in enumerate(_INT_KEYS))
        return self.table if is_live else None

    def idle(self, b: int, *, is_done: bool) -> None:
        """Empty slot ``b``: no prompt (the source is exhausted, or its prompt failed and ``is_done``)."""
        s = self.state
        self.prompts[b] = None
        self.images[b] = None
        s[keys.RESPONSE_LEN][b] = s[keys.TURN][b] = 0
        s[keys.ACTIVE][b] = False
        s[keys.SEQ_LEN][b] = s[keys.PROMPT_LEN][b] = 0  # a stale seq_len may equal max_length
        self.done[b] = is_done
        if self.waiting or self.closing:
            self._forget_waits([b])

    # -- trees: a slot's sequence copied into free slots --
    def fork(self, parent: int, children: list[int], length: int, steps: int, samples: list[int]) -> list[int]:
        """Copy ``parent``'s first ``length`` tokens (``steps`` of them generated: its response length there) into
        the free slots ``children``, each a new trajectory (and episode) with sample id ``samples[i]``; the rest of
        its state (prompt, turn, group) as the parent's. Returns the children's trajectory ids."""
        self.copy_on_write()
        rows = torch.tensor(children, dtype=torch.int64)
        self.tokens[rows, :length] = self.tokens[parent, :length]
        if self.log_probs is not None:
            self.log_probs[rows, :length] = self.log_probs[parent, :length]
        trajs = list(range(self.next_traj, self.next_traj + len(children)))
        self.next_traj += len(children)
        columns = self.table[:, parent, None].repeat(1, len(children))
        columns[_ROW[keys.TOKEN]] = self.tokens[parent, length - 1]
        columns[_ROW[keys.SEQ_LEN]] = length
        columns[_ROW[keys.RESPONSE_LEN]] = steps
        columns[_ROW[keys.TRAJ_ID]] = torch.tensor(trajs)
        columns[_ROW[keys.SAMPLE_ID]] = torch.tensor(samples)
        self.table[:, rows] = columns  # live: copy_on_write stacked it
        self.state[keys.ACTIVE][rows] = True
        self.done[rows] = False
        prompt = self.prompts[parent]
        cap = self.closing.get(parent)
        for b, sample in zip(children, samples, strict=True):
            self.prompts[b] = dataclasses.replace(prompt, sample_id=sample)
            self.images[b] = self.images[parent]  # a fork is within the current turn: every image so far
            self.episodes[b] = self.new_episode()
            self.closing.pop(b, None)
            if cap is not None and length == int(self.state[keys.SEQ_LEN][parent]):
                self.closing[b] = cap
        self.any_done = bool(self.done.any())
        return trajs

    # -- waiting slots (a turn handler holds them while other slots move) --
    def hold(self, rows: list[int]) -> None:
        """Slots whose turn ended wait: inactive (no steps), holding their tokens and lengths, until woken."""
        s = self.state
        s[keys.ACTIVE] = s[keys.ACTIVE].clone()  # the observation handed out keeps its own
        s[keys.ACTIVE][rows] = False
        self.waiting.update(rows)
        self.deadline, self.all_active = None, False

    def wake(self, appended: dict[int, torch.Tensor], closing: list[int]) -> int:
        """Waiting slots go on: ``appended`` ids written after their last turn (their next turn starts after them);
        ``closing``: slots whose next turn is one token long. Returns the number of tokens written."""
        s = self.state
        written = 0
        if appended:
            at = s[keys.SEQ_LEN].clone()
            self.write_feedback(appended, at)
            written = self.continue_turns(appended, at)
        bare = [b for b in closing if b not in appended]  # no feedback (it did not fit): a new turn all the same
        if bare:
            s[keys.PROMPT_LEN], s[keys.TURN] = s[keys.PROMPT_LEN].clone(), s[keys.TURN].clone()
            s[keys.PROMPT_LEN][bare] = s[keys.SEQ_LEN][bare]
            s[keys.TURN][bare] += 1
        self.activate(list(appended) + bare)
        for b in closing:
            self.closing[b] = int(s[keys.SEQ_LEN][b]) + 1
        return written

    def activate(self, rows: list[int]) -> None:
        """Waiting slots take steps again."""
        s = self.state
        s[keys.ACTIVE] = s[keys.ACTIVE].clone()
        s[keys.ACTIVE][rows] = True
        self.waiting.difference_update(rows)
        self.deadline, self.all_active = None, False

    def set_deadlines(self, max_new_tokens: int, max_length: int, max_turn_tokens: int | None) -> None:
        """The length at which each slot reaches a limit (its budget, the context, its turn's limit): a step and a
        wave add as many tokens to ``seq_len`` as to ``response_len``, so it moves only when slots change."""
        s = self.state
        budget = torch.clamp(s[keys.SEQ_LEN] - s[keys.RESPONSE_LEN] + max_new_tokens, max=max_length)
        for b, cap in self.closing.items():  # a woken slot's last turn: one token
            budget[b] = min(int(budget[b]), cap)
        self.budget_deadline = budget
        turn = None if max_turn_tokens is None else s[keys.PROMPT_LEN] + max_turn_tokens
        self.deadline = budget if turn is None else torch.minimum(budget, turn)
        self.all_active = bool(s[keys.ACTIVE].all())
        gap = self.deadline - s[keys.SEQ_LEN]
        self.steps_left = int((gap if self.all_active else torch.where(s[keys.ACTIVE], gap, max_length)).min())

    def commit(self, action, active, new_len, resp_len, done, *, any_done: bool) -> None:
        """Make a step (or a wave's last step) the slots' state."""
        s = self.state
        s[keys.TOKEN] = action.clone() if self.all_active else torch.where(active, action, s[keys.TOKEN])
        s[keys.SEQ_LEN], s[keys.RESPONSE_LEN] = new_len, resp_len
        self.done, self.any_done = done, any_done
        self.steps_left -= 1

    def continue_turns(self, appended: dict[int, torch.Tensor], new_len: torch.Tensor) -> int:
        """Write each continuing slot's feedback ids after its turn and move it to its next turn (lengths past
        the feedback, the turn counter up); returns the number of feedback tokens written."""
        s = self.state
        self.deadline = None  # seq_len jumps past the feedback, response_len does not
        s[keys.SEQ_LEN], s[keys.TOKEN] = s[keys.SEQ_LEN].clone(), s[keys.TOKEN].clone()
        s[keys.PROMPT_LEN], s[keys.TURN] = s[keys.PROMPT_LEN].clone(), s[keys.TURN].clone()
        slots = torch.tensor(list(appended), dtype=torch.int64)
        sizes = torch.tensor([len(ids) for ids in appended.values()], dtype=torch.int64)
        end = new_len[slots] + sizes
        s[keys.SEQ_LEN][slots] = end
        s[keys.PROMPT_LEN][slots] = end
        s[keys.TOKEN][slots] = torch.stack([ids[-1] for ids in appended.values()])
        s[keys.TURN][slots] += 1
        return int(sizes.sum())

    def write_feedback(self, appended: dict[int, torch.Tensor], new_len: torch.Tensor, *,
                       images: dict[int, ImageInputs] | None = None) -> None:  # fmt: skip
        """Write the feedback ids after each slot's turn (before :meth:`continue_turns` moves it), and add the images
        they show to the slot's."""
        ends = new_len.tolist()
        for b, ids in appended.items():
            self.tokens[b, ends[b] : ends[b] + len(ids)] = ids
        for b, inputs in (images or {}).items():
            self.images[b] = ImageInputs.cat([self.images[b], inputs])

    def archive(self, done: torch.Tensor, new_len: torch.Tensor) -> None:
        """Keep the full sequences of the slots whose episode ended (one gather, then views of it)."""
        slots = done.nonzero().squeeze(-1)
        if not len(slots):
            return
        trajs, ends = self.state[keys.TRAJ_ID][slots].tolist(), new_len[slots].tolist()
        rows = self.tokens[slots, : max(ends)]
        for i, (traj, end) in enumerate(zip(trajs, ends, strict=True)):
            if len(self.finished) >= self.max_finished:
                self.finished.pop(next(iter(self.finished)))
            self.finished[traj] = rows[i, :end]
        for b, traj in zip(slots.tolist(), trajs, strict=True):
            prompt = self.prompts[b]
            if self.images[b] is not None and (prompt is None or self.images[b] is not prompt.images):
                if len(self.finished_images) >= self.max_finished:
                    self.finished_images.pop(next(iter(self.finished_images)))
                self.finished_images[traj] = self.images[b]

    def state_dict(self) -> dict:
        """The slots' contents as plain data (a checkpoint loads with ``torch.load(weights_only=True)``)."""
        return {
            "tokens": self.tokens.clone(),
            "state": {k: v.clone() for k, v in self.state.items()},
            "done": self.done.clone(),
            "is_reset": self.is_reset,
            "next_traj": self.next_traj,
            "episodes": list(self.episodes),
            "next_episode": self.next_episode,
            "waiting": sorted(self.waiting),
            "closing": sorted([b, cap] for b, cap in self.closing.items()),
            "prompts": [None if p is None else _prompt_state(p) for p in self.prompts],
            "images": [None if x is None or (p is not None and x is p.images) else x.state_dict()
                       for x, p in zip(self.images, self.prompts, strict=True)],  # fmt: skip
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` of slots of the same shape."""
        saved = tuple(state["tokens"].shape)
        if saved != tuple(self.tokens.shape):
            raise ValueError(
                f"this checkpoint is of an env with (batch_size, max_length) {saved}, this env has "
                f"{tuple(self.tokens.shape)}; resume with the same batch_size and max_length"
            )
        if len(state["prompts"]) != len(self.prompts):
            raise ValueError(
                f"this checkpoint holds {len(state['prompts'])} slots but the env has batch_size {len(self.prompts)}; "
                "resume with an env of the same batch_size"
            )
        self.tokens.copy_(state["tokens"])
        saved_state = state["state"]
        self._use_table(torch.stack([saved_state[k] for k in _INT_KEYS]), saved_state[keys.ACTIVE].clone())
        self.deadline = None
        self.done = state["done"].clone()
        self.any_done = bool(self.done.any())
        self.is_reset, self.next_traj = state["is_reset"], state["next_traj"]
        # a checkpoint of an earlier release has no episode ids: each trajectory its own episode
        self.episodes = list(state.get("episodes", self.state[keys.TRAJ_ID].tolist()))
        self.next_episode = int(state.get("next_episode", self.next_traj))
        self.continuations.clear()  # a live episode's next trajectory cannot be saved
        self.failures = []
        self.waiting = set(state.get("waiting", []))
        self.closing = {int(b): int(cap) for b, cap in state.get("closing", [])}
        self.prompts = [None if p is None else _prompt_of(p) for p in state["prompts"]]
        saved_images = state.get("images", [None] * len(self.prompts))
        self.images = [ImageInputs.from_state_dict(x) if x is not None else (p.images if p is not None else None)
                       for x, p in zip(saved_images, self.prompts, strict=True)]  # fmt: skip


def _prompt_state(prompt: Prompt) -> dict:
    """A prompt as plain data (its images as their tensors)."""
    out = {f.name: getattr(prompt, f.name) for f in dataclasses.fields(prompt)}
    if prompt.images is not None:
        out["images"] = prompt.images.state_dict()
    return out


def _prompt_of(state: dict) -> Prompt:
    images = state.get("images")
    return Prompt(**{**state, "images": None if images is None else ImageInputs.from_state_dict(images)})
