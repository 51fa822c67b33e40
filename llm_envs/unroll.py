"""Turn a wave of generated tokens into the token-level steps stepping would give, vectorized over (B, T)."""

from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["TurnEnd", "WaveSteps", "is_any", "unroll_wave"]

_FIXED = (keys.PROMPT_LEN, keys.TRAJ_ID, keys.GROUP_ID, keys.SAMPLE_ID, keys.TURN)
_AFTER_TURN = (keys.TOKEN, keys.SEQ_LEN, keys.PROMPT_LEN, keys.TURN)  # what a continuing turn moves


@dataclasses.dataclass
class TurnEnd:
    """How the env answered the slots whose turn ended: flags (B,), reward (B, 1), appended feedback."""

    terminated: torch.Tensor
    truncated: torch.Tensor
    reward: torch.Tensor
    appended: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class WaveSteps:
    """A wave laid out over all B slots: (B, T) tokens and log-probs, rows outside the request idle."""

    actions: torch.Tensor
    log_probs: torch.Tensor
    raw_log_probs: torch.Tensor | None
    lengths: torch.Tensor  # (B,) 0 for slots outside the wave
    version: int
    in_wave: torch.Tensor  # bool (B,): rows of the request that hold at least one token
    unfinished: torch.Tensor | None = None  # bool (B,): interrupted rows (their turn goes on in the next wave)
    versions: torch.Tensor | None = None  # int64 (B, T) per-token versions, or None: every token has ``version``
    # filled by unroll_wave
    end: torch.Tensor | None = None
    ended: torch.Tensor | None = None
    limited: torch.Tensor | None = None
    cut: torch.Tensor | None = None
    new_len: torch.Tensor | None = None
    resp_len: torch.Tensor | None = None
    last_action: torch.Tensor | None = None
    start: dict | None = None
    written: tuple | None = None

    @classmethod
    def from_result(cls, request: WaveRequest, result: WaveResult, batch: int) -> WaveSteps:
        """Check ``result`` against ``request`` and scatter its rows to their slots."""
        n = len(request)
        actions = result.actions
        if not isinstance(actions, torch.Tensor) or actions.dtype != torch.int64 or actions.dim() != 2:
            raise TypeError(f"WaveResult.actions must be an int64 tensor (n, T), got {getattr(actions, 'dtype', type(actions))} "
                            f"of shape {tuple(getattr(actions, 'shape', ()))}")  # fmt: skip
        if actions.shape[0] != n or tuple(result.lengths.shape) != (n,) or result.log_probs.shape != actions.shape:
            raise ValueError(
                f"WaveResult rows must match the request's {n} prompts: actions {tuple(actions.shape)}, "
                f"lengths {tuple(result.lengths.shape)}, log_probs {tuple(result.log_probs.shape)}"
            )
        finished = result.finished
        if finished is not None and (not isinstance(finished, torch.Tensor) or finished.dtype != torch.bool
                                     or tuple(finished.shape) != (n,)):  # fmt: skip
            raise ValueError(f"WaveResult.finished must be a bool tensor ({n},) (False: the row was interrupted), got "
                             f"{getattr(finished, 'dtype', type(finished))} {tuple(getattr(finished, 'shape', ()))}")  # fmt: skip
        low = result.lengths if finished is None else torch.where(finished, result.lengths, 1)  # unfinished: may be 0
        if n and (int(low.min()) < 1 or int(result.lengths.min()) < 0 or int(result.lengths.max()) > actions.shape[1]):
            raise ValueError(f"WaveResult.lengths must lie in [1, {actions.shape[1]}] (0 allowed only where "
                             f"finished is False), got {result.lengths.tolist()}")  # fmt: skip
        if result.versions is not None and (result.versions.shape != actions.shape or result.versions.dtype != torch.int64):
            raise ValueError(f"WaveResult.versions must be int64 {tuple(actions.shape)} like actions, got "
                             f"{result.versions.dtype} {tuple(result.versions.shape)}")  # fmt: skip
        T, slots = max(actions.shape[1], 1), request.slots
        full = torch.zeros(batch, T, dtype=torch.int64)
        full[slots, : actions.shape[1]] = actions
        logp = torch.zeros(batch, T)
        logp[slots, : actions.shape[1]] = result.log_probs.float()
        raw = None
        if result.raw_log_probs is not None:
            raw = torch.zeros(batch, T)
            raw[slots, : actions.shape[1]] = result.raw_log_probs.float()
        lengths = torch.zeros(batch, dtype=torch.int64)
        lengths[slots] = result.lengths
        in_wave = torch.zeros(batch, dtype=torch.bool)
        in_wave[slots] = result.lengths > 0  # an interrupted row that produced nothing yet is left as it was
        unfinished = versions = None
        if finished is not None and not bool(finished.all()):
            unfinished = torch.zeros(batch, dtype=torch.bool)
            unfinished[slots] = ~finished
        if result.versions is not None:
            versions = torch.full((batch, T), int(result.version), dtype=torch.int64)
            versions[slots, : actions.shape[1]] = result.versions
        return cls(full, logp, raw, lengths, int(result.version), in_wave, unfinished, versions)

    def rollback(self, tokens: torch.Tensor) -> None:
        """Restore the buffer entries the wave overwrote (a failed reward function leaves no trace)."""
        rows, cols, previous = self.written
        tokens[rows, cols] = previous

    def to_tensordict(self, end: TurnEnd, after: dict, width: int | None = None) -> TensorDict:
        """The (B, Tn) steps; ``after`` is the env state once the turn ends (continuing slots moved on).

        Every tensor is zero past each row's last step (and on rows outside the wave), so the rows are
        whole right-padded trajectories a recorder can hand out as they are; each is built in one pass.
        ``width`` pads the steps to at least that many (inactive) steps in the same pass.
        """
        s0, B = self.start, self.actions.shape[0]
        Tn = int(self.end[self.in_wave].max()) + 1 if bool(self.in_wave.any()) else 1
        Tn = max(Tn, width or 0)
        if self.actions.shape[1] < Tn:
            grow = Tn - self.actions.shape[1]
            self.actions = torch.nn.functional.pad(self.actions, (0, grow))
            self.log_probs = torch.nn.functional.pad(self.log_probs, (0, grow))
            if self.raw_log_probs is not None:
                self.raw_log_probs = torch.nn.functional.pad(self.raw_log_probs, (0, grow))
            if self.versions is not None:
                self.versions = torch.nn.functional.pad(self.versions, (0, grow))
        t = torch.arange(Tn)
        end_at = torch.where(self.in_wave, self.end, -1)[:, None]  # (B, 1): -1 outside the wave
        valid = t <= end_at  # (B, Tn)
        is_end = t == end_at
        term, trunc = is_end & end.terminated[:, None], is_end & end.truncated[:, None]
        zero = torch.zeros((), dtype=torch.int64)
        acts = self.actions[:, :Tn] * valid
        seq = torch.where(valid, s0[keys.SEQ_LEN][:, None] + t, zero)
        resp = torch.where(valid, s0[keys.RESPONSE_LEN][:, None] + t, zero)
        token = torch.where(valid, torch.cat([s0[keys.TOKEN][:, None], acts[:, :-1]], 1), zero)
        fixed = {k: torch.where(valid, s0[k][:, None], zero) for k in _FIXED}
        obs = {keys.TOKEN: token, keys.SEQ_LEN: seq, keys.RESPONSE_LEN: resp, keys.ACTIVE: valid, **fixed}
        nxt = {keys.TOKEN: acts, keys.SEQ_LEN: seq + valid, keys.RESPONSE_LEN: resp + valid, keys.ACTIVE: valid,
               keys.TRAJ_ID: fixed[keys.TRAJ_ID], keys.GROUP_ID: fixed[keys.GROUP_ID], keys.SAMPLE_ID: fixed[keys.SAMPLE_ID],
               keys.PROMPT_LEN: fixed[keys.PROMPT_LEN].clone(), keys.TURN: fixed[keys.TURN].clone()}  # fmt: skip
        if end.appended:  # a continuing turn: the last step's next observation is the next turn's start
            rows = torch.tensor(sorted(end.appended))
            nxt[keys.TOKEN] = nxt[keys.TOKEN].clone()  # not the actions' tensor
            for key in _AFTER_TURN:
                nxt[key][rows, self.end[rows]] = after[key][rows]
        reward = torch.where(is_end, end.reward[:, :1], 0.0).unsqueeze(-1)
        done = (term | trunc).unsqueeze(-1)
        nxt[keys.REWARD_NAME], nxt[keys.DONE_NAME] = reward, done
        nxt[keys.TERMINATED_NAME], nxt[keys.TRUNCATED_NAME] = term.unsqueeze(-1), trunc.unsqueeze(-1)
        out = {**obs, keys.ACTION: acts, keys.ACTION_LOG_PROB: self.log_probs[:, :Tn] * valid,
               keys.POLICY_VERSION: valid * (self.version if self.versions is None else self.versions[:, :Tn]),
               keys.NEXT: TensorDict._new_unsafe(nxt, torch.Size([B, Tn]))}  # fmt: skip
        if self.raw_log_probs is not None:
            out[keys.RAW_LOG_PROB] = self.raw_log_probs[:, :Tn] * valid
        return TensorDict._new_unsafe(out, torch.Size([B, Tn]))

    def to_cells(self, end: TurnEnd, after: dict) -> tuple[TensorDict, torch.Tensor]:
        """The steps of :meth:`to_tensordict` without its padding: a TensorDict (n,) of the wave's real steps, slot
        by slot (each slot's in order), and each slot's number of steps (B,) (0 outside the wave). Built over
        those steps only: a wave whose rows are mostly padding (turns of different lengths) costs what its tokens
        cost."""
        s0, T = self.start, self.actions.shape[1]
        steps = torch.where(self.in_wave, self.end + 1, 0)
        slot, t, first = _runs(steps)
        n = len(slot)
        at = slot * T + t
        actions = self.actions.reshape(-1)
        acts = actions.index_select(0, at)
        previous = actions.index_select(0, (at - 1).clamp(min=0))
        seq = s0[keys.SEQ_LEN].index_select(0, slot) + t
        resp = s0[keys.RESPONSE_LEN].index_select(0, slot) + t
        token = torch.where(t == 0, s0[keys.TOKEN].index_select(0, slot), previous)
        fixed = {k: s0[k].index_select(0, slot) for k in _FIXED}
        live = torch.ones(n, dtype=torch.bool)
        obs = {keys.TOKEN: token, keys.SEQ_LEN: seq, keys.RESPONSE_LEN: resp, keys.ACTIVE: live, **fixed}
        nxt = {keys.TOKEN: acts, keys.SEQ_LEN: seq + 1, keys.RESPONSE_LEN: resp + 1, keys.ACTIVE: live.clone(),
               keys.TRAJ_ID: fixed[keys.TRAJ_ID], keys.GROUP_ID: fixed[keys.GROUP_ID], keys.SAMPLE_ID: fixed[keys.SAMPLE_ID],
               keys.PROMPT_LEN: fixed[keys.PROMPT_LEN].clone(), keys.TURN: fixed[keys.TURN].clone()}  # fmt: skip
        last = first + steps - 1  # each slot's last step (in the wave)
        if end.appended:  # a continuing turn: the last step's next observation is the next turn's start
            rows = torch.tensor(sorted(end.appended))
            nxt[keys.TOKEN] = nxt[keys.TOKEN].clone()  # not the actions' tensor
            for key in _AFTER_TURN:
                nxt[key][last[rows]] = after[key][rows]
        rows = self.in_wave.nonzero().squeeze(-1)
        ends = last.index_select(0, rows)
        reward = torch.zeros(n, 1)
        reward[ends] = end.reward.index_select(0, rows)[:, :1]
        term, trunc = torch.zeros(n, 1, dtype=torch.bool), torch.zeros(n, 1, dtype=torch.bool)
        term[ends, 0], trunc[ends, 0] = end.terminated.index_select(0, rows), end.truncated.index_select(0, rows)
        nxt[keys.REWARD_NAME], nxt[keys.DONE_NAME] = reward, term | trunc
        nxt[keys.TERMINATED_NAME], nxt[keys.TRUNCATED_NAME] = term, trunc
        out = {**obs, keys.ACTION: acts, keys.ACTION_LOG_PROB: self.log_probs.reshape(-1).index_select(0, at),
               keys.POLICY_VERSION: torch.full((n,), self.version) if self.versions is None
               else self.versions.reshape(-1).index_select(0, at), keys.NEXT: TensorDict._new_unsafe(nxt, torch.Size([n]))}  # fmt: skip
        if self.raw_log_probs is not None:
            out[keys.RAW_LOG_PROB] = self.raw_log_probs.reshape(-1).index_select(0, at)
        return TensorDict._new_unsafe(out, torch.Size([n])), steps


