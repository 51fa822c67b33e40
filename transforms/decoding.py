"""Text of a collected batch: each trajectory's response (and prompt) decoded with the tokenizer."""

from __future__ import annotations

from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._checks import get_prompts, require

__all__ = ["decode"]

ASSISTANT, FEEDBACK = "assistant", "feedback"  # the roles of decode(by_turn=True) segments


def decode(batch: TensorDictBase, tokenizer, *, with_prompt: bool = False, skip_special_tokens: bool = True,
           by_turn: bool = False) -> list[str] | list[list[dict]]:  # fmt: skip
    """The response of every row of a TRAJECTORIES batch [N, T] as text (the prompt first if ``with_prompt``).

    A multi-turn row's text is its generated tokens, all turns joined. With ``by_turn=True`` every row
    is a list of segments instead, ``{"role": "assistant", "content": ...}`` for each generated turn
    and ``{"role": "feedback", "content": ...}`` for the tokens the env wrote between two turns (the
    template's turn close, the feedback message and the generation prompt, decoded; with
    ``skip_special_tokens`` a template's special role tokens drop out).

    Example:
        >>> from tokengym.testing import make_trajectory_batch, tiny_tokenizer
        >>> texts = decode(make_trajectory_batch([3, 1]), tiny_tokenizer())
        >>> len(texts), all(isinstance(t, str) for t in texts)
        (2, True)
        >>> [[s["role"] for s in row] for row in decode(make_trajectory_batch([3, 1]), tiny_tokenizer(), by_turn=True)]
        [['assistant'], ['assistant']]
    """
    action = require(batch, keys.ACTION, "decode")
    mask = require(batch, keys.MASK, "decode")
    if by_turn:
        return [_turns(batch, i, tokenizer, skip_special_tokens) for i in range(action.shape[0])]
    rows = [action[i][mask[i]] for i in range(action.shape[0])]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)
    if not with_prompt:
        return texts
    table = get_prompts(batch, None, "decode")
    groups = batch.get(keys.GROUP_ID)[:, 0].tolist()
    return [table.text(g) + text for g, text in zip(groups, texts, strict=True)]


def _turns(batch: TensorDictBase, row: int, tokenizer, skip_special_tokens: bool) -> list[dict]:
    """Row ``row`` as assistant turns and the env's feedback between them."""
    mask = batch.get(keys.MASK)[row]
    actions = batch.get(keys.ACTION)[row][mask]
    turn = batch.get(keys.TURN, None)
    turn = None if turn is None else turn[row][mask]
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)  # noqa: E731
    if turn is None or not bool((turn > 0).any()):
        return [{"role": ASSISTANT, "content": text(actions)}]
    table = get_prompts(batch, None, "decode")
    sequence = table.sequence(int(batch.get(keys.TRAJ_ID)[row, 0]))
    at = require(batch, keys.SEQ_LEN, "decode")[row][mask]  # step t's action sits at position seq_len[t]
    out, last = [], -1
    for j in turn.unique().tolist():
        in_turn = turn == j
        if out:  # the env's tokens between the previous turn's last token and this turn's first
            out.append({"role": FEEDBACK, "content": text(sequence[last + 1 : int(at[in_turn][0])])})
        out.append({"role": ASSISTANT, "content": text(actions[in_turn])})
        last = int(at[in_turn][-1])
    return out
