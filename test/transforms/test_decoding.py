"""decode: a TRAJECTORIES batch as text; multi-turn rows as turns and the env's feedback, separately."""

import torch
from tensordict import TensorDict

from tokengym.llm_envs import PromptTable, keys
from tokengym.transforms import decode


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_multi_turn_row_gives_turns_and_feedback(tokenizer):
    prompt, turn0, feedback, turn1 = (_ids(tokenizer, t) for t in ("<|user|>12+7=<|end|><|assistant|>", "20",
                                                                   "<|end|><|user|>try again<|end|><|assistant|>", "19"))  # fmt: skip
    sequence = torch.tensor(prompt + turn0 + feedback + turn1)
    table = PromptTable(pad_token_id=tokenizer.pad_token_id)
    table.add(0, torch.tensor(prompt))
    table.add_sequence(5, sequence)
    n0, n1, p = len(turn0), len(turn1), len(prompt)
    seq_len = list(range(p, p + n0)) + list(range(p + n0 + len(feedback), p + n0 + len(feedback) + n1))
    steps = n0 + n1
    batch = TensorDict({keys.ACTION: torch.tensor([turn0 + turn1]), keys.MASK: torch.ones(1, steps, dtype=torch.bool),
                        keys.TURN: torch.tensor([[0] * n0 + [1] * n1]), keys.SEQ_LEN: torch.tensor([seq_len]),
                        keys.TRAJ_ID: torch.full((1, steps), 5), keys.GROUP_ID: torch.zeros(1, steps, dtype=torch.long)},
                       batch_size=[1, steps])  # fmt: skip
    batch.set_non_tensor(keys.PROMPTS, table)
    assert decode(batch, tokenizer) == ["2019"]  # the generated tokens, turns joined
    assert decode(batch, tokenizer, by_turn=True) == [[
        {"role": "assistant", "content": "20"}, {"role": "feedback", "content": "try again"},
        {"role": "assistant", "content": "19"}]]  # fmt: skip
    raw = decode(batch, tokenizer, by_turn=True, skip_special_tokens=False)[0][1]["content"]
    assert raw == "<|end|><|user|>try again<|end|><|assistant|>"
