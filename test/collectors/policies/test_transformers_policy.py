import pytest
import torch

from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.testing import tiny_model


def _step_greedy(env, policy, steps):
    td, actions, logps = env.reset(), [], []
    for _ in range(steps):
        td = policy(td)
        actions.append(td["action"].clone())
        logps.append(td["action_log_prob"].clone())
        _, td = env.step_and_maybe_reset(td)
    return torch.stack(actions, 1), torch.stack(logps, 1)


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_stepwise_greedy_equals_generate(tokenizer, family, prompts):
    model = tiny_model(tokenizer, family=family)
    eos = tokenizer.eos_token_id
    prompts = prompts[:4]
    env = TokenEnv(prompts, tokenizer, batch_size=4, max_new_tokens=16, max_length=64, model_config=model.config)
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(greedy=True, banned_token_ids=(eos,)))
    actions, logps = _step_greedy(env, policy, 16)
    x = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**x, max_new_tokens=16, do_sample=False, suppress_tokens=[eos],
                         output_logits=True, return_dict_in_generate=True)  # fmt: skip
    width = x["input_ids"].shape[1]
    assert torch.equal(out.sequences[:, width:], actions)
    # the first generated token has a real log-prob (TorchRL's wrapper reports 0 there)
    first = out.logits[0].clone()
    first[:, eos] = -float("inf")
    expected = first.log_softmax(-1).gather(-1, actions[:, :1]).squeeze(-1)
    assert torch.allclose(logps[:, 0], expected, atol=1e-4)
    assert bool((logps[:, 0] < 0).all())


def test_refilled_slot_decodes_like_a_fresh_generate(tokenizer, model, make_env, make_policy, prompts):
    """Slots finish at different steps; each refill replaces only that slot's cache."""
    eos = tokenizer.eos_token_id
    env = make_env(prompts, batch_size=2, max_new_tokens=5)
    policy = make_policy(env, sampling=SamplingConfig(greedy=True, banned_token_ids=(eos,)))
    td, responses = env.reset(), {}
    for _ in range(5 * 3 + 2):  # three waves, and refills land mid-way for slot 1 below
        td = policy(td)
        for b in range(2):
            responses.setdefault(int(td["traj_id"][b]), []).append(int(td["action"][b]))
        out, td = env.step_and_maybe_reset(td)
    for traj, prompt in [(2, prompts[2]), (3, prompts[3]), (4, prompts[4])]:
        x = tokenizer([prompt], return_tensors="pt")
        gen = model.generate(**x, max_new_tokens=5, do_sample=False, suppress_tokens=[eos])
        assert gen[0, x["input_ids"].shape[1] :].tolist() == responses[traj][:5]


def test_cache_stays_bounded_over_a_long_run(make_env, make_policy):
    env = make_env(batch_size=3, max_new_tokens=6)
    policy = make_policy(env)
    td = env.reset()
    widest = 0
    for _ in range(300):
        td = policy(td)
        _, td = env.step_and_maybe_reset(td)
        widest = max(widest, policy.cache.columns)
    # prompts are at most ~10 tokens, responses 6: the cache never holds much more than one sequence
    assert widest <= 1.25 * 20 + 10


def test_policy_version_is_stamped(make_env, make_policy):
    env = make_env()
    policy = make_policy(env)
    td = policy(env.reset())
    assert td["policy_version"].tolist() == [0] * 4
    policy.update_weights()
    _, td = env.step_and_maybe_reset(td)
    assert policy(td)["policy_version"].tolist() == [1] * 4


def test_raw_log_prob_is_optional(make_env, make_policy):
    env = make_env()
    policy = make_policy(env, sampling=SamplingConfig(temperature=0.7), return_raw_log_prob=True)
    td = policy(env.reset())
    assert "raw_log_prob" in td.keys() and not torch.allclose(td["raw_log_prob"], td["action_log_prob"])


def test_vocab_mismatch_is_rejected(tokenizer, make_env):
    from tokengym.testing import tiny_tokenizer

    big = tiny_model(tiny_tokenizer(2048))
    env = make_env()
    with pytest.raises(ValueError, match=r"can emit ids up to 2047 but the env accepts \[0, 512\); build the env with model_config"):
        TransformersPolicy(big, env)
    small_vocab = tiny_model(tokenizer)
    small_vocab.config.vocab_size = 300
    with pytest.raises(ValueError, match=r"has vocab_size 300, smaller than the env tokenizer's 512"):
        TransformersPolicy(small_vocab, env)


def test_model_without_cache_and_bad_sampling(tokenizer, make_env):
    env = make_env()
    model = tiny_model(tokenizer)
    with pytest.raises(TypeError, match=r"sampling must be a SamplingConfig, got dict"):
        TransformersPolicy(model, env, sampling={"temperature": 1.0})
    model.config.use_cache = False
    with pytest.raises(ValueError, match=r"config.use_cache is False; set model.config.use_cache = True"):
        TransformersPolicy(model, env)
    with pytest.raises(TypeError, match=r"model must be a transformers causal LM, got int"):
        TransformersPolicy(3, env)


def test_score_reproduces_the_sampling_log_probs(make_env, make_policy):
    from tokengym.collectors import TokenCollector
    from tokengym.llm_envs import keys

    env = make_env(batch_size=3, max_new_tokens=5, eos_token_ids=list(range(1, 512, 9)))
    policy = make_policy(env, sampling=SamplingConfig(temperature=0.8))
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4)))
    mask = batch[keys.MASK]
    logp, entropy = policy.teacher_forced_log_probs(batch, with_entropy=True)
    assert torch.allclose(logp[mask], batch[keys.ACTION_LOG_PROB][mask], atol=1e-5)
    assert bool((entropy[mask] > 0).all()) and bool((entropy[~mask] == 0).all())


def test_outputs_are_ordinary_tensors_though_the_cache_runs_in_inference_mode(make_env, make_policy):
    """The KV cache's forwards run under torch.inference_mode (faster); what the policy hands out is not an
    inference tensor: a user may write it in place and use it in a loss that autograd saves, and a checkpoint
    of the cache holds ordinary tensors."""
    env = make_env()
    policy = make_policy(env)
    td = policy(env.reset())
    for key in ("action", "action_log_prob"):
        assert not td[key].is_inference()
    weight = torch.ones(4, requires_grad=True)
    (weight * td["action_log_prob"]).sum().backward()  # saved for backward: refused for an inference tensor
    td["action_log_prob"].mul_(1.0)  # in place: refused outside inference mode for an inference tensor
    _, td = env.step_and_maybe_reset(td)
    td = policy(td)  # the next step goes on from the cache filled in inference mode
    state = policy.cache.state_dict()
    assert not any(k.is_inference() or v.is_inference() for k, v in state["kv"]) and not state["mask"].is_inference()
    restored = type(policy.cache)(policy.model, 4)
    restored.load_state_dict(state)
    restored.length += 0  # the restored cache is written in place by the next steps
