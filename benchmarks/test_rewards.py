"""MathAnswerReward per response: the fast integer path and the math-verify path, beside the regex verifier.

Each benchmark scores the same 64 responses (one list, repeated) per round; divide the mean by 64 for
the cost of one response. Reference answers repeat as in a GRPO group, so their parse is cached.
"""

import pytest

from tokengym.llm_envs import MathAnswerReward

N = 64
# integer reference, integer-only response: never reaches math-verify
FAST = [("19", "19"), ("7", "\\boxed{7}"), ("12", "13"), ("0", "-0")]
# realistic model outputs that need math-verify
LATEX = [
    ("\\frac{1}{2}", "The answer is 0.5"),
    ("1000", "so \\boxed{10^{3}}"),
    ("5", "The answer is 5. Check: 5+2=7"),
    ("\\frac{3}{4}", "Final answer: \\boxed{0.75}"),
]


def _rows(cases):
    rows = (cases * N)[:N]
    return [r for _, r in rows], [""] * N, [{"answer": a} for a, _ in rows]


@pytest.mark.parametrize(
    "name, verifier, cases",
    [("fast_path", "math_verify", FAST), ("math_verify", "math_verify", LATEX), ("exact_regex", "exact", LATEX)],
)
def test_math_answer_reward_per_response(benchmark, name, verifier, cases):
    reward = MathAnswerReward(verifier=verifier)
    responses, prompts, metadata = _rows(cases)
    reward(responses, prompts, metadata)  # warm: imports, the LaTeX parser, cached reference answers
    benchmark.pedantic(reward, args=(responses, prompts, metadata), rounds=10, warmup_rounds=1)
    benchmark.extra_info["responses_per_round"] = N
    benchmark.extra_info["us_per_response"] = benchmark.stats.stats.mean / N * 1e6
