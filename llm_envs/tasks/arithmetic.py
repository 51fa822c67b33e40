"""Arithmetic task: ``"12+7="`` -> ``"19"``, checked by :class:`~tokengym.llm_envs.rewards.MathAnswerReward`.

The answer must be a number: the reward uses the exact verifier, so echoing the problem (``"12+7"``),
which math-verify would evaluate to the right value, earns nothing.
"""

from __future__ import annotations

import random

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.rewards import MathAnswerReward
from tokengym.llm_envs.tasks._common import check_positive_int, make_task_env
from tokengym.llm_envs.token_env import RewardFn, TokenEnv

__all__ = ["arithmetic_prompts", "arithmetic_reward", "make_arithmetic_env"]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_prompts(n: int, *, seed: int = 0, max_operand: int = 20, ops: str = "+-") -> list[dict]:
    """``n`` seeded problems ``{"prompt": "a+b=", "answer": "c"}`` with operands in ``[0, max_operand]``.

    Subtraction puts the larger operand first, so every answer is a non-negative integer.

    Args:
        n: number of problems.
        seed: seed of the generator; the same seed gives the same problems.
        max_operand: largest operand.
        ops: the operators to draw from, a subset of ``"+-*"``.

    Example:
        >>> arithmetic_prompts(2, seed=0, max_operand=9)
        [{'prompt': '6+6=', 'answer': '12'}, {'prompt': '8-4=', 'answer': '4'}]
    """
    check_positive_int("n", n)
    check_positive_int("max_operand", max_operand, minimum=0)
    if not isinstance(ops, str) or not ops or set(ops) - set(_OPS):
        raise ValueError(f"ops must be a non-empty string of operators from {''.join(_OPS)!r}, got {ops!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        out.append({"prompt": f"{a}{op}{b}=", "answer": str(_OPS[op](a, b))})
    return out


def arithmetic_reward(*, correct: float = 1.0, wrong: float = 0.0) -> MathAnswerReward:
    """The arithmetic task's reward: exact match of the response's last number (or ``\\boxed{}``).

    Example:
        >>> arithmetic_reward()(["19", "12+7", "\\\\boxed{19}"], [""] * 3, [{"answer": "19"}] * 3)
        tensor([1., 0., 1.])
    """
    return MathAnswerReward("answer", correct=correct, wrong=wrong, verifier="exact")


def make_arithmetic_env(
    *,
    tokenizer,
    batch_size: int = 8,
    max_new_tokens: int = 16,
    n_prompts: int = 1000,
    seed: int = 0,
    max_operand: int = 20,
    ops: str = "+-",
    reward_fn: RewardFn | None = None,
    **env_kwargs,
) -> TokenEnv:
    """A :class:`TokenEnv` over ``n_prompts`` arithmetic problems with :func:`arithmetic_reward`.

    Args:
        tokenizer: the tokenizer of the model you train (``tokengym.testing.tiny_tokenizer()`` in tests).
        batch_size: parallel slots.
        max_new_tokens: response budget.
        n_prompts: number of problems generated.
        seed: seed of the problems (and of the prompt order if ``shuffle=True``).
        max_operand: largest operand.
        ops: operators drawn from ``"+-*"``.
        reward_fn: replaces :func:`arithmetic_reward` (it gets the problems' ``answer`` in the metadata).
        **env_kwargs: forwarded to :class:`TokenEnv` (``max_length`` defaults to 256).

    Example:
        >>> import torch
        >>> from tokengym.llm_envs import keys
        >>> from tokengym.testing import tiny_tokenizer
        >>> env = make_arithmetic_env(tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=4)
        >>> td = env.reset()
        >>> answer = env.slot_prompt(0).metadata["answer"]
        >>> for a in env.tokenizer(answer)["input_ids"] + [env.tokenizer.eos_token_id]:
        ...     out = env.step(td.set(keys.ACTION, torch.tensor([a])))
        ...     td = out["next"]
        >>> out[keys.REWARD].item()
        1.0
    """
    require_tokenizer("make_arithmetic_env", tokenizer)
    prompts = arithmetic_prompts(n_prompts, seed=seed, max_operand=max_operand, ops=ops)
    return make_task_env(
        prompts,
        arithmetic_reward() if reward_fn is None else reward_fn,
        tokenizer=tokenizer,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        seed=seed,
        **env_kwargs,
    )
