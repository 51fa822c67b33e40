"""train() refuses, before it trains on anything or publishes, what would run and do the wrong thing silently
(issue 47): an AsyncCollector on the trained model, the sampler's own weights sent back to it, loss weights the loss
does not read (on any batch), and a device this machine does not have."""

import copy

import pytest
import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import AsyncCollector, TokenCollector
from tokengym.collectors.policies import PaddedSequenceActor, SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model
from tokengym.training import train
from tokengym.transforms import GroupAdvantage, MismatchCorrection, WeightedLoss, to_padded

PROMPTS = ["1+1=", "2+3=", "4+4=", "3+5="]


def _reward(responses, prompts, metadata):
    return torch.arange(len(responses), dtype=torch.float32)  # spread within every group: nonzero advantages


def _collector(tokenizer, policy_model):
    env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, max_new_tokens=3, group_size=2,
                   model_config=policy_model.config, seed=0)  # fmt: skip
    return TokenCollector(env, TransformersPolicy(policy_model, env, seed=0), mode="trajectories", batch_size=4)


def _ppo(model, **kwargs):
    return ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False, **kwargs)


@pytest.fixture
def trained(tokenizer):
    return tiny_model(tokenizer, seed=0)


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# -- row 1: an AsyncCollector whose policy generates with the trained model --
def test_an_async_collector_on_the_trained_model_is_refused_before_the_first_batch(tokenizer, trained):
    inner = _collector(tokenizer, trained)  # the policy holds the trained model, not a copy
    before = _snapshot(trained)
    with AsyncCollector(inner, max_staleness=1) as collector:
        with pytest.raises(ValueError, match=r"the AsyncCollector's policy generates with the trained Qwen2ForCausalLM .*"
                                             r"TransformersPolicy\(copy\.deepcopy\(model\), env\).*"
                                             r"weights=model\.state_dict"):  # fmt: skip
            train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=2,
                  prepare=GroupAdvantage("grpo"), weights=trained.state_dict)  # fmt: skip
        assert inner.steps_done == 0 and collector.version == 0  # nothing collected, nothing published
    assert _unchanged(trained, before)


def test_an_async_collector_without_weights_is_refused_before_the_first_batch(tokenizer, trained):
    inner = _collector(tokenizer, copy.deepcopy(trained))
    before = _snapshot(trained)
    with AsyncCollector(inner, max_staleness=1) as collector:
        with pytest.raises(ValueError, match=r"train\(\) got no weights= but AsyncCollector needs them .*"
                                             r"weights=model\.state_dict"):  # fmt: skip
            train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=2,
                  prepare=GroupAdvantage("grpo"))  # fmt: skip
        assert inner.steps_done == 0
    assert _unchanged(trained, before)  # before: one optimizer step, then "needs the weights"


def test_an_async_collector_with_its_own_copy_trains(tokenizer, trained):
    inner = _collector(tokenizer, copy.deepcopy(trained))
    with AsyncCollector(inner, max_staleness=1) as collector:
        rows = train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=2,
                     prepare=GroupAdvantage("grpo"), weights=trained.state_dict)  # fmt: skip
    assert len(rows) == 2 and collector.version == 2  # both updates went out (they land at a step boundary)


# -- row 5: the sampler's own weights sent back to it --
def test_the_samplers_own_weights_are_refused_before_the_version_moves(tokenizer, trained):
    sampler = copy.deepcopy(trained)
    collector = _collector(tokenizer, sampler)
    with pytest.raises(ValueError, match=r"weights\(\) returned the collector's policy's own weights .*"
                                         r"weights=sampler\.state_dict.*never change.*weights=model\.state_dict"):  # fmt: skip
        train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=2,
              prepare=GroupAdvantage("grpo"), weights=sampler.state_dict)  # fmt: skip
    assert collector.policy.version == 0  # no update counted


def test_the_trained_models_weights_reach_the_samplers_copy(tokenizer, trained):
    sampler = copy.deepcopy(trained)
    collector = _collector(tokenizer, sampler)
    train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=2,
          prepare=GroupAdvantage("grpo"), weights=trained.state_dict)  # fmt: skip
    assert collector.policy.version == 2 and torch.equal(sampler.lm_head.weight, trained.lm_head.weight)


