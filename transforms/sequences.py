"""Sequences of a collected batch: the padded prompt + response layout and teacher-forced log-probs of its tokens.

The collectors' policy, the KL transform (reference log-probs) and the losses share these helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.image_inputs import ImageInputs
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.transforms._checks import (
    check_batch,
    check_number,
    get_prompts,
    require,
    valid_mask,
)
from tokengym.transforms.image_rows import forward_inputs, row_images
from tokengym.transforms.token_log_probs import TokenScorer, final_hidden_states

__all__ = ["SequenceLayout", "sequence_log_probs", "sequence_layout", "step_log_probs",
           "check_trajectory_rows"]


def sequence_log_probs(model, tokens: torch.Tensor, attention_mask: torch.Tensor, *, temperature: float = 1.0,
                       images: Sequence[ImageInputs | None] | None = None) -> torch.Tensor:  # fmt: skip
    """Log-prob of each token given its prefix, from one forward of a transformers causal LM.

    Position ids come from the attention mask, so left padding scores exactly like no padding. The model runs on its
    own device (the inputs go there); the result is on ``tokens``' device. Memory: the last hidden states and one
    chunk of logits at a time (:class:`~tokengym.transforms.TokenScorer`), never (N, L, V), for a model that exposes
    its decoder and output layer (``get_decoder``, ``get_output_embeddings``); another model's whole logits. A
    vision-language model takes each row's ``images`` and M-RoPE positions
    (``tokengym.transforms.image_rows.forward_inputs``).

    Args:
        model: a transformers causal LM (anything returning ``.logits`` of shape (N, L, V)).
        tokens: int64 (N, L) token ids.
        attention_mask: bool or int (N, L); False/0 on padding.
        temperature: logits are divided by it before the softmax (> 0).
        images: each row's ``ImageInputs`` (``None`` for a row without), or ``None`` for rows without images
            (``tokengym.transforms.image_rows.row_images``).

    Returns:
        float32 (N, L): ``out[:, j] = log p(tokens[:, j] | tokens[:, :j])``; 0 on padding and on each row's first real token.

    Raises:
        ValueError: on shape mismatch, ``temperature <= 0``, images for a text-only model, or a row's image tokens
            without their images.

    Example:
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
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
    home, attention_mask = tokens.device, attention_mask.long()
    inputs = forward_inputs(model, tokens, attention_mask, images, owner="sequence_log_probs")
    split = final_hidden_states(model, **inputs)
    if split is not None:  # the output layer per chunk of scored tokens: no (N, L, V) logits
        hidden, head, softcap = split
        tokens, attention_mask = tokens.to(hidden.device), attention_mask.to(hidden.device)
        scored = torch.zeros(tokens.shape, dtype=torch.bool, device=hidden.device)
        scored[:, 1:] = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()
        rows = (torch.arange(tokens.numel(), device=hidden.device) - 1).reshape(tokens.shape)[scored]
        scorer = TokenScorer(hidden.flatten(0, 1), head, temperature=temperature, softcap=softcap)
        result = torch.zeros(tokens.shape, dtype=torch.float32, device=hidden.device)
        result[scored] = scorer.log_probs(rows, tokens[scored])
        return result.to(home)
    out = model(**inputs, use_cache=False)
    logits = out.logits[:, :-1].float()  # (N, L-1, V) on the model's output device
    if temperature != 1.0:
        logits = logits / temperature
    tokens, attention_mask = tokens.to(logits.device), attention_mask.to(logits.device)
    # gather - logsumexp keeps memory at (N, L, V) once instead of a full log_softmax copy
    picked = logits.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (N, L-1)
    logp = picked - torch.logsumexp(logits, dim=-1)
    result = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    # a token is scored when it and its predecessor are real (the first token has no prefix)
    scored = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()
    result[:, 1:] = torch.where(scored, logp, torch.zeros_like(logp))
    return result.to(home)


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


class SequenceLayout(NamedTuple):
    """Token ids of every trajectory of a batch and where each step's action sits in them.

    Attributes:
        tokens: int64 (N, L): left-padded first prompt, then the rest of the sequence right-padded.
        attention_mask: bool (N, L): False on padding.
        action_mask: bool (N, L): True exactly on the tokens the policy generated (not on prompts
            or env-inserted multi-turn feedback).
        response_start: ``P``, the column of the first response token.
        columns: int64 (N, T): the column of step ``t``'s action. Valid steps sit at
            ``P + seq_len[t] - seq_len[0]`` (``P + t`` single-turn); padding steps fill the columns
            after the row's last token, in order, so every step has its own column.
        images: each row's images (its trajectory's: its prompt's, then those multi-turn feedback showed; ``None``
            for a row without), or ``None`` when the batch has none. ``tokengym.transforms.image_rows.forward_inputs``
            turns them and the tokens into a forward's inputs (a vision-language model's M-RoPE position ids too).
    """

    tokens: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    response_start: int
    columns: torch.Tensor
    images: list[ImageInputs | None] | None = None


