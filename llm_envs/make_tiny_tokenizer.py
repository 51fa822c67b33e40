"""Regenerate the tiny tokenizer fixtures ``llm_envs/data/tiny_tokenizer_<vocab>.json``.

The tiny tokenizer is a byte-level BPE trained on a small built-in corpus: the words of the built-in
tasks' prompts (``Numbers: ... Target: ... Expression:``, ``Reverse ...:``, ``a+b=``, the
multi-turn feedback and tool hint), plus seeded arithmetic and word lines. BPE training output
differs across ``tokenizers`` versions, so the trained files are committed and
:func:`~tokengym.llm_envs.tiny_models.tiny_tokenizer` only loads them; this module is run by hand
when the corpus changes (never at import time)::

    python -m tokengym.llm_envs.make_tiny_tokenizer            # rewrites the 512 and 2048 fixtures
    python -m tokengym.llm_envs.make_tiny_tokenizer --vocab 4096

Example:
    >>> train_tiny_tokenizer(512).get_vocab_size()
    512
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokengym.llm_envs.tiny_models import SPECIAL_TOKENS, VOCAB_SIZES

__all__ = ["DATA_DIR", "FIXTURE_SIZES", "corpus", "train_tiny_tokenizer", "write_fixtures"]

DATA_DIR = Path(__file__).resolve().parent / "data"
FIXTURE_SIZES = VOCAB_SIZES

_LINES = [
    "What is 12 + 7? The answer is 19.",
    "Compute 3 * 4 and put the result in \\boxed{12}.",
    "Reverse the string abc: cba. Reverse hello: olleh.",
    "Use the numbers 2 3 5 to reach 10 with + - * /. Answer: 2*5=10",
    "The quick brown fox jumps over the lazy dog.",
    "Question: 45 - 17 = ? Answer: 28. Correct! Wrong, try again.",
    "def add(a, b):\n    return a + b\nprint(add(2, 3))",
    "<tool>calculator: (3 + 4) * 2</tool> result 14",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "user assistant system tool. Think step by step, then answer.",
]

_WORDS = (
    "the a answer is correct wrong try again compute number result sum product difference "
    "reverse string count down reach target use each once think step first then final value "
    "python code tool call output error print return def import for in range if else while"
).split()


def _task_lines(rng: random.Random, n: int) -> list[str]:
    """Prompts and answers of the built-in tasks, as the tasks write them."""
    from tokengym.llm_envs.tasks import (
        TOOL_HINT,
        WRONG_FEEDBACK,
        arithmetic_prompts,
        countdown_prompts,
        reversal_prompts,
    )

    seed = rng.randrange(2**31)
    lines = [p["prompt"] + p["answer"] for p in arithmetic_prompts(n, seed=seed, ops="+-*")]
    lines += [p["prompt"] + " " + p["answer"] for p in countdown_prompts(n, seed=seed)]
    lines += [p["prompt"] + " " + p["answer"] for p in reversal_prompts(n, seed=seed)]
    for p in arithmetic_prompts(n // 4, seed=seed + 1):
        a = p["prompt"].removesuffix("=")
        lines += [p["prompt"] + TOOL_HINT, f"<tool>calculator: {a}</tool>", f"<tool>python: print({a})</tool>",
                  f"{p['answer']} {WRONG_FEEDBACK}"]  # fmt: skip
    return lines


def corpus(seed: int = 0) -> list[str]:
    """The training corpus: fixed lines, the tasks' prompts and seeded arithmetic / word lines."""
    rng = random.Random(seed)
    lines = list(_LINES) + _task_lines(rng, 600)
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        words = " ".join(rng.choice(_WORDS) for _ in range(6))
        lines.append(f"{words} {a} {op} {b} = {value} \\boxed{{{rng.randint(0, 99)}}}")
        lines.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))))
    return lines


def train_tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE on :func:`corpus` (the special tokens of ``tiny_models`` first)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def write_fixtures(sizes=FIXTURE_SIZES, out_dir: Path = DATA_DIR) -> list[Path]:
    """Train one tokenizer per vocabulary size and save each as ``tiny_tokenizer_<size>.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for size in sizes:
        path = out_dir / f"tiny_tokenizer_{size}.json"
        train_tiny_tokenizer(size).save(str(path), pretty=True)
        paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=list(FIXTURE_SIZES), help="vocabulary sizes")
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR)
    args = parser.parse_args()
    for written in write_fixtures(args.vocab, args.out_dir):
        print(written)
