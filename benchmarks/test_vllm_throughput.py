"""vLLM collection throughput: tokengym's wave collector on a vLLM engine ÷ the same engine's raw ``LLM.generate``.

Every contestant samples B slots x 64 new tokens (EOS banned, so every row is 64 real tokens) from the
full-vocabulary distribution at temperature 1 and returns the log-prob of each sampled token; all run
in the same process, one round runs every contestant once in an order rotated per round, and a
contestant's tokens/s is the median over 5 rounds; a ratio is the median over rounds of the ratio within
a round (contestants run back to back). One torch thread; vLLM's CPU engine in-process
(``enforce_eager=True``, prefix caching on).

- ``vllm generate``: ``llm.generate`` on the env's prompt token ids with the same ``SamplingParams``
  the policy sends (``logprobs=0``, a seed per request, EOS banned, no detokenization).
- ``vllm policy``: ``VLLMPolicy.generate`` on the env's ``WaveRequest`` (request, results to tensors).
- ``vllm collector``: ``TokenCollector(env, VLLMPolicy(...), source="wave", mode="steps")``, one
  batch of 64 steps (one wave, refill, unroll, recorder): what a user gets. The time a collector call
  spends outside ``policy.generate`` (env, unroll, recorder) is reported per wave: on a shared machine it
  is a steadier measure of tokengym's cost than a ratio of two noisy rates.
- ``generate`` / ``stepwise``: ``model.generate`` and the stepwise ``TransformersPolicy`` collector on the
  same weights, for comparison.

The markdown table (date, machine, configuration) is printed at the end of the module.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.collectors.policies.vllm_policy import VLLMPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer

torch.set_num_threads(1)

NEW_TOKENS = 64
ROUNDS = 5
REAL_VOCAB = 151936
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_model_len": 256}
_TABLE: dict = {}
_NAMES = ["vllm generate", "vllm policy", "vllm collector", "generate", "stepwise"]


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    layers: int
    hidden: int
    heads: int  # head size hidden / heads >= 32: vLLM's CPU attention kernels need it
    vocab: int
    B: int

    @property
    def description(self) -> str:
        return f"Qwen2 {self.layers}x{self.hidden} ({self.heads} heads), vocab {self.vocab}; EOS banned ({NEW_TOKENS} tokens)"


CONFIGS = [Config(name, *spec, B=B) for name, spec in (("tiny", (2, 64, 2, 512)), ("small", (4, 256, 4, 2048)),
                                                       ("qwen2-151k", (2, 128, 4, REAL_VOCAB))) for B in (8, 32)]  # fmt: skip
_ENGINES: dict[str, tuple] = {}


def _engine(config: Config, tmp_path_factory):
    """(tokenizer, model, owning VLLMPolicy) per model, shared by both batch sizes."""
    if config.name not in _ENGINES:
        tok = tiny_tokenizer(2048 if config.vocab == 2048 else 512)
        qc = Qwen2Config(vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=2 * config.hidden,
                         num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.heads // 2,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)  # fmt: skip
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(qc).eval()
        model.generation_config.pad_token_id = tok.pad_token_id
        path = tmp_path_factory.mktemp(config.name)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        env = _env(tok, model, config.B)
        _ENGINES[config.name] = (tok, model, VLLMPolicy(str(path), env, engine_kwargs=ENGINE))
    return _ENGINES[config.name]


def _env(tok, model, B: int) -> TokenEnv:
    texts = [f"Question {i}: what is {i} + {2 * i + 3}? Think step by step, then give the final value." for i in range(B)]
    prompts = [tok.decode(tok(t)["input_ids"][:32]) for t in texts]  # ~32 tokens each
    return TokenEnv(prompts, tok, batch_size=B, max_new_tokens=NEW_TOKENS, max_length=256, model_config=model.config)


# -- contestants: each returns a callable that runs one unit of work and returns its real tokens --
def _vllm_generate(tok, model, owner, B):
    env = _env(tok, model, B)
    env.reset()
    prompts = [{"prompt_token_ids": p.tolist()} for p in env.wave_request().prompts]
    from vllm import SamplingParams

    sampling = dict(n=1, logprobs=0, flat_logprobs=True, ignore_eos=True, detokenize=False, temperature=1.0,
                    logit_bias={tok.eos_token_id: -float("inf")}, stop_token_ids=[tok.eos_token_id], max_tokens=NEW_TOKENS)  # fmt: skip
    state = {"seed": 0}

    def run() -> int:
        params = [SamplingParams(**sampling, seed=state["seed"] + i) for i in range(B)]
        state["seed"] += B
        outputs = owner.llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].logprobs.logprobs) == len(o.outputs[0].token_ids) for o in outputs)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return run


def _sampling(tok) -> SamplingConfig:
    return SamplingConfig(banned_token_ids=(tok.eos_token_id,))


def _vllm_policy(tok, model, owner, B):
    env = _env(tok, model, B)
    env.reset()
    request = env.wave_request()
    policy = VLLMPolicy(owner.llm, env, sampling=_sampling(tok))
    return lambda: int(policy.generate(request).lengths.sum())


class _TimedPolicy(VLLMPolicy):
    """Times its ``generate`` calls, so a collector call splits into vLLM generation and the rest."""

    seconds = 0.0

    def generate(self, request):
        start = time.perf_counter()
        try:
            return super().generate(request)
        finally:
            self.seconds += time.perf_counter() - start


def _vllm_collector(tok, model, owner, B, overhead: list):
    env = _env(tok, model, B)
    policy = _TimedPolicy(owner.llm, env, sampling=_sampling(tok))
    batches = iter(TokenCollector(env, policy, mode="steps", batch_size=NEW_TOKENS, source="wave"))

    def run() -> int:
        start, inside = time.perf_counter(), policy.seconds
        tokens = int(next(batches).get(keys.MASK).sum())
        overhead.append(time.perf_counter() - start - (policy.seconds - inside))  # env, unroll, recorder
        return tokens

    return run


def _generate(tok, model, owner, B):
    env = _env(tok, model, B)
    env.reset()
    request = env.wave_request()
    policy = TransformersPolicy(model, env, sampling=_sampling(tok))
    return lambda: int(policy.generate(request).lengths.sum())


def _stepwise(tok, model, owner, B):
    env = _env(tok, model, B)
    policy = TransformersPolicy(model, env, sampling=_sampling(tok))
    batches = iter(TokenCollector(env, policy, mode="steps", batch_size=NEW_TOKENS))
    return lambda: int(next(batches).get(keys.MASK).sum())


CONTESTANTS = {"vllm generate": _vllm_generate, "vllm policy": _vllm_policy, "generate": _generate, "stepwise": _stepwise}


def _median(values) -> float:
    return sorted(values)[len(values) // 2]


@pytest.fixture(scope="module", autouse=True)
def _table(write_uncaptured):
    """Close the engines, then print the table (pytest captures output during teardown: lifted here)."""
    yield
    for _, _, owner in _ENGINES.values():
        owner.close()
    if _TABLE:
        write_uncaptured(_write_table)


def _write_table(write) -> None:
    import vllm

    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    write("")
    write("### vLLM collection throughput (benchmarks/test_vllm_throughput.py)")
    write(f"date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores{load}; torch {torch.__version__} "
          f"({torch.get_num_threads()} thread), vllm {vllm.__version__} (CPU, in-process, eager)")  # fmt: skip
    write("Real tokens/s, median of 5 interleaved rounds, B x 64 new tokens, temperature 1, full vocabulary.")
    write("| config | B | " + " | ".join(_NAMES) + " | collector ÷ vllm generate | policy ÷ vllm generate "
          "| collector ms per wave outside policy.generate (% of the wave) | setup |")
    write("|---" * (len(_NAMES) + 6) + "|")
    for (name, B), (description, rates, ratios, overhead_ms) in _TABLE.items():
        cells = [f"{rates[n]:.0f}" for n in _NAMES] + [f"{ratios[n]:.3f}" for n in ("vllm collector", "vllm policy")]
        wave_ms = 1e3 * B * NEW_TOKENS / rates["vllm collector"]
        cells.append(f"{overhead_ms:.1f} ({100 * overhead_ms / wave_ms:.1f}%)")
        write(f"| {name} | {B} | " + " | ".join(cells) + f" | {description} |")


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c.name}-B{c.B}" for c in CONFIGS])
def test_vllm_throughput(benchmark, tmp_path_factory, config, interleaved):
    tok, model, owner = _engine(config, tmp_path_factory)
    torch.manual_seed(0)
    overhead: list[float] = []
    runs = {name: make(tok, model, owner, config.B) for name, make in CONTESTANTS.items()}
    runs["vllm collector"] = _vllm_collector(tok, model, owner, config.B, overhead)
    runs = {name: runs[name] for name in _NAMES}  # the three vLLM contestants back to back in most rounds
    per_round = interleaved(runs, ROUNDS, benchmark)
    rates = {n: _median(v) for n, v in per_round.items()}
    # ratios of the same round (contestants run back to back), median over rounds: steadier on a shared machine
    base = per_round["vllm generate"]
    ratios = {n: _median([a / b for a, b in zip(per_round[n], base, strict=True)]) for n in per_round}
    overhead_ms = 1e3 * _median(overhead)
    benchmark.extra_info.update({f"tokens_per_s[{n}]": v for n, v in rates.items()})
    benchmark.extra_info.update({f"ratio_to_vllm_generate[{n}]": v for n, v in ratios.items()})
    benchmark.extra_info["collector_overhead_ms_per_wave"] = overhead_ms
    _TABLE[(config.name, config.B)] = (config.description, rates, ratios, overhead_ms)
