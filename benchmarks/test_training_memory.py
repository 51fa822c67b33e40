"""Peak memory and time of one GRPO training step: chunked log-probs against whole logits, and token-budget
micro-batches as the batch and the sequence grow.

The model is Qwen2's vocabulary (151,936) on a 2 x 128 Qwen2 (float32, one torch thread): the logits dominate, as they
do for a 0.5B model on a GPU. Each measurement runs in a fresh process: the peak resident set over one
:func:`~tokengym.training.train_step` (``/proc/self/clear_refs`` resets the high-water mark after the model and the
batch are built), and the step's seconds (a second step, after a first that warms the allocator). The whole-logits
contestant is the same actor with ``full_logits=True`` (what every actor did before chunking).

Run: ``pytest benchmarks/test_training_memory.py --benchmark-only -q -s`` (about 10 minutes here); the 1,024-token
row is marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REAL_VOCAB, PROMPT = 151_936, 32


def _setup(rows: int, new_tokens: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tokengym.testing import make_trajectory_batch
    from tokengym.transforms import GroupAdvantage, to_padded

    torch.set_num_threads(1)
    config = Qwen2Config(vocab_size=REAL_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
                         max_position_embeddings=PROMPT + new_tokens + 8)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).eval()
    lengths = [new_tokens - (i * 7) % max(1, new_tokens // 4) for i in range(rows)]  # uneven, as responses are
    batch = make_trajectory_batch(lengths, group_size=8, prompt_len=PROMPT - 2, vocab=REAL_VOCAB, steps=new_tokens)
    return model, to_padded(GroupAdvantage("grpo")(batch))


def child(rows: int, new_tokens: int, full_logits: bool, max_tokens: int | None, checkpointing: bool,
          warm_up: bool = True) -> dict:  # fmt: skip
    """In the child process: one warm-up step, then the peak RSS rise and the seconds of a second step (``warm_up``
    False: of the first step, whose peak includes the allocator's warm-up: an upper bound of a later step's)."""
    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors.policies import PaddedSequenceActor
    from tokengym.training import TrainOptions, train_step

    model, padded = _setup(rows, new_tokens)
    loss = GRPOLoss(PaddedSequenceActor(model, full_logits=full_logits), entropy_bonus=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # no optimizer state: the step's own memory
    options = TrainOptions(micro_batch_tokens=max_tokens, gradient_checkpointing=checkpointing)
    if warm_up:
        train_step(padded.clone(), loss, optimizer, options=options)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    train_step(padded.clone(), loss, optimizer, options=options)
    seconds = time.perf_counter() - start
    return {"rise_mib": (_status_kib("VmHWM") - before) / 1024, "peak_mib": _status_kib("VmHWM") / 1024,
            "s": seconds}  # fmt: skip


def _gradient_mib() -> float:
    """The size of the model's largest gradient (the tied embedding's), MiB."""
    return REAL_VOCAB * 128 * 4 / 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def measure(rows: int, new_tokens: int, *, full_logits: bool = False, max_tokens: int | None = None,
            checkpointing: bool = False, warm_up: bool = True) -> dict:  # fmt: skip
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_training_memory as b; "
            f"print(json.dumps(b.child({rows}, {new_tokens}, {full_logits}, {max_tokens}, {checkpointing}, {warm_up})))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def table(write_uncaptured):
    rows: list = []
    yield rows
    if rows:
        write_uncaptured(lambda write: _write(write, rows))


def _write(write, rows: list) -> None:
    import os

    import transformers

    write("")
    write("### Training memory (benchmarks/test_training_memory.py)")
    write(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; torch {torch.__version__} (1 thread), "
          f"transformers {transformers.__version__}; Qwen2 2 x 128, vocabulary {REAL_VOCAB:,}, float32; "
          f"GRPOLoss(PaddedSequenceActor), prompts of {PROMPT} tokens, one step after a warm-up, fresh process each")  # fmt: skip
    write("| study | rows x new tokens | log-probs | token budget | checkpointing | peak RSS rise MiB | peak RSS MiB | s |")
    write("|---" * 8 + "|")
    for study, (n, t), r, kind, budget, ckpt in rows:
        write(f"| {study} | {n} x {t} | {kind} | {budget or '-'} | {'on' if ckpt else 'off'} | {r['rise_mib']:.0f} | "
              f"{r['peak_mib']:.0f} | {r['s']:.2f} |")  # fmt: skip


def test_peak_is_flat_as_the_batch_grows_at_a_token_budget(benchmark, table):
    """Rows 16 -> 128 at 128 new tokens, 2,560 padded tokens per micro-batch (16 rows fit in one, 128 take eight): from
    the first batch that is split (32 rows) to one 4x as large, the peak stays within 10%.

    16 rows are one micro-batch, and their peak is one gradient lower: with several micro-batches the gradient
    accumulated so far lives beside the next one's activations (here the tied 151,936 x 128 embedding's, 74 MiB), a
    step of the parameters' size, once, whatever the batch; the table shows it."""
    peaks = {}
    for n in (16, 32, 64, 128):
        r = measure(n, 128, max_tokens=2560)
        peaks[n] = r["rise_mib"]
        table.append(("batch grows", (n, 128), r, "chunked", 2560, False))
    benchmark.extra_info["peaks_mib"] = peaks
    benchmark.pedantic(lambda: None, rounds=1)
    assert peaks[128] <= 1.10 * peaks[32] + 16, peaks
    assert peaks[32] - peaks[16] <= 2 * _gradient_mib() + 16, peaks  # the one step: a gradient, not the batch


