"""OpenEnv adapter against real servers: an openenv-core server of a 3-turn game (see openenv_server.py),
a server killed mid-episode, a server that answers with malformed messages, one that never answers."""

import pytest
import torch
from adapter_helpers import SOURCES, Server, collect, gym_episode, turn_texts
from openenv_server import score

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.errors import EpisodeError, PromptError
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import make_openenv_env
from tokengym.llm_envs.gym_adapter import GymTokenEnv
from tokengym.transforms.layouts import to_padded

END_IDS = list(range(1, 512, 7))  # many end ids: turns end after a few tokens of a random model


def _env(url, tok, lm, **kwargs):
    kwargs = {"batch_size": 4, "max_turns": 3, "max_new_tokens": 40, "max_length": 256, "eos_token_ids": END_IDS,
              "model_config": lm.config, "timeout_s": 10.0, **kwargs}  # fmt: skip
    return make_openenv_env(url, tok, **kwargs)


@pytest.mark.parametrize("source", SOURCES)
def test_sessions_give_per_turn_rewards_and_masked_feedback(openenv_server, tok, lm, make_policy, source):
    env = _env(openenv_server.url, tok, lm)
    policy, kind = make_policy(env, source)
    batches = collect(env, policy, kind, trajectories=8)
    checked_turns = feedback_seen = 0
    for batch in batches:
        table = batch.get_non_tensor(keys.PROMPTS)
        padded = to_padded(batch)
        for row in range(batch.shape[0]):
            meta = table.metadata(int(batch[keys.GROUP_ID][row, 0]))
            assert meta["where"] == f"OpenEnv server ws://127.0.0.1:{openenv_server.port}/ws"
            target, texts = meta["seed"] % 10, turn_texts(tok, batch, row)
            mask, turn = batch[keys.MASK][row], batch[keys.TURN][row]
            rewards = batch[keys.REWARD][row].squeeze(-1)
            for t, text in enumerate(texts):
                last = int(((turn == t) & mask).nonzero()[-1])
                reward, feedback, done = score(text, target)
                assert rewards[last].item() == pytest.approx(reward), (row, t, text)
                assert bool(batch[keys.DONE][row, last]) == (t == len(texts) - 1)
                checked_turns += 1
                if t < len(texts) - 1:  # the server's answer sits between the turns, masked out of the actions
                    assert not done
                    tokens, action_mask = padded[keys.TOKENS][row], padded[keys.ACTION_MASK][row]
                    env_text = tok.decode(tokens[padded[keys.ATTENTION_MASK][row] & ~action_mask])
                    assert feedback in env_text
                    feedback_seen += 1
            end = int(mask.nonzero()[-1])
            if len(texts) < 3 and not bool(batch[keys.TRUNCATED][row, end]):  # the server ended it: the right digit
                assert score(texts[-1], target)[2]
    assert checked_turns > 8 and feedback_seen > 0


def test_concurrent_sessions_one_per_slot(openenv_server, tok, lm):
    env = _env(openenv_server.url, tok, lm, batch_size=6)
    env.reset()
    assert len(env.turns.backend.live) == 6
    episodes = sorted(env.slot_prompt(b).metadata["episode"] for b in range(6))
    assert episodes == list(range(6))
    outcomes = env.turns.backend.step(episodes, ["5"] * 6)  # six steps in flight at once, one per session
    assert [o.reward for o in outcomes] == [score("5", env.source.episode_seed(g) % 10)[0] for g in episodes]
    env.close()
    assert env.turns.backend.live == []


def test_killed_server_ends_only_its_episodes_and_the_collector_resumes(openenv_server, tok, lm):
    first = Server("openenv")
    try:
        env = _env(first.url, tok, lm)
        collector = TokenCollector(env, TransformersPolicy(lm, env), mode="trajectories", batch_size=4)
        iterator = iter(collector)
        next(iterator)
        first.stop()  # mid-episode: the slots hold live sessions
        with pytest.raises(PromptError) as caught:
            for _ in range(50):
                next(iterator)
        message = str(caught.value)
        assert f"ws://127.0.0.1:{first.port}/ws" in message and "episode" in message
        assert isinstance(caught.value.__cause__, EpisodeError)
        state = collector.state_dict()
    finally:
        first.stop()
    env = _env(openenv_server.url, tok, lm)  # resume against another server
    resumed = TokenCollector(env, TransformersPolicy(lm, env), mode="trajectories", batch_size=4)
    resumed.load_state_dict(state)
    got, errors = [], []
    while len(got) < 2 and len(errors) < 20:
        try:
            for batch in resumed:
                got.append(batch)
                if len(got) == 2:
                    break
        except PromptError as err:  # restored slots' sessions died with the first server
            errors.append(str(err))
    assert len(got) == 2 and all("no live session" in e or "episode" in e for e in errors)
    groups = torch.cat([b[keys.GROUP_ID][:, 0] for b in got])
    assert len(groups.unique()) == len(groups)  # no episode twice
    assert int(groups.max()) >= state["env"]["source"]["next_episode"]  # new episodes on the new server
    env.close()


@pytest.mark.parametrize("mode, expected", [("malformed", r"malformed message \(not JSON\)"), ("silent", "TimeoutError")])
def test_bad_server_ends_the_episode_with_a_clear_error(tok, lm, mode, expected):
    server = Server(mode)
    try:
        env = _env(server.url, tok, lm, batch_size=2, timeout_s=1.0, action_field="guess")
        collector = TokenCollector(env, TransformersPolicy(lm, env), mode="steps", batch_size=4)
        with pytest.raises(PromptError, match=expected) as caught:
            for _ in collector:
                pass
        assert f"ws://127.0.0.1:{server.port}/ws" in str(caught.value) and "episode" in str(caught.value)
    finally:
        server.stop()


def test_bad_arguments(openenv_server, tok, lm):
    with pytest.raises(ValueError, match="url must look like"):
        make_openenv_env("127.0.0.1:80", tok)
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        make_openenv_env(openenv_server.url, tok, timeout_s=0)
    with pytest.raises(ValueError, match="group_size must be 1"):
        make_openenv_env(openenv_server.url, tok, group_size=2)
    env = _env(openenv_server.url, tok, lm, batch_size=1, action_field="nope")  # the server rejects the action
    env.reset()
    out = env.turns.backend.step([0], ["5"])
    assert "answered with an error" in str(out[0])
    env.close()


def test_gym_reset_with_a_seed_starts_the_same_episode_again(openenv_server, tok):
    """``reset(seed=0)`` of a gymnasium-wrapped OpenEnv env, a few steps, ``reset(seed=0)``: the same session again."""
    env = GymTokenEnv(make_openenv_env, url=openenv_server.url, tokenizer=tok, batch_size=1, max_turns=3,
                      max_new_tokens=16, max_length=256, timeout_s=10.0)  # fmt: skip
    assert env.env.source.episode_seed(0) % 10 == 0  # the target of episode 0: the guesses below are wrong
    actions = [t for guess in "123" for t in (*tok.encode(guess), tok.eos_token_id)]
    first = gym_episode(env, actions)
    assert first[0][1]["metadata"]["episode"] == 0 and len(first) > 2
    again = gym_episode(env, actions[:3])  # mid-episode: the session the slot held is closed
    assert repr(again) == repr(first[:4])
    assert repr(gym_episode(env, actions)) == repr(first)
    assert env.env.turns.backend.live == []  # max_turns ended it
    env.env.close()
