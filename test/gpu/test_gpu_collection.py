"""Collection with the model on a device: stepwise and wave policies, the reference, checkpoints, host traffic."""

import statistics
import warnings

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PolicyWithReference,
    SamplingConfig,
    StepwiseReference,
    TransformersPolicy,
    sample_tokens,
)
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.devices import input_device, output_device, seeded_generator
from tokengym.testing import tiny_model

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


def _env(tokenizer, model, **kwargs):
    kwargs = {"batch_size": 4, "max_new_tokens": 8, "max_length": 64, "group_size": 2, **kwargs}
    return TokenEnv(PROMPTS, tokenizer, _reward, model_config=model.config, **kwargs)


def _model(tokenizer, device, dtype=torch.float32, seed=0):
    return tiny_model(tokenizer, seed=seed).to(device=device, dtype=dtype)


def _collect(tokenizer, model, *, source="step", seed=0, batches=2, sampling=None, **env_kwargs):
    env = _env(tokenizer, model, **env_kwargs)
    policy = TransformersPolicy(model, env, sampling=sampling or SamplingConfig(), seed=seed)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source=source)
    out = []
    for batch in collector:
        out.append(batch)
        if len(out) == batches:
            return out, policy


def test_batches_come_out_on_the_host_with_float32_log_probs(tokenizer, device, dtype):
    model = _model(tokenizer, device, dtype)
    batches, policy = _collect(tokenizer, model)
    assert policy.generator.device.type == torch.device(device).type
    assert policy.cache.device.type == torch.device(device).type and policy.cache.length.device.type == "cpu"
    for batch in batches:
        assert all(t.device.type == "cpu" for t in batch.values(True, True) if isinstance(t, torch.Tensor))
        lp = batch[keys.ACTION_LOG_PROB][batch[keys.MASK]]
        assert lp.dtype == torch.float32 and bool(torch.isfinite(lp).all()) and bool((lp <= 0).all())


def test_the_same_seed_gives_the_same_tokens_on_the_same_device(tokenizer, device, dtype):
    model = _model(tokenizer, device, dtype)
    first, _ = _collect(tokenizer, model, seed=3)
    again, _ = _collect(tokenizer, model, seed=3)
    other, _ = _collect(tokenizer, model, seed=4)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a[keys.ACTION], b[keys.ACTION])
        assert torch.equal(a[keys.ACTION_LOG_PROB], b[keys.ACTION_LOG_PROB])
    assert not all(torch.equal(a[keys.ACTION], b[keys.ACTION]) for a, b in zip(first, other, strict=True))


def test_stepwise_log_probs_are_the_teacher_forced_ones(tokenizer, device):
    model = _model(tokenizer, device)
    batches, policy = _collect(tokenizer, model, sampling=SamplingConfig(temperature=0.8))
    for batch in batches:
        forced = policy.teacher_forced_log_probs(batch)
        assert forced.device.type == "cpu"
        torch.testing.assert_close(forced, batch[keys.ACTION_LOG_PROB] * batch[keys.MASK], atol=2e-4, rtol=0)


def test_greedy_waves_equal_greedy_steps(tokenizer, device):
    model = _model(tokenizer, device)
    greedy = SamplingConfig(greedy=True)
    steps, _ = _collect(tokenizer, model, sampling=greedy, batches=1)
    waves, _ = _collect(tokenizer, model, sampling=greedy, batches=1, source="wave")
    assert torch.equal(steps[0][keys.ACTION], waves[0][keys.ACTION])
    mask = steps[0][keys.MASK]
    torch.testing.assert_close(steps[0][keys.ACTION_LOG_PROB][mask], waves[0][keys.ACTION_LOG_PROB][mask],
                               atol=2e-4, rtol=0)  # fmt: skip


def test_sampled_waves_on_the_device(tokenizer, device, dtype):
    model = _model(tokenizer, device, dtype)
    batches, policy = _collect(tokenizer, model, source="wave", seed=5)
    again, _ = _collect(tokenizer, model, source="wave", seed=5)
    for batch, same in zip(batches, again, strict=True):
        assert batch[keys.ACTION].device.type == "cpu"
        assert torch.equal(batch[keys.ACTION], same[keys.ACTION])
        assert bool(torch.isfinite(batch[keys.ACTION_LOG_PROB]).all())