def _own_prompts(batch, table: PromptTable, prompt: torch.Tensor, lengths: torch.Tensor, pad_id: int):
    """The left-padded prompts with every row whose trajectory has a prompt of its own (a split episode's later
    part, :meth:`PromptTable.add_trajectory_prompt`) taking it."""
    trajs = batch.get(keys.TRAJ_ID)[:, 0].tolist()
    own = [table.trajectory_prompt(t) for t in trajs]
    if all(o is None for o in own):
        return prompt, lengths
    rows = [o.to(prompt.device) if o is not None else prompt[i, prompt.shape[1] - int(lengths[i]) :]
            for i, o in enumerate(own)]  # fmt: skip
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=prompt.device)
    out = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.int64, device=prompt.device)
    for i, row in enumerate(rows):
        out[i, out.shape[1] - len(row) :] = row
    return out, lengths


def _multi_turn_rows(batch: TensorDictBase, mask: torch.Tensor) -> torch.Tensor:
    turn = batch.get(keys.TURN, None)
    if turn is None:
        return torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
    return ((turn > 0) & mask).any(-1)


def _tails(batch, table, mask, multi, lengths, pad_id, owner) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per row: the tokens after the first prompt, and each valid step's offset into them."""
    action = batch.get(keys.ACTION)
    n_steps = mask.sum(-1).tolist()
    offsets = torch.arange(mask.shape[1], device=mask.device).expand(mask.shape).clone()  # (N, T)
    if bool(multi.any()):
        seq_len = require(batch, keys.SEQ_LEN, owner)
        # positions after the prompt (a player that waited before its first turn has its first observation there)
        offsets = torch.where(multi[:, None], seq_len - lengths[:, None].to(seq_len.device), offsets)
    traj = batch.get(keys.TRAJ_ID)[:, 0].tolist()
    tails = []
    for i, is_multi in enumerate(multi.tolist()):
        if not is_multi:
            tails.append(action[i, : n_steps[i]])
            continue
        full = table.sequence(traj[i]).to(action.device)
        tail = full[int(lengths[i]) :]
        steps = offsets[i, : n_steps[i]]
        if len(steps) and (int(steps.min()) < 0 or int(steps.max()) >= len(tail)
                           or not bool((tail[steps] == action[i, : n_steps[i]]).all())):  # fmt: skip
            raise ValueError(
                f"{owner}: the PromptTable's sequence of trajectory {traj[i]} does not hold row {i}'s actions at "
                f"their {keys.SEQ_LEN!r} positions; the batch and its prompt table do not match"
            )
        tails.append(tail)
    return tails, offsets


def pad_token_id_of(table: PromptTable, pad_id: int | None, owner: str) -> int:
    """``pad_id`` if given, else the pad id the batch's PromptTable records (the env tokenizer's); a clear error if neither.

    Example:
        >>> pad_token_id_of(PromptTable(pad_token_id=5), None, "to_padded"), pad_token_id_of(PromptTable(), 0, "x")
        (5, 0)
    """
    if pad_id is None:
        pad_id = table.pad_token_id
    if pad_id is None:
        raise ValueError(
            f"{owner} needs a pad token id and the batch's PromptTable records none (it was not built by a "
            "tokengym collector); pass pad_id=tokenizer.pad_token_id (SequenceActor: pad_token_id=...)"
        )
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"{owner}: the pad token id must be an int >= 0 (tokenizer.pad_token_id), got {pad_id!r}")
    return pad_id


