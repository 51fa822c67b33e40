"""Text of a collected batch: each trajectory's response (and prompt) decoded with the tokenizer."""

from __future__ import annotations

from tensordict import TensorDictBase

from tokengym.llm_envs import keys
from tokengym.transforms._checks import get_prompts, require

__all__ = ["decode"]


def decode(batch: TensorDictBase, tokenizer, *, with_prompt: bool = False, skip_special_tokens: bool = True) -> list[str]:
    """The response of every row of a TRAJECTORIES batch [N, T] as text (the prompt first if ``with_prompt``).

    Example:
        >>> from tokengym.testing import make_trajectory_batch, tiny_tokenizer
        >>> texts = decode(make_trajectory_batch([3, 1]), tiny_tokenizer())
        >>> len(texts), all(isinstance(t, str) for t in texts)
        (2, True)
    """
    action = require(batch, keys.ACTION, "decode")
    mask = require(batch, keys.MASK, "decode")
    rows = [action[i][mask[i]] for i in range(action.shape[0])]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)
    if not with_prompt:
        return texts
    table = get_prompts(batch, None, "decode")
    groups = batch.get(keys.GROUP_ID)[:, 0].tolist()
    return [table.text(g) + text for g, text in zip(groups, texts, strict=True)]
