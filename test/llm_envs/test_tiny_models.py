"""Tests of llm_envs/tiny_models.py and make_tiny_tokenizer.py: the committed tokenizer fixtures."""

import pytest
from tokenizers import Tokenizer

from tokengym.llm_envs.make_tiny_tokenizer import write_fixtures
from tokengym.llm_envs.tasks import WRONG_FEEDBACK, countdown_prompts, reversal_prompts
from tokengym.llm_envs.tiny_models import SPECIAL_TOKENS, VOCAB_SIZES, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_fixture_loads_with_special_tokens(vocab_size):
    tok = tiny_tokenizer(vocab_size)
    assert len(tok) == vocab_size
    assert tok.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == SPECIAL_TOKENS
    assert (tok.pad_token_id, tok.eos_token_id, tok.padding_side) == (0, 1, "left")
    text = "Numbers: 3 10 2. Target: 5. Expression: (10-3)-2"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>2+2=<|end|><|assistant|>"


@pytest.mark.parametrize("vocab_size", VOCAB_SIZES)
def test_task_words_are_few_tokens(vocab_size):
    tok = tiny_tokenizer(vocab_size)

    def count(text):
        return len(tok(text, add_special_tokens=False)["input_ids"])

    assert count(" Expression:") == 2 and count(" Target:") == 2 and count("Reverse") == 1
    assert count(countdown_prompts(1, seed=1)[0]["prompt"]) <= 12
    assert count(reversal_prompts(1)[0]["prompt"]) <= 8
    assert count(WRONG_FEEDBACK) <= 16
    assert all(count(str(n)) == 1 for n in range(21))  # small numbers: one token each


def test_unknown_vocab_size():
    with pytest.raises(ValueError, match=r"vocab_size must be one of \(512, 2048\).*got 1000; add another with"):
        tiny_tokenizer(1000)


def test_tiny_model_matches_the_fixture():
    tok = tiny_tokenizer(2048)
    assert tiny_model(tok, size="small").config.vocab_size == 2048


def test_regenerate_fixture(tmp_path):
    (path,) = write_fixtures((512,), tmp_path)
    tok = Tokenizer.from_file(str(path))
    assert tok.get_vocab_size() == 512 and path.name == "tiny_tokenizer_512.json"
    assert [tok.id_to_token(i) for i in range(len(SPECIAL_TOKENS))] == SPECIAL_TOKENS
    assert len(tok.encode(" Expression:").ids) <= 3
