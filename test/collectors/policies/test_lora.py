"""PEFT LoRA models with TransformersPolicy, the sequence actors, the losses, the reference and checkpoints."""

import copy

import peft  # noqa: E402 (the lora extra; make test installs it)
import pytest
import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors._ray_worker import pack_weights
from tokengym.collectors.policies import (
    AdaptersDisabled,
    PaddedSequenceActor,
    PolicyWithReference,
    SamplingConfig,
    SequenceActor,
    StepwiseReference,
    TransformersPolicy,
    adapter_weights,
    merged_weights,
)
from tokengym.collectors.policies._lora_sync import AdapterSpec
from tokengym.collectors.policies._vllm_engine import checkpoint_shapes
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model
from tokengym.transforms import GroupAdvantage, KLRewardTransform, to_padded

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(tokenizer, *, seed=0, r=4, family="qwen2", trained=True, targets=None, task_type=None):
    """A tiny model with a LoRA adapter; ``trained``: the adapter changes the model (B != 0)."""
    targets = targets or (TARGETS if family == "qwen2" else ["c_attn", "c_proj", "c_fc"])
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=not trained,
                             fan_in_fan_out=family == "gpt2", task_type=task_type)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return peft.get_peft_model(tiny_model(tokenizer, family=family), config)


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


def _env(tokenizer, model, **kwargs):
    kwargs = {"batch_size": 4, "max_new_tokens": 6, "max_length": 64, "group_size": 2, **kwargs}
    return TokenEnv(PROMPTS, tokenizer, _reward, model_config=model.config, **kwargs)


def _batches(collector, n):
    out = []
    for batch in collector:
        out.append(batch)
        if len(out) == n:
            return out


def _nbytes(weights):
    return sum(t.numel() * t.element_size() for t in weights.values())


def _assert_teacher_forced(batch, model, env, atol=1e-5):
    forced = TransformersPolicy(model, env).teacher_forced_log_probs(batch)
    torch.testing.assert_close(forced, batch[keys.ACTION_LOG_PROB] * batch[keys.MASK], atol=atol, rtol=0)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])  # PeftModel, PeftModelForCausalLM
def test_a_lora_model_steps_and_generates_waves_alike(tokenizer, task_type):
    model = lora(tokenizer, task_type=task_type)
    batches = {}
    for source in ("step", "wave"):
        env = _env(tokenizer, model, seed=1)
        policy = TransformersPolicy(model, env, seed=3)
        batches[source] = _batches(TokenCollector(env, policy, mode="trajectories", batch_size=4, source=source), 2)
        _assert_teacher_forced(batches[source][1], model, env)
    for step, wave in zip(batches["step"], batches["wave"], strict=True):
        assert torch.equal(step[keys.ACTION], wave[keys.ACTION])
        torch.testing.assert_close(step[keys.ACTION_LOG_PROB], wave[keys.ACTION_LOG_PROB], atol=1e-5, rtol=0)


def test_loss_gradients_reach_only_the_adapter(tokenizer):
    model = lora(tokenizer)
    env = _env(tokenizer, model)
    batch = GroupAdvantage("grpo")(next(iter(TokenCollector(env, TransformersPolicy(model, env), mode="trajectories",
                                                           batch_size=4))))  # fmt: skip
    batch.set(keys.ADVANTAGE, torch.randn(batch[keys.ADVANTAGE].shape, generator=torch.Generator().manual_seed(0)))
    losses = {"grpo": lambda: GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)(to_padded(batch)).loss_objective,
              "ppo": lambda: ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False,
                                         functional=False)(batch)["loss_objective"]}  # fmt: skip
    for name, loss in losses.items():
        model.zero_grad(set_to_none=True)
        loss().backward()
        adapter = {n: p.grad for n, p in model.named_parameters() if ".lora_" in n}
        base = [n for n, p in model.named_parameters() if ".lora_" not in n and p.grad is not None]
        assert len(adapter) == 2 * 2 * len(TARGETS) and all(g is not None and g.abs().sum() > 0 for g in adapter.values()), name
        assert base == [], name


@pytest.mark.parametrize("form", ["model", "state_dict", "adapter_weights"])
def test_an_update_copies_only_the_adapter_into_the_policy(tokenizer, form):
    trainer, generator = lora(tokenizer, seed=1), lora(tokenizer, seed=2)
    base_before = {n: p.clone() for n, p in generator.named_parameters() if ".lora_" not in n}
    env = _env(tokenizer, generator)
    policy = TransformersPolicy(generator, env, sampling=SamplingConfig(temperature=0.8))
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4)
    next(iter(collector))
    weights = {"model": trainer, "state_dict": trainer.state_dict(), "adapter_weights": adapter_weights(trainer)}[form]
    assert collector.update_policy_weights_(weights) == 1
    adapter_params = sum(p.numel() for n, p in trainer.named_parameters() if ".lora_" in n)
    assert policy.weight_sync == "adapter" and policy.last_update_bytes == _nbytes(adapter_weights(trainer)) == 4 * adapter_params
    for name, tensor in adapter_weights(generator).items():
        assert torch.equal(tensor, adapter_weights(trainer)[name])
    assert all(torch.equal(p, base_before[n]) for n, p in generator.named_parameters() if ".lora_" not in n)
    batch = next(iter(collector))
    assert set(batch[keys.POLICY_VERSION][batch[keys.MASK]].tolist()) == {1}
    forced = TransformersPolicy(trainer, env, sampling=SamplingConfig(temperature=0.8)).teacher_forced_log_probs(batch)
    torch.testing.assert_close(forced, batch[keys.ACTION_LOG_PROB] * batch[keys.MASK], atol=1e-5, rtol=0)


