"""Helpers shared by the vLLM policy tests: tiny vLLM-compatible models, teacher-forced log-probs, running servers."""

import contextlib

import pytest
import torch
from transformers import GPT2LMHeadModel, Qwen2ForCausalLM

from tokengym.testing import tiny_model


def vllm_model(tokenizer, family: str = "qwen2", *, tie: bool = True, seed: int = 0):
    """A tiny model vLLM's CPU kernels run (2 attention heads: head size >= 32)."""
    config = tiny_model(tokenizer, family=family).config
    if family == "qwen2":
        config.num_attention_heads, config.num_key_value_heads = 2, 1
    else:
        config.n_head = 2
    config.tie_word_embeddings = tie
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = (Qwen2ForCausalLM if family == "qwen2" else GPT2LMHeadModel)(config)
    return model.eval()


def teacher_forced(model, prompt, actions, sampling=None):
    """Log-probs (T,) of ``actions`` after ``prompt`` under ``model``, filtered as ``sampling`` says."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, actions])[None]).logits[0, len(prompt) - 1 : -1]  # (T, V)
    if sampling is not None and not sampling.greedy:
        logits = logits / sampling.temperature
        logits[:, list(sampling.banned_token_ids)] = -float("inf")
        if sampling.top_k:
            kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        if sampling.top_p < 1:  # drop a token once the mass before it reaches top_p
            probs, order = logits.softmax(-1).sort(-1, descending=True)
            drop_sorted = probs.cumsum(-1) - probs >= sampling.top_p
            logits = logits.masked_fill(
                torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), -float("inf")
            )
    return logits.log_softmax(-1).gather(-1, actions[:, None]).squeeze(-1)


@pytest.fixture(scope="session")
def make_vllm_model():
    """``make_vllm_model(tokenizer, family="qwen2", *, tie=True, seed=0)``: see :func:`vllm_model`."""
    return vllm_model


@pytest.fixture(scope="session")
def teacher_forcing():
    """``teacher_forcing(model, prompt, actions, sampling=None)``: see :func:`teacher_forced`."""
    return teacher_forced


@contextlib.contextmanager
def running(servers, *, wait=None):
    """Launch every :class:`LocalVLLMServer` of ``servers`` at once (they start in parallel), wait until those of
    ``wait`` (default: all) are healthy, and stop them all at the end (their logs go with them)."""
    try:
        for server in servers:
            server.launch()
        for server in servers if wait is None else wait:
            server.wait()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def running_servers():
    """``with running_servers(servers, wait=None): ...``: see :func:`running`."""
    return running
