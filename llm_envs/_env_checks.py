"""Checks of TokenEnv arguments and of reward-function outputs (clear errors at construction or at the step)."""

from __future__ import annotations

import functools
import inspect
import math

import torch

from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.prompts import Prompt


def context_limit(tokenizer, model_config) -> int:
    """The model's context length (config), else the tokenizer's ``model_max_length``, capped at 65536."""
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", None)
    if limit is None:
        limit = getattr(tokenizer, "model_max_length", 4096)
    return int(min(limit, 1 << 16))


def first_non_finite(values: torch.Tensor) -> int | None:
    """Index of the first NaN or infinity of a 1-D tensor, or ``None`` when every value is finite."""
    if math.isfinite(float(values.sum())):  # one op: a NaN or an infinity makes the sum non-finite
        return None
    finite = torch.isfinite(values)  # or finite values whose sum overflows
    return None if bool(finite.all()) else int((~finite).nonzero()[0])


def check_rewards(values, slots: list[int], prompts: list[Prompt]) -> torch.Tensor:
    n = len(slots)

    def first() -> str:  # built only for an error message
        return f"slots {slots} (first: prompt {prompts[0].index} {prompts[0].text[:60]!r})"

    try:
        # detached: a reward function's autograd graph must not reach the collected batch
        out = torch.as_tensor(values, dtype=torch.float32).detach().reshape(-1)
    except (TypeError, ValueError, RuntimeError) as err:
        raise RewardFunctionError(f"reward_fn must return {n} numbers for {first()}, got {values!r:.80} ({err})") from err
    if out.numel() != n:
        raise RewardFunctionError(
            f"reward_fn returned {out.numel()} values for {n} finished responses in {first()}; "
            "return one float per response"
        )
    bad = first_non_finite(out)
    if bad is not None:
        raise RewardFunctionError(
            f"reward_fn returned {out[bad].item()} for slot {slots[bad]}, prompt {prompts[bad].index} "
            f"{prompts[bad].text[:60]!r}; rewards must be finite"
        )
    return out


def check_arguments(fn, role: str, params: tuple[str, ...], returns: str, hint: str = "") -> None:
    """Refuse at construction a callable ``fn`` that the env could not call as ``role(*params)``: it would raise a
    ``TypeError`` at the first finished turn. A callable without a readable signature (a builtin) passes.

    Example:
        >>> check_arguments(lambda responses, prompts: [0.0], "reward_fn", ("responses", "prompts", "metadata"),
        ...                 "one float per response")
        Traceback (most recent call last):
        ...
        TypeError: reward_fn <lambda>(responses, prompts) cannot be called as reward_fn(responses, prompts, metadata) (too many positional arguments); define it as def <lambda>(responses, prompts, metadata) returning one float per response
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*params)
    except TypeError as err:
        wanted = ", ".join(params)
        if inspect.isroutine(fn) or isinstance(fn, functools.partial):
            name = getattr(fn, "__name__", "fn")
            fix = f"def {name}({wanted})"
        else:  # a callable object: its __call__
            name = type(fn).__name__
            fix = f"{name}.__call__(self, {wanted})"
        raise TypeError(f"{role} {name}{sig} cannot be called as {role}({wanted}) ({err}); define it as {fix} "
                        f"returning {returns}{hint}") from None  # fmt: skip


def check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_env_args(tokenizer, *, batch_size, max_new_tokens, max_turn_tokens, max_turns) -> None:
    """A token env's sizes and tokenizer, checked before anything is built."""
    check_int("batch_size", batch_size)
    check_int("max_new_tokens", max_new_tokens)
    if max_turn_tokens is not None:
        check_int("max_turn_tokens", max_turn_tokens)
    check_tokenizer(tokenizer)
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")


def check_budget(max_new_tokens: int, max_length: int, *, is_given: bool = True) -> None:
    """Refuse a response budget the sequence cannot hold: ``max_length`` is the prompt and the response together, and a
    prompt has at least one token, so ``max_new_tokens`` must be below ``max_length`` (else batches are
    ``max_new_tokens`` wide and the budget is never reached).

    Example:
        >>> check_budget(64, 32)
        Traceback (most recent call last):
        ...
        ValueError: max_new_tokens=64 cannot fit in max_length=32: max_length holds the prompt and the response together and a prompt has at least one token, so a response has at most 31 tokens; pass max_new_tokens=31 or less, or max_length=65 or more (the longest prompt + max_new_tokens)
    """
    if max_new_tokens >= max_length:
        where = f"max_length={max_length}" + ("" if is_given else " (the default: the model's or tokenizer's limit)")
        raise ValueError(
            f"max_new_tokens={max_new_tokens} cannot fit in {where}: max_length holds the prompt and the response "
            f"together and a prompt has at least one token, so a response has at most {max_length - 1} tokens; pass "
            f"max_new_tokens={max_length - 1} or less, or max_length={max_new_tokens + 1} or more (the longest prompt + "
            "max_new_tokens)"
        )


def check_tokenizer(tokenizer) -> None:
    if tokenizer is None or isinstance(tokenizer, str):
        raise TypeError(
            f"a tokenizer is required (a transformers tokenizer with pad_token_id and eos_token_id), got "
            f"{tokenizer!r}; load it with AutoTokenizer.from_pretrained(model_dir) (or tokengym.testing.tiny_tokenizer())"
        )
    for attr in ("pad_token_id", "eos_token_id"):
        if getattr(tokenizer, attr, None) is None:
            raise ValueError(
                f"the tokenizer has no {attr}; set it first, e.g. tokenizer.pad_token = tokenizer.eos_token"
                if attr == "pad_token_id"
                else "the tokenizer has no eos_token_id; set tokenizer.eos_token or pass eos_token_ids"
            )


def eos_ids(tokenizer, model_config, explicit, vocab_size: int) -> set[int]:
    if explicit is not None:
        ids = {int(i) for i in explicit}
    else:
        ids = {int(tokenizer.eos_token_id)}
        gen_eos = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
        gen_eos = gen_eos if gen_eos is not None else getattr(model_config, "eos_token_id", None)
        if gen_eos is not None:
            ids |= {int(i) for i in (gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos])}
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"eos token ids {bad} are outside the vocabulary [0, {vocab_size})")
    return ids


_NEEDS_TOKENIZER = ("{builder} needs tokenizer=: the tokenizer of the model you train "
                    "(AutoTokenizer.from_pretrained(model_dir); tokengym.testing.tiny_tokenizer() in tests)")


def require_tokenizer(builder: str, tokenizer) -> None:
    """Raise ``TypeError`` naming ``builder`` and the fix when ``tokenizer`` is ``None`` (no toy default)."""
    if tokenizer is None:
        raise TypeError(_NEEDS_TOKENIZER.format(builder=builder))
