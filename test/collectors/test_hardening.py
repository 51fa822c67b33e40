"""Regression tests of collector and env defects found by trying tokengym as a new user (issue 12, items 10-15)."""

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.errors import PromptError, RewardFunctionError
from tokengym.llm_envs import PromptSource, TokenEnv, keys


def _check_log_probs_match_teacher_forcing(policy, batches):
    for batch in batches:
        mask = batch[keys.MASK]
        forced = policy.teacher_forced_log_probs(batch)
        assert torch.allclose(forced[mask], batch[keys.ACTION_LOG_PROB][mask], atol=1e-5)


def test_retry_after_a_reward_error_keeps_log_probs_exact(make_env, make_policy):
    """Item 10: the policy's cache ran one token ahead of the rolled-back env; a retry fed it twice."""
    calls = {"n": 0}

    def flaky(responses, prompts, metadata):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("flaky reward service")
        return [0.0] * len(responses)

    env = make_env(batch_size=3, max_new_tokens=6, eos_token_ids=list(range(1, 512, 5)))
    env.reward_fn = flaky
    policy = make_policy(env, seed=1)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4)
    with pytest.raises(RewardFunctionError, match="flaky reward service"):
        next(iter(collector))
    batches = [b for b, _ in zip(collector, range(3), strict=False)]  # iterate again: the step is retried
    assert len(batches) == 3
    _check_log_probs_match_teacher_forcing(policy, batches)


@pytest.mark.parametrize("source", ["step", "wave"])
def test_bad_prompt_mid_collection_is_named_skipped_and_nothing_is_lost(tokenizer, model, source):
    """Item 11: a prompt that cannot be encoded left the collector broken (KeyError on the next batch)."""
    items = ["1+1=", "2+2=", "3+3=", {"no_prompt_field": 1}, "4+4=", "5+5=", "6+6="]
    env = TokenEnv(PromptSource(items, tokenizer, group_size=2, epochs=1), tokenizer, batch_size=2,
                   max_new_tokens=3, model_config=model.config, eos_token_ids=list(range(1, 512, 3)))  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4, source=source)
    got, errors = [], []
    while True:
        try:
            for batch in collector:
                got.append(batch)
            break
        except PromptError as err:  # named; iterating again goes on with the next prompts
            errors.append(str(err))
    assert len(errors) == 1 and "prompt item 3 is a mapping without a prompt field" in errors[0]
    texts, trajs = [], []
    for batch in got:
        mask, table = batch[keys.MASK], batch.get_non_tensor(keys.PROMPTS)
        rows = batch[keys.GROUP_ID][:, 0].tolist()
        texts += [table.text(g) for g in rows]
        trajs += batch[keys.TRAJ_ID][:, 0].tolist()
        assert all(g in table for g in rows) and bool(mask[:, 0].all())
    good = [item for item in items if isinstance(item, str)]
    assert sorted(texts) == sorted(good * 2)  # every sample of every good prompt, once; the bad one skipped
    assert len(set(trajs)) == len(trajs) == 12


def test_reward_tensors_are_detached(make_env, make_policy):
    """Item 12: a reward function returning a tensor with a graph made rewards and log-probs carry grad_fn."""
    weight = torch.ones(1, requires_grad=True)

    def differentiable(responses, prompts, metadata):
        return weight * torch.ones(len(responses))

    env = make_env(batch_size=2, max_new_tokens=3)
    env.reward_fn = differentiable
    batch = next(iter(TokenCollector(env, make_policy(env), mode="steps", batch_size=4)))
    assert batch[keys.REWARD].grad_fn is None and not batch[keys.REWARD].requires_grad
    assert batch[keys.ACTION_LOG_PROB].grad_fn is None


@pytest.mark.parametrize(("ids", "bad"), [([5, 600, 7], 600), ([5, -3], -3)])
def test_prompt_ids_outside_the_vocabulary(tokenizer, ids, bad):
    """Item 13: out-of-range prompt ids failed deep inside torch."""
    env = TokenEnv([ids], tokenizer, batch_size=1, max_new_tokens=2, max_length=32)
    with pytest.raises(PromptError, match=rf"{bad}.*outside the vocabulary \[0, 512\)"):
        env.reset()


def test_bad_sampling_and_context_fail_at_construction(tokenizer, model):
    """Item 13: banned ids out of range, banning every token, a model with fewer positions than the env holds."""
    from tokengym.testing import tiny_model

    env = TokenEnv(["1+1="], tokenizer, batch_size=1, max_new_tokens=2, model_config=model.config)
    with pytest.raises(ValueError, match=r"banned_token_ids \[600\] are outside the model's vocabulary \[0, 512\)"):
        TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=(600,)))
    with pytest.raises(ValueError, match="bans all 512 tokens"):
        TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=tuple(range(512))))
    short = tiny_model(tokenizer, family="gpt2", max_positions=64)
    env = TokenEnv(["1+1="], tokenizer, batch_size=1, max_new_tokens=100)  # no model_config: the tokenizer's limit
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has 64 positions; build the env with model_config"):
        TransformersPolicy(short, env)


@pytest.mark.parametrize(("saved", "loaded"), [(3, 4), (4, 2), (1, 4)])
def test_load_state_dict_from_another_batch_size(make_env, make_policy, saved, loaded):
    """Item 14: 3->4 and 4->2 raised a bare RuntimeError; 1->4 copied slot 0 into every slot."""
    env = make_env(batch_size=saved)
    collector = TokenCollector(env, make_policy(env), mode="steps", batch_size=2)
    next(iter(collector))
    env2 = make_env(batch_size=loaded)
    other = TokenCollector(env2, make_policy(env2), mode="steps", batch_size=2)
    with pytest.raises(ValueError, match=rf"checkpoint is of an env with \(batch_size, max_length\) \({saved}, 64\)"):
        other.load_state_dict(collector.state_dict())


@pytest.mark.parametrize("include_cache", [True, False])
def test_checkpoints_load_with_weights_only(make_env, make_policy, tmp_path, include_cache):
    """Item 15: checkpoints needed pickle (weights_only=True failed); the KV cache can be left out."""
    def make():
        env = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=list(range(1, 512, 7)))
        return TokenCollector(env, make_policy(env, seed=2), mode="trajectories", batch_size=3)

    collector = make()
    it = iter(collector)
    next(it)
    torch.save(collector.state_dict(include_cache=include_cache), tmp_path / "ckpt.pt")
    expected = next(it)
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    got = next(iter(resumed))
    assert torch.equal(got[keys.ACTION], expected[keys.ACTION])
    mask = got[keys.MASK]
    if include_cache:
        assert torch.equal(got[keys.ACTION_LOG_PROB], expected[keys.ACTION_LOG_PROB])
    else:  # re-prefilled: the same tokens, log-probs equal up to the last bits
        assert torch.allclose(got[keys.ACTION_LOG_PROB][mask], expected[keys.ACTION_LOG_PROB][mask], atol=1e-5)
