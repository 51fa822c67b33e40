"""Evaluation over held-out prompts: pass@k (the unbiased estimator), mean@k and maj@k, per prompt and overall.

:func:`evaluate` runs any policy a :class:`~tokengym.collectors.TokenCollector` runs (transformers, vLLM,
servers) over an env whose prompt source ends (``PromptSource(..., epochs=1)``) and whose ``group_size``
``n`` is the samples per prompt: ``n = 1`` with a greedy policy is greedy accuracy, ``n = k`` with a
sampling policy gives pass@k, mean@k and maj@k. A sample is correct when its reward reaches
``threshold``; maj@k takes the most frequent answer of the group (``answer_fn`` of the response text,
ties to the first seen) and is right when that answer's samples are.

pass@k is the unbiased estimator of Chen et al. (2021), ``1 - C(n - c, k) / C(n, k)`` for ``c`` correct of
``n`` samples, not the best of the first ``k`` samples (which under-reports and varies with the order).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable

from tokengym.collectors import TokenCollector
from tokengym.llm_envs import keys

__all__ = ["Evaluation", "evaluate", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` samples drawn without replacement from ``n`` samples, ``c`` of
    them correct, is correct: ``1 - C(n - c, k) / C(n, k)``.

    Example:
        >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 3, 2)
        (0.25, 0.5, 0.0, 1.0)
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}: pass@k needs at least k samples per prompt")
    if c > n:
        raise ValueError(f"c={c} correct samples of n={n}: c must be <= n")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclasses.dataclass
class Evaluation:
    """What :func:`evaluate` measured.

    ``metrics`` is a flat dict for a logger: ``pass@k`` for each ``k`` asked, ``mean@n`` (mean correctness of all
    samples), ``maj@n``, ``mean_reward``, ``prompts`` and ``samples``. ``per_prompt`` holds one dict per prompt
    (``group`` id, ``text``, ``rewards``, ``answers``, ``correct`` count, ``majority`` answer, ``is_majority_correct``
    and the ``pass@k`` values), in prompt order.
    """

    metrics: dict[str, float]
    per_prompt: list[dict]

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in self.metrics.items())


def evaluate(env, policy, *, threshold: float = 1.0, answer_fn: Callable[[str], object] | None = None,
             ks: tuple[int, ...] | None = None, source: str | None = None) -> Evaluation:  # fmt: skip
    """Run ``policy`` on every prompt of ``env`` (``group_size`` samples each) and score the groups.

    Args:
        env: a :class:`~tokengym.llm_envs.TokenEnv` (or a ``TransformedEnv`` of one) whose prompt source ends:
            ``PromptSource(prompts, tokenizer, group_size=n, epochs=1)``; its reward function scores.
        policy: any policy a :class:`~tokengym.collectors.TokenCollector` runs on ``env`` (greedy or sampling).
        threshold: a sample is correct when its reward is ``>= threshold``.
        answer_fn: the answer a response text states, for maj@k (default: the text, stripped).
        ks: the k of pass@k (each <= n); default: 1, 2, 4, ... up to n, and n.
        source: ``"step"`` or ``"wave"`` (default: what the policy does, as the collector picks).

    Returns:
        an :class:`Evaluation`.

    Example:
        >>> import torch
        >>> from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
        >>> from tokengym.llm_envs import PromptSource, TokenEnv
        >>> from tokengym.testing import tiny_model, tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> prompts = PromptSource([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}], tok,
        ...                        group_size=4, epochs=1)
        >>> env = TokenEnv(prompts, tok, lambda r, p, m: [float(x.strip() == d["answer"]) for x, d in zip(r, m)],
        ...                batch_size=8, max_new_tokens=4, max_length=32)
        >>> result = evaluate(env, TransformersPolicy(tiny_model(tok), env, sampling=SamplingConfig(), seed=0))
        >>> sorted(result.metrics)
        ['maj@4', 'mean@4', 'mean_reward', 'pass@1', 'pass@2', 'pass@4', 'prompts', 'samples']
        >>> result.metrics["prompts"], result.metrics["samples"]
        (2, 8)
    """
    base = getattr(env, "base_env", env)
    prompt_source = base.source
    n = int(getattr(prompt_source, "group_size", 1))
    if getattr(prompt_source, "epochs", 1) is None:
        raise ValueError("evaluate needs a prompt source that ends: build it with PromptSource(prompts, tokenizer, "
                         f"group_size={n}, epochs=1) (this one repeats forever, epochs=None)")  # fmt: skip
    ks = _default_ks(n) if ks is None else tuple(ks)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"every k of pass@k must be an int in [1, group_size={n}], got {k!r}; sample more per "
                             f"prompt (group_size) or ask for a smaller k")  # fmt: skip
    answer_fn = answer_fn or str.strip
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=n * max(1, base.batch_size[0] // n),
                               source=source)  # fmt: skip
    groups: dict[int, dict] = {}
    try:
        for batch in collector:
            _add_batch(groups, batch, base, answer_fn)
    finally:
        collector.shutdown()
    return _score(groups, n, ks, threshold)


def _default_ks(n: int) -> tuple[int, ...]:
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return (*ks, n)


def _add_batch(groups: dict[int, dict], batch, env, answer_fn) -> None:
    """Each trajectory's reward (summed over its steps) and answer, by group."""
    mask = batch.get(keys.MASK)
    reward = (batch.get(keys.REWARD).squeeze(-1) * mask).sum(1).tolist()
    actions, lengths = batch.get(keys.ACTION), mask.sum(1)
    texts = env.decode_responses([actions[i, : int(n)] for i, n in enumerate(lengths)])
    table = batch.get_non_tensor(keys.PROMPTS)
    for i, group in enumerate(batch.get(keys.GROUP_ID)[:, 0].tolist()):
        entry = groups.setdefault(group, {"text": table.text(group), "metadata": table.metadata(group),
                                          "rewards": [], "answers": []})  # fmt: skip
        entry["rewards"].append(reward[i])
        entry["answers"].append(answer_fn(texts[i]))


