"""Training layouts of a TRAJECTORIES batch: padded sequences [N, L], packed sequences, DPO pairs.

The padded layout (Trinity-RFT ``Experiences.gather``, verl) puts the left-padded prompt in columns
``[0, P)`` and the response, right-padded, in columns ``[P, P + T)``: every step key of the batch is
copied token-aligned there (log-probs, rewards, advantages, ids...), so :func:`padded_to_steps`
gives the step batch back exactly.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase

from tokengym.llm_envs import keys
from tokengym.llm_envs.prompt_table import PromptTable
from tokengym.transforms._checks import check_batch, found_keys, get_prompts
from tokengym.transforms.group_advantages import sequence_scores
from tokengym.transforms.sequences import pad_token_id_of, sequence_layout

__all__ = ["to_padded", "padded_to_steps", "to_packed", "dpo_pairs"]

# the nested TorchRL keys are dropped whole (excluding a leaf would leave an empty sub-TensorDict)
_LAYOUT_KEYS = (keys.TOKENS[0], keys.LOG_PROBS[0], keys.REF_LOG_PROBS[:2], keys.ATTENTION_MASK, keys.ACTION_MASK,
                keys.POSITION_IDS)


def to_padded(batch: TensorDictBase, prompts: PromptTable | None = None, *, pad_id: int | None = None) -> TensorDictBase:
    """Padded sequence layout [N, P + T]: left-padded prompt + right-padded response, one row per trajectory.

    Writes every key TorchRL's ``GRPOLoss`` reads by default: ``keys.TOKENS`` (``("tokens", "full")``),
    ``keys.LOG_PROBS`` (``("log_probs", "full")``), ``keys.ADVANTAGE`` (when the batch has it) and,
    when the batch holds reference log-probs (``keys.REF_LOG_PROB``, from ``PolicyWithReference`` or
    ``KLRewardTransform``), ``keys.REF_LOG_PROBS`` (``("next", "ref_log_probs", "full")``, what
    ``GRPOLoss(kl_to_ref_coeff=...)`` reads); also ``keys.ATTENTION_MASK``, ``keys.ACTION_MASK``
    (generated tokens), ``keys.POSITION_IDS`` and, token-aligned in the response columns, every step key of ``batch``
    (0 / False in the prompt columns). ``keys.RESPONSE_START`` (non-tensor) holds ``P``.
    Multi-turn rows (``keys.TURN > 0``) hold their full sequence from the PromptTable: env feedback
    sits between the turns with ``ACTION_MASK`` False and step keys 0, and step ``t`` is at column
    ``P + seq_len[t] - seq_len[0]`` (see :func:`~tokengym.transforms.sequences.sequence_layout`).

    Args:
        batch: TRAJECTORIES batch [N, T] (see :func:`~tokengym.transforms.split_trajectories`).
        prompts: the PromptTable; defaults to the one under ``keys.PROMPTS``.
        pad_id: padding token id; ``None`` takes the PromptTable's (the env tokenizer's ``pad_token_id``,
            recorded by the collector) and raises a ``ValueError`` when it records none.

    Example:
        >>> table = PromptTable(pad_token_id=0); table.add(0, torch.tensor([7, 8]))
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4], [5, 6]]), keys.GROUP_ID: torch.zeros(2, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.tensor([[0, 0], [1, 1]]), keys.MASK: torch.tensor([[1, 1], [1, 0]]).bool()}, [2, 2])
        >>> p = to_padded(b, table)
        >>> p[keys.TOKENS].tolist(), p[keys.ACTION_MASK].tolist()
        ([[7, 8, 3, 4], [7, 8, 5, 0]], [[False, False, True, True], [False, False, True, False]])
    """
    pad_id = pad_token_id_of(get_prompts(batch, prompts, "to_padded"), pad_id, "to_padded")
    layout = sequence_layout(batch, prompts, pad_id=pad_id)
    tokens, attention_mask, width = layout.tokens, layout.attention_mask, layout.response_start
    n, steps = batch.batch_size
    data = batch.exclude(keys.PROMPTS)
    length = tokens.shape[1]
    columns = layout.columns
    is_contiguous = length == width + steps and bool((columns == width + torch.arange(steps, device=columns.device)).all())
    rows = torch.arange(n, device=columns.device)[:, None].expand(n, steps)

    def place(x: torch.Tensor) -> torch.Tensor:  # every step at its column, 0 elsewhere
        out = x.new_zeros((n, length, *x.shape[2:]))
        if is_contiguous:
            out[:, width:] = x
        else:
            out[rows, columns] = x
        return out

    out = data.apply(place, batch_size=[n, length])
    action_mask = layout.action_mask
    out.set(keys.TOKENS, tokens)
    if keys.ACTION_LOG_PROB in out.keys():
        out.set(keys.LOG_PROBS, out.get(keys.ACTION_LOG_PROB))
    if keys.REF_LOG_PROB in out.keys():
        out.set(keys.REF_LOG_PROBS, out.get(keys.REF_LOG_PROB))
    out.set(keys.ATTENTION_MASK, attention_mask)
    out.set(keys.ACTION_MASK, action_mask)
    out.set(keys.POSITION_IDS, (attention_mask.long().cumsum(-1) - 1).clamp(min=0))
    out.set_non_tensor(keys.RESPONSE_START, width)
    if batch.get(keys.PROMPTS, None) is not None:
        out.set_non_tensor(keys.PROMPTS, batch.get_non_tensor(keys.PROMPTS))
    return out


def padded_to_steps(padded: TensorDictBase) -> TensorDictBase:
    """The step batch [N, T] a padded layout came from (inverse of :func:`to_padded`).

    Example:
        >>> table = PromptTable(pad_token_id=0); table.add(0, torch.tensor([7]))
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4]]), keys.GROUP_ID: torch.zeros(1, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.zeros(1, 2, dtype=torch.long)}, [1, 2])
        >>> (padded_to_steps(to_padded(b, table)) == b).all()
        True
    """
    check_batch(padded, "padded_to_steps", (keys.TOKENS,))
    try:
        width = padded.get_non_tensor(keys.RESPONSE_START)
    except KeyError:
        width = None
    if width is None:
        raise KeyError(f"padded_to_steps reads {keys.RESPONSE_START!r} (tokengym.llm_envs.keys), written by "
                       f"to_padded, but got keys {found_keys(padded)}")  # fmt: skip
    data = padded.exclude(*_LAYOUT_KEYS, keys.RESPONSE_START, keys.PROMPTS)
    columns = _step_columns(padded, int(width))
    if columns is None:
        steps = data[:, int(width) :]
    else:
        n, t = columns.shape
        rows = torch.arange(n, device=columns.device)[:, None]
        steps = data.apply(lambda x: x[rows, columns], batch_size=[n, t])
    if padded.get(keys.PROMPTS, None) is not None:
        steps.set_non_tensor(keys.PROMPTS, padded.get_non_tensor(keys.PROMPTS))
    return steps


def _step_columns(padded: TensorDictBase, width: int) -> torch.Tensor | None:
    """Columns of the steps in a multi-turn padded layout (``None`` when they are ``[width, L)``).

    Inverts :func:`~tokengym.transforms.sequences.sequence_layout`: valid steps are the generated
    tokens in order, then the padding steps fill the columns after each row's last token.
    """
    generated = padded.get(keys.ACTION_MASK)[:, width:]
    attended = padded.get(keys.ATTENTION_MASK)[:, width:]
    if bool((generated == attended).all()):
        return None
    n, length = generated.shape
    n_steps, tail_len = generated.sum(-1), attended.sum(-1)
    steps = int((length - tail_len + n_steps).min())  # the row with the most padding steps fills the width
    t = torch.arange(steps, device=generated.device)
    cols = torch.arange(length, device=generated.device)
    order = torch.where(generated, cols, length).sort(-1).values[:, :steps]  # generated, in order
    pad_cols = tail_len[:, None] + t - n_steps[:, None]
    return width + torch.where(t < n_steps[:, None], order, pad_cols)


def to_packed(batch: TensorDictBase, prompts: PromptTable | None = None, *, pad_id: int | None = None) -> TensorDictBase:
    """Packed layout: every sequence's prompt + response tokens concatenated, no padding.

    Returns a TensorDict (batch_size ``[]``) with every key of :func:`to_padded` as (1, S, ...)
    (``S`` the total number of tokens), ``keys.POSITION_IDS`` restarting at 0 for each sequence and
    ``keys.SEQ_OFFSETS`` (N + 1,) so sequence ``i`` is ``[offsets[i], offsets[i + 1])``.

    Example:
        >>> table = PromptTable(pad_token_id=0); table.add(0, torch.tensor([7, 8]))
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4], [5, 6]]), keys.GROUP_ID: torch.zeros(2, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.tensor([[0, 0], [1, 1]]), keys.MASK: torch.tensor([[1, 1], [1, 0]]).bool()}, [2, 2])
        >>> p = to_packed(b, table)
        >>> p[keys.TOKENS].tolist(), p[keys.POSITION_IDS].tolist(), p[keys.SEQ_OFFSETS].tolist()
        ([[7, 8, 3, 4, 7, 8, 5]], [[0, 1, 2, 3, 0, 1, 2]], [0, 4, 7])
    """
    padded = to_padded(batch, prompts, pad_id=pad_id)
    attention_mask = padded.get(keys.ATTENTION_MASK)
    flat = padded.exclude(keys.RESPONSE_START, keys.PROMPTS)[attention_mask]  # (S,) row-major = concatenated
    packed = flat.unsqueeze(0)
    packed.batch_size = torch.Size([])
    lengths = attention_mask.sum(-1)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=lengths.device)
    offsets[1:] = lengths.cumsum(0)
    packed.set(keys.SEQ_OFFSETS, offsets)
    return packed


def dpo_pairs(batch: TensorDictBase, prompts: PromptTable | None = None, *, pad_id: int | None = None,
              reward_key=keys.REWARD) -> TensorDictBase:  # fmt: skip
    """DPO pairs: per group, the highest-scoring trajectory (chosen) and the lowest (rejected).

    The score is the summed ``reward_key`` of a trajectory; groups whose samples all score the same
    give no pair and are left out. Ties pick the first row.

    Returns:
        TensorDict [G, L] with ``keys.CHOSEN`` and ``keys.REJECTED``, each a padded layout.

    Example:
        >>> table = PromptTable(pad_token_id=0); table.add(0, torch.tensor([7]))
        >>> done = torch.tensor([[[False], [True]]] * 3)
        >>> b = TensorDict({keys.ACTION: torch.tensor([[3, 4], [5, 6], [1, 2]]), keys.GROUP_ID: torch.zeros(3, 2, dtype=torch.long),
        ...                 keys.TRAJ_ID: torch.tensor([[0, 0], [1, 1], [2, 2]]), keys.RESPONSE_LEN: torch.tensor([[0, 1]] * 3),
        ...                 keys.DONE: done, keys.REWARD: done.float() * torch.tensor([0.5, 1.0, 0.0])[:, None, None]}, [3, 2])
        >>> pairs = dpo_pairs(b, table)
        >>> pairs[keys.CHOSEN, keys.TOKENS].tolist(), pairs[keys.REJECTED, keys.TOKENS].tolist()
        ([[7, 5, 6]], [[7, 1, 2]])
    """
    owner = "dpo_pairs"
    padded = to_padded(batch, prompts, pad_id=pad_id)
    seq, scores, groups = sequence_scores(batch, reward_key=reward_key, owner=owner)
    row_of_seq = torch.zeros(len(scores), dtype=torch.int64, device=seq.device)
    rows = torch.arange(seq.shape[0], device=seq.device)[:, None].expand_as(seq)
    row_of_seq[seq[seq >= 0]] = rows[seq >= 0]
    _, inverse = torch.unique(groups, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if len(inverse) else 0
    best = torch.full((num_groups,), float("-inf"), device=scores.device).scatter_reduce(0, inverse, scores, "amax")
    worst = torch.full((num_groups,), float("inf"), device=scores.device).scatter_reduce(0, inverse, scores, "amin")
    order = torch.arange(len(scores), device=scores.device)
    big = torch.full((num_groups,), len(scores), dtype=torch.int64, device=scores.device)
    chosen = big.scatter_reduce(0, inverse, torch.where(scores == best[inverse], order, big[inverse]), "amin")
    rejected = big.scatter_reduce(0, inverse, torch.where(scores == worst[inverse], order, big[inverse]), "amin")
    keep = best > worst
    data = padded.exclude(keys.RESPONSE_START, keys.PROMPTS)
    out = TensorDict({keys.CHOSEN: data[row_of_seq[chosen[keep]]], keys.REJECTED: data[row_of_seq[rejected[keep]]]},
                     batch_size=[int(keep.sum()), padded.shape[1]])  # fmt: skip
    return out
