"""A group's prompt computed once: shared prefill, held prompts and the cache's row copy give today's tokens."""

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import PrefixStore, SamplingConfig, SlotKVCache, TransformersPolicy
from tokengym.llm_envs import MultiTurnTokenEnv, TokenEnv, keys
from tokengym.llm_envs.turns import Turn
from tokengym.testing import tiny_model

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


def _again(responses, prompts, metadata, turns):
    return [Turn(0.5, "again") if t < 1 else Turn(1.0) for t in turns]


def _env(tokenizer, model, *, multi_turn=False, **kwargs):
    kwargs = {"batch_size": 8, "max_new_tokens": 6, "max_length": 96, "group_size": 4, **kwargs}
    if multi_turn:
        return MultiTurnTokenEnv(PROMPTS, tokenizer, _again, max_turns=2, model_config=model.config, **kwargs)
    return TokenEnv(PROMPTS, tokenizer, _reward, model_config=model.config, **kwargs)


class _TokenCount:
    """Tokens the model ran a forward over (prefill, extension and decode alike)."""

    def __init__(self, model) -> None:
        self.tokens = 0
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.tokens += int(kwargs["input_ids"].numel())


def _collect(tokenizer, model, share, *, source="step", batches=3, **env_kwargs):
    env = _env(tokenizer, model, **env_kwargs)
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=0.9), seed=3, share_prefixes=share)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source=source)
    out = []
    for batch in collector:
        out.append(batch)
        if len(out) == batches:
            return out, policy


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
@pytest.mark.parametrize("source", ["step", "wave"])
def test_shared_and_separate_prefill_give_the_same_tokens(tokenizer, source, multi_turn):
    model = tiny_model(tokenizer)
    counter = _TokenCount(model)
    shared, _ = _collect(tokenizer, model, True, source=source, multi_turn=multi_turn)
    shared_tokens, counter.tokens = counter.tokens, 0
    separate, _ = _collect(tokenizer, model, False, source=source, multi_turn=multi_turn)
    for a, b in zip(shared, separate, strict=True):
        assert torch.equal(a[keys.ACTION], b[keys.ACTION])
        torch.testing.assert_close(a[keys.ACTION_LOG_PROB], b[keys.ACTION_LOG_PROB], atol=1e-5, rtol=0)
    assert shared_tokens < counter.tokens  # the groups' prompts ran once, not group_size times


def test_held_prompts_stay_within_their_bound_and_go_with_new_weights(tokenizer):
    model = tiny_model(tokenizer)
    env = _env(tokenizer, model, batch_size=3)  # groups of 4 over 3 slots: samples start at different steps
    policy = TransformersPolicy(model, env, prefix_cache_bytes=0)
    next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4)))
    assert policy.cache.prefixes.hits == 0 and policy.cache.prefixes.nbytes == 0
    policy = TransformersPolicy(model, env, prefix_cache_bytes=2**20)
    next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4)))
    assert policy.cache.prefixes.hits > 0 and 0 < policy.cache.prefixes.nbytes <= 2**20
    policy.update_weights()
    assert policy.cache.prefixes.nbytes == 0  # the old weights' keys and values
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        PrefixStore(-1)


def test_resume_with_held_prompts_is_exact(tokenizer, tmp_path):
    model = tiny_model(tokenizer)

    def make():
        env = _env(tokenizer, model, batch_size=3)
        return TokenCollector(env, TransformersPolicy(model, env, seed=2), mode="trajectories", batch_size=4)

    collector = make()
    it = iter(collector)
    next(it)
    torch.save(collector.state_dict(), tmp_path / "ckpt.pt")
    expected = next(it)
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    got = next(iter(resumed))
    assert torch.equal(got[keys.ACTION], expected[keys.ACTION])
    assert torch.equal(got[keys.ACTION_LOG_PROB], expected[keys.ACTION_LOG_PROB])


def test_copy_rows_keeps_the_first_tokens_of_a_row(model):
    """A row copied up to token t decodes as a row prefilled with those t tokens (the fork primitive)."""
    cache, fresh = SlotKVCache(model, 3), SlotKVCache(model, 3)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 0, 0, 0, 0], [13, 14, 15, 0, 0, 0]])
    active = torch.ones(3, dtype=torch.bool)
    cache.sync(tokens, torch.tensor([6, 2, 3]), torch.arange(3), active)  # rows cache 5, 1 and 2 tokens
    cache.copy_rows(torch.tensor([0, 0]), torch.tensor([1, 2]), torch.tensor([2, 4]))  # rows 1, 2: 5 6 | 5 6 7 8
    assert cache.length.tolist() == [5, 2, 4]
    logits = cache.decode(torch.tensor([10, 7, 9]), active)
    same = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 0, 0, 0], [5, 6, 7, 8, 9, 0]])
    fresh.sync(same, torch.tensor([6, 3, 5]), torch.arange(3), active)
    torch.testing.assert_close(logits, fresh.decode(torch.tensor([10, 7, 9]), active), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="upto"):
        cache.copy_rows(torch.tensor([1]), torch.tensor([2]), torch.tensor([9]))
