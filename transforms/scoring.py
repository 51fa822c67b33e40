"""Teacher-forced scoring: log-probs of given tokens under a causal LM, in one forward pass.

The collectors' policy, the KL transform (reference log-probs) and the losses share these helpers.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.transforms._checks import (
    check_batch,
    check_number,
    check_single_turn,
    get_prompts,
    require,
    valid_mask,
)

__all__ = ["sequence_log_probs", "batch_sequences", "step_log_probs", "check_trajectory_rows"]


def sequence_log_probs(model, tokens: torch.Tensor, attention_mask: torch.Tensor, *,
                       temperature: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Log-prob of each token given its prefix, from one forward of a transformers causal LM.

    Position ids come from the attention mask, so left padding scores exactly like no padding.

    Args:
        model: a transformers causal LM (anything returning ``.logits`` of shape (N, L, V)).
        tokens: int64 (N, L) token ids.
        attention_mask: bool or int (N, L); False/0 on padding.
        temperature: logits are divided by it before the softmax (> 0).

    Returns:
        float32 (N, L): ``out[:, j] = log p(tokens[:, j] | tokens[:, :j])``; 0 on padding and on each row's first real token.

    Raises:
        ValueError: on shape mismatch or ``temperature <= 0``.

    Example:
        >>> from tokengym.llm_envs.testing import tiny_tokenizer, tiny_model
        >>> model = tiny_model(tiny_tokenizer())
        >>> tokens = torch.tensor([[0, 5, 6, 7], [4, 5, 6, 7]])
        >>> lp = sequence_log_probs(model, tokens, tokens.ne(0) | (torch.arange(4) > 0))
        >>> lp.shape, bool((lp[:, 2:] < 0).all()), lp[0, :2].tolist()  # no score without a prefix
        (torch.Size([2, 4]), True, [0.0, 0.0])
    """
    temperature = check_number("temperature", temperature, low=0.0, low_open=True,
                               fix="Use temperature=1.0 for the model's own distribution.")  # fmt: skip
    if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:
        raise ValueError(f"tokens must be an int64 tensor (N, L), got {getattr(tokens, 'shape', type(tokens))}")
    if attention_mask.shape != tokens.shape:
        raise ValueError(
            f"attention_mask must have the shape of tokens {tuple(tokens.shape)}, got {tuple(attention_mask.shape)}"
        )
    attention_mask = attention_mask.long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    logits = out.logits[:, :-1].float()  # (N, L-1, V)
    if temperature != 1.0:
        logits = logits / temperature
    # gather - logsumexp keeps memory at (N, L, V) once instead of a full log_softmax copy
    picked = logits.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (N, L-1)
    logp = picked - torch.logsumexp(logits, dim=-1)
    result = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
    # a token is scored when it and its predecessor are real (the first token has no prefix)
    scored = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()
    result[:, 1:] = torch.where(scored, logp, torch.zeros_like(logp))
    return result


def check_trajectory_rows(batch: TensorDictBase, owner: str) -> torch.Tensor:
    """Raise ValueError unless each row holds one trajectory from response step 0 (TRAJECTORIES mode).

    Returns the valid-step mask (bool [N, T]).
    """
    check_batch(batch, owner, (keys.TRAJ_ID,))
    mask = valid_mask(batch)
    traj = batch.get(keys.TRAJ_ID)
    steps = mask.shape[1]
    prefix = mask.long().cumprod(-1).sum(-1) == mask.sum(-1)  # valid steps form a prefix of the row
    same = (traj == traj[:, :1]) | ~mask
    resp = batch.get(keys.RESPONSE_LEN, None)
    starts = (resp[:, 0] == 0) | ~mask[:, 0] if resp is not None and steps else torch.ones_like(prefix)
    bad = ~(prefix & same.all(-1) & starts)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(
            f"{owner} needs a TRAJECTORIES batch (each row one trajectory from response step 0, right-padded), "
            f"but row {row} is not one. Collect in TRAJECTORIES mode or split a STEPS batch first with "
            f"tokengym.transforms.split_trajectories(batch, complete_only=True)."
        )
    return mask