def test_the_reference_scores_on_its_device(tokenizer, device):
    model = _model(tokenizer, device)
    env = _env(tokenizer, model)
    policy = PolicyWithReference(TransformersPolicy(model, env, seed=0), StepwiseReference(model, env))
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4)))
    mask = batch[keys.MASK]
    assert batch[keys.REF_LOG_PROB].device.type == "cpu"
    torch.testing.assert_close(batch[keys.REF_LOG_PROB][mask], batch[keys.ACTION_LOG_PROB][mask], atol=2e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_resume_from_a_checkpoint_is_exact_on_the_device(tokenizer, device, dtype, tmp_path):
    model = _model(tokenizer, device, dtype)

    def make():
        env = _env(tokenizer, model, max_new_tokens=6)
        return TokenCollector(env, TransformersPolicy(model, env, seed=2), mode="trajectories", batch_size=4)

    collector = make()
    it = iter(collector)
    next(it)
    torch.save(collector.state_dict(), tmp_path / "ckpt.pt")
    expected = next(it)
    resumed = make()
    state = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=True)  # the KV cache goes back
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert torch.equal(got[keys.ACTION], expected[keys.ACTION])
    assert torch.equal(got[keys.ACTION_LOG_PROB], expected[keys.ACTION_LOG_PROB])


def test_a_checkpoint_from_another_device_names_the_fix(tokenizer, device):
    model = _model(tokenizer, device)
    env = _env(tokenizer, model)
    policy = TransformersPolicy(model, env)
    state = policy.collection_state()
    assert state["generator_device"] == torch.device(device).type
    state["generator_device"] = "cpu" if device == "cuda" else "cuda"
    with pytest.raises(ValueError, match="sampling generator ran on"):
        policy.load_collection_state(state)


def test_a_generator_on_another_device_is_refused_by_name(device):
    logits = torch.zeros(2, 5, device=device)
    action, logp, _ = sample_tokens(logits, SamplingConfig(), seeded_generator(logits.device, 0))
    assert action.device == logits.device and logp.dtype == torch.float32
    elsewhere = torch.zeros(2, 5, device="meta" if device == "cpu" else "cpu")
    with pytest.raises(ValueError, match="seeded_generator"):
        sample_tokens(elsewhere, SamplingConfig(), seeded_generator(device, 0))


def test_a_model_moved_after_the_policy_was_built_names_the_fix(tokenizer, device):
    model = _model(tokenizer, device)
    env = _env(tokenizer, model)
    policy = TransformersPolicy(model, env)
    assert policy(env.reset())[keys.ACTION].shape == (4,)
    model.to("meta" if device == "cpu" else "cpu")
    fix = ("now on the meta device.*build the policy on a model with its weights loaded" if device == "cpu"
           else "build the policy after moving the model")  # fmt: skip
    with pytest.raises(ValueError, match=fix):
        policy(env.reset())


def test_a_device_map_model_takes_inputs_on_its_embedding_device(tokenizer, device, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(tokenizer)
    model.config.tie_word_embeddings = False  # a head of its own, which the map may put elsewhere
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.save_pretrained(tmp_path)
    # on a GPU the map offloads the head to the CPU (accelerate keeps its weights there and runs it on the GPU)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map={"model": device, "lm_head": "cpu"}).eval()
    assert input_device(model).type == torch.device(device).type
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6]], device=input_device(model))).logits
    assert output_device(model) == logits.device  # where the logits really come out: sampling happens there
    batches, policy = _collect(tokenizer, model, batches=1)
    assert policy.generator.device.type == logits.device.type
    forced = policy.teacher_forced_log_probs(batches[0])
    torch.testing.assert_close(forced, batches[0][keys.ACTION_LOG_PROB] * batches[0][keys.MASK], atol=2e-4, rtol=0)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("decode", ["dynamic", "graph", "compile"])
def test_one_host_synchronization_per_env_step(tokenizer, device, decode):
    """CUDA only (what only CUDA shows): the policy's step and the env's step synchronize once, refills apart, with
    the dynamic cache, the captured step (decode="graph") and the compiled one (decode="compile", counted once its
    cudagraph trees replay: their first call runs the compiled step, the second records it)."""
    model = _model(tokenizer, device, torch.bfloat16)
    env = _env(tokenizer, model, max_new_tokens=48, batch_size=8, eos_token_ids=[])
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=(tokenizer.eos_token_id,)),
                                decode=decode)  # fmt: skip
    td = env.reset()
    for _ in range(3 if decode == "compile" else 1):  # the first step prefills every slot (and captures the graph)
        td = policy(td)
        _, td = env.step_and_maybe_reset(td)
    counts, sites = [], []
    for _ in range(16):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                td = policy(td)
                _, td = env.step_and_maybe_reset(td)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
        counts.append(len(syncs))
        sites.append(syncs)
    assert statistics.median(counts) <= 1 and max(counts) <= 2, list(zip(counts, sites, strict=True))
