"""Agent programs written against the OpenAI SDK as token envs: real ``openai`` clients, a tiny model that calls
tools, every generated token checked against the policy and teacher forcing."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from agent_helpers import TASKS, TOOLS, calculator_agent, first_messages
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import PaddedSequenceActor, SamplingConfig, TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.agents import AgentError, make_agent_env
from tokengym.llm_envs.errors import PromptError
from tokengym.testing import PublishAfter
from tokengym.transforms import GroupAdvantage, group_advantages, step_log_probs, to_padded

GREEDY = SamplingConfig(greedy=True)


def _env(tok, model, agent=calculator_agent, tasks=TASKS, **kwargs):
    kwargs = {"batch_size": 4, "group_size": 2, "max_new_tokens": 120, "max_length": 512, "max_turns": 4,
              "model_config": model.config, "temperature": None, **kwargs}  # fmt: skip
    return make_agent_env(agent, tasks, tok, **kwargs)


def _collect(env, policy, *, source=None, n=4, steps=4000):
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=n, total_steps=steps, source=source)
    return next(iter(collector)), collector


def _check_tokens(batch, model, tok):
    """Each generated token is the one the policy sampled, its log-prob equals teacher forcing, env tokens masked."""
    mask = batch[keys.MASK]
    scored = step_log_probs(model, batch, pad_id=tok.pad_token_id)
    torch.testing.assert_close(scored[mask], batch[keys.RAW_LOG_PROB][mask], atol=1e-5, rtol=1e-5)
    padded = to_padded(batch, pad_id=tok.pad_token_id)
    assert padded[keys.ACTION_MASK].sum().item() == mask.sum().item()  # env tokens (tool results) are masked
    return padded


@pytest.mark.parametrize("source", ["step", "wave"])
def test_react_agent_with_parallel_tool_calls_trains(tool_tokenizer, tool_model, source):
    tok, model = tool_tokenizer, tool_model
    env = _env(tok, model)
    policy = TransformersPolicy(model, env, sampling=GREEDY, return_raw_log_prob=True)
    batch, collector = _collect(env, policy, source=source)
    assert batch.shape[0] == 4
    reward = batch[keys.REWARD].sum((1, 2))
    assert reward.tolist() == [1.0] * 4  # two parallel calls, the tool results, the right sums (greedy replays them)
    assert (batch[keys.TURN].amax(1) == 1).all()  # two turns each: the calls, then the answer
    _check_tokens(batch, model, tok)
    table = batch.get_non_tensor(keys.PROMPTS)
    for traj in batch[keys.TRAJ_ID][:, 0].tolist():  # two parallel calls answered by two tool results each
        text = tok.decode(table.sequence(traj))
        assert text.count("</tool_call>") == 3 and text.count("</tool_response>") == 2, text
        assert "<|tool|><tool_response>" in text
    assert collector.metrics["agent_episodes"] >= 4 and collector.metrics["agent_errors"] == 0
    # GRPO on the batch
    batch = GroupAdvantage()(batch)
    padded = to_padded(batch, pad_id=tok.pad_token_id)
    actor = PaddedSequenceActor(model)
    loss = GRPOLoss(actor)(padded)
    assert torch.isfinite(loss.loss_objective)
    env.close()


def test_an_agent_call_across_a_weight_update_gets_one_reply(tool_tokenizer, tool_model):
    """A wave interrupted by an update (partial rollouts) goes on in the next wave: the program sees one reply per call,
    as if nothing happened (the update here publishes the same weights, so greedy decoding replays the same episode)."""
    tok, model = tool_tokenizer, tool_model
    env = _env(tok, model)
    policy = TransformersPolicy(model, env, sampling=GREEDY, return_raw_log_prob=True)
    policy.interrupt = PublishAfter(6, lambda: collector.update_policy_weights_(model.state_dict()))
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=4, total_steps=4000, source="wave")
    batch = next(iter(collector))
    assert collector.metrics["interrupted_sequences"] > 0 and policy.version == 1
    assert batch[keys.REWARD].sum((1, 2)).tolist() == [1.0] * 4  # the right sums, as without the interruption
    assert (batch[keys.TURN].amax(1) == 1).all() and collector.metrics["agent_errors"] == 0
    _check_tokens(batch, model, tok)
    table = batch.get_non_tensor(keys.PROMPTS)
    for traj in batch[keys.TRAJ_ID][:, 0].tolist():  # two calls answered by two tool results, as in one wave
        text = tok.decode(table.sequence(traj))
        assert text.count("</tool_call>") == 3 and text.count("</tool_response>") == 2, text
    env.close()


# -- failures end only their episode, through the PromptError path --


def _collect_through_errors(env, policy, *, n=4, source="wave", steps=3000, batches=1):
    """Iterate a collector past its AgentErrors: (the last of ``batches`` batches, errors seen, collector)."""
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=n, total_steps=steps, source=source)
    it, errors, got = iter(collector), [], []
    while len(got) < batches:
        try:
            got.append(next(it))
        except PromptError as err:  # the same iterator goes on
            errors.append(err)
            assert len(errors) < 20
    return got[-1], errors, collector


@pytest.mark.parametrize("failure", ["raises", "hangs"])
def test_agent_that_raises_or_hangs_ends_only_its_episode(tool_tokenizer, tool_model, failure):
    async def agent(client, task):
        reply = await client.chat.completions.create(model="p", messages=first_messages(task), tools=TOOLS)
        if task["question"].startswith("1+1"):
            if failure == "raises":
                raise RuntimeError("tool backend down")
            await asyncio.sleep(60)  # hangs: the time limit ends it
        return float(reply.choices[0].finish_reason == "tool_calls")

    env = _env(tool_tokenizer, tool_model, agent, group_size=1, batch_size=2, time_limit=1.0, epochs=3)
    policy = TransformersPolicy(tool_model, env, sampling=GREEDY, return_raw_log_prob=True)
    batch, errors, collector = _collect_through_errors(env, policy, n=2, batches=3)
    assert errors and all(isinstance(e.__cause__, AgentError) for e in errors)
    cause = str(errors[0].__cause__)
    assert "agent" in cause and "task 1" in cause and "the others go on" in cause, cause
    assert ("RuntimeError: tool backend down" if failure == "raises" else "time limit of 1.0 s") in cause
    assert collector.metrics["agent_errors"] == 3 and collector.metrics["agent_episodes"] == 6
    rewards = batch[keys.REWARD].sum((1, 2)).tolist()
    assert sorted(rewards) == [0.0, 1.0]  # the failed episode scores 0, the other its reward
    env.close()


def test_history_rewrite_is_refused_naming_the_message(tool_tokenizer, tool_model):
    seen = []

    async def agent(client, task):
        messages = first_messages(task)
        reply = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        messages += [{"role": "assistant", "content": "I rewrote this"}, {"role": "user", "content": "go on"}]
        try:
            await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        except openai.BadRequestError as err:
            seen.append(str(err))
        return float(reply.choices[0].finish_reason == "tool_calls")

    env = _env(tool_tokenizer, tool_model, agent, group_size=1, batch_size=2, epochs=1)
    policy = TransformersPolicy(tool_model, env, sampling=GREEDY, return_raw_log_prob=True)
    batch, errors, collector = _collect_through_errors(env, policy, n=2)
    assert not errors and len(seen) == 2
    assert "rewrote its history: message 1 (assistant" in seen[0] and "I rewrote this" in seen[0]
    assert collector.metrics["history_rewrites"] == 2
    env.close()


def test_requests_the_env_cannot_honour_are_refused_with_the_fix(tool_tokenizer, tool_model):
    refusals = {}

    async def agent(client, task):
        messages = first_messages(task)
        for name, extra in {"n": {"n": 2}, "stream": {"stream": True}, "temperature": {"temperature": 0.3},
                            "max_tokens": {"max_tokens": 4}}.items():  # fmt: skip
            try:
                await client.chat.completions.create(model="p", messages=messages, **extra)
            except openai.BadRequestError as err:
                refusals[name] = str(err)
        await client.chat.completions.create(model="p", messages=messages, temperature=1.0)
        return 1.0

    env = _env(tool_tokenizer, tool_model, agent, tasks=TASKS[:1], group_size=1, batch_size=1, epochs=1,
               temperature=1.0, max_turn_tokens=64)  # fmt: skip
    policy = TransformersPolicy(tool_model, env, return_raw_log_prob=True)
    batch, errors, _ = _collect_through_errors(env, policy, n=1)
    assert not errors and batch[keys.REWARD].sum().item() == 1.0
    assert "n=2 is not supported" in refusals["n"] and "group_size" in refusals["n"]
    assert "stream=True" in refusals["stream"]
    assert "temperature=0.3 conflicts" in refusals["temperature"]
    assert "max_turn_tokens=64" in refusals["max_tokens"]
    env.close()


def test_conversation_that_outgrows_the_context_gets_length(tool_tokenizer, tool_model):
    finish = []

    async def agent(client, task):
        messages = [{"role": "user", "content": "tell a long story " * 3}]
        while True:
            try:
                reply = await client.chat.completions.create(model="p", messages=messages)
            except openai.BadRequestError as err:
                finish.append(str(err))
                return 0.5
            finish.append(reply.choices[0].finish_reason)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]

    env = _env(tool_tokenizer, tool_model, agent, tasks=["x"], group_size=1, batch_size=1, epochs=1, max_length=48,
               max_new_tokens=47, max_turns=8, eos_token_ids=[tool_tokenizer.eos_token_id])  # fmt: skip
    policy = TransformersPolicy(tool_model, env, return_raw_log_prob=True)
    batch, errors, _ = _collect_through_errors(env, policy, n=1, source="step")
    assert not errors and "length" in finish and "context" in finish[-1]
    assert batch[keys.REWARD].sum().item() == 0.5 and bool(batch[("next", "truncated")].any())
    env.close()


def test_sync_agent_over_http_with_a_bearer_key(tool_tokenizer, tool_model):
    """A plain function with the sync ``openai.OpenAI`` client, over HTTP on 127.0.0.1: same turns, same checks."""
    import httpx

    urls = []

    def agent(client, task):
        urls.append(str(client.base_url))
        reply = client.chat.completions.create(model="p", messages=first_messages(task), tools=TOOLS)
        denied = httpx.post(f"{client.base_url}chat/completions", json={"messages": first_messages(task)},
                            headers={"Authorization": "Bearer wrong"}, timeout=60)  # fmt: skip
        assert denied.status_code == 401
        return float(bool(reply.choices[0].message.tool_calls))

    env = _env(tool_tokenizer, tool_model, agent, transport="http", group_size=1, batch_size=2, epochs=1)
    policy = TransformersPolicy(tool_model, env, sampling=GREEDY, return_raw_log_prob=True)
    batch, errors, _ = _collect_through_errors(env, policy, n=2)
    assert not errors and urls[0].startswith("http://127.0.0.1:")
    assert batch[keys.REWARD].sum().item() == 2.0
    _check_tokens(batch, tool_model, tool_tokenizer)
    env.close()
    with pytest.raises(httpx.ConnectError):  # the endpoint is gone with the env
        httpx.get(urls[0] + "models", timeout=2)


def test_sixteen_agents_whose_tools_sleep_do_not_serialize(tool_tokenizer, tool_model):
    """16 episodes, each sleeping 1 s in its tool between two turns: their sleeps overlap (counted, not timed: a
    runner that awaited one program at a time would never have two asleep at once)."""
    sleep, asleep, most = 1.0, [0], [0]

    async def agent(client, task):
        messages = first_messages(task)
        reply = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        asleep[0] += 1
        most[0] = max(most[0], asleep[0])
        await asyncio.sleep(sleep)  # a slow tool
        asleep[0] -= 1
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        return 1.0

    env = _env(tool_tokenizer, tool_model, agent, tasks=TASKS * 8, group_size=1, batch_size=16, epochs=1,
               max_turn_tokens=8)  # fmt: skip
    policy = TransformersPolicy(tool_model, env, return_raw_log_prob=True)
    batch, errors, _ = _collect_through_errors(env, policy, n=16, source="wave")
    assert not errors and batch.shape[0] == 16 and batch[keys.REWARD].sum().item() == 16.0
    assert most[0] >= 2, most  # the tools slept side by side
    env.close()


def test_episodes_of_a_group_must_open_alike(tool_tokenizer, tool_model):
    async def agent(client, task):  # a random system prompt: each run of a task opens differently
        import random

        messages = [{"role": "system", "content": f"seed {random.random()}"}, *first_messages(task)]
        await client.chat.completions.create(model="p", messages=messages)
        return 1.0

    env = _env(tool_tokenizer, tool_model, agent, group_size=2, batch_size=2, epochs=1)
    with pytest.raises(PromptError) as info:
        env.reset()
    assert "must open with the same messages" in str(info.value.__cause__)
    env.close()


@pytest.mark.parametrize("source", ["step", "wave"])
def test_history_rewrite_splits_the_episode_with_the_option(tool_tokenizer, tool_model, source):
    """on_rewrite="split": the part so far is its own trajectory, the rewritten conversation starts a new one; both
    carry the episode's reward, group and sample ids; advantages count the episode once."""
    tok, model = tool_tokenizer, tool_model
    started = []

    async def agent(client, task):
        messages = first_messages(task)
        first = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
        summary = f"(summary: the model said {len(first.choices[0].message.content or '')} chars)"
        rewritten = [{"role": "user", "content": task["question"] + " " + summary}]  # drops the first turn
        await client.chat.completions.create(model="p", messages=rewritten, tools=TOOLS)
        started.append(task)
        return float(len(started))  # every episode its own reward: groups spread

    env = _env(tok, model, agent, on_rewrite="split", group_size=2, batch_size=2, epochs=1)
    policy = TransformersPolicy(model, env, return_raw_log_prob=True)
    batch, errors, collector = _collect_through_errors(env, policy, n=4, source=source)
    assert not errors and collector.metrics["history_splits"] == 4 == batch.shape[0] // 2  # 4 episodes, 2 parts each
    rewards = batch[keys.REWARD].sum((1, 2))
    episode = batch[keys.GROUP_ID][:, 0] * 10 + batch[keys.SAMPLE_ID][:, 0]
    for e in episode.unique():
        rows = episode == e
        assert int(rows.sum()) == 2 and rewards[rows][0] == rewards[rows][1] >= 1  # both parts: the episode's reward
    assert bool((batch[keys.TURN] == 0).all())  # each part is one turn: the split is not a turn
    _check_tokens(batch, model, tok)  # the second part's prompt is its own (the rewritten conversation)
    table = batch.get_non_tensor(keys.PROMPTS)
    assert len(table.own_prompt_trajs()) == 4
    adv = GroupAdvantage()(batch)[keys.ADVANTAGE][:, 0, 0]
    episodes = episode.unique()
    first = torch.stack([(episode == e).nonzero()[0, 0] for e in episodes])
    expected = group_advantages(rewards[first], batch[keys.GROUP_ID][first, 0])  # one sample per episode
    for e, a in zip(episodes, expected, strict=True):
        torch.testing.assert_close(adv[episode == e], a.expand(2))  # every part: its episode's advantage
    env.close()