def test_chunked_against_whole_logits_as_the_sequence_grows(benchmark, table):
    """8 rows, 128 -> 512 new tokens: whole logits grow with L x V, chunks do not."""
    for t in (128, 256, 512):
        for full in (True, False):
            r = measure(8, t, full_logits=full)
            table.append(("sequence grows", (8, t), r, "whole" if full else "chunked", None, False))
    benchmark.pedantic(lambda: None, rounds=1)


def test_chunked_time_against_whole_logits(benchmark, table):
    """Seconds per step at equal micro-batches (none) at 8 x 256, in one process: 5 interleaved rounds after a warm-up
    of each, the median of the per-round ratios."""
    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors.policies import PaddedSequenceActor
    from tokengym.training import train_step

    model, padded = _setup(8, 256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    losses = {full: GRPOLoss(PaddedSequenceActor(model, full_logits=full), entropy_bonus=False) for full in (True, False)}
    times: dict = {True: [], False: []}
    for round_ in range(6):
        for full in ((True, False) if round_ % 2 else (False, True)):
            start = time.perf_counter()
            train_step(padded.clone(), losses[full], optimizer)
            if round_:
                times[full].append(time.perf_counter() - start)
    ratios = sorted(c / w for c, w in zip(times[False], times[True], strict=True))
    benchmark.extra_info["chunked_over_whole"] = ratios
    table.append(("time", (8, 256), {"rise_mib": float("nan"), "peak_mib": float("nan"), "s": ratios[len(ratios) // 2]},
                  f"chunked ÷ whole, median of 5 rounds (range {ratios[0]:.2f}-{ratios[-1]:.2f})", None, False))  # fmt: skip
    benchmark.pedantic(lambda: None, rounds=1)


@pytest.mark.slow
def test_a_thousand_new_tokens_at_64_rows_fits_in_2_gb(benchmark, table):
    """[64, 1056] (1,024 new tokens): whole logits would take 64 x 1056 x 151,936 x 4 B = 41 GB. The first step is
    measured (no warm-up step: a step takes minutes here); its peak, allocator warm-up included, bounds a later one's."""
    r = measure(64, 1024, max_tokens=4224, checkpointing=True, warm_up=False)
    table.append(("long", (64, 1024), r, "chunked", 4224, True))
    benchmark.pedantic(lambda: None, rounds=1)
    assert r["peak_mib"] < 2048, r
