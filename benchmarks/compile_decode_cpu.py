"""The decodes of TransformersPolicy on the CPU against the hand-written KV-cache loop: ``"dynamic"`` (the default),
``"static"`` (the fixed-shape step) and ``"compile"`` (that step through ``torch.compile``, Inductor's C++ kernels).

    python benchmarks/compile_decode_cpu.py          # prints one line per configuration

Every contestant generates 64 tokens per slot from ~32-token prompts with the end id banned, samples the full
vocabulary at temperature 1 with tokengym's ``sample_tokens`` and counts real tokens; the collectors use
``max_length=256`` (the static buffers: 320 columns). One warm-up round (the compiled policy compiles before it,
timed apart), then 5 rounds, each running every contestant once in an order rotated per round; tokens/s is the
median over the rounds, a ratio the median of the per-round ratios to the hand loop. One torch thread.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # the hand loop and the jobs of the throughput suite
import test_collector_throughput as throughput  # noqa: E402

from tokengym.collectors import TokenCollector  # noqa: E402
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy  # noqa: E402
from tokengym.llm_envs import TokenEnv, keys  # noqa: E402

CONFIGS = [("tiny", 8), ("tiny", 32), ("small", 8), ("small", 32)]
DECODES = ("dynamic", "static", "compile")
ROUNDS = 5


def stepwise(job, decode: str):
    """One STEPS batch of ``new_tokens`` env steps of a policy with ``decode``; returns its real tokens."""
    B = len(job.prompts)
    env = TokenEnv(job.prompts, job.tok, batch_size=B, max_new_tokens=job.new_tokens, eos_token_ids=job.eos,
                   model_config=job.model.config, max_length=256)  # fmt: skip
    policy = TransformersPolicy(job.model, env, sampling=SamplingConfig(banned_token_ids=tuple(job.eos)), decode=decode)
    batches = iter(TokenCollector(env, policy, mode="steps", batch_size=job.new_tokens))
    return lambda: int(next(batches).get(keys.MASK).sum())


def main() -> None:
    torch.set_num_threads(1)
    for model, B in CONFIGS:
        job = throughput._job(throughput.Config(model, model, B))
        runs = {"hand loop": throughput._hand_loop(job), **{d: stepwise(job, d) for d in DECODES}}
        begin = time.perf_counter()
        runs["compile"]()
        print(f"{model} B={B}: the compiled policy's first batch (its compile included) {time.perf_counter() - begin:.1f} s")
        names, rates = list(runs), {n: [] for n in runs}
        for r in range(ROUNDS + 1):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                begin = time.perf_counter()
                tokens = runs[name]()
                if r:  # round 0 warms up
                    rates[name].append(tokens / (time.perf_counter() - begin))
        cells = []
        for name in names:
            ratio = statistics.median(a / b for a, b in zip(rates[name], rates["hand loop"], strict=True))
            cells.append(f"{name} {statistics.median(rates[name]):,.0f} tok/s ({ratio:.2f}x)")
        print(f"{model} B={B}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
