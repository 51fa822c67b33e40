"""Training with the model on a device: the actors, TorchRL's losses, train(), the transforms, evaluate(), LoRA."""

import peft
import pytest
import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PaddedSequenceActor,
    SamplingConfig,
    SequenceActor,
    TransformersPolicy,
    adapter_weights,
)
from tokengym.evaluation import evaluate
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.llm_envs.devices import check_same_device
from tokengym.testing import tiny_model
from tokengym.training import train
from tokengym.transforms import GroupAdvantage, KLRewardTransform, MismatchCorrection, to_padded

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


def _collector(tokenizer, model, **kwargs):
    env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, max_new_tokens=6, max_length=64, group_size=2,
                   model_config=model.config)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=0.9), seed=0)
    return TokenCollector(env, policy, mode="trajectories", batch_size=4, **kwargs), policy


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout", ["padded", "steps"])
def test_train_on_the_device_moves_the_prepared_batch(tokenizer, device, dtype, layout):
    model = tiny_model(tokenizer).to(device=device, dtype=dtype)
    collector, policy = _collector(tokenizer, model)
    if layout == "padded":
        loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
        prepare = lambda batch: to_padded(GroupAdvantage("grpo")(batch))  # noqa: E731
    else:
        loss = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)
        prepare = GroupAdvantage("grpo")
    before = _params(model)
    seen = []
    rows = train(collector, loss, torch.optim.SGD(model.parameters(), lr=1e-2), iterations=2, prepare=prepare,
                 device=device, on_iteration=lambda row, data: seen.append(data.device))  # fmt: skip
    assert [row["iter"] for row in rows] == [0, 1] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert all(d is not None and d.type == torch.device(device).type for d in seen)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert policy.version == 2
    if dtype == torch.float32:  # on-policy first step: the ratio is 1, nothing clipped
        assert rows[0].get("clip_fraction", 0.0) == 0.0


def test_a_host_batch_for_a_device_model_names_the_fix():
    with pytest.raises(ValueError, match=r"train\(\.\.\., device='cuda:0'\)"):
        check_same_device("PaddedSequenceActor", torch.device("cpu"), torch.device("cuda:0"))
    check_same_device("PaddedSequenceActor", torch.device("cpu"), torch.device("cpu"))


def test_actors_score_a_host_batch_for_the_transforms(tokenizer, device):
    model = tiny_model(tokenizer).to(device)
    collector, _ = _collector(tokenizer, model)
    batch = next(iter(collector))
    mask = batch[keys.MASK]
    # the reference transform scores the host batch with a model on the device; the batch stays on the host
    shaped = KLRewardTransform(beta=0.1, ref_model=model)(batch.clone())
    assert shaped[keys.REF_LOG_PROB].device.type == "cpu" and bool((shaped[keys.REF_LOG_PROB][mask] < 0).all())
    step = SequenceActor(model).log_prob(batch)
    assert step.device.type == "cpu"
    torch.testing.assert_close(step[mask], batch[keys.ACTION_LOG_PROB][mask], atol=2e-4, rtol=0)
    padded = to_padded(GroupAdvantage("grpo")(batch))
    corrected = MismatchCorrection("truncate", trainer=PaddedSequenceActor(model).log_prob)(padded)
    assert corrected[keys.TRAINER_LOG_PROB].device.type == "cpu"
    assert corrected[keys.LOSS_WEIGHT].device.type == "cpu"


def test_the_reference_transform_scores_the_sampler_log_probs_at_temperature_one(tokenizer, device):
    model = tiny_model(tokenizer).to(device)
    env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, max_new_tokens=6, max_length=64,
                   model_config=model.config)  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=1), mode="trajectories", batch_size=4)
    batch = next(iter(collector))
    mask = batch[keys.MASK]
    shaped = KLRewardTransform(beta=0.1, ref_model=model)(batch.clone())
    torch.testing.assert_close(shaped[keys.REF_LOG_PROB][mask], batch[keys.ACTION_LOG_PROB][mask], atol=2e-4, rtol=0)


def test_evaluate_on_the_device(tokenizer, device):
    model = tiny_model(tokenizer).to(device)
    rows = [{"prompt": p, "answer": "2"} for p in PROMPTS[:3]]
    source = PromptSource(rows, tokenizer, group_size=2, epochs=1)
    env = TokenEnv(source, tokenizer, lambda r, p, m: [float(x.strip() == d["answer"]) for x, d in zip(r, m, strict=True)],
                   batch_size=4, max_new_tokens=4, max_length=32)  # fmt: skip
    result = evaluate(env, TransformersPolicy(model, env, sampling=SamplingConfig(), seed=0))
    assert result.metrics["prompts"] == 3 and result.metrics["samples"] == 6


def test_lora_adapters_sync_into_a_policy_on_the_device(tokenizer, device):
    def lora(seed):
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return peft.get_peft_model(tiny_model(tokenizer), config).to(device)

    trainer, generator = lora(1), lora(2)
    collector, policy = _collector(tokenizer, generator)
    next(iter(collector))
    assert collector.update_policy_weights_(adapter_weights(trainer)) == 1 and policy.weight_sync == "adapter"
    for name, tensor in adapter_weights(generator).items():
        assert torch.equal(tensor, adapter_weights(trainer)[name])
    batch = next(iter(collector))
    forced = TransformersPolicy(trainer, policy.env, sampling=SamplingConfig(temperature=0.9)).teacher_forced_log_probs(batch)
    torch.testing.assert_close(forced, batch[keys.ACTION_LOG_PROB] * batch[keys.MASK], atol=2e-4, rtol=0)