def batch_sequences(batch: TensorDictBase, prompts: PromptTable | None = None, *,
                    pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """Left-padded prompt + right-padded response of every row of a TRAJECTORIES batch.

    Args:
        batch: collected batch [N, T] with ``keys.ACTION``, ``keys.GROUP_ID``, ``keys.TRAJ_ID``.
        prompts: the PromptTable; defaults to the one under ``keys.PROMPTS``.
        pad_id: token id used for padding.

    Returns:
        ``(tokens, attention_mask, P)``: int64 (N, P + T), bool (N, P + T), and the prompt width ``P``;
        response step ``t`` of row ``i`` is at column ``P + t``.

    Example:
        >>> from tensordict import TensorDict
        >>> table = PromptTable(); table.add(0, torch.tensor([7, 8])); table.add(1, torch.tensor([9]))
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4], [5, 0]]), keys.GROUP_ID: torch.tensor([[0, 0], [1, 1]]),
        ...                 keys.TRAJ_ID: torch.tensor([[0, 0], [1, 1]]), keys.MASK: torch.tensor([[1, 1], [1, 0]]).bool()}, [2, 2])
        >>> tokens, attn, width = batch_sequences(b, table)
        >>> tokens.tolist(), width
        ([[7, 8, 3, 4], [0, 9, 5, 0]], 2)
    """
    owner = "batch_sequences"
    mask = check_trajectory_rows(batch, owner)
    check_single_turn(batch, owner)
    table = get_prompts(batch, prompts, owner)
    action = require(batch, keys.ACTION, owner)
    group = require(batch, keys.GROUP_ID, owner)[:, 0]
    # one left_padded row per group (not per sequence), then gathered for every sequence
    unique, inverse = torch.unique(group, return_inverse=True)
    prompt, lengths = table.left_padded(unique.cpu(), pad_id=pad_id)
    prompt, lengths = prompt.to(action.device)[inverse], lengths.to(action.device)[inverse]
    if bool((lengths == 0).any()):
        raise ValueError(f"{owner}: group {int(group[lengths == 0][0])} has an empty prompt; nothing to condition on")
    width = prompt.shape[1]
    prompt_mask = torch.arange(width, device=action.device) >= (width - lengths)[:, None]  # (N, P)
    response = torch.where(mask, action, torch.full_like(action, pad_id))
    tokens = torch.cat([prompt, response], dim=1)
    attention_mask = torch.cat([prompt_mask, mask], dim=1)
    return tokens, attention_mask, width


@torch.no_grad()
def step_log_probs(model, batch: TensorDictBase, prompts: PromptTable | None = None, *, pad_id: int = 0,
                   temperature: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Log-prob of every step's action under ``model``, aligned with the step batch (one forward).

    Args:
        model: a transformers causal LM (e.g. the reference model).
        batch: TRAJECTORIES batch [N, T].
        prompts: the PromptTable; defaults to the one under ``keys.PROMPTS``.
        pad_id: token id used for padding.
        temperature: divides the logits (1.0 scores the model's own distribution).

    Returns:
        float32 [N, T], 0 on padding steps.

    Example:
        >>> from tensordict import TensorDict
        >>> from tokengym.llm_envs.testing import tiny_tokenizer, tiny_model
        >>> table = PromptTable(); table.add(0, torch.tensor([7, 8]))
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4]]), keys.GROUP_ID: torch.zeros(1, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.zeros(1, 2, dtype=torch.long)}, [1, 2])
        >>> step_log_probs(tiny_model(tiny_tokenizer()), b, table).shape
        torch.Size([1, 2])
    """
    tokens, attention_mask, width = batch_sequences(batch, prompts, pad_id=pad_id)
    logp = sequence_log_probs(model, tokens, attention_mask, temperature=temperature)
    return logp[:, width:]
