"""Issue 19: the vectorized response decoder gives the tokenizer's text; token-id rewards skip decoding."""

import torch

from tokengym.collectors import TokenCollector
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs._decode import ResponseDecoder


def test_decoder_equals_batch_decode_on_random_ids(tokenizer):
    decoder = ResponseDecoder(tokenizer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):  # random ids: special tokens, split multi-byte characters, empty rows
        rows = [torch.randint(0, len(tokenizer), (int(n),), generator=gen) for n in torch.randint(0, 40, (16,), generator=gen)]
        assert decoder(rows) == tokenizer.batch_decode(rows, skip_special_tokens=True)
    assert decoder.table is not None  # the byte-level fast path (16 rows), not the fallback
    text = ["naïve café ✓ 12+7=19", " 日本語", "a\nb\tc"]
    rows = [torch.tensor(tokenizer.encode(t)) for t in text]
    assert decoder(rows) == tokenizer.batch_decode(rows, skip_special_tokens=True)


def test_reward_taking_token_ids_gets_ids_not_text(tokenizer):
    seen = []

    def by_ids(responses, prompts, metadata):
        seen.extend(responses)
        return [float(len(r)) for r in responses]

    by_ids.takes_token_ids = True
    env = TokenEnv(["1+1=", "2+2="], tokenizer, by_ids, batch_size=2, max_new_tokens=3, max_length=32)

    def policy(td):
        td.set("action", torch.full((2,), 40))
        td.set("action_log_prob", torch.zeros(2))
        return td.set("policy_version", torch.zeros(2, dtype=torch.int64))

    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=2, source="step")))
    assert seen and all(isinstance(r, torch.Tensor) and r.tolist() == [40, 40, 40] for r in seen)
    assert batch["next", "reward"].sum().item() == 6.0
