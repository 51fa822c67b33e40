"""Offline tiny causal LMs and tokenizers for tests, examples, the demo and benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE loaded from a committed fixture (trained
on the built-in tasks' words by :mod:`tokengym.llm_envs.make_tiny_tokenizer`), and the models are
random-init transformers models built from a config.

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
from importlib import resources

import torch
from tokenizers import Tokenizer
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

__all__ = ["tiny_tokenizer", "tiny_model", "tiny_reward_model", "CHAT_TEMPLATE", "TOOL_CHAT_TEMPLATE", "SIZES", "FAMILIES",
           "VOCAB_SIZES"]  # fmt: skip

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

# Qwen2.5's tool-use template in the tiny tokenizer's role markers: tool schemas in the system turn, Hermes
# <tool_call> JSON in assistant turns, consecutive tool results in one <|tool|> turn (set tokenizer.chat_template)
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\nCall tools as "
    "<tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|end|>"
    "{%- elif messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' or (m['role'] == 'system' and not loop.first) or (m['role'] == 'assistant' and "
    "not (m['tool_calls'] is defined and m['tool_calls'])) %}{{ '<|' + m['role'] + '|>' + (m['content'] or '') + '<|end|>' }}"
    "{%- elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}{% for tc in m['tool_calls'] %}"
    "{% set f = tc['function'] if tc['function'] is defined else tc %}<tool_call>\n{\"name\": \"{{ f['name'] }}\", "
    "\"arguments\": {{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|end|>"
    "{%- elif m['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|tool|>{% endif %}"
    "<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|end|>{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

SIZES = {
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 512},
    "small": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "vocab": 2048},
}
FAMILIES = ("qwen2", "gpt2")
VOCAB_SIZES = (512, 2048)  # tokenizer fixtures in llm_envs/data/


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    return (resources.files("tokengym.llm_envs") / "data" / f"tiny_tokenizer_{vocab_size}.json").read_text("utf-8")


def tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Load the offline byte-level BPE tokenizer, with pad/eos tokens and a chat template.

    The tokenizer is a committed fixture (``llm_envs/data/tiny_tokenizer_<vocab_size>.json``), so it
    is the same with every ``tokenizers`` version; ``python -m tokengym.llm_envs.make_tiny_tokenizer``
    regenerates it.

    Args:
        vocab_size: 512 (the ``"tiny"`` models) or 2048 (the ``"small"`` models).
    """
    if vocab_size not in VOCAB_SIZES:
        raise ValueError(
            f"vocab_size must be one of {VOCAB_SIZES} (the shipped tokenizer fixtures), got {vocab_size!r}; "
            "add another with python -m tokengym.llm_envs.make_tiny_tokenizer --vocab N"
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
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
        size: ``"tiny"`` (2 layers x 64, attention head size 16) or ``"small"`` (4 layers x 256, head size 64). vLLM
            on CPU (``VLLMPolicy``, ``LocalVLLMServer``) serves ``"small"``: its CPU attention runs head sizes 32 and
            up, and the vLLM policies refuse ``"tiny"`` at construction.
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
