"""Vision-language collection throughput (issue 52): the tiny Qwen2-VL stepped by tokengym against a hand-written
KV-cache loop of the same model, in the same run.

Every contestant generates ``NEW_TOKENS`` tokens for each of B prompts (one 48 x 48 image each: 36 image tokens of a
~50-token prompt), EOS and the vision tokens banned, full-vocabulary sampling at temperature 1 with tokengym's
:func:`sample_tokens`, and the log-prob of each sampled token. One round runs every contestant once in a rotated
order; tokens/s is the median over the rounds, a ratio the median of the per-round ratios. One torch thread.

- ``hand loop``: one prefill of the B left-padded prompts with their images and M-RoPE positions (transformers'
  ``get_rope_index``), then per token one cached forward at each row's position (length + rope delta), sample,
  append; under ``torch.no_grad()``; ``hand loop, inference mode``: the same under ``torch.inference_mode()``.
- ``stepwise``: ``TokenCollector`` + ``TransformersPolicy``, one STEPS batch of ``NEW_TOKENS`` steps over the same B
  prompts each time (the prompt source renders each once, as the hand loop's inputs are rendered once); its refills
  prefill the B prompts with their images, as the hand loop's prefill does (no prompt store across batches).
- ``wave``: the same env and policy with ``source="wave"``.

The table lands in ``throughput_table`` (printed at the end of ``make bench``).
"""

from __future__ import annotations

import statistics

import pytest
import torch
from transformers import DynamicCache

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy, sample_tokens
from tokengym.llm_envs import TokenEnv, keys, vision_token_ids
from tokengym.llm_envs.tasks.visual import shape_count_prompts
from tokengym.testing import tiny_vl_model, tiny_vl_processor, tiny_vl_tokenizer

NEW_TOKENS = 32
ROUNDS = 5


def _setup(B: int):
    tok = tiny_vl_tokenizer()
    processor, model = tiny_vl_processor(tok), tiny_vl_model(tok)
    items = shape_count_prompts(B, seed=0)  # each batch refills the same B prompts (their renderings cached, as text's)
    banned = tuple(sorted({tok.eos_token_id, *vision_token_ids(model)}))
    return tok, processor, model, items, banned


def _hand_loop(tok, processor, model, items, banned, B: int, *, inference_mode: bool):
    texts = [processor.apply_chat_template(item["prompt"], add_generation_prompt=True, tokenize=False)
             for item in items[:B]]  # fmt: skip
    tok.padding_side = "left"
    x = processor(text=texts, images=[item["images"][0] for item in items[:B]], return_tensors="pt", padding=True)
    positions, delta = model.model.get_rope_index(x["input_ids"], mm_token_type_ids=x["mm_token_type_ids"],
                                                  image_grid_thw=x["image_grid_thw"],
                                                  attention_mask=x["attention_mask"])  # fmt: skip
    gen, sampling = torch.Generator().manual_seed(0), SamplingConfig(banned_token_ids=banned)
    grad_off = torch.inference_mode if inference_mode else torch.no_grad

    @grad_off()
    def run() -> int:
        cache, mask = DynamicCache(config=model.config), x["attention_mask"]
        out = model(input_ids=x["input_ids"], attention_mask=mask, position_ids=positions, past_key_values=cache,
                    pixel_values=x["pixel_values"], image_grid_thw=x["image_grid_thw"], logits_to_keep=1)  # fmt: skip
        logits, at = out.logits[:, -1], mask.sum(-1, keepdim=True) + delta  # the next token's position
        for _ in range(NEW_TOKENS):
            tokens, logp, _ = sample_tokens(logits, sampling, gen, with_raw_log_prob=False)
            mask = torch.cat([mask, torch.ones_like(at)], 1)
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=at, past_key_values=cache
                           ).logits[:, -1]  # fmt: skip
            at = at + 1
        return B * NEW_TOKENS

    return run


def _tokengym(tok, processor, model, items, banned, B: int, *, source: str):
    env = TokenEnv(items, tok, batch_size=B, max_new_tokens=NEW_TOKENS, processor=processor, model_config=model.config,
                   max_length=256)  # fmt: skip
    # no prompt store: each batch prefills its B prompts with their images, as the hand loop's prefill does
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=banned), prefix_cache_bytes=0)
    batches = iter(TokenCollector(env, policy, mode="steps", batch_size=NEW_TOKENS, source=source))
    return lambda: int(next(batches).get(keys.MASK).sum())


@pytest.mark.parametrize("B", [8, 32])
def test_vision_collector_throughput(benchmark, throughput_table, interleaved, B):
    setup = _setup(B)
    runs = {"hand loop": _hand_loop(*setup, B, inference_mode=False),
            "hand loop, inference mode": _hand_loop(*setup, B, inference_mode=True),
            "stepwise": _tokengym(*setup, B, source="step"), "wave": _tokengym(*setup, B, source="wave")}  # fmt: skip
    rates = interleaved(runs, ROUNDS, benchmark)
    medians = {n: statistics.median(v) for n, v in rates.items()}
    ratios = {(a, b): statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))
              for a, b in [("stepwise", "hand loop"), ("stepwise", "hand loop, inference mode"),
                           ("wave", "hand loop")]}  # fmt: skip
    benchmark.extra_info.update({f"tokens_per_s[{n}]": v for n, v in medians.items()})
    description = (f"tiny Qwen2-VL 2x64, vocab 516; one 48x48 image per prompt; {NEW_TOKENS} new tokens, EOS banned; "
                   f"{ROUNDS} rounds")  # fmt: skip
    throughput_table[("tiny-vl", B)] = (description, medians, ratios)
