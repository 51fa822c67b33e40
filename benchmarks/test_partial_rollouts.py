"""Partial rollouts: a trainer publishing weights every batch to a wave collector, against the same with the update
waiting for the wave's end and with the interrupted trajectories restarted from their prompts (``in_flight="drop"``).

Configuration: the small tiny Qwen2 (4 layers x 256, vocabulary 2,048), ``TransformersPolicy`` waves
(``source="wave"``), B = 16 slots, groups of 4, 96 new tokens per trajectory at most, TRAJECTORIES batches of 16
under ``AsyncCollector(max_staleness=2, stale_tokens="mask")`` (nothing dropped at hand-out), one torch thread. Each
contestant collects 6 batches per round and the trainer publishes new weights after each (a copy of the weights,
moved a little), taking no time to train; 3 interleaved rounds after a warm-up, medians. Measured per update (the collectors' metrics): the seconds from the
publish to the collector generating under the new weights (``update_wait_s``), the tokens generated and then
discarded, the seconds the generator waited at the staleness bound; and tokens/s (real tokens) against the same collection without
updates. Prints a markdown table at the end.
"""

from __future__ import annotations

import copy
import datetime
import platform
import statistics
import time

import pytest
import torch
from _publishing import CONTESTANTS, moved_weights

from tokengym.collectors import AsyncCollector, CollectorOptions, TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer

ROUNDS, BATCHES = 3, 6
PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]
_LINES: list[str] = []  # the tables, printed at the end of the module


def _run(tok, model, partial: bool, in_flight: str, publish: bool) -> dict:
    env = TokenEnv(PROMPTS, tok, batch_size=16, max_new_tokens=96, max_length=128, group_size=4)
    policy = TransformersPolicy(copy.deepcopy(model), env, seed=0)
    inner = TokenCollector(env, policy, mode="trajectories", batch_size=16, source="wave",
                           options=CollectorOptions(partial_rollouts=partial, in_flight=in_flight))  # fmt: skip
    tokens = 0
    start = time.perf_counter()
    with AsyncCollector(inner, max_staleness=2, stale_tokens="mask") as collector:
        for i, batch in enumerate(collector):
            tokens += int(batch[keys.MASK].sum())
            if publish:  # the trainer takes no time: the collector is generating when the weights arrive
                collector.update_policy_weights_(moved_weights(model, i))
            if i == BATCHES - 1:
                break
        seconds = time.perf_counter() - start
        metrics = dict(collector.metrics)
    updates = max(int(metrics["weight_updates"]), 1)
    return {"latency_s": metrics["update_wait_s"] / updates if publish else float("nan"),
            "discarded": metrics["dropped_tokens"] / updates, "interrupted": metrics["interrupted_sequences"] / updates,
            "idle_s": metrics["collector_wait_s"] / updates, "tokens_per_s": tokens / seconds,
            "masked": metrics["masked_stale_tokens"]}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _report(write_uncaptured):
    yield
    if _LINES:
        write_uncaptured(lambda write: [write(line) for line in _LINES])


def test_partial_rollouts_against_wave_boundary_updates():
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    results: dict[str, list[dict]] = {name: [] for name in CONTESTANTS}
    names = list(CONTESTANTS)
    for r in range(ROUNDS + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # order rotated per round
            out = _run(tok, model, *CONTESTANTS[name])
            if r:  # round 0 warms up
                results[name].append(out)
    med = {n: {k: statistics.median(o[k] for o in outs) for k in outs[0]} for n, outs in results.items()}
    ratios = {n: statistics.median(o["tokens_per_s"] / b["tokens_per_s"] for o, b in
                                   zip(results[n], results["no updates"], strict=True)) for n in names}  # fmt: skip
    _LINES.extend(["", f"Partial rollouts, {datetime.date.today().isoformat()}, {platform.machine()}, torch "
                   f"{torch.__version__}, small tiny Qwen2, B=16, <= 96 new tokens, {BATCHES} batches x {ROUNDS} "
                   "interleaved rounds, medians", "",
                   "| contestant | publish -> new weights, ms | tokens discarded / update | sequences interrupted / "
                   "update | generator idle / update, ms | tokens/s | ÷ no updates |", "|---|---|---|---|---|---|---|"])  # fmt: skip
    for n in names:
        m = med[n]
        _LINES.append(f"| {n} | {m['latency_s'] * 1e3:.1f} | {m['discarded']:.1f} | {m['interrupted']:.1f} | "
                      f"{m['idle_s'] * 1e3:.1f} | {m['tokens_per_s']:,.0f} | {ratios[n]:.3f} |")
    partial, boundary, drop = med["partial rollouts"], med["update at the wave's end"], med["interrupted, in_flight='drop'"]
    assert partial["discarded"] == 0 and partial["interrupted"] > 0
    assert drop["discarded"] > 0
    assert partial["latency_s"] < boundary["latency_s"]  # the update lands mid-wave, not at its end



def _tails_run(tok, model, over: bool) -> float:
    """Real tokens/s of 4 TRAJECTORIES batches of 16 from 32 slots, response lengths spread by many end ids."""
    env = TokenEnv(PROMPTS, tok, batch_size=32, max_new_tokens=128, max_length=160, group_size=4,
                   eos_token_ids=list(range(1, 512, 23)))  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=16,
                               source="wave", options=CollectorOptions(over_sampling=over))  # fmt: skip
    start, tokens = time.perf_counter(), 0
    for i, batch in enumerate(collector):
        tokens += int(batch[keys.MASK].sum())
        if i == 3:
            break
    return tokens / (time.perf_counter() - start)


def test_over_sampling_carries_long_tails():
    """Waves that stop once the batch can be filled (the long rows go on in the next wave) against whole waves."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    rates: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for r in range(ROUNDS + 1):
            for over in (True, False) if r % 2 == 0 else (False, True):
                rate = _tails_run(tok, model, over)
                if r:
                    rates[over].append(rate)
    ratio = statistics.median(a / b for a, b in zip(rates[True], rates[False], strict=True))
    lines = ["", f"Over-sampling, {datetime.date.today().isoformat()}, small tiny Qwen2, 32 slots, batches of 16 "
             f"(groups of 4), <= 128 new tokens, lengths spread by 22 end ids, 4 batches x {ROUNDS} interleaved rounds", "",
             "| waves | tokens/s | ÷ whole waves |", "|---|---|---|",
             f"| stop once the batch can be filled | {statistics.median(rates[True]):,.0f} | {ratio:.3f} |",
             f"| whole waves | {statistics.median(rates[False]):,.0f} | 1.000 |"]  # fmt: skip
    _LINES.extend(lines)
    assert ratio > 0  # a measurement: the table says which way it goes
