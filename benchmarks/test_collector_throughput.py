"""Collector throughput against ``model.generate``, a hand-written KV-cache loop and TorchRL's LLMCollector.

Every contestant generates ``new_tokens`` tokens per slot (64; 32 with the real vocabulary) and samples from the
same full-vocabulary distribution (temperature 1, no top-k / top-p),
computes the log-prob of each sampled token, and is timed in the same run: one round runs every
contestant once, in an order rotated per round, and a contestant's tokens/s is the median over 3
rounds of the real (non-padding) tokens it produced divided by its time. One torch thread.

- ``generate``: ``model.generate(do_sample=True, top_k=0)``; a logits processor records the log-prob
  of each chosen token (what an RL collector needs). Fixed-length configs suppress EOS with
  ``min_new_tokens``.
- ``hand loop``: prefill (last-position logits only), then per token one cached forward, EOS banned
  in place, tokengym's :func:`sample_tokens` with the default config (the same exact sampler the
  policy uses), append. Variable lengths: rows stop at EOS and the loop ends when all rows ended.
- ``hand loop, inference mode``: the same loop under ``torch.inference_mode()`` instead of ``torch.no_grad()``
  (tokengym's KV cache runs its forwards so): the stricter baseline.
- ``stepwise``: :class:`TokenCollector` + :class:`TransformersPolicy`, one STEPS batch of ``new_tokens``
  steps; finished slots are refilled (variable lengths keep every slot busy).
- ``wave``: generate-then-unroll (``TokenCollector(source="wave")`` or the older ``UnrollCollector``).
- ``torchrl``: ``LLMCollector`` over a ``ChatEnv`` with ``StepCounter(max_steps=1)`` so dialogs do not
  grow, EOS suppressed, real response tokens counted (tiny configs only: it is slow).

``benchmarks/conftest.py`` prints the markdown table (date, machine, configuration) at the end.
"""

from __future__ import annotations

import dataclasses
import inspect
import statistics

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy, sample_tokens
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer

NEW_TOKENS = 64  # per slot; the real-vocabulary configs take half (their generate baseline is slow)
REAL_VOCAB = 151936


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    model: str  # "tiny" | "small" | "qwen2-151k"
    B: int
    eos_count: int = 0  # > 0: that many EOS ids, lengths spread (variable-length config)
    group_size: int = 1
    with_torchrl: bool = False
    new_tokens: int = NEW_TOKENS
    rounds: int = 5  # cheap configs take more rounds: on a shared machine one round can catch a load spike

    @property
    def description(self) -> str:
        model = {"tiny": "tiny Qwen2 2x64, vocab 512", "small": "small Qwen2 4x256, vocab 2048",
                 "qwen2-151k": f"Qwen2 2x128, vocab {REAL_VOCAB}"}[self.model]  # fmt: skip
        if self.eos_count:
            return f"{model}; {self.eos_count} EOS ids (lengths 1-{self.new_tokens}), group {self.group_size}"
        return f"{model}; EOS suppressed ({self.new_tokens} new tokens)"


