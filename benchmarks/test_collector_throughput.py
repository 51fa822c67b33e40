"""Collector throughput against raw ``model.generate`` and TorchRL's LLMCollector, in one run.

Prompts of about 32 tokens, 64 new tokens with EOS suppressed (fixed length), one torch thread.
Each case collects B x 64 tokens per round; ``benchmarks/conftest.py`` prints tokens/s and the
ratio to raw generate (same model, prompts and batch) at the end of the run.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tokengym.collectors import SamplingConfig, TokenCollector, TransformersPolicy, UnrollCollector
from tokengym.llm_envs import TokenEnv
from tokengym.testing import tiny_model, tiny_tokenizer

NEW_TOKENS = 64
CONFIGS = [("tiny", 8), ("tiny", 32), ("small", 8), ("small", 32)]
_MODELS: dict[str, tuple] = {}


def _model(size: str):
    if size not in _MODELS:
        tok = tiny_tokenizer(512 if size == "tiny" else 2048)
        _MODELS[size] = (tok, tiny_model(tok, size=size))
    return _MODELS[size]


def _prompts(tok, B: int) -> list[str]:
    texts = [f"Question {i}: what is {i} + {2 * i + 3}? Think step by step, then give the final value." for i in range(B)]
    return [tok.decode(tok(t)["input_ids"][:32]) for t in texts]  # ~32 tokens each


def _raw_generate(tok, model, prompts):
    x = tok(prompts, return_tensors="pt", padding=True)
    width = x["input_ids"].shape[1]

    def run():
        out = model.generate(**x, do_sample=True, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        logits = torch.stack(out.logits, 1)  # (B, T, V)
        return logits.log_softmax(-1).gather(-1, out.sequences[:, width:, None])

    return run


def _hand_loop(tok, model, prompts):
    """The practical limit: prefill, then one cached forward + sample + gather per token."""
    x = tok(prompts, return_tensors="pt", padding=True)
    eos = tok.eos_token_id

    @torch.no_grad()
    def run():
        cache, mask = DynamicCache(config=model.config), x["attention_mask"]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=x["input_ids"], attention_mask=mask, position_ids=pos, past_key_values=cache)
        logits, last, lps = out.logits[:, -1], pos[:, -1:], []
        for _ in range(NEW_TOKENS):
            logits[:, eos] = -float("inf")
            logp = logits.log_softmax(-1)
            tokens = torch.multinomial(logp.exp(), 1)
            lps.append(logp.gather(-1, tokens))
            mask, last = torch.cat([mask, torch.ones_like(tokens)], 1), last + 1
            logits = model(input_ids=tokens, attention_mask=mask, position_ids=last, past_key_values=cache).logits[:, -1]
        return torch.cat(lps, 1)

    return run


def _tokengym(tok, model, prompts, collector_cls, *, max_length: int = 256):
    env = TokenEnv(prompts, tok, batch_size=len(prompts), max_new_tokens=NEW_TOKENS,
                   model_config=model.config, max_length=max_length)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=(tok.eos_token_id,)))
    batches = iter(collector_cls(env, policy, mode="steps", batch_size=NEW_TOKENS))
    return lambda: next(batches)


def _torchrl(tok, model, prompts):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.transforms import DataLoadingPrimer
    from torchrl.modules.llm import TransformersWrapper

    B = len(prompts)

    class _Prompts:
        batch_size = B

        def __iter__(self):
            while True:
                yield {"query": prompts}

    env = ChatEnv(batch_size=(B,), tokenizer=tok, input_mode="history")
    env = env.append_transform(DataLoadingPrimer(dataloader=_Prompts(), batch_size=(B,)))
    policy = TransformersWrapper(model, tokenizer=tok, input_mode="history", generate=True, return_log_probs=True,
                                 generate_kwargs={"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS,
                                                  "do_sample": True})  # fmt: skip
    batches = iter(LLMCollector(env, policy=policy, dialog_turns_per_batch=B))
    return lambda: next(batches)


METHODS = {
    "raw_generate": _raw_generate,
    "hand_kv_loop": _hand_loop,
    "tokengym_stepwise": lambda tok, model, prompts: _tokengym(tok, model, prompts, TokenCollector),
    "tokengym_unroll": lambda tok, model, prompts: _tokengym(tok, model, prompts, UnrollCollector),
    "torchrl_llm_collector": _torchrl,
}


# torchrl's LLM stack builds a loss with deprecated torch arguments at import time
@pytest.mark.filterwarnings("ignore:size_average and reduce args:UserWarning")
@pytest.mark.parametrize("size,B", CONFIGS, ids=[f"{s}-B{b}" for s, b in CONFIGS])
@pytest.mark.parametrize("method", list(METHODS))
def test_collector_throughput(benchmark, throughput_table, method, size, B):
    tok, model = _model(size)
    torch.manual_seed(0)
    run = METHODS[method](tok, model, _prompts(tok, B))
    benchmark.pedantic(run, rounds=4, warmup_rounds=1)
    tokens_per_s = B * NEW_TOKENS / benchmark.stats.stats.median
    benchmark.extra_info["tokens_per_s"] = tokens_per_s
    throughput_table[(size, B)][method] = tokens_per_s


@pytest.mark.parametrize("max_length", [128, 1024])
def test_bytes_per_step(benchmark, bytes_table, max_length):
    """Bytes a collected STEPS batch stores per env step and slot: the same for any buffer length."""
    tok, model = _model("tiny")
    run = _tokengym(tok, model, _prompts(tok, 8), TokenCollector, max_length=max_length)
    batch = benchmark.pedantic(run, rounds=2, warmup_rounds=1)
    stored = sum(v.numel() * v.element_size() for v in batch.values(True, True) if isinstance(v, torch.Tensor))
    per_step = stored / batch.numel()
    benchmark.extra_info["bytes_per_step"] = per_step
    bytes_table[max_length] = per_step