def test_split_needs_trajectory_batches(tool_tokenizer, tool_model):
    env = _env(tool_tokenizer, tool_model, calculator_agent, on_rewrite="split")
    with pytest.raises(ValueError, match="mode='trajectories'"):
        TokenCollector(env, TransformersPolicy(tool_model, env), mode="steps", batch_size=8)
    env.close()


def test_reward_fn_scores_the_final_conversation_and_two_calls_at_once_are_refused(tool_tokenizer, tool_model):
    seen = []

    async def agent(client, task):  # returns None: reward_fn scores; tries two calls at once first
        messages = first_messages(task)
        results = await asyncio.gather(*(client.chat.completions.create(model="p", messages=messages) for _ in range(2)),
                                       return_exceptions=True)  # fmt: skip
        seen.extend(type(r).__name__ + ": " + str(r) for r in results if isinstance(r, Exception))
        return None

    def reward_fn(messages, task):
        return float(len(messages)) + (task is TASKS[1])

    env = _env(tool_tokenizer, tool_model, agent, reward_fn=reward_fn, group_size=1, batch_size=2, epochs=1)
    policy = TransformersPolicy(tool_model, env, return_raw_log_prob=True)
    batch, errors, _ = _collect_through_errors(env, policy, n=2)
    assert not errors and sorted(batch[keys.REWARD].sum((1, 2)).tolist()) == [2.0, 3.0]  # user + assistant (+1)
    assert len(seen) == 2 and all("ConflictError" in s and "one call at a time" in s for s in seen)
    env.close()


