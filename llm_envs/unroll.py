"""Build the token-level TensorDict of a whole wave of generated responses at once (generate-then-unroll)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tokengym.llm_envs import keys

__all__ = ["unroll_wave"]


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Index of the first True per row of (B, T), or T when none."""
    T = flags.shape[1]
    idx = torch.where(flags, torch.arange(T).expand_as(flags), torch.full_like(flags, T, dtype=torch.int64))
    return idx.min(dim=1).values


def unroll_wave(env, actions: torch.Tensor) -> TensorDict:
    """Steps of a freshly reset ``env`` fed ``actions`` (B, T) per slot, computed without stepping.

    Applies the env's own termination rules (EOS, stop strings, ``max_new_tokens``, ``max_length``)
    and reward function, writes the tokens into ``env.tokens`` and leaves every active slot done,
    so the result equals ``T`` calls of ``env.step`` (the slot idles after its last step: those steps
    have ``active`` False). Returns a TensorDict (B, T') with ``T'`` the longest trajectory.
    """
    s, B = env._rt.state, env.batch_size[0]
    if bool((s[keys.RESPONSE_LEN] != 0).any()):
        raise ValueError("unroll_wave needs freshly reset slots (response_len 0); call env.reset() first")
    active, p = s[keys.ACTIVE], s[keys.PROMPT_LEN]
    T = actions.shape[1]
    t = torch.arange(T)
    pos = p[:, None] + t  # (B, T) where each action is written
    fits = pos < env.max_length
    rows = torch.arange(B)[:, None].expand(B, T)
    env.tokens[rows[fits], pos[fits]] = actions[fits]
    terminated = torch.isin(actions, env._eos)
    if env._stop.is_enabled:
        for j in range(T):  # only tokens that could complete a stop string are decoded
            cand = active & ~terminated[:, j] & fits[:, j]
            terminated[:, j] |= env._stop.hits(env.tokens, actions[:, j], cand, p, p + j + 1)
    limit = (t + 1 >= env.max_new_tokens)[None, :] | (pos + 1 >= env.max_length)
    end = _first_true(terminated | limit).clamp(max=T - 1)  # (B,) index of each last step
    Tn = int(end[active].max()) + 1 if bool(active.any()) else 1
    t, end_t = t[:Tn], end[:, None]
    valid = active[:, None] & (t <= end_t)  # (B, Tn)
    is_end = active[:, None] & (t == end_t)
    term = is_end & terminated[:, :Tn]
    trunc = is_end & ~term
    reward = torch.zeros(B, Tn, 1)
    done_rows = active.nonzero().squeeze(-1)
    if len(done_rows):
        final = torch.zeros(B, 1)
        env._score(done_rows, p + end + 1, final)  # one reward_fn call for the whole wave
        reward[done_rows, end[done_rows], 0] = final[done_rows, 0]
    acts = actions[:, :Tn]
    prev = torch.cat([s[keys.TOKEN][:, None], acts[:, :-1]], dim=1)
    fixed = {k: s[k][:, None].expand(B, Tn) for k in (keys.PROMPT_LEN, keys.TRAJ_ID, keys.GROUP_ID, keys.SAMPLE_ID, keys.TURN)}
    obs = {keys.TOKEN: prev, keys.SEQ_LEN: pos[:, :Tn], keys.RESPONSE_LEN: t.expand(B, Tn), keys.ACTIVE: valid, **fixed}
    nxt = {keys.TOKEN: acts, keys.SEQ_LEN: pos[:, :Tn] + 1, keys.RESPONSE_LEN: (t + 1).expand(B, Tn),
           keys.ACTIVE: valid, **fixed}  # fmt: skip
    done = (term | trunc)[..., None]
    nxt.update(reward=reward, done=done, terminated=term[..., None], truncated=trunc[..., None])
    out = TensorDict({**obs, keys.ACTION: acts, "next": TensorDict(nxt, [B, Tn])}, [B, Tn])
    # leave the env where T steps would have: every active slot finished
    s[keys.SEQ_LEN] = torch.where(active, p + end + 1, s[keys.SEQ_LEN])
    s[keys.RESPONSE_LEN] = torch.where(active, end + 1, s[keys.RESPONSE_LEN])
    s[keys.TOKEN] = torch.where(active, actions[torch.arange(B), end], s[keys.TOKEN])
    env._rt.done = active.clone()
    return out