def _score(groups: dict[int, dict], n: int, ks: tuple[int, ...], threshold: float) -> Evaluation:
    per_prompt, totals = [], Counter()
    for group in sorted(groups):
        entry = groups[group]
        correct = [r >= threshold for r in entry["rewards"]]
        c = sum(correct)
        votes = Counter(entry["answers"])
        majority = max(votes, key=lambda a: (votes[a], -entry["answers"].index(a)))
        is_majority_correct = any(ok for a, ok in zip(entry["answers"], correct, strict=True) if a == majority)
        row = {"group": group, "text": entry["text"], "rewards": entry["rewards"], "answers": entry["answers"],
               "correct": c, "majority": majority, "is_majority_correct": is_majority_correct}  # fmt: skip
        samples = len(correct)
        for k in ks:
            if samples >= k:  # a group cut short (its prompt failed mid-way) gives what it has
                row[f"pass@{k}"] = pass_at_k(samples, c, k)
                totals[f"pass@{k}"] += row[f"pass@{k}"]
        totals["correct"] += c
        totals["samples"] += samples
        totals["maj"] += is_majority_correct
        totals["reward"] += sum(entry["rewards"])
        per_prompt.append(row)
    prompts = len(per_prompt)
    if not prompts:
        raise ValueError("the env's prompt source gave no prompt: nothing to evaluate")
    metrics: dict[str, float] = {f"pass@{k}": totals[f"pass@{k}"] / prompts for k in ks}
    metrics[f"mean@{n}"] = totals["correct"] / totals["samples"]
    metrics[f"maj@{n}"] = totals["maj"] / prompts
    metrics["mean_reward"] = totals["reward"] / totals["samples"]
    metrics["prompts"], metrics["samples"] = prompts, int(totals["samples"])
    return Evaluation(metrics, per_prompt)
