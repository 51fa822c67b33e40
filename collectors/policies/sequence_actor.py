"""SequenceActor: the policy as TorchRL losses see it, scoring whole trajectories in one teacher-forced forward."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase

from tokengym.llm_envs import keys
from tokengym.transforms.sequences import sequence_layout

__all__ = ["MaskedCategorical", "PaddedSequenceActor", "SequenceActor"]


class SequenceActor(TensorDictModuleBase):
    """Gives ``ClipPPOLoss`` (and friends) the current policy's distribution over every collected step.

    Reads a TRAJECTORIES batch (N, T) and its prompt table (``keys.PROMPTS``), runs the model once
    on left-padded prompt + response (N, P + T), and returns a categorical distribution over the
    vocabulary per step; no step ever copies its context. ``temperature`` must match the one the
    sampling policy used, so that the ratio against ``action_log_prob`` is a real importance ratio
    (top-k / top-p filtering is not reproduced: train with ``top_k=0, top_p=1``).

    Args:
        model: the transformers causal LM being trained.
        pad_token_id: id used to pad prompts and responses; ``None`` takes the batch's PromptTable's (the
            env tokenizer's, recorded by the collector) and raises a ``ValueError`` when it records none.
        temperature: the sampling temperature.
    """

    in_keys = [keys.ACTION, keys.GROUP_ID, keys.TRAJ_ID, keys.MASK, keys.PROMPTS]
    out_keys = [keys.LOGITS]

    def __init__(self, model, *, pad_token_id: int | None = None, temperature: float = 1.0) -> None:
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


class MaskedCategorical(torch.distributions.Categorical):
    """A categorical over every column of a padded layout, with the boolean loss mask TorchRL's LLM losses read."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__(logits=logits, validate_args=False)
        self.mask = mask


class PaddedSequenceActor(TensorDictModuleBase):
    """The policy as ``torchrl.objectives.llm.GRPOLoss`` sees it, on the padded layout of
    :func:`~tokengym.transforms.to_padded` (``keys.TOKENS`` = ``("tokens", "full")``).

    ``get_dist`` returns a distribution over the whole (N, L) sequence whose column ``j`` scores
    token ``j`` and whose ``mask`` is ``keys.ACTION_MASK`` (the generated tokens), so ``GRPOLoss``
    runs on ``to_padded(batch)`` with its default keys.

    Args:
        model: the transformers causal LM being trained.
        temperature: the sampling temperature.

    Example:
        >>> from torchrl.objectives.llm import GRPOLoss
        >>> from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
        >>> from tokengym.transforms import GroupAdvantage, to_padded
        >>> model = tiny_model(tiny_tokenizer())
        >>> batch = GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1], group_size=2))
        >>> out = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)(to_padded(batch))
        >>> out.loss_objective.shape
        torch.Size([])
    """

    in_keys = [keys.TOKENS, keys.ATTENTION_MASK, keys.ACTION_MASK, keys.POSITION_IDS]
    out_keys = [keys.LOGITS]

    def __init__(self, model, *, temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the sampling temperature), got {temperature}")
        self.model, self.temperature = model, temperature

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        out = self.model(input_ids=tensordict.get(keys.TOKENS), attention_mask=tensordict.get(keys.ATTENTION_MASK).long(),
                         position_ids=tensordict.get(keys.POSITION_IDS), use_cache=False)  # fmt: skip
        logits = out.logits.float() / self.temperature  # (N, L, V)
        # the logits at column j-1 predict token j: shift right so that column j scores token j
        tensordict.set(keys.LOGITS, torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1))
        return tensordict

    def get_dist(self, tensordict: TensorDictBase, logits_key=keys.LOGITS) -> MaskedCategorical:
        td = self(tensordict.copy())
        return MaskedCategorical(td.get(logits_key), td.get(keys.ACTION_MASK))
