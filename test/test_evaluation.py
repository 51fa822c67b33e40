"""Evaluation: the unbiased pass@k estimator, and evaluate() on a real policy against what its samples say."""

import itertools
import math

import pytest
import torch

from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.evaluation import evaluate, pass_at_k
from tokengym.llm_envs import PromptSource, TokenEnv
from tokengym.testing import tiny_model, tiny_tokenizer

PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(2)]


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_chance_that_a_random_k_subset_holds_a_correct_sample(n):
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            expected = sum(any(s) for s in subsets) / len(subsets)
            assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12), (n, c, k)


def test_pass_at_k_is_not_best_of_the_first_k():
    # one correct sample of 8, last in order: best-of-first-2 says 0, the estimator 2/8
    assert pass_at_k(8, 1, 2) == pytest.approx(0.25)


@pytest.mark.parametrize("args", [(4, 1, 0), (4, 1, 5), (4, 5, 2), (-1, 0, 1), (4.0, 1, 1), (True, 1, 1)])
def test_pass_at_k_refuses_impossible_counts(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)


class _Recorder:
    """A reward function that scores by response length parity and records every (prompt, response, reward)."""

    def __init__(self):
        self.seen = []

    def __call__(self, responses, prompts, metadata):
        out = [float(len(r) % 2 == 0) for r in responses]
        self.seen += list(zip(prompts, responses, out, strict=True))
        return out


def _env(tok, reward, n, *, batch_size=8, epochs=1):
    source = PromptSource(PROMPTS, tok, group_size=n, epochs=epochs)
    return TokenEnv(source, tok, reward, batch_size=batch_size, max_new_tokens=6, max_length=32)


@pytest.mark.parametrize("source", ["step", "wave"])
def test_evaluate_matches_the_samples_it_scored(source):
    torch.manual_seed(0)
    tok, reward, n = tiny_tokenizer(), _Recorder(), 4
    env = _env(tok, reward, n)
    result = evaluate(env, TransformersPolicy(tiny_model(tok), env, sampling=SamplingConfig(temperature=1.5), seed=3),
                      source=source)  # fmt: skip
    by_prompt = {}
    for prompt, response, r in reward.seen:
        by_prompt.setdefault(prompt, []).append((response.strip(), r))
    assert len(by_prompt) == len(PROMPTS) and all(len(v) == n for v in by_prompt.values())
    assert result.metrics["prompts"] == len(PROMPTS) and result.metrics["samples"] == n * len(PROMPTS)
    expected = {f"pass@{k}": 0.0 for k in (1, 2, 4)}
    maj = correct = 0
    for samples in by_prompt.values():
        c = sum(r == 1.0 for _, r in samples)
        correct += c
        for k in (1, 2, 4):
            expected[f"pass@{k}"] += pass_at_k(n, c, k) / len(PROMPTS)
        answers = [a for a, _ in samples]
        top = max(answers.count(a) for a in answers)
        winner = next(a for a in answers if answers.count(a) == top)  # ties: the first seen
        maj += any(r == 1.0 for a, r in samples if a == winner)
    for key, value in expected.items():
        assert result.metrics[key] == pytest.approx(value), key
    assert result.metrics["mean@4"] == pytest.approx(correct / (n * len(PROMPTS)))
    assert result.metrics["maj@4"] == pytest.approx(maj / len(PROMPTS))
    assert 0 < result.metrics["mean@4"] < 1, "the check needs both right and wrong samples"
    rows = {row["text"]: row for row in result.per_prompt}
    assert set(rows) == set(by_prompt)
    for prompt, samples in by_prompt.items():
        assert sorted(rows[prompt]["answers"]) == sorted(a for a, _ in samples)
    assert "pass@4" in str(result)


def test_greedy_evaluation_answers_as_generate_does():
    torch.manual_seed(0)
    tok, reward = tiny_tokenizer(), _Recorder()
    model = tiny_model(tok)
    env = _env(tok, reward, 1, batch_size=4)
    result = evaluate(env, TransformersPolicy(model, env, sampling=SamplingConfig(greedy=True)))
    enc = tok([p["prompt"] for p in PROMPTS], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    greedy = {p["prompt"]: t.strip() for p, t in zip(PROMPTS, texts, strict=True)}
    assert {row["text"]: row["answers"][0] for row in result.per_prompt} == greedy
    right = sum(len(t) % 2 == 0 for t in texts) / len(PROMPTS)
    assert result.metrics["pass@1"] == result.metrics["mean@1"] == result.metrics["maj@1"] == pytest.approx(right)


def test_evaluate_refuses_a_source_that_never_ends_and_a_k_above_the_samples():
    tok = tiny_tokenizer()
    env = _env(tok, _Recorder(), 2, epochs=None)
    policy = TransformersPolicy(tiny_model(tok), env)
    with pytest.raises(ValueError, match="epochs=1"):
        evaluate(env, policy)
    env = _env(tok, _Recorder(), 2)
    with pytest.raises(ValueError, match=r"\[1, group_size=2\].*got 4"):
        evaluate(env, TransformersPolicy(tiny_model(tok), env), ks=(1, 4))
