"""Offline tiny causal LMs and tokenizers for tests, examples, the demo and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained at run time on a small built-in
corpus, and the models are random-init transformers models built from a config.

Example:
    >>> tok = tiny_tokenizer()
    >>> tok.decode(tok("12+7=")["input_ids"])
    '12+7='
    >>> model = tiny_model(tok, family="qwen2", size="tiny")
    >>> model.config.vocab_size == len(tok)
    True
"""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

__all__ = ["tiny_tokenizer", "tiny_model", "tiny_reward_model", "CHAT_TEMPLATE", "SIZES", "FAMILIES"]

PAD, EOS, BOS = "<|pad|>", "<|endoftext|>", "<|bos|>"
USER, ASSISTANT, SYSTEM, TOOL, END_TURN = "<|user|>", "<|assistant|>", "<|system|>", "<|tool|>", "<|end|>"
SPECIAL_TOKENS = [PAD, EOS, BOS, USER, ASSISTANT, SYSTEM, TOOL, END_TURN]

# role markers are special tokens, so a turn boundary is one token id (cheap to detect)
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_CORPUS = [
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


def _corpus() -> list[str]:
    """The built-in corpus plus seeded synthetic lines, so BPE can learn up to ~2k merges."""
    import random

    rng = random.Random(0)
    lines = list(_CORPUS)
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        words = " ".join(rng.choice(_WORDS) for _ in range(6))
        lines.append(f"{words} {a} {op} {b} = {eval(f'{a}{op}{b}')} \\boxed{{{rng.randint(0, 99)}}}")
        lines.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9))))
    return lines


SIZES = {
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 512},
    "small": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 2048},
}
FAMILIES = ("qwen2", "gpt2")


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Build a byte-level BPE tokenizer offline, with pad/eos tokens and a chat template.

    Args:
        vocab_size: target vocabulary size (the corpus is small, so the result may be smaller;
            256 byte tokens and the special tokens are always present).
    """
    if not isinstance(vocab_size, int) or vocab_size < 300:
        raise ValueError(f"vocab_size must be an int >= 300 (256 bytes + specials), got {vocab_size!r}")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _qwen2_config(vocab: int, spec: dict, tok: PreTrainedTokenizerFast, max_positions: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=spec["hidden"],
        intermediate_size=spec["hidden"] * 2,
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )


def _gpt2_config(vocab: int, spec: dict, tok: PreTrainedTokenizerFast, max_positions: int) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab,
        n_embd=spec["hidden"],
        n_layer=spec["layers"],
        n_head=spec["heads"],
        n_positions=max_positions,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )


def _config(tokenizer, family: str, size: str, max_positions: int):
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    make = _qwen2_config if family == "qwen2" else _gpt2_config
    return make(len(tokenizer), SIZES[size], tokenizer, max_positions)


def tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    family: str = "qwen2",
    size: str = "tiny",
    seed: int = 0,
    max_positions: int = 2048,
) -> PreTrainedModel:
    """Build a random-init causal LM whose vocabulary matches ``tokenizer`` (eval mode, float32).

    Args:
        tokenizer: e.g. from :func:`tiny_tokenizer`.
        family: ``"qwen2"`` or ``"gpt2"``.
        size: ``"tiny"`` (2 layers x 64) or ``"small"`` (4 layers x 256).
        seed: seed for the random init.
        max_positions: context limit written to the config.
    """
    config = _config(tokenizer, family, size, max_positions)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = (Qwen2ForCausalLM if family == "qwen2" else GPT2LMHeadModel)(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval()


def tiny_reward_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0) -> PreTrainedModel:
    """Build a random-init Qwen2 sequence-classification model with one label (a reward model)."""
    config = _config(tokenizer, "qwen2", "tiny", 2048)
    config.num_labels = 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
    return model.eval()
