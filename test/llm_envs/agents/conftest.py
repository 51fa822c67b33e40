"""Fixtures of the agent env tests: the tool-template tokenizer and a tiny model that calls tools."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: the tests import agent_helpers
from agent_helpers import TASKS, TOOLS, answer, calls_text, first_messages  # noqa: E402

from tokengym.llm_envs.turns.render import ChatRenderer
from tokengym.testing import TOOL_CHAT_TEMPLATE, tiny_model, tiny_tokenizer


@pytest.fixture(scope="session")
def tool_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    return tok


def _sequence(tok, task) -> tuple[torch.Tensor, torch.Tensor]:
    """The token sequence the agent env writes for ``task`` (first call, turn, tool results, answer) and the
    mask of the model's tokens."""
    end = tok.convert_tokens_to_ids("<|end|>")
    prompt = tok(tok.apply_chat_template(first_messages(task), tools=TOOLS, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]  # fmt: skip
    turn1 = tok(calls_text(task), add_special_tokens=False)["input_ids"] + [end]
    results = [{"role": "tool", "tool_call_id": f"c{i}", "content": str(a + b)} for i, (a, b) in enumerate(task["pairs"])]
    feedback = ChatRenderer(tok).feedback_ids(torch.tensor(turn1), results).tolist()
    turn2 = tok(answer(task), add_special_tokens=False)["input_ids"] + [end]
    ids = prompt + turn1 + feedback + turn2
    generated = [False] * len(prompt) + [True] * len(turn1) + [False] * len(feedback) + [True] * len(turn2)
    return torch.tensor(ids), torch.tensor(generated)


@pytest.fixture(scope="session")
def tool_model(tool_tokenizer):
    """The tiny Qwen2 taught the two conversations until greedy decoding replays them (~150 steps, ~5 s)."""
    tok = tool_tokenizer
    model = tiny_model(tok, seed=0).train()
    seqs = [_sequence(tok, t) for t in TASKS]
    ids = torch.nn.utils.rnn.pad_sequence([s[0] for s in seqs], batch_first=True)
    gen = torch.nn.utils.rnn.pad_sequence([s[1] for s in seqs], batch_first=True)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        for step in range(400):
            logits = model(ids[:, :-1]).logits
            if step % 10 == 0 and bool((logits.argmax(-1) == ids[:, 1:])[gen[:, 1:]].all()):
                break  # greedy decoding now replays both conversations token for token
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = nll[gen[:, 1:]].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()
