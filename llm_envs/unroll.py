"""Turn a wave of generated tokens into the token-level steps stepping would give, vectorized over (B, T)."""

from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys
from tokengym.llm_envs.waves import WaveRequest, WaveResult

__all__ = ["TurnEnd", "WaveSteps", "unroll_wave"]

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
    in_wave: torch.Tensor  # bool (B,)
    # filled by unroll_wave
    end: torch.Tensor | None = None
    ended: torch.Tensor | None = None
    limited: torch.Tensor | None = None
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
        if n and (int(result.lengths.min()) < 1 or int(result.lengths.max()) > actions.shape[1]):
            raise ValueError(f"WaveResult.lengths must lie in [1, {actions.shape[1]}], got {result.lengths.tolist()}")
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
        in_wave[slots] = True
        return cls(full, logp, raw, lengths, int(result.version), in_wave)

    def rollback(self, tokens: torch.Tensor) -> None:
        """Restore the buffer entries the wave overwrote (a failed reward function leaves no trace)."""
        rows, cols, previous = self.written
        tokens[rows, cols] = previous

    def to_tensordict(self, end: TurnEnd, after: dict) -> TensorDict:
        """The (B, Tn) steps; ``after`` is the env state once the turn ends (continuing slots moved on)."""
        s0, B = self.start, self.actions.shape[0]
        Tn = int(self.end[self.in_wave].max()) + 1 if bool(self.in_wave.any()) else 1
        t = torch.arange(Tn)
        valid = self.in_wave[:, None] & (t <= self.end[:, None])  # (B, Tn)
        is_end = self.in_wave[:, None] & (t == self.end[:, None])
        term, trunc = is_end & end.terminated[:, None], is_end & end.truncated[:, None]
        reward = torch.zeros(B, Tn, 1)
        reward[:, :, 0] = torch.where(is_end, end.reward[:, :1].expand(B, Tn), 0.0)
        acts = self.actions[:, :Tn]
        pos = s0[keys.SEQ_LEN][:, None] + t
        resp = s0[keys.RESPONSE_LEN][:, None] + t
        fixed = {k: s0[k][:, None].expand(B, Tn) for k in _FIXED}
        obs = {keys.TOKEN: torch.cat([s0[keys.TOKEN][:, None], acts[:, :-1]], 1), keys.SEQ_LEN: pos,
               keys.RESPONSE_LEN: resp, keys.ACTIVE: valid, **fixed}  # fmt: skip
        nxt = {keys.TOKEN: acts, keys.SEQ_LEN: pos + 1, keys.RESPONSE_LEN: resp + 1, keys.ACTIVE: valid, **fixed}
        if end.appended:  # a continuing turn: the last step's next observation is the next turn's start
            rows = torch.tensor(sorted(end.appended))
            for key in _AFTER_TURN:
                nxt[key] = nxt[key].clone()
                nxt[key][rows, self.end[rows]] = after[key][rows]
        done = (term | trunc)[..., None]
        nxt.update(reward=reward, done=done, terminated=term[..., None], truncated=trunc[..., None])
        out = {**obs, keys.ACTION: acts, keys.ACTION_LOG_PROB: self.log_probs[:, :Tn] * valid,
               keys.POLICY_VERSION: torch.full((B, Tn), self.version), keys.NEXT: TensorDict(nxt, [B, Tn])}  # fmt: skip
        if self.raw_log_probs is not None:
            out[keys.RAW_LOG_PROB] = self.raw_log_probs[:, :Tn] * valid
        return TensorDict(out, [B, Tn])


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row of (B, T), or T when none."""
    T = flags.shape[1]
    idx = torch.where(flags, torch.arange(T).expand_as(flags), torch.full_like(flags, T, dtype=torch.int64))
    return idx.min(dim=1).values


def unroll_wave(wave: WaveSteps, state: dict, tokens: torch.Tensor, rules: dict) -> WaveSteps:
    """Write the wave's tokens into ``tokens`` (B, L) and find where each slot's turn ends.

    ``state`` is the env's slot state (observation keys, (B,) each) before the wave; ``rules`` holds
    ``eos`` (ids tensor), ``stop`` (a stop checker), ``max_new_tokens`` and ``max_length``. Fills
    ``wave.end`` (index of each slot's last step), the ``ended`` / ``limited`` flags at that step,
    the lengths after it and what :meth:`WaveSteps.rollback` needs.
    """
    B, T = wave.actions.shape
    in_wave, actions = wave.in_wave, wave.actions
    seq0, resp0, p_len = state[keys.SEQ_LEN], state[keys.RESPONSE_LEN], state[keys.PROMPT_LEN]
    t = torch.arange(T)
    pos = seq0[:, None] + t  # (B, T) where each action is written
    real = in_wave[:, None] & (t < wave.lengths[:, None]) & (pos < rules["max_length"])
    rows = torch.arange(B)[:, None].expand(B, T)
    wave.written = (rows[real], pos[real], tokens[rows[real], pos[real]].clone())
    tokens[rows[real], pos[real]] = actions[real]
    terminated = real & torch.isin(actions, rules["eos"])
    stop = rules["stop"]
    if stop.is_enabled:
        for j in range(T):  # only tokens that could complete a stop string are decoded
            cand = real[:, j] & ~terminated[:, j]
            if bool(cand.any()):
                terminated[:, j] |= stop.hits(tokens, actions[:, j], cand, p_len, pos[:, j] + 1)
    limit = ((resp0[:, None] + t + 1) >= rules["max_new_tokens"]) | (pos + 1 >= rules["max_length"])
    limit |= t + 1 >= wave.lengths[:, None]  # the backend stopped: truncated unless the env ended the turn
    end = _first_true(terminated | (limit & real)).clamp(max=T - 1)
    idx = torch.arange(B)
    wave.end = torch.where(in_wave, end, torch.zeros_like(end))
    wave.ended = in_wave & terminated[idx, wave.end]
    wave.limited = in_wave & ~wave.ended
    wave.new_len = torch.where(in_wave, seq0 + wave.end + 1, seq0)
    wave.resp_len = torch.where(in_wave, resp0 + wave.end + 1, resp0)
    wave.last_action = torch.where(in_wave, actions[idx, wave.end], state[keys.TOKEN])
    wave.start = dict(state)
    return wave