def is_any(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``torch.isin(values, ids)``; a few comparisons are several times faster for the usual 1-3 EOS ids."""
    if ids.numel() > 4 or ids.numel() == 0:
        return torch.isin(values, ids)
    first, *rest = ids.tolist()
    out = values == first
    for i in rest:
        out |= values == i
    return out


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row of (B, T), or T when none (argmax gives the first maximum)."""
    first = flags.to(torch.uint8).argmax(dim=1)
    return torch.where(flags.any(dim=1), first, flags.shape[1])


def unroll_wave(wave: WaveSteps, state: dict, tokens: torch.Tensor, rules: dict) -> WaveSteps:
    """Write the wave's tokens into ``tokens`` (B, L) and find where each slot's turn ends.

    ``state`` is the env's slot state (observation keys, (B,) each) before the wave; ``rules`` holds
    ``eos`` (ids tensor), ``stop`` (a stop checker), ``max_new_tokens``, ``max_length`` and ``max_turn_tokens``
    (or ``None``). Fills ``wave.end`` (index of each slot's last step), the ``ended`` / ``limited`` / ``cut``
    (the turn's limit, not the trajectory's) flags at that step,
    the lengths after it and what :meth:`WaveSteps.rollback` needs.

    Each limit is a step index per row (where the budget, the context, the turn's limit or the backend's length is
    reached), so only the end ids are searched over the whole (B, T) wave; without stop strings only the tokens up to
    each row's end are written (with them, every real token first: a stop string is decoded from the buffer).
    """
    B, T = wave.actions.shape
    in_wave, actions = wave.in_wave, wave.actions
    seq0, resp0, p_len = state[keys.SEQ_LEN], state[keys.RESPONSE_LEN], state[keys.PROMPT_LEN]
    room = torch.minimum(wave.lengths, rules["max_length"] - seq0)  # real steps: t < room (the context's end)
    is_end_id = is_any(actions, rules["eos"])
    first_end = _first_true(is_end_id)  # the first end id, or T
    stop = rules["stop"]
    if stop.is_enabled:
        t = torch.arange(T)
        pos = seq0[:, None] + t  # (B, T) where each action is written
        real = in_wave[:, None] & (t < room[:, None])
        r, c = real.nonzero(as_tuple=True)  # once: the boolean mask is not resolved again per use
        _write(wave, tokens, r, c, seq0)
        terminated = real & is_end_id
        for j in range(T):  # only tokens that could complete a stop string are decoded
            cand = real[:, j] & ~terminated[:, j]
            if bool(cand.any()):
                terminated[:, j] |= stop.hits(tokens, actions[:, j], cand, p_len, pos[:, j] + 1)
        first_end = _first_true(terminated)
    first_end = torch.where(first_end < room, first_end, T)  # an end id past the real tokens does not count
    # the step at which each limit is reached: the trajectory's budget or the context, the turn's own limit (the turn
    # ends, the episode may go on), the backend's length (truncated unless the env ended the turn)
    budget_at = torch.minimum(rules["max_new_tokens"] - resp0, rules["max_length"] - seq0) - 1
    end = torch.minimum(torch.minimum(first_end, budget_at), wave.lengths - 1)
    cut_at = None
    if rules.get("max_turn_tokens") is not None:
        cut_at = p_len + rules["max_turn_tokens"] - seq0 - 1
        end = torch.minimum(end, cut_at)
    end = end.clamp(min=0, max=T - 1)
    wave.end = torch.where(in_wave, end, torch.zeros_like(end))
    wave.ended = in_wave & (first_end == wave.end)
    at_budget = wave.end >= budget_at
    at_cut = wave.end >= cut_at if cut_at is not None else torch.zeros_like(in_wave)
    wave.cut = in_wave & ~wave.ended & ~at_budget & at_cut
    # as stepping has it: the budget flag stands even where EOS came on the last token (the episode cannot go on)
    backend_stop = ~wave.ended & ~wave.cut  # the backend stopped the row: truncated, unless it was interrupted
    if wave.unfinished is not None:
        backend_stop &= ~wave.unfinished
    wave.limited = in_wave & (at_budget | backend_stop)
    wave.new_len = torch.where(in_wave, seq0 + wave.end + 1, seq0)
    wave.resp_len = torch.where(in_wave, resp0 + wave.end + 1, resp0)
    idx = torch.arange(B)
    wave.last_action = torch.where(in_wave, actions[idx, wave.end], state[keys.TOKEN])
    if not stop.is_enabled:  # the tokens up to each row's end, and no further
        r, c, _ = _runs(torch.where(in_wave, wave.end + 1, 0))
        _write(wave, tokens, r, c, seq0)
    wave.start = dict(state)
    return wave


def _write(wave: WaveSteps, tokens: torch.Tensor, r: torch.Tensor, c: torch.Tensor, seq0: torch.Tensor) -> None:
    """Write the wave's actions at (row ``r``, step ``c``) into ``tokens``, keeping what they overwrite (a rollback)."""
    p = seq0.index_select(0, r) + c
    wave.written = (r, p, tokens[r, p])  # advanced indexing copies: the previous entries
    tokens[r, p] = wave.actions[r, c]


def _runs(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of ``counts[b]`` cells for each row ``b``, laid end to end: each cell's row and its index within its run,
    and each run's first cell."""
    row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first = counts.cumsum(0) - counts
    return row, torch.arange(len(row)) - first.index_select(0, row), first