def sequence_layout(batch: TensorDictBase, prompts: PromptTable | None = None, *,
                    pad_id: int | None = None) -> SequenceLayout:  # fmt: skip
    """The :class:`SequenceLayout` of a TRAJECTORIES batch, single- or multi-turn.

    Single-turn rows are prompt + actions. Rows with ``keys.TURN > 0`` take their full sequence
    (prompt, turns and env feedback) from the PromptTable (``table.sequence(traj_id)``, recorded by
    the collector), where step ``t``'s action is at position ``keys.SEQ_LEN`` of the step. Padding
    uses ``pad_id``, by default the pad id the PromptTable records (the env tokenizer's). Each row's images (a
    vision-language model's batch) are its trajectory's, as the PromptTable records them (``layout.images``).

    Example:
        >>> from tensordict import TensorDict
        >>> table = PromptTable(pad_token_id=0); table.add(0, torch.tensor([7, 8])); table.add_sequence(0, torch.tensor([7, 8, 3, 9, 9, 4]))
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4]]), keys.GROUP_ID: torch.zeros(1, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.zeros(1, 2, dtype=torch.long), keys.TURN: torch.tensor([[0, 1]]),
        ...                 keys.SEQ_LEN: torch.tensor([[2, 5]])}, [1, 2])
        >>> lay = sequence_layout(b, table)
        >>> lay.tokens.tolist(), lay.action_mask.long().tolist(), lay.columns.tolist()
        ([[7, 8, 3, 9, 9, 4]], [[0, 0, 1, 0, 0, 1]], [[2, 5]])
    """
    owner = "sequence_layout"
    mask = check_trajectory_rows(batch, owner)
    table = get_prompts(batch, prompts, owner)
    pad_id = pad_token_id_of(table, pad_id, owner)
    action = require(batch, keys.ACTION, owner)
    group, traj_ids = require(batch, keys.GROUP_ID, owner)[:, 0], batch.get(keys.TRAJ_ID)[:, 0]
    device, (n, steps) = action.device, mask.shape
    # one left_padded row per group (not per sequence), then gathered for every sequence
    unique, inverse = torch.unique(group, return_inverse=True)
    prompt, lengths = table.left_padded(unique.cpu(), pad_id=pad_id)
    prompt, lengths = prompt.to(device)[inverse], lengths.to(device)[inverse]
    if table.own_prompt_trajs():  # later parts of split episodes start from prompts of their own
        prompt, lengths = _own_prompts(batch, table, prompt, lengths, pad_id)
    if bool((lengths == 0).any()):
        raise ValueError(f"{owner}: group {int(group[lengths == 0][0])} has an empty prompt; nothing to condition on")
    width = prompt.shape[1]
    prompt_mask = torch.arange(width, device=device) >= (width - lengths)[:, None]  # (N, P)
    multi = _multi_turn_rows(batch, mask)
    if not bool(multi.any()):  # single-turn: the response is the actions, step t at column P + t
        response = torch.where(mask, action, torch.full_like(action, pad_id))
        columns = width + torch.arange(steps, device=device).expand(n, steps)
        tokens = torch.cat([prompt, response], dim=1)
        attention_mask = torch.cat([prompt_mask, mask], dim=1)
        action_mask = torch.cat([torch.zeros_like(prompt_mask), mask], dim=1)
        return SequenceLayout(tokens, attention_mask, action_mask, width, columns, row_images(table, group, traj_ids))
    tails, offsets = _tails(batch, table, mask, multi, lengths, pad_id, owner)
    tail_len = torch.tensor([len(t) for t in tails], dtype=torch.int64, device=device)
    n_steps = mask.sum(-1)
    # padding steps go after the row's last token, so every step keeps a column of its own
    t = torch.arange(steps, device=device)
    offsets = torch.where(mask, offsets, tail_len[:, None] + t - n_steps[:, None])
    length = max(int((tail_len - n_steps).max()) + steps, 1)
    response = torch.full((n, length), pad_id, dtype=torch.int64, device=device)
    for i, tail in enumerate(tails):
        response[i, : len(tail)] = tail
    response_mask = torch.arange(length, device=device) < tail_len[:, None]
    generated = torch.zeros_like(response_mask)
    rows = torch.arange(n, device=device)[:, None].expand(n, steps)
    generated[rows[mask], offsets[mask]] = True
    tokens = torch.cat([prompt, response], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    action_mask = torch.cat([torch.zeros_like(prompt_mask), generated], dim=1)
    return SequenceLayout(tokens, attention_mask, action_mask, width, width + offsets, row_images(table, group, traj_ids))


@torch.no_grad()
def step_log_probs(model, batch: TensorDictBase, prompts: PromptTable | None = None, *, pad_id: int | None = None,
                   temperature: float = 1.0) -> torch.Tensor:  # fmt: skip
    """Log-prob of every step's action under ``model``, aligned with the step batch (one forward).

    Args:
        model: a transformers causal LM (e.g. the reference model).
        batch: TRAJECTORIES batch [N, T].
        prompts: the PromptTable; defaults to the one under ``keys.PROMPTS``.
        pad_id: token id used for padding; ``None`` takes the PromptTable's (the env tokenizer's).
        temperature: divides the logits (1.0 scores the model's own distribution).

    Returns:
        float32 [N, T], 0 on padding steps.

    Example:
        >>> from tensordict import TensorDict
        >>> from tokengym.testing import tiny_tokenizer, tiny_model
        >>> table = PromptTable(pad_token_id=0); table.add(0, torch.tensor([7, 8]))
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4]]), keys.GROUP_ID: torch.zeros(1, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.zeros(1, 2, dtype=torch.long)}, [1, 2])
        >>> step_log_probs(tiny_model(tiny_tokenizer()), b, table).shape
        torch.Size([1, 2])
    """
    layout = sequence_layout(batch, prompts, pad_id=pad_id)
    logp = sequence_log_probs(model, layout.tokens, layout.attention_mask, temperature=temperature,
                              images=layout.images)  # fmt: skip
    out = logp.gather(1, layout.columns)  # (N, T)
    return torch.where(valid_mask(batch), out, torch.zeros_like(out))
