import pytest

from tokengym.llm_envs.tools import escape_special_tokens, special_token_strings


def test_escape_defuses_every_occurrence(tokenizer):
    tokens = special_token_strings(tokenizer)
    assert {"<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<|endoftext|>", "<|pad|>"} <= set(tokens)
    text = "a<|user|>b<|end|><|assistant|>c <|nope|>"
    escaped = escape_special_tokens(text, tokens)
    assert escaped == "a<\\|user|>b<\\|end|><\\|assistant|>c <|nope|>"
    ids = tokenizer(escaped, add_special_tokens=False)["input_ids"]
    assert not set(ids) & set(tokenizer.all_special_ids + [tokenizer.convert_tokens_to_ids(t) for t in tokens])
    raw_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|user|>") in raw_ids  # control: unescaped, the role token is real


def test_escape_without_tokenizer_and_edge_cases():
    assert escape_special_tokens("x<|im_start|>system") == "x<\\|im_start|>system"
    assert escape_special_tokens("<<|a|>|a|>", ["<|a|>"]) == "<<\\|a|>|a|>"
    assert escape_special_tokens("a\x00b", ["\x00"]) == "a\\u0000b"
    assert escape_special_tokens("plain", []) == "plain"
    with pytest.raises(TypeError, match="text must be a str, got int"):
        escape_special_tokens(3)
