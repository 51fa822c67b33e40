"""The captured decode step (TransformersPolicy(decode="graph"), GraphDecode) and the compiled one (decode="compile",
CompiledDecode): on CUDA, the graph's replays and the compiled step give the tokens and log-probs of the same step
uncaptured (decode="static") for the same generator state, see a weight update between two steps and capture (compile)
again when the buffers grow (test_gpu_collection counts their host synchronizations). On the CPU the same tests
compare decode="static" (the step a graph captures) with decode="dynamic", and decode="compile" (Inductor's kernels on
the CPU) with decode="static"."""

import copy

import pytest
import torch

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.branching import SegmentRule
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model

PROMPTS = ["What is 12 + 7?", "hi", "Reverse the string abc:", "a b c d e f g h", "1+1=", "count down 5 4"]
# on each device: (the decode under test, the one it must equal)
DECODES = {"captured": {"cpu": ("static", "dynamic"), "cuda": ("graph", "static")},
           "compiled": {"cpu": ("compile", "static"), "cuda": ("compile", "static")}}  # fmt: skip


@pytest.fixture(params=list(DECODES))
def decodes(request, device) -> tuple[str, str]:
    """(the decode under test, the one it must equal) on ``device``."""
    return DECODES[request.param][device]


def _stepped(policy) -> bool:
    """Whether the policy's step is captured or compiled (then it counts its captures)."""
    return policy.graph is not None


def _reward(responses, prompts, metadata):
    return [float(len(r) % 3) for r in responses]


def _collect(tokenizer, model, decode, *, batches=2, sampling=None, tree=None, max_length=40, seed=0):
    env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, group_size=2, max_new_tokens=20, max_length=max_length,
                   model_config=model.config)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=seed, decode=decode, sampling=sampling, return_raw_log_prob=True)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4,
                               options=CollectorOptions(tree=tree) if tree else None)  # fmt: skip
    it = iter(collector)
    return [next(it) for _ in range(batches)], policy


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.7, top_k=40, top_p=0.9)],
                         ids=["plain", "filtered"])  # fmt: skip
def test_the_captured_step_gives_the_uncaptured_tokens_and_log_probs(tokenizer, device, decodes, sampling):
    model = tiny_model(tokenizer, seed=0).to(device)
    fast, reference = decodes
    want, _ = _collect(tokenizer, model, reference, sampling=sampling, tree=SegmentRule(3, 2))
    got, policy = _collect(tokenizer, model, fast, sampling=sampling, tree=SegmentRule(3, 2))
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a[keys.ACTION], b[keys.ACTION])
        for key in (keys.ACTION_LOG_PROB, keys.RAW_LOG_PROB):
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)
    if _stepped(policy):
        assert policy.graph.captures == 1 and policy.graph.capture_seconds > 0


def test_a_weight_update_between_two_replays_reaches_the_next_token(tokenizer, device, decodes):
    model = tiny_model(tokenizer, seed=0).to(device)
    env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, group_size=2, max_new_tokens=20, max_length=40,
                   model_config=model.config)  # fmt: skip
    policy = TransformersPolicy(copy.deepcopy(model), env, seed=0, decode=decodes[0])
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4)
    it = iter(collector)
    next(it)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(device) * 0.05)
    buffers = [k.data_ptr() for k, _ in policy.cache.buffers]
    collector.update_policy_weights_(new.state_dict())
    batch = next(it)
    mask = batch[keys.MASK] & (batch[keys.POLICY_VERSION] == 1)
    forced = TransformersPolicy(new, env).teacher_forced_log_probs(batch)
    assert bool(mask.any())
    torch.testing.assert_close(batch[keys.ACTION_LOG_PROB][mask], forced[mask], atol=1e-4, rtol=0)
    assert [k.data_ptr() for k, _ in policy.cache.buffers] == buffers  # cleared in place: the graph's buffers
    if _stepped(policy):
        assert policy.graph.captures == 1  # the update needed no new graph


def test_grown_buffers_are_captured_again(tokenizer, device, decodes):
    """Self-play's waiting seats can outgrow the buffers: a new layout, a new graph, the same tokens."""
    model = tiny_model(tokenizer, seed=0).to(device)
    fast, reference = decodes
    want, _ = _collect(tokenizer, model, reference, batches=1)
    got, policy = _collect(tokenizer, model, fast, batches=0)
    policy.cache.reserve(policy.cache.capacity + 8)  # as a window too wide for the buffers would
    assert policy.cache.layout == 2
    env = policy.env
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4)
    batch = next(iter(collector))
    assert torch.equal(batch[keys.ACTION], want[0][keys.ACTION])
    if _stepped(policy):
        assert policy.graph.captures == 1  # captured on the grown buffers only


def test_waves_on_the_captured_step_give_the_uncaptured_waves(tokenizer, device, decodes):
    """Waves (source="wave") run on the policy's fixed-shape step: captured, every wave filling the env's slots, they
    give the uncaptured step's tokens (on the CPU: the static step's waves give generate's)."""
    model = tiny_model(tokenizer, seed=0).to(device)
    fast, reference = decodes
    batches = {}
    for decode in (reference, fast):
        env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, group_size=2, max_new_tokens=20, max_length=40,
                       model_config=model.config)  # fmt: skip
        policy = TransformersPolicy(model, env, seed=0, decode=decode, return_raw_log_prob=True)
        it = iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave"))
        batches[decode] = [next(it) for _ in range(2)]
    for a, b in zip(batches[reference], batches[fast], strict=True):
        assert torch.equal(a[keys.ACTION], b[keys.ACTION])
        for key in (keys.ACTION_LOG_PROB, keys.RAW_LOG_PROB):
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)
    if _stepped(policy):
        assert policy.graph.captures == 1


def test_steps_after_a_wave_and_waves_after_steps(tokenizer, device, decodes):
    """The step's input buffers, made during a wave (under inference mode), are written again by a step outside it,
    and the other way round: the tokens of the uncaptured static step in the same order of calls."""
    model = tiny_model(tokenizer, seed=0).to(device)
    batches = {}
    for decode in ("static", decodes[0]):
        env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, group_size=2, max_new_tokens=20, max_length=40,
                       model_config=model.config)  # fmt: skip
        policy = TransformersPolicy(model, env, seed=0, decode=decode, return_raw_log_prob=True)
        waves = iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave"))
        steps = iter(TokenCollector(env, policy, mode="trajectories", batch_size=4))
        batches[decode] = [next(waves), next(steps), next(waves)]
    for a, b in zip(batches["static"], batches[decodes[0]], strict=True):
        assert torch.equal(a[keys.ACTION], b[keys.ACTION])
        for key in (keys.ACTION_LOG_PROB, keys.RAW_LOG_PROB):
            torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0)
