import copy

import pytest
import torch
from torchrl.envs import TransformedEnv

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import StepwiseReference
from tokengym.llm_envs import keys
from tokengym.testing import tiny_model
from tokengym.transforms import KLRewardTransform, step_log_probs


def test_stepwise_reference_matches_teacher_forced_scoring(tokenizer, model, make_env, make_policy):
    ref_model = tiny_model(tokenizer, seed=1)
    env = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=list(range(1, 512, 9)))
    policy, ref = make_policy(env), StepwiseReference(ref_model, env)
    collector = TokenCollector(env, lambda td: ref(policy(td)), mode="trajectories", batch_size=4)
    batch = next(iter(collector))
    mask = batch[keys.MASK]
    scored = step_log_probs(ref_model, batch, pad_id=tokenizer.pad_token_id)
    assert torch.allclose(batch[keys.REF_LOG_PROB][mask], scored[mask], atol=1e-5)


def test_kl_transform_inside_a_transformed_env(tokenizer, model, make_env, make_policy):
    """KL shaping per step inside the env equals shaping the collected batch once."""
    ref_model = tiny_model(tokenizer, seed=1)
    base = make_env(batch_size=2, max_new_tokens=4, reward_fn=lambda r, p, m: [1.0] * len(r))
    env = TransformedEnv(base, KLRewardTransform(beta=0.3))
    policy, ref = make_policy(base), StepwiseReference(ref_model, base)
    batch = next(iter(TokenCollector(env, lambda td: ref(policy(td)), mode="trajectories", batch_size=3)))
    mask = batch[keys.MASK]
    raw, shaped = batch[keys.REWARD_RAW].squeeze(-1), batch[keys.REWARD].squeeze(-1)
    kl = batch[keys.ACTION_LOG_PROB] - batch[keys.REF_LOG_PROB]
    assert torch.allclose(shaped[mask], (raw - 0.3 * kl)[mask], atol=1e-5)
    assert torch.allclose((raw * mask).sum(1), torch.ones(3))

    offline = KLRewardTransform(beta=0.3)(copy.deepcopy(batch.exclude(keys.REWARD_KL, keys.KL)).set(keys.REWARD, batch[keys.REWARD_RAW]))
    assert torch.allclose(offline[keys.REWARD].squeeze(-1)[mask], shaped[mask], atol=1e-5)


def test_bad_temperature(model, make_env):
    with pytest.raises(ValueError, match=r"temperature must be > 0, got 0"):
        StepwiseReference(model, make_env(), temperature=0)
