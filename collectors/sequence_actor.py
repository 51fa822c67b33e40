"""SequenceActor: the policy as TorchRL losses see it, scoring whole trajectories in one teacher-forced forward."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tokengym.llm_envs import keys
from tokengym.transforms.scoring import sequence_layout

__all__ = ["SequenceActor"]


class SequenceActor(TensorDictModuleBase):
    """Gives ``ClipPPOLoss`` (and friends) the current policy's distribution over every collected step.

    Reads a TRAJECTORIES batch (N, T) and its prompt table (``keys.PROMPTS``), runs the model once
    on left-padded prompt + response (N, P + T), and returns a categorical distribution over the
    vocabulary per step; no step ever copies its context. ``temperature`` must match the one the
    sampling policy used, so that the ratio against ``action_log_prob`` is a real importance ratio
    (top-k / top-p filtering is not reproduced: train with ``top_k=0, top_p=1``).

    Args:
        model: the transformers causal LM being trained.
        pad_token_id: id used to pad prompts and responses.
        temperature: the sampling temperature.
    """

    in_keys = [keys.ACTION, keys.GROUP_ID, keys.TRAJ_ID, keys.MASK, keys.PROMPTS]
    out_keys = [keys.LOGITS]

    def __init__(self, model, *, pad_token_id: int, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the sampling temperature), got {temperature}")
        self.model, self.pad_token_id, self.temperature = model, pad_token_id, temperature

    def logits(self, tensordict: TensorDictBase) -> torch.Tensor:
        """Logits (N, T, V) of each step's token distribution, temperature applied."""
        layout = sequence_layout(tensordict, pad_id=self.pad_token_id)
        attention_mask = layout.attention_mask.long()
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=layout.tokens, attention_mask=attention_mask, position_ids=positions, use_cache=False)
        # step t is predicted at the column before its token (multi-turn: feedback sits in between)
        index = (layout.columns - 1)[..., None].expand(*layout.columns.shape, out.logits.shape[-1])
        return out.logits.gather(1, index).float() / self.temperature  # (N, T, V)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tensordict.set(keys.LOGITS, self.logits(tensordict))
        return tensordict

    def get_dist(self, tensordict: TensorDictBase) -> torch.distributions.Categorical:
        """The per-step categorical distribution (what ``ClipPPOLoss`` calls)."""
        return torch.distributions.Categorical(logits=self.logits(tensordict))
