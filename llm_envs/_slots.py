"""Writes of prompts into a token env's slots: the token buffer and the per-slot state, vectorized over slots."""

from __future__ import annotations

import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompts import Prompt

__all__ = ["write_prompts"]

_KEYS = (keys.TOKEN, keys.SEQ_LEN, keys.PROMPT_LEN, keys.RESPONSE_LEN, keys.TURN, keys.TRAJ_ID, keys.GROUP_ID,
         keys.SAMPLE_ID, keys.ACTIVE)  # fmt: skip


def write_prompts(tokens: torch.Tensor, state: dict, loaded: list[tuple[int, Prompt]], first_traj: int) -> None:
    """Put ``loaded`` (slot, prompt) pairs into ``tokens`` (B, L) and ``state`` ((B,) tensors by key), with
    trajectory ids ``first_traj, first_traj + 1, ...``: a few vectorized writes, not a dozen per slot.

    The prompts must fit and hold in-vocabulary ids (the env checks both first).

    Example:
        >>> from tokengym.llm_envs.prompts import Prompt
        >>> tokens = torch.zeros(2, 4, dtype=torch.int64)
        >>> state = {k: torch.zeros(2, dtype=torch.bool if k == keys.ACTIVE else torch.int64) for k in _KEYS}
        >>> write_prompts(tokens, state, [(1, Prompt(torch.tensor([5, 6]), "", {}, 0, 3, 0))], 7)
        >>> tokens[1].tolist(), state[keys.SEQ_LEN].tolist(), state[keys.TRAJ_ID].tolist(), state[keys.TOKEN].tolist()
        ([5, 6, 0, 0], [0, 2], [0, 7], [0, 6])
    """
    if len(loaded) == 1:  # one slot (a step source's usual refill): scalar writes, no index tensors
        b, prompt = loaded[0]
        n = prompt.ids.numel()
        tokens[b, :n] = prompt.ids
        for key, value in ((keys.TOKEN, prompt.ids[n - 1]), (keys.SEQ_LEN, n), (keys.PROMPT_LEN, n),
                           (keys.RESPONSE_LEN, 0), (keys.TURN, 0), (keys.TRAJ_ID, first_traj),
                           (keys.GROUP_ID, prompt.group_id), (keys.SAMPLE_ID, prompt.sample_id), (keys.ACTIVE, True)):  # fmt: skip
            state[key][b] = value
        return
    ids = torch.cat([p.ids for _, p in loaded])
    slots = torch.tensor([b for b, _ in loaded])
    lens = torch.tensor([p.ids.numel() for _, p in loaded])
    ends = lens.cumsum(0)
    rows = torch.repeat_interleave(slots, lens)
    cols = torch.arange(len(ids)) - torch.repeat_interleave(ends - lens, lens)
    tokens[rows, cols] = ids
    state[keys.TOKEN][slots] = ids[ends - 1]
    state[keys.SEQ_LEN][slots] = lens
    state[keys.PROMPT_LEN][slots] = lens
    state[keys.RESPONSE_LEN][slots] = 0
    state[keys.TURN][slots] = 0
    state[keys.TRAJ_ID][slots] = torch.arange(first_traj, first_traj + len(loaded))
    state[keys.GROUP_ID][slots] = torch.tensor([p.group_id for _, p in loaded])
    state[keys.SAMPLE_ID][slots] = torch.tensor([p.sample_id for _, p in loaded])
    state[keys.ACTIVE][slots] = True