CONFIGS = [
    Config("tiny", "tiny", 8, with_torchrl=True, rounds=7),
    Config("tiny", "tiny", 32, with_torchrl=True),
    Config("small", "small", 8),
    Config("small", "small", 32, rounds=3),
    Config("qwen2-151k", "qwen2-151k", 8, new_tokens=NEW_TOKENS // 2, rounds=3),
    Config("qwen2-151k", "qwen2-151k", 32, new_tokens=NEW_TOKENS // 2, rounds=3),
    Config("tiny-varlen", "tiny", 16, eos_count=16, group_size=4, rounds=7),
]
_MODELS: dict[str, tuple] = {}


def _model(kind: str):
    if kind not in _MODELS:
        if kind == "qwen2-151k":
            tok = tiny_tokenizer(512)
            config = Qwen2Config(vocab_size=REAL_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)  # fmt: skip
            with torch.random.fork_rng():
                torch.manual_seed(0)
                model = Qwen2ForCausalLM(config).eval()
            model.generation_config.pad_token_id = tok.pad_token_id
        else:
            tok = tiny_tokenizer(512 if kind == "tiny" else 2048)
            model = tiny_model(tok, size=kind)
        _MODELS[kind] = (tok, model)
    return _MODELS[kind]


@dataclasses.dataclass
class Job:
    """What every contestant is asked to do: B slots, ``new_tokens`` each (or until one of ``eos``)."""

    tok: object
    model: object
    prompts: list[str]  # B prompts, groups of ``group_size`` equal prompts
    eos: list[int]
    group_size: int
    is_fixed_length: bool
    new_tokens: int


def _job(config: Config) -> Job:
    tok, model = _model(config.model)
    n = config.B // config.group_size
    texts = [f"Question {i}: what is {i} + {2 * i + 3}? Think step by step, then give the final value." for i in range(n)]
    prompts = [tok.decode(tok(t)["input_ids"][:32]) for t in texts]  # ~32 tokens each
    prompts = [p for p in prompts for _ in range(config.group_size)]
    if config.eos_count:  # many EOS ids in a near-uniform random model: a per-token stop chance of ~3%
        eos = [tok.eos_token_id, *range(300, 300 + config.eos_count - 1)]
    else:
        eos = [tok.eos_token_id]
    return Job(tok, model, prompts, eos, config.group_size, is_fixed_length=not config.eos_count,
               new_tokens=config.new_tokens)


# -- contestants: each returns a callable that runs one unit of work and returns its real tokens --
class _RecordLogProbs(LogitsProcessor):
    """Log-prob of each token ``generate`` picks, from the final scores it sampled from (last processor)."""

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None
        self.log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        self.prev = scores
        return scores

    def take(self, chosen: torch.Tensor) -> None:
        if self.prev is not None:
            picked = self.prev.gather(-1, chosen[:, None]).squeeze(-1)
            self.log_probs.append(picked - self.prev.logsumexp(-1))
            self.prev = None


def _generate(job: Job):
    x = job.tok(job.prompts, return_tensors="pt", padding=True)
    width = x["input_ids"].shape[1]
    fixed = {"min_new_tokens": job.new_tokens} if job.is_fixed_length else {}

    def run() -> int:
        rec = _RecordLogProbs()
        out = job.model.generate(**x, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=job.new_tokens,
                                 eos_token_id=job.eos, pad_token_id=job.tok.pad_token_id,
                                 logits_processor=LogitsProcessorList([rec]), **fixed)  # fmt: skip
        new = out[:, width:]
        rec.take(new[:, -1])
        assert len(rec.log_probs) == new.shape[1]
        return _real_tokens(new, job.eos)

    return run


def _real_tokens(actions: torch.Tensor, eos: list[int]) -> int:
    """Tokens up to and including the first EOS of each row (B, T)."""
    ended = torch.isin(actions, torch.tensor(eos))
    after = (ended.cumsum(1) - ended.long()) > 0  # strictly after the first EOS
    return int((~after).sum())


def _hand_loop(job: Job, *, inference_mode: bool = False):
    """The practical limit: prefill, then one cached forward + the same sampler + append per token.

    ``inference_mode``: the forwards run under ``torch.inference_mode()`` (as tokengym's KV cache runs them) instead
    of ``torch.no_grad()``: ~10% less per forward of the tiny model here, so the stricter baseline."""
    x = job.tok(job.prompts, return_tensors="pt", padding=True)
    eos = torch.tensor(job.eos)
    gen, sampling = torch.Generator().manual_seed(0), SamplingConfig()
    model = job.model
    # the minimal loop asks only for what it uses (older samplers always return the raw log-prob too)
    lean = {"with_raw_log_prob": False} if "with_raw_log_prob" in inspect.signature(sample_tokens).parameters else {}

    grad_off = torch.inference_mode if inference_mode else torch.no_grad

    @grad_off()
    def run() -> int:
        cache, mask = DynamicCache(config=model.config), x["attention_mask"]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=x["input_ids"], attention_mask=mask, position_ids=pos, past_key_values=cache,
                    logits_to_keep=1)  # fmt: skip
        logits, last, lps = out.logits[:, -1], pos[:, -1:], []
        running = torch.ones(len(job.prompts), dtype=torch.bool)
        real = 0
        for _ in range(job.new_tokens):
            if job.is_fixed_length:
                logits[:, eos] = -float("inf")
            tokens, logp, _ = sample_tokens(logits, sampling, gen, **lean)
            lps.append(logp)
            real += int(running.sum())
            if not job.is_fixed_length:
                running &= ~torch.isin(tokens, eos)
                if not bool(running.any()):
                    break
            mask, last = torch.cat([mask, torch.ones_like(last)], 1), last + 1
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=last,
                           past_key_values=cache).logits[:, -1]  # fmt: skip
        return real

    return run


def _wave_collector(env, policy, **kwargs):
    if "source" in inspect.signature(TokenCollector).parameters:
        return TokenCollector(env, policy, source="wave", **kwargs)
    from tokengym.collectors import UnrollCollector

    return UnrollCollector(env, policy, **kwargs)


