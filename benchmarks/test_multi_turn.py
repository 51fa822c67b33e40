"""Multi-turn collection: KV cache extended across turns vs re-prefilling the whole history every turn.

4 turns of 64 generated tokens per episode, 8 slots, the tiny model. Turns end by a forced EOS
at the 64th token (EOS is banned from sampling, so every turn has exactly 64 tokens). Compared:

* ``tokengym``: :class:`MultiTurnTokenEnv` + :class:`TransformersPolicy`; only the feedback
  tokens are prefilled at a turn boundary.
* ``reprefill``: the same loop, but the policy drops its KV cache at every turn boundary and
  re-prefills prompt + all earlier turns (what a turn-level env serving a stateless engine does).
* ``generate``: a turn-level loop: per turn, re-tokenize the chat history as text and call
  ``model.generate`` on it (left-padded batch), as turn-level agent frameworks do.

Run: ``.venv/bin/pytest benchmarks/test_multi_turn.py -s`` (the ratio table is printed and stored
in ``benchmark.extra_info``).
"""

from __future__ import annotations

import time

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv, Turn
from tokengym.testing import tiny_model, tiny_tokenizer

B, TURNS, TURN_TOKENS = 8, 4, 64
FEEDBACK = "Your answer is wrong. Please check your work and try again."
PROMPTS = [[{"role": "user", "content": f"Compute {a} + {a * 3} and explain every step."}] for a in range(B)]


def _feedback(responses, prompts, metadata, turns):
    return [Turn(0.0, feedback=FEEDBACK) for _ in responses]


class _ForcedTurns:
    """Overrides the action with EOS at a turn's 64th token; ``is_reprefill`` drops the cache per turn."""

    def __init__(self, policy: TransformersPolicy, eos: int, *, is_reprefill: bool) -> None:
        self.policy, self.eos, self.is_reprefill, self.version = policy, eos, is_reprefill, 0
        self._turn = None

    def __call__(self, td):
        turn = td.get(keys.TURN)
        if self.is_reprefill and self._turn is not None and bool((turn != self._turn).any()):
            self.policy.reset_cache()  # the next call prefills every slot's whole history
        self._turn = turn.clone()
        td = self.policy(td)
        at_end = td.get(keys.SEQ_LEN) - td.get(keys.PROMPT_LEN) == TURN_TOKENS - 1
        td.set(keys.ACTION, torch.where(at_end, torch.full_like(at_end, self.eos, dtype=torch.int64), td.get(keys.ACTION)))
        return td


def _setup(size: str):
    tok = tiny_tokenizer()
    model = tiny_model(tok, size=size)
    return tok, model


def _run_tokengym(tok, model, *, is_reprefill: bool) -> int:
    env = MultiTurnTokenEnv(PROMPTS, tok, _feedback, max_turns=TURNS, batch_size=B, max_new_tokens=TURNS * TURN_TOKENS,
                            model_config=model.config)  # fmt: skip
    sampling = SamplingConfig(banned_token_ids=(tok.eos_token_id,))
    policy = _ForcedTurns(TransformersPolicy(model, env, sampling=sampling, seed=0), tok.eos_token_id,
                          is_reprefill=is_reprefill)  # fmt: skip
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=B)))
    assert batch[keys.MASK].sum(-1).tolist() == [TURNS * TURN_TOKENS] * B
    return int(batch[keys.MASK].sum())


@torch.no_grad()
def _run_generate(tok, model) -> int:
    """Turn-level baseline: the history is re-tokenized and fully prefilled by ``generate`` every turn."""
    histories = [list(p) for p in PROMPTS]
    tokens = 0
    for turn in range(TURNS):
        texts = [tok.apply_chat_template(h, tokenize=False, add_generation_prompt=True) for h in histories]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=TURN_TOKENS, min_new_tokens=TURN_TOKENS, do_sample=True,
                             top_k=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
        new = out[:, enc["input_ids"].shape[1] :]
        tokens += new.numel()
        for h, text in zip(histories, tok.batch_decode(new, skip_special_tokens=True), strict=True):
            h.append({"role": "assistant", "content": text})
            if turn + 1 < TURNS:
                h.append({"role": "user", "content": FEEDBACK})
    return tokens


def _time(fn, rounds: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.benchmark(group="multi_turn")
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_multi_turn_collection(benchmark, size):
    tok, model = _setup(size)
    tokens = benchmark.pedantic(lambda: _run_tokengym(tok, model, is_reprefill=False), rounds=3, warmup_rounds=1)
    assert tokens == B * TURNS * TURN_TOKENS
    ours = benchmark.stats.stats.min
    reprefill = _time(lambda: _run_tokengym(tok, model, is_reprefill=True))
    generate = _time(lambda: _run_generate(tok, model))
    info = {
        "tokens": tokens,
        "tokengym_s": ours,
        "reprefill_s": reprefill,
        "generate_s": generate,
        "speedup_vs_reprefill": reprefill / ours,
        "speedup_vs_generate": generate / ours,
    }
    benchmark.extra_info.update(info)
    print(f"\n{size} model: multi-turn collection, {B} slots x {TURNS} turns x {TURN_TOKENS} tokens ({tokens} tokens), best of 3")
    for name in ("tokengym", "reprefill", "generate"):
        seconds = info[f"{name}_s"]
        print(f"  {name:<10} {seconds:7.3f} s  {tokens / seconds:8.0f} tok/s  x{seconds / ours:.2f} of tokengym's time")
