"""Countdown task: combine the given numbers with ``+ - * /`` (each at most once) to reach a target."""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import torch

from tokengym.llm_envs._env_checks import require_tokenizer
from tokengym.llm_envs.rewards import last_boxed
from tokengym.llm_envs.tasks._common import check_positive_int, make_task_env
from tokengym.llm_envs.token_env import RewardFn, TokenEnv

__all__ = ["CountdownReward", "countdown_prompts", "evaluate_expression", "make_countdown_env"]

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200  # bounds parsing work on a runaway response
# only digits, + - * / ( ) and spaces reach ast.parse: model output such as "3and 4" would make
# Python's tokenizer emit a SyntaxWarning ("invalid decimal literal") on every scored response
_EXPRESSION_CHARS = re.compile(r"[\d+\-*/()\s]*")


def countdown_prompts(n: int, *, seed: int = 0, n_numbers: int = 3, max_number: int = 10) -> list[dict]:
    """``n`` seeded puzzles ``{"prompt", "answer", "numbers", "target"}``, each solvable with all numbers.

    Args:
        n: number of puzzles.
        seed: seed of the generator.
        n_numbers: numbers per puzzle (2 or more).
        max_number: numbers are drawn from ``[1, max_number]``.

    Example:
        >>> countdown_prompts(1, seed=1)
        [{'prompt': 'Numbers: 3 10 2. Target: 5. Expression:', 'answer': '(10-3)-2', 'numbers': [3, 10, 2], 'target': 5}]
    """
    check_positive_int("n", n)
    check_positive_int("n_numbers", n_numbers, minimum=2)
    check_positive_int("max_number", max_number)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        numbers = [rng.randint(1, max_number) for _ in range(n_numbers)]
        order = rng.sample(numbers, len(numbers))
        value, expression = order[0], str(order[0])
        for x in order[1:]:
            op = rng.choice("+-*")
            if op == "-" and x > value:  # keep the target positive
                op = "+"
            value = {"+": value + x, "-": value - x, "*": value * x}[op]
            expression = f"({expression}{op}{x})"
        expression = expression[1:-1]  # drop the outer parentheses
        prompt = f"Numbers: {' '.join(map(str, numbers))}. Target: {value}. Expression:"
        out.append({"prompt": prompt, "answer": expression, "numbers": numbers, "target": value})
    return out


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"{type(node).__name__} is not allowed")


def evaluate_expression(expression: str, numbers: Sequence[int]) -> Fraction | None:
    """Exact value of ``expression`` if it uses only ``numbers`` (each at most once) and ``+ - * /``, else ``None``.

    Parsed with :mod:`ast`, never ``eval``: names, calls, powers, unary minus and floats are rejected.

    Example:
        >>> evaluate_expression("(2+3)*4", [2, 3, 4]), evaluate_expression("2*2", [2, 3])
        (Fraction(20, 1), None)
    """
    if len(expression) > _MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None
    if Counter(used) - Counter(numbers):
        return None
    return value


def _expression(response: str) -> str:
    """The expression a response proposes: its ``\\boxed{}``, else its first line, cut at ``=``."""
    text = last_boxed(response)
    if text is None:
        lines = response.strip().splitlines()
        text = lines[0] if lines else ""
    return text.split("=")[0]


class CountdownReward:
    """``correct`` if the response's expression reaches ``metadata["target"]`` using ``metadata["numbers"]``.

    Args:
        correct: reward of a valid expression with the target value.
        wrong: reward otherwise (bad syntax, a number not given or reused, wrong value).

    Raises:
        KeyError: at call time, if the metadata lacks ``numbers`` or ``target``.

    Example:
        >>> meta = {"numbers": [2, 3, 5], "target": 25}
        >>> CountdownReward()(["(2+3)*5", "5*5", "\\\\boxed{5*(3+2)}"], [""] * 3, [meta] * 3)
        tensor([1., 0., 1.])
    """

    def __init__(self, *, correct: float = 1.0, wrong: float = 0.0) -> None:
        for name, value in (("correct", correct), ("wrong", wrong)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite number, got {value!r}")
        self.correct, self.wrong = float(correct), float(wrong)

    def __call__(self, responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        out = []
        for response, meta in zip(responses, metadata, strict=True):
            missing = [k for k in ("numbers", "target") if k not in meta]
            if missing:
                raise KeyError(
                    f"{type(self).__name__} reads metadata {missing} but the prompt's metadata has keys "
                    f"{sorted(meta)}; use countdown_prompts() or add 'numbers' and 'target' fields"
                )
            value = evaluate_expression(_expression(response), [int(x) for x in meta["numbers"]])
            out.append(self.correct if value is not None and value == Fraction(meta["target"]) else self.wrong)
        return torch.tensor(out, dtype=torch.float32)


def make_countdown_env(
    *,
    tokenizer,
    batch_size: int = 8,
    max_new_tokens: int = 16,
    n_prompts: int = 1000,
    seed: int = 0,
    n_numbers: int = 3,
    max_number: int = 10,
    reward_fn: RewardFn | None = None,
    **env_kwargs,
) -> TokenEnv:
    """A :class:`TokenEnv` over ``n_prompts`` countdown puzzles with :class:`CountdownReward`.

    Args:
        tokenizer: the tokenizer of the model you train (``tokengym.testing.tiny_tokenizer()`` in tests).
        batch_size: parallel slots.
        max_new_tokens: response budget.
        n_prompts: number of puzzles generated.
        seed: seed of the puzzles (and of the prompt order if ``shuffle=True``).
        n_numbers: numbers per puzzle.
        max_number: largest number.
        reward_fn: replaces :class:`CountdownReward` (it gets the puzzles' ``numbers`` and ``target``
            in the metadata).
        **env_kwargs: forwarded to :class:`TokenEnv` (``max_length`` defaults to 256).

    Example:
        >>> from tokengym.testing import tiny_tokenizer
        >>> make_countdown_env(tokenizer=tiny_tokenizer(), batch_size=2, n_prompts=4).batch_size
        torch.Size([2])
    """
    require_tokenizer("make_countdown_env", tokenizer)
    prompts = countdown_prompts(n_prompts, seed=seed, n_numbers=n_numbers, max_number=max_number)
    return make_task_env(
        prompts,
        CountdownReward() if reward_fn is None else reward_fn,
        tokenizer=tokenizer,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        seed=seed,
        **env_kwargs,
    )
