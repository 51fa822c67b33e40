"""Writes of prompts into a token env's slots: the token buffer and the per-slot state, vectorized over slots."""

from __future__ import annotations

import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompts import Prompt

__all__ = ["write_prompts"]


def write_prompts(tokens: torch.Tensor, state: dict, loaded: list[tuple[int, Prompt]], first_traj: int) -> None:
    """Put ``loaded`` (slot, prompt) pairs into ``tokens`` (B, L) and ``state`` ((B,) tensors by key), with
    trajectory ids ``first_traj, first_traj + 1, ...``: a few vectorized writes, not a dozen per slot.

    The prompts must fit and hold in-vocabulary ids (the env checks both first).
    """
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
