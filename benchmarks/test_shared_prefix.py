"""Prefix-shared training layout: one GRPOLoss forward+backward, SharedPrefixActor ÷ PaddedSequenceActor.

One group of G = 8 samples, a prompt of P = 512 or 2048 tokens, R = 128 response tokens each, float32, one thread:
the "small" tiny Qwen2 (4 layers x 256, vocabulary 2,048) at both P, and (marked ``slow``) a 2 x 128 Qwen2 with the
real vocabulary (151,936) at P = 512. Both actors read the same ``to_padded`` layout; the step is
``GRPOLoss(actor)(padded).loss_objective.backward()`` (the shared actor builds its layout inside the step).

- time: median seconds per step over interleaved rounds (the two actors in a rotated order each round); the ratio is
  the median of the per-round ratios.
- peak memory: the rise of the peak RSS (``VmHWM``, reset first) over one step in a fresh process per case (torch's
  CPU allocations are invisible to ``tracemalloc``). Beside it, computed: one vocabulary-sized float32 tensor of
  each actor (the padded actor and its loss hold several (N, L, V) ones; the shared actor's distribution works on its
  (M·S, V) packed logits) and the (M, 1, S, S) boolean block mask.
- work: forward+backward FLOPs from the model's shapes (6 x multiply-adds): per token the projections, MLP and output
  layer; per attended (query, key) pair the score and value products. The padded rows have no padding, so SDPA runs
  its causal kernel (mask None, ``is_causal``) and skips the blocks above the diagonal: N·L(L+1)/2 pairs; the shared
  layout's dense block mask computes all M·S² pairs. The issue's "0.72x" is dense against dense (N·L²), what a padded
  batch with any padding runs (a 4-D mask).

Run: ``.venv/bin/python -m pytest benchmarks/test_shared_prefix.py --benchmark-only -s`` (about 4 minutes on 2 cores;
``-m "not slow"``: the small model alone, about 2 minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

G, R, REAL_VOCAB = 8, 128, 151_936
CASES = [("small", 512, 5), ("small", 2048, 3),
         pytest.param("qwen2-151k", 512, 1, marks=pytest.mark.slow)]  # fmt: skip
_CONTESTANTS = ("padded", "shared")


def _setup(kind: str, prompt_len: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
    from tokengym.transforms import GroupAdvantage, to_padded

    torch.set_num_threads(1)
    tok = tiny_tokenizer(2048)
    if kind == "small":
        model = tiny_model(tok, size="small", max_positions=prompt_len + R + 64)
    else:  # the Qwen2 vocabulary on a 2 x 128 model, as in test_collector_throughput.py
        config = Qwen2Config(vocab_size=REAL_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=prompt_len + R + 64,
                             tie_word_embeddings=True, pad_token_id=tok.pad_token_id)  # fmt: skip
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config).eval()
    batch = make_trajectory_batch([R] * G, group_size=G, prompt_len=prompt_len, vocab=2048, steps=R)
    return model, to_padded(GroupAdvantage("grpo")(batch))


def _step_fn(model, name: str):
    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors.policies import PaddedSequenceActor, SharedPrefixActor

    actor = (SharedPrefixActor if name == "shared" else PaddedSequenceActor)(model)
    loss = GRPOLoss(actor, entropy_bonus=False)

    def step(padded) -> None:
        model.zero_grad(set_to_none=True)
        loss(padded.clone()).loss_objective.backward()

    return step


def _peak_rss_mb(name: str, kind: str, prompt_len: int) -> float:
    """The rise of the peak RSS over one step, in a fresh process (after the model and the batch are built)."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_shared_prefix as b; "
            f"print(b.peak_child({name!r}, {kind!r}, {prompt_len}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def peak_child(name: str, kind: str, prompt_len: int) -> float:
    """In the child process: MiB the peak RSS rises by over one step (Linux: the peak is reset to the current RSS
    through ``/proc/self/clear_refs`` first, so import-time peaks do not hide the step's)."""
    model, padded = _setup(kind, prompt_len)
    step = _step_fn(model, name)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    step(padded)
    return (_status_kib("VmHWM") - before) / 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def _work(config, tokens: int, pairs: int) -> float:
    """Forward+backward FLOPs: 6 x (multiply-adds per token x tokens + per attended pair x pairs)."""
    h, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // heads)
    per_token = layers * (2 * h * h + 2 * h * kv + 3 * h * config.intermediate_size) + h * config.vocab_size
    return 6.0 * (tokens * per_token + pairs * layers * 2 * h)


