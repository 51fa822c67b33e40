"""Agent envs on every backend: in-process vLLM (log-probs vs teacher forcing), AsyncCollector with weight
updates, Ray workers (the agent pickles). A two-turn chat program on the random tiny model, no tools."""

from __future__ import annotations

import copy
import functools
import sys

import pytest
import torch
from ray import cloudpickle

from tokengym.collectors import TokenCollector
from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.agents import make_agent_env
from tokengym.testing import tiny_tokenizer
from tokengym.transforms import step_log_probs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import test modules by name

TASKS = ["1+1=", "2+3=", "7*8=", "9-4="]


async def chat_agent(client, task, replies=None):
    """Two turns: the task, then a follow-up question; the reward is how many turns ended on their own."""
    messages = [{"role": "user", "content": task}]
    ended = 0
    for follow_up in ("and why?", None):
        reply = await client.chat.completions.create(model="p", messages=messages, logprobs=True)
        choice = reply.choices[0]
        if replies is not None:  # by task: each task runs once
            replies.setdefault(task, []).append((choice.token_ids, [c.logprob for c in choice.logprobs.content]))
        ended += choice.finish_reason == "stop"
        if follow_up is None:
            break
        messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": follow_up}]
    return float(ended)


def make_env(agent=chat_agent, *, batch_size=2, epochs=1, **kwargs):
    return make_agent_env(agent, TASKS, tiny_tokenizer(), batch_size=batch_size, max_new_tokens=24, max_turn_tokens=10,
                          max_length=256, max_turns=2, epochs=epochs, **kwargs)  # fmt: skip


def _rows(batch) -> set:
    """Each trajectory's generated ids, turn after turn."""
    mask = batch[keys.MASK]
    return {tuple(batch[keys.ACTION][i][mask[i]].tolist()) for i in range(batch.shape[0])}


def test_agent_env_on_in_process_vllm(vllm_engine, lm):
    from tokengym.collectors.policies.vllm_policy import VLLMPolicy

    replies = {}
    env = make_env(functools.partial(chat_agent, replies=replies), batch_size=4)
    policy = VLLMPolicy(vllm_engine.llm, env)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, total_steps=400, source="wave")))
    mask = batch[keys.MASK]
    assert bool((batch[keys.TURN][mask] == 1).any())  # two turns
    scored = step_log_probs(lm, batch, pad_id=env.tokenizer.pad_token_id)
    torch.testing.assert_close(scored[mask], batch[keys.ACTION_LOG_PROB][mask], atol=2e-4, rtol=0)
    # the replies carried the ids the policy sampled and their log-probs
    sampled = {tuple(batch[keys.ACTION][i][mask[i]].tolist()): batch[keys.ACTION_LOG_PROB][i][mask[i]]
               for i in range(4)}  # fmt: skip
    replied = {tuple(i for ids, _ in r for i in ids): torch.tensor([lp for _, lps in r for lp in lps])
               for r in replies.values()}  # fmt: skip
    assert set(sampled) == set(replied)
    for ids, lp in sampled.items():
        torch.testing.assert_close(replied[ids], lp, atol=1e-6, rtol=0)
    env.close()


def test_agent_env_behind_async_collector_with_weight_updates(lm):
    env = make_env(batch_size=2, epochs=None)
    policy = TransformersPolicy(copy.deepcopy(lm), env, return_raw_log_prob=True)
    inner = TokenCollector(env, policy, mode="trajectories", batch_size=2, total_steps=2000)
    got = []
    with AsyncCollector(inner, max_staleness=1) as collector:
        for batch in collector:
            got.append(batch)
            collector.update_policy_weights_(lm.state_dict())
            if len(got) == 3:
                break
        metrics = collector.metrics
    assert all(b.shape[0] == 2 for b in got) and metrics["agent_errors"] == 0
    env.close()


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for this module's Ray tests (one already running is used as is)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    if started:
        ray.shutdown()


def _worker_policies(lm, **kwargs):
    """``make_policy(env)`` for Ray workers: a copy of ``lm`` with its weights, in a TransformersPolicy."""
    weights = {k: v.clone() for k, v in lm.state_dict().items()}

    def make_policy(env):
        model = copy.deepcopy(lm)
        model.load_state_dict(weights)
        return TransformersPolicy(model, env, **kwargs)

    return make_policy


def test_agent_env_on_ray_workers(lm, local_ray):
    from tokengym.collectors.ray_collector import RayTokenCollector

    with RayTokenCollector(make_env, _worker_policies(lm), num_workers=2, mode="trajectories", batch_size=4,
                           total_steps=800) as collector:  # fmt: skip
        batch = next(iter(collector))
    assert batch.shape[0] == 4 and len(_rows(batch)) >= 2
    assert set(batch[keys.REWARD].sum((1, 2)).tolist()) <= {0.0, 1.0, 2.0}


async def rewriting_agent(client, task):
    """Two calls, the second with the first turn dropped (a rewrite): with on_rewrite="split", two trajectories."""
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": task}])
    await client.chat.completions.create(model="p", messages=[{"role": "user", "content": task + " again"}])
    return float(len(task))


def test_split_episodes_on_ray_workers(lm, local_ray):
    from tokengym.collectors.ray_collector import RayTokenCollector
    from tokengym.transforms import to_padded

    env_fn = functools.partial(make_env, rewriting_agent, on_rewrite="split")
    with RayTokenCollector(env_fn, _worker_policies(lm, return_raw_log_prob=True), num_workers=2,
                           mode="trajectories", batch_size=2, total_steps=800) as collector:  # fmt: skip
        batch = next(iter(collector))
        assert collector.metrics["history_splits"] >= 2
    assert batch.shape[0] == 4  # 2 episodes, each a part and its last trajectory
    episode = batch[keys.GROUP_ID][:, 0] * 100 + batch[keys.SAMPLE_ID][:, 0]
    rewards = batch[keys.REWARD].sum((1, 2))
    for e in episode.unique():
        assert (episode == e).sum() == 2 and rewards[episode == e].unique().numel() == 1
    mask = batch[keys.MASK]
    scored = step_log_probs(lm, batch)  # the parts' own prompts travel with the workers' batches
    torch.testing.assert_close(scored[mask], batch[keys.RAW_LOG_PROB][mask], atol=1e-5, rtol=0)
    assert to_padded(batch).shape[0] == 4


@pytest.mark.parametrize("bad", ["no template", "no tokenizer"])
def test_make_agent_env_refuses_a_tokenizer_it_cannot_use(bad):
    tok = tiny_tokenizer()
    if bad == "no template":
        tok.chat_template = None
        with pytest.raises(ValueError, match="chat_template"):
            make_agent_env(chat_agent, TASKS, tok)
    else:
        with pytest.raises(TypeError, match="make_agent_env"):
            make_agent_env(chat_agent, TASKS, None)