def _collector(job: Job, *, is_wave: bool, max_length: int = 256):
    B = len(job.prompts)
    distinct = job.prompts[:: job.group_size]
    env = TokenEnv(distinct, job.tok, batch_size=B, max_new_tokens=job.new_tokens, group_size=job.group_size,
                   eos_token_ids=job.eos, model_config=job.model.config, max_length=max_length)  # fmt: skip
    banned = tuple(job.eos) if job.is_fixed_length else ()
    policy = TransformersPolicy(job.model, env, sampling=SamplingConfig(banned_token_ids=banned))
    make = _wave_collector if is_wave else TokenCollector
    return make(env, policy, mode="steps", batch_size=job.new_tokens)


def _tokengym(job: Job, *, is_wave: bool):
    batches = iter(_collector(job, is_wave=is_wave))
    return lambda: int(next(batches).get(keys.MASK).sum())


def _torchrl(job: Job):
    from torchrl.collectors.llm import LLMCollector
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv
    from torchrl.envs.llm.transforms import DataLoadingPrimer
    from torchrl.modules.llm import TransformersWrapper

    B, prompts = len(job.prompts), job.prompts

    class _Prompts:
        batch_size = B

        def __iter__(self):
            while True:
                yield {"query": prompts}

    env = ChatEnv(batch_size=(B,), tokenizer=job.tok, input_mode="history")
    env = env.append_transform(DataLoadingPrimer(dataloader=_Prompts(), batch_size=(B,)))
    env = env.append_transform(StepCounter(max_steps=1))  # one turn per dialog: prompts do not grow
    # top_k=0 is rejected by the wrapper; the model's generation config has no top-k (full vocabulary)
    assert not job.model.generation_config.top_k
    policy = TransformersWrapper(job.model, tokenizer=job.tok, input_mode="history", generate=True,
                                 return_log_probs=True,
                                 generate_kwargs={"max_new_tokens": job.new_tokens, "min_new_tokens": job.new_tokens,
                                                  "do_sample": True, "temperature": 1.0, "top_p": 1.0})  # fmt: skip
    batches = iter(LLMCollector(env, policy=policy, dialog_turns_per_batch=B))

    def run() -> int:
        batch = next(batches)
        return sum(t.numel() for t in _leaves(batch.get(("tokens", "response"), as_list=True)))

    return run


def _leaves(nested):
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [t for item in nested for t in _leaves(item)]


# (numerator, denominator) pairs printed as ratios beside the tokens/s columns
RATIOS = [("stepwise", "hand loop"), ("stepwise", "hand loop, inference mode"), ("stepwise", "generate"),
          ("wave", "generate"), ("stepwise", "torchrl")]  # fmt: skip
CONTESTANTS = {
    "generate": _generate,
    "hand loop": _hand_loop,
    "hand loop, inference mode": lambda job: _hand_loop(job, inference_mode=True),
    "stepwise": lambda job: _tokengym(job, is_wave=False),
    "wave": lambda job: _tokengym(job, is_wave=True),
    "torchrl": _torchrl,
}


# torchrl's LLM stack builds a loss with deprecated torch arguments at import time
@pytest.mark.filterwarnings("ignore:size_average and reduce args:UserWarning")
@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c.name}-B{c.B}" for c in CONFIGS])
def test_collector_throughput(benchmark, throughput_table, config, interleaved):
    job = _job(config)
    torch.manual_seed(0)
    runs = {n: make(job) for n, make in CONTESTANTS.items() if n != "torchrl" or config.with_torchrl}
    rates = interleaved(runs, config.rounds, benchmark)
    medians = {n: statistics.median(v) for n, v in rates.items()}
    benchmark.extra_info.update({f"tokens_per_s[{n}]": v for n, v in medians.items()})
    # a ratio is the median of the per-round ratios: contestants of one round ran back to back, under one load
    ratios = {(a, b): statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))
              for a, b in RATIOS if a in rates and b in rates}  # fmt: skip
    throughput_table[(config.name, config.B)] = (f"{config.description}; {config.rounds} rounds", medians, ratios)


@pytest.mark.parametrize("max_length", [128, 1024])
def test_bytes_per_step(benchmark, bytes_table, max_length):
    """Bytes a collected STEPS batch stores per env step and slot: the same for any buffer length."""
    batches = iter(_collector(_job(CONFIGS[0]), is_wave=False, max_length=max_length))
    batch = benchmark.pedantic(lambda: next(batches), rounds=2, warmup_rounds=1)
    stored = sum(v.numel() * v.element_size() for v in batch.values(True, True) if isinstance(v, torch.Tensor))
    per_step = stored / batch.numel()
    benchmark.extra_info["bytes_per_step"] = per_step
    bytes_table[max_length] = per_step