def test_ray_and_async_collectors_send_only_the_adapter_of_a_peft_model(tokenizer):
    model = lora(tokenizer)
    packed = pack_weights(model)  # what RayTokenCollector.update_policy_weights_(model) puts into the object store
    assert set(packed) == set(adapter_weights(model))
    assert sum(array.nbytes for array, _, _ in packed.values()) == _nbytes(adapter_weights(model))


def test_updates_that_do_not_fit_name_the_fix(tokenizer):
    model = lora(tokenizer)
    env = _env(tokenizer, model)
    policy = TransformersPolicy(model, env)
    with pytest.raises(KeyError, match="not LoRA adapter tensors.*adapter_weights"):
        policy.update_weights(tiny_model(tokenizer).state_dict())
    with pytest.raises(ValueError, match="wrong shape"):
        policy.update_weights(lora(tokenizer, r=8))
    with pytest.raises(KeyError, match="missing 4 tensors"):
        policy.update_weights(lora(tokenizer, targets=TARGETS[1:]))
    plain = TransformersPolicy(tiny_model(tokenizer), env)
    with pytest.raises(ValueError, match="has no adapter.*merged_weights"):
        plain.update_weights(adapter_weights(model))
    with pytest.raises(ValueError, match="plain LoRA.*DoRA"):
        TransformersPolicy(peft.get_peft_model(tiny_model(tokenizer), peft.LoraConfig(target_modules=["q_proj"],
                                                                                     use_dora=True)), env)  # fmt: skip
    with pytest.raises(ValueError, match=r"decode='compile' does not take a LoRA model .*the compiled step on the old "
                                         r"adapter's tensors.*decode='static'.*merge_and_unload"):  # fmt: skip
        TransformersPolicy(lora(tokenizer), env, decode="compile")
    assert policy.version == 0


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_merged_weights_equal_peft_merge_and_a_plain_policy_loads_them(tokenizer, family, tmp_path):
    model = lora(tokenizer, family=family)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    merged = merged_weights(model)
    assert set(merged) == set(expected) and all(torch.equal(merged[k], expected[k]) for k in expected)
    # from a LoraConfig and the base checkpoint (vLLM policies merge so for an engine without LoRA)
    base = tiny_model(tokenizer, family=family)
    base.save_pretrained(tmp_path)
    spec = AdapterSpec.of(model.peft_config["default"], checkpoint_shapes(tmp_path))
    from_config = spec.merge(base.state_dict(), adapter_weights(model))
    torch.testing.assert_close(from_config, expected, atol=1e-6, rtol=0)
    env = _env(tokenizer, base)
    plain = TransformersPolicy(base, env)  # a policy without adapters gets the merged weights of a PEFT model
    plain.update_weights(model)
    assert plain.weight_sync == "full" and plain.last_update_bytes == _nbytes(merged)
    _assert_teacher_forced(next(iter(TokenCollector(env, plain, mode="trajectories", batch_size=4))), model, env)


def test_the_disabled_adapter_reference_equals_the_base_model(tokenizer):
    model, base = lora(tokenizer), tiny_model(tokenizer)  # the same base weights (seed 0)
    batches = []
    for reference in (AdaptersDisabled(model), base):
        env = _env(tokenizer, model, seed=4)
        policy = PolicyWithReference(TransformersPolicy(model, env, seed=5), StepwiseReference(reference, env))
        batches.append(_batches(TokenCollector(env, policy, mode="trajectories", batch_size=4), 2))
    for disabled, separate in zip(*batches, strict=True):
        assert torch.equal(disabled[keys.ACTION], separate[keys.ACTION])  # the policy kept its adapter
        torch.testing.assert_close(disabled[keys.REF_LOG_PROB], separate[keys.REF_LOG_PROB], atol=1e-5, rtol=0)
    batch = batches[0][1]
    _assert_teacher_forced(batch, model, env)
    assert (batch[keys.REF_LOG_PROB] - batch[keys.ACTION_LOG_PROB]).abs().max() > 0.05  # the adapter matters
    shaped = [KLRewardTransform(ref_model=ref)(batch.clone())[keys.REF_LOG_PROB] for ref in (AdaptersDisabled(model), base)]
    torch.testing.assert_close(shaped[0], shaped[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(shaped[0], batch[keys.REF_LOG_PROB] * batch[keys.MASK], atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="peft LoRA model"):
        AdaptersDisabled(base)


def test_resume_with_the_saved_adapter_is_exact(tokenizer):
    def collector(model, seed=0):
        env = _env(tokenizer, model, shuffle=True, seed=7)
        return TokenCollector(env, TransformersPolicy(model, env, seed=seed), mode="trajectories", batch_size=4)

    def train_step(model):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))

    model = lora(tokenizer)
    first = collector(model)
    _batches(first, 1)
    train_step(model)
    first.update_policy_weights_(model)
    _batches(first, 1)
    state, saved = first.state_dict(), {k: v.clone() for k, v in adapter_weights(model).items()}
    straight = _batches(first, 3)

    restored = lora(tokenizer, seed=9)  # another adapter, replaced by the saved one
    peft.set_peft_model_state_dict(restored, saved)
    resumed = collector(restored, seed=123)
    resumed.load_state_dict(state)
    for expected, got in zip(straight, _batches(resumed, 3), strict=True):
        for key in expected.keys(True, True):
            if isinstance(expected.get(key), torch.Tensor):
                assert torch.equal(expected.get(key), got.get(key)), key