def test_hermes_parser_parallel_calls_and_malformed_text():
    from tokengym.llm_envs.agents import HermesToolParser, tool_parser

    parser = tool_parser("qwen2.5")
    assert isinstance(parser, HermesToolParser)
    turn = parser.parse('Let me add both.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
                        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 1}"}\n</tool_call>')  # fmt: skip
    assert turn.content == "Let me add both." and turn.malformed is None
    assert [c["function"]["name"] for c in turn.tool_calls] == ["add", "add"]
    assert [json.loads(c["function"]["arguments"]) for c in turn.tool_calls] == [{"a": 2, "b": 3}, {"a": 4, "b": 1}]
    assert len({c["id"] for c in turn.tool_calls}) == 2
    for text, why in [('<tool_call>{"name": "add"', "without its closing"), ("<tool_call>{oops}</tool_call>", "not JSON"),
                      ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
                      ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "not an object")]:  # fmt: skip
        bad = parser.parse(text)
        assert bad.content == text and bad.tool_calls == [] and why in bad.malformed
    assert parser.parse("no call here").tool_calls == []
    with pytest.raises(ValueError, match="tool_parser must be one of"):
        tool_parser("mistral")


def test_malformed_tool_calls_are_answered_as_text_and_counted(tool_tokenizer, tool_model):
    contents = []

    async def agent(client, task):
        reply = await client.chat.completions.create(model="p", messages=first_messages(task), tools=TOOLS)
        contents.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
        return 0.0

    class Strict:  # a parser that calls every turn with a tool call malformed
        def parse(self, text):
            from tokengym.llm_envs.agents import ParsedTurn

            return ParsedTurn(text, malformed="strict parser")

    env = _env(tool_tokenizer, tool_model, agent, tool_parser_name=Strict(), group_size=1, batch_size=2, epochs=1)
    policy = TransformersPolicy(tool_model, env, sampling=GREEDY, return_raw_log_prob=True)
    _, errors, collector = _collect_through_errors(env, policy, n=2)
    assert not errors and collector.metrics["malformed_tool_calls"] == 2
    assert all("<tool_call>" in c and finish == "stop" for c, finish in contents)
    env.close()
