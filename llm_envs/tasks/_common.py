"""Helpers shared by the built-in tasks: argument checks, the env constructor."""

from __future__ import annotations

from tokengym.llm_envs.token_env import RewardFn, TokenEnv


def check_positive_int(name: str, value, *, minimum: int = 1) -> None:
    """Raise ``ValueError`` unless ``value`` is an int ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def make_task_env(
    prompts: list[dict],
    reward_fn: RewardFn,
    *,
    tokenizer,
    batch_size: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    **env_kwargs,
) -> TokenEnv:
    """A :class:`TokenEnv` over ``prompts`` (``max_length`` defaults to 256)."""
    env_kwargs.setdefault("max_length", 256)
    return TokenEnv(
        prompts, tokenizer, reward_fn, batch_size=batch_size, max_new_tokens=max_new_tokens, seed=seed, **env_kwargs
    )
