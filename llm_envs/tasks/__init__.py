"""Built-in offline tasks: seeded prompt generators, their reward functions, and env constructors.

Example:
    >>> from tokengym.llm_envs.tasks import make_arithmetic_env
    >>> from tokengym.testing import tiny_tokenizer
    >>> make_arithmetic_env(tokenizer=tiny_tokenizer(), batch_size=2, n_prompts=8).batch_size
    torch.Size([2])
"""

from __future__ import annotations

from tokengym.llm_envs.tasks.arithmetic import arithmetic_prompts, arithmetic_reward, make_arithmetic_env
from tokengym.llm_envs.tasks.countdown import (
    CountdownReward,
    countdown_prompts,
    evaluate_expression,
    make_countdown_env,
)
from tokengym.llm_envs.tasks.files import load_prompt_file
from tokengym.llm_envs.tasks.multi_turn_math import (
    TOOL_HINT,
    WRONG_FEEDBACK,
    MultiTurnMathFeedback,
    make_multi_turn_math_env,
)
from tokengym.llm_envs.tasks.reversal import ReversalReward, make_reversal_env, reversal_prompts
from tokengym.llm_envs.tasks.visual import digit_reading_prompts, shape_count_prompts

__all__ = [
    "digit_reading_prompts",
    "shape_count_prompts",
    "CountdownReward",
    "MultiTurnMathFeedback",
    "TOOL_HINT",
    "WRONG_FEEDBACK",
    "ReversalReward",
    "arithmetic_prompts",
    "arithmetic_reward",
    "countdown_prompts",
    "evaluate_expression",
    "load_prompt_file",
    "make_arithmetic_env",
    "make_countdown_env",
    "make_multi_turn_math_env",
    "make_reversal_env",
    "reversal_prompts",
]
