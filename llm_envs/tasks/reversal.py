"""String reversal task: ``"Reverse abc:"`` -> ``"cba"``, exact match with optional partial credit."""

from __future__ import annotations

import random
import string

import torch

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.tasks._common import check_positive_int, make_task_env
from tokengym.llm_envs.token_env import RewardFn, TokenEnv

__all__ = ["ReversalReward", "make_reversal_env", "reversal_prompts"]


def reversal_prompts(
    n: int, *, seed: int = 0, min_len: int = 3, max_len: int = 8, alphabet: str = string.ascii_lowercase
) -> list[dict]:
    """``n`` seeded words to reverse, ``{"prompt": "Reverse abc:", "answer": "cba"}``.

    Args:
        n: number of words.
        seed: seed of the generator.
        min_len: shortest word.
        max_len: longest word.
        alphabet: characters to draw from.

    Example:
        >>> reversal_prompts(1, seed=0, max_len=4)
        [{'prompt': 'Reverse ynbi:', 'answer': 'ibny'}]
    """
    check_positive_int("n", n)
    check_positive_int("min_len", min_len)
    check_positive_int("max_len", max_len)
    if max_len < min_len:
        raise ValueError(f"max_len must be >= min_len, got max_len={max_len} and min_len={min_len}")
    if not isinstance(alphabet, str) or not alphabet.strip():
        raise ValueError(f"alphabet must be a non-empty string of visible characters, got {alphabet!r}")
    rng = random.Random(seed)
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len))) for _ in range(n)]
    return [{"prompt": f"Reverse {w}:", "answer": w[::-1]} for w in words]


class ReversalReward:
    """1 for the exact reversed string (surrounding spaces ignored); with ``partial_credit``, the share of right characters.

    Args:
        partial_credit: give ``matching positions / max(len(response), len(answer))`` to a wrong answer.

    Raises:
        KeyError: at call time, if the metadata lacks ``answer``.

    Example:
        >>> meta = [{"answer": "cba"}] * 3
        >>> ReversalReward(partial_credit=True)([" cba", "cbx", "abc"], [""] * 3, meta)
        tensor([1.0000, 0.6667, 0.3333])
    """

    def __init__(self, *, partial_credit: bool = False) -> None:
        if not isinstance(partial_credit, bool):
            raise TypeError(f"partial_credit must be a bool, got {partial_credit!r}")
        self.partial_credit = partial_credit

    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        out = []
        for response, meta in zip(responses, metadata, strict=True):
            if "answer" not in meta:
                raise KeyError(
                    f"{type(self).__name__} reads metadata['answer'] but the prompt's metadata has keys "
                    f"{sorted(meta)}; use reversal_prompts() or add an 'answer' field"
                )
            got, want = response.strip(), str(meta["answer"])
            if got == want:
                out.append(1.0)
            elif self.partial_credit and got:
                out.append(sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want)))
            else:
                out.append(0.0)
        return torch.tensor(out, dtype=torch.float32)


def make_reversal_env(
    *,
    tokenizer,
    batch_size: int = 8,
    max_new_tokens: int = 16,
    n_prompts: int = 1000,
    seed: int = 0,
    partial_credit: bool = False,
    reward_fn: RewardFn | None = None,
    **env_kwargs,
) -> TokenEnv:
    """A :class:`TokenEnv` over ``n_prompts`` words to reverse, with :class:`ReversalReward`.

    Args:
        tokenizer: the tokenizer of the model you train (``tokengym.testing.tiny_tokenizer()`` in tests).
        batch_size: parallel slots.
        max_new_tokens: response budget.
        n_prompts: number of words generated.
        seed: seed of the words (and of the prompt order if ``shuffle=True``).
        partial_credit: see :class:`ReversalReward`.
        reward_fn: replaces :class:`ReversalReward` (it gets the words' ``answer`` in the metadata).
        **env_kwargs: forwarded to :class:`TokenEnv` (``max_length`` defaults to 256).

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> make_reversal_env(tokenizer=tiny_tokenizer(), batch_size=2, n_prompts=4).batch_size
        torch.Size([2])
    """
    require_tokenizer("make_reversal_env", tokenizer)
    return make_task_env(
        reversal_prompts(n_prompts, seed=seed),
        ReversalReward(partial_credit=partial_credit) if reward_fn is None else reward_fn,
        tokenizer=tokenizer,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        seed=seed,
        **env_kwargs,
    )