# -- row 2: loss weights a plain loss would not read --
_WEIGHTED_FIX = r"carries per-token loss weights 'loss_weight', which {owner} does not read.*WeightedLoss\(loss\)"


def _with_weights(batch):
    return batch.set(keys.LOSS_WEIGHT, torch.ones(batch.shape))  # all ones: still weights the loss would not read


def test_loss_weights_on_the_first_batch_are_refused_before_any_step(tokenizer, trained):
    collector = _collector(tokenizer, trained)
    before = _snapshot(trained)
    with pytest.raises(ValueError, match=_WEIGHTED_FIX.format(owner=r"ClipPPOLoss\(SequenceActor\)")):
        train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=2,
              prepare=lambda b: _with_weights(GroupAdvantage("grpo")(b)))  # fmt: skip
    assert _unchanged(trained, before) and collector.policy.version == 0


def test_loss_weights_that_first_appear_on_a_later_batch_are_refused_there(tokenizer, trained):
    """AsyncCollector(stale_tokens="mask") writes the weights only on a batch that holds stale tokens."""
    collector = _collector(tokenizer, trained)
    seen = []

    def prepare(batch):
        seen.append(1)
        batch = GroupAdvantage("grpo")(batch)
        return _with_weights(batch) if len(seen) == 2 else batch

    with pytest.raises(ValueError, match=_WEIGHTED_FIX.format(owner=r"ClipPPOLoss\(SequenceActor\)")):
        train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=3, prepare=prepare)
    assert len(seen) == 2 and collector.policy.version == 1  # refused on the second batch, before its step


def test_mismatch_weights_under_a_plain_grpo_loss_are_refused(tokenizer, trained):
    collector = _collector(tokenizer, trained)
    actor = PaddedSequenceActor(trained)
    correction = MismatchCorrection("truncate", cap=2.0, trainer=actor.log_prob)  # writes keys.LOSS_WEIGHT
    with pytest.raises(ValueError, match=_WEIGHTED_FIX.format(owner=r"GRPOLoss\(PaddedSequenceActor\)")
                       + r".*aggregation='none'"):  # fmt: skip
        train(collector, GRPOLoss(actor, entropy_bonus=False), torch.optim.Adam(trained.parameters(), lr=1e-2),
              iterations=1, prepare=lambda b: correction(to_padded(GroupAdvantage("grpo")(b))))  # fmt: skip


def test_the_same_weights_under_weighted_loss_train(tokenizer, trained):
    collector = _collector(tokenizer, trained)
    rows = train(collector, WeightedLoss(_ppo(trained, reduction="none")),
                 torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=2,
                 prepare=lambda b: _with_weights(GroupAdvantage("grpo")(b)))  # fmt: skip
    assert len(rows) == 2


# -- row 6: a device this machine does not have, named before torch's own error --
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_is_refused_before_the_first_batch(tokenizer, trained, device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    collector = _collector(tokenizer, trained)
    with pytest.raises(ValueError, match=r"device='cuda(:0)?' but this machine has no usable CUDA device .*"
                                         r"device=None \(or 'cpu'\)"):  # fmt: skip
        train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=1,
              prepare=GroupAdvantage("grpo"), device=device)  # fmt: skip
    assert collector.steps_done == 0


@pytest.mark.gpu  # needs CUDA (a device index past the last one): run by benchmarks/gpu/run.sh
def test_a_cuda_index_past_the_last_device_is_refused(tokenizer, trained):
    collector = _collector(tokenizer, trained)
    with pytest.raises(ValueError, match=r"device='cuda:99' but this machine has \d+ CUDA device"):
        train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=1,
              prepare=GroupAdvantage("grpo"), device="cuda:99")  # fmt: skip


def test_the_meta_device_is_refused_before_the_first_batch(tokenizer, trained):
    collector = _collector(tokenizer, trained)
    with pytest.raises(ValueError, match=r"device='meta' holds no data .*device='cuda', or None"):
        train(collector, _ppo(trained), torch.optim.Adam(trained.parameters(), lr=1e-2), iterations=1,
              prepare=GroupAdvantage("grpo"), device="meta")  # fmt: skip
    assert collector.steps_done == 0
