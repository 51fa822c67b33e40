"""A model cast to another dtype after the policy was built goes on in the new dtype (the KV cache is re-allocated
and every slot prefilled again), where it raised a raw ``Index put requires the source and destination dtypes match``
from inside the KV cache; a model on the meta device is refused naming the fix (issue 47)."""

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model

PROMPTS = ["1+1=", "2+3=", "4+4=", "3+5="]
CASTS = {"to_bfloat16": lambda m: m.to(torch.bfloat16), "half": lambda m: m.half()}


def _collector(tokenizer, model, *, cast=None, source="step", policy_after_cast=False):
    env = TokenEnv(PROMPTS, tokenizer, lambda r, p, m: [1.0] * len(r), batch_size=2, max_new_tokens=3,
                   model_config=model.config, seed=0)  # fmt: skip
    if policy_after_cast:
        cast(model)
    policy = TransformersPolicy(model, env, seed=0)
    if cast is not None and not policy_after_cast:
        cast(model)
    return TokenCollector(env, policy, mode="trajectories", batch_size=2, source=source), policy


@pytest.mark.parametrize("cast", CASTS.values(), ids=CASTS.keys())
def test_a_model_cast_after_the_policy_was_built_collects_what_a_policy_built_after_the_cast_does(tokenizer, cast):
    late, policy = _collector(tokenizer, tiny_model(tokenizer, seed=0), cast=cast)
    early, _ = _collector(tokenizer, tiny_model(tokenizer, seed=0), cast=cast, policy_after_cast=True)
    a, b = next(iter(late)), next(iter(early))  # raised RuntimeError: Index put requires ... dtypes match
    assert torch.equal(a[keys.ACTION], b[keys.ACTION])
    assert torch.equal(a[keys.ACTION_LOG_PROB], b[keys.ACTION_LOG_PROB])
    assert policy.cache.kv[0][0].dtype == next(policy.model.parameters()).dtype  # the cache follows the model


@pytest.mark.parametrize("source", ["step", "wave"])
def test_a_model_cast_between_batches_goes_on_in_the_new_dtype(tokenizer, source):
    model = tiny_model(tokenizer, seed=0)
    collector, policy = _collector(tokenizer, model, source=source)
    it = iter(collector)
    next(it)  # the slots' sequences are cached in float32
    model.to(torch.bfloat16)
    batch = next(it)
    assert batch.shape[0] == 2 and bool(torch.isfinite(batch[keys.ACTION_LOG_PROB]).all())
    model.float()  # and back
    assert next(it).shape[0] == 2 and policy.cache.kv[0][0].dtype == torch.float32


def test_a_model_on_the_meta_device_is_refused_at_construction(tokenizer):
    model = tiny_model(tokenizer, seed=0).to("meta")
    env = TokenEnv(PROMPTS, tokenizer, lambda r, p, m: [1.0] * len(r), batch_size=2, max_new_tokens=3,
                   model_config=model.config)  # fmt: skip
    with pytest.raises(ValueError, match=r"TransformersPolicy got a model whose weights are on the meta device .*"
                                         r"nothing to run: load the weights \(from_pretrained\(name\), or "
                                         r"model\.to_empty\(device='cpu'\) then model\.load_state_dict"):  # fmt: skip
        TransformersPolicy(model, env, seed=0)


def test_a_model_moved_to_the_meta_device_after_the_policy_was_built_is_refused(tokenizer):
    model = tiny_model(tokenizer, seed=0)
    collector, _ = _collector(tokenizer, model)
    model.to("meta")
    with pytest.raises(ValueError, match=r"built with its model on cpu, the model's weights are now on the meta device"
                                         r" .* build the policy on a model with its weights loaded"):  # fmt: skip
        next(iter(collector))


def test_a_float32_checkpoint_resumes_on_a_bfloat16_model(tokenizer):
    saved, _ = _collector(tokenizer, tiny_model(tokenizer, seed=0))
    next(iter(saved))
    state = saved.state_dict()  # its KV cache in float32
    resumed, policy = _collector(tokenizer, tiny_model(tokenizer, seed=0), cast=CASTS["to_bfloat16"],
                                 policy_after_cast=True)  # fmt: skip
    resumed.load_state_dict(state)
    assert policy.cache.kv[0][0].dtype == torch.bfloat16  # raised Index put ... dtypes match at the next step
    assert next(iter(resumed)).shape[0] == 2