def _analytic(model, padded) -> dict:
    from tokengym.llm_envs import keys
    from tokengym.transforms import to_shared_prefix

    n, length = padded[keys.TOKENS].shape
    packs, width = to_shared_prefix(padded).tokens.shape
    causal = bool(padded[keys.ATTENTION_MASK].all())  # no padding: SDPA's causal kernel
    padded_pairs = n * length * (length + 1) // 2 if causal else n * length * length
    shared_pairs = packs * width * width
    vocab = model.config.vocab_size
    return {"tokens": packs * width / (n * length), "pairs_vs_kernel": shared_pairs / padded_pairs,
            "pairs_vs_dense": shared_pairs / (n * length * length),
            "work": _work(model.config, packs * width, shared_pairs) / _work(model.config, n * length, padded_pairs),
            "logits_mb": (n * length * vocab * 4 / 2**20, packs * width * vocab * 4 / 2**20),
            "mask_mb": packs * width * width / 2**20, "shape": f"{n}x{length} -> {packs}x{width}"}  # fmt: skip


@pytest.fixture(scope="module")
def table(write_uncaptured):
    rows: dict = {}
    yield rows
    if rows:
        write_uncaptured(lambda write: _write_table(write, rows))


def _write_table(write, rows: dict) -> None:
    import os

    import transformers

    machine = (f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; torch {torch.__version__} "
               f"({torch.get_num_threads()} thread), transformers {transformers.__version__}")  # fmt: skip
    write("")
    write("### Prefix-shared training layout (benchmarks/test_shared_prefix.py)")
    write(f"machine: {machine}; float32; G = {G}, R = {R}, one group; small: the tiny Qwen2 4 x 256, vocabulary "
          f"2,048; qwen2-151k: 2 x 128, vocabulary {REAL_VOCAB:,}")  # fmt: skip
    write("| model | P | padded -> packed | tokens | attn pairs ÷ padded's causal kernel | ÷ padded dense | work ratio | "
          "padded s | shared s | time ratio | time ÷ work | peak RSS padded MiB | shared MiB | RSS ratio | "
          "one logits tensor MiB padded / shared | block mask MiB |")  # fmt: skip
    write("|---" * 16 + "|")
    for (kind, p), r in rows.items():
        a = r["analytic"]
        write(f"| {kind} | {p} | {a['shape']} | {a['tokens']:.2f} | {a['pairs_vs_kernel']:.2f} | {a['pairs_vs_dense']:.2f} | "
              f"{a['work']:.2f} | {r['s']['padded']:.2f} | {r['s']['shared']:.2f} | {r['ratio']:.2f} | "
              f"{r['ratio'] / a['work']:.2f} | {r['rss']['padded']:.0f} | {r['rss']['shared']:.0f} | "
              f"{r['rss']['shared'] / r['rss']['padded']:.2f} | {a['logits_mb'][0]:.0f} / {a['logits_mb'][1]:.0f} | "
              f"{a['mask_mb']:.0f} |")  # fmt: skip


@pytest.mark.parametrize(("kind", "prompt_len", "rounds"), CASES)
def test_shared_prefix_forward_backward(benchmark, table, kind, prompt_len, rounds):
    model, padded = _setup(kind, prompt_len)
    steps = {name: _step_fn(model, name) for name in _CONTESTANTS}
    seconds: dict[str, list[float]] = {name: [] for name in _CONTESTANTS}
    for name in _CONTESTANTS:  # warm-up
        steps[name](padded)
    state = {"round": 0}

    def one_round() -> None:
        r = state["round"]
        state["round"] += 1
        for name in _CONTESTANTS[r % 2 :] + _CONTESTANTS[: r % 2]:
            start = time.perf_counter()
            steps[name](padded)
            seconds[name].append(time.perf_counter() - start)

    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    ratios = sorted(s / p for s, p in zip(seconds["shared"], seconds["padded"], strict=True))
    row = {"s": {n: sorted(v)[len(v) // 2] for n, v in seconds.items()}, "ratio": ratios[len(ratios) // 2],
           "rss": {n: _peak_rss_mb(n, kind, prompt_len) for n in _CONTESTANTS}, "analytic": _analytic(model, padded)}  # fmt: skip
    table[(kind, prompt_len)] = row
    benchmark.extra_info.update(json.loads(json.dumps(row, default=str)))
    assert row["ratio"] < 1.0
