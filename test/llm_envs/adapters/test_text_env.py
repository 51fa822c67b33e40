"""Gym-style text envs: two real TextArena games collected through the adapter (rewards and turns as the
game reports them, checked by replaying each episode's turns on a fresh game), a user's own env."""

import functools
import pickle

import pytest
import torch
from adapter_helpers import SOURCES, collect, gym_episode, turn_texts

from tokengym.collectors import TokenCollector
from tokengym.errors import PromptError
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import TextArenaEnv, make_text_env, make_textarena_env, textarena_factory
from tokengym.llm_envs.gym_adapter import GymTokenEnv
from tokengym.transforms.layouts import to_padded

END_IDS = list(range(1, 512, 7))
GAMES = ("GuessTheNumber-v0", "TowerOfHanoi-v0")


def _replay(env_id, seed, texts):
    """Per-turn rewards and the turn the game ended at, playing ``texts`` on a fresh game."""
    game = TextArenaEnv(env_id)
    game.reset(seed=seed)
    rewards = []
    for t, text in enumerate(texts):
        _, reward, terminated, truncated, _ = game.step(text)
        rewards.append(reward)
        if terminated or truncated:
            return rewards, t
    return rewards, None


@pytest.mark.parametrize("game", GAMES)
@pytest.mark.parametrize("source", SOURCES)
def test_textarena_games_report_their_rewards_and_turns(tok, lm, make_policy, game, source):
    env = make_textarena_env(game, tok, batch_size=4, max_turns=4, max_new_tokens=48, max_length=1024,
                             eos_token_ids=END_IDS, model_config=lm.config)  # fmt: skip
    policy, kind = make_policy(env, source)
    batches = collect(env, policy, kind, trajectories=6)
    n_turns = 0
    for batch in batches:
        table = batch.get_non_tensor(keys.PROMPTS)
        for row in range(batch.shape[0]):
            meta = table.metadata(int(batch[keys.GROUP_ID][row, 0]))
            texts = turn_texts(tok, batch, row)
            expected, ended_at = _replay(game, meta["seed"], texts)
            mask, turn = batch[keys.MASK][row], batch[keys.TURN][row]
            last = [int(((turn == t) & mask).nonzero()[-1]) for t in range(len(texts))]
            got = batch[keys.REWARD][row].squeeze(-1)[last].tolist()
            assert got == pytest.approx(expected), (game, row, texts)
            end = last[-1]
            if ended_at is not None:  # the game ended it: at that turn, terminated
                assert ended_at == len(texts) - 1 and bool(batch[keys.TERMINATED][row, end])
            else:  # the game went on: the env ended it (max_turns or the token budget)
                assert len(texts) == 4 or bool(batch[keys.TRUNCATED][row, end])
            n_turns += len(texts)
    assert n_turns > 6
    assert len(env.turns.backend.live) <= 4  # one game per slot, instances reused


class Counter:
    """A user's own text env: the reward of turn t is t + 1; the episode ends after ``length`` turns."""

    def __init__(self, length=3):
        self.length, self.t = length, 0

    def reset(self, seed=None):
        self.t = 0
        return f"count from {seed % 5}", {}

    def step(self, text):
        self.t += 1
        return f"next {self.t}", float(self.t), self.t >= self.length, False, {}


def test_own_text_env_per_turn_rewards_and_masked_feedback(tok, lm, make_policy):
    env = make_text_env(functools.partial(Counter, 3), tok, batch_size=3, max_turns=5, max_new_tokens=60,
                        max_length=256, eos_token_ids=END_IDS, model_config=lm.config)  # fmt: skip
    policy, kind = make_policy(env, "step")
    batch = torch.cat(collect(env, policy, kind, trajectories=3))
    padded = to_padded(batch)
    full = 0
    for row in range(batch.shape[0]):
        mask, turn = batch[keys.MASK][row], batch[keys.TURN][row]
        turns = turn[mask].unique().tolist()
        last = [int(((turn == t) & mask).nonzero()[-1]) for t in turns]
        assert batch[keys.REWARD][row].squeeze(-1)[last].tolist() == [t + 1.0 for t in turns]
        if len(turns) == 3:
            full += 1
            env_text = tok.decode(padded[keys.TOKENS][row][padded[keys.ATTENTION_MASK][row] & ~padded[keys.ACTION_MASK][row]])
            assert "next 1" in env_text and "next 2" in env_text
    assert full > 0


def test_failing_text_env_ends_only_its_episode():
    class Flaky(Counter):
        def step(self, text):
            if self.t == 1:
                raise RuntimeError("the game crashed")
            return super().step(text)

    from tokengym.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    env = make_text_env(Flaky, tok, batch_size=2, max_turns=4, max_length=128, name="Flaky")
    collector = TokenCollector(env, lambda td: td.set(keys.ACTION, torch.full((2,), tok.eos_token_id)),
                               mode="steps", batch_size=8)  # fmt: skip
    with pytest.raises(PromptError, match=r"episode \d failed at turn 1 on text env Flaky: RuntimeError: the game crashed"):
        for _ in collector:
            pass


def test_factories_pickle_and_bad_input(tok):
    factory = pickle.loads(pickle.dumps(textarena_factory("GuessTheNumber-v0")))
    assert isinstance(factory(), TextArenaEnv)
    env = pickle.loads(pickle.dumps(make_textarena_env("TowerOfHanoi-v0", tok, batch_size=2).turns.backend))
    assert env.live == []
    with pytest.raises(ValueError, match="textarena.make\\('NoSuchGame-v0'\\) failed"):
        make_textarena_env("NoSuchGame-v0", tok)
    with pytest.raises(TypeError, match="factory must be callable"):
        make_text_env("GuessTheNumber-v0", tok)
    with pytest.raises(PromptError, match="which has no reset"):
        make_text_env(object, tok, batch_size=1).reset()


def test_sharded_sources_start_disjoint_episodes(tok):
    """Ray workers shard the episode ids (``env.source.shard(i, n)``): no episode runs twice."""
    seen = []
    for index in range(2):
        env = make_text_env(Counter, tok, batch_size=3, max_length=128)
        env.source.shard(index, 2)
        env.reset()
        seen.append([env.slot_prompt(b).metadata["episode"] for b in range(3)])
        with pytest.raises(ValueError, match="shard\\(\\) must come before the first draw"):
            env.source.shard(0, 2)
    assert seen == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize("make, env_kwargs", [(make_text_env, {"factory": Counter}),
                                              (make_textarena_env, {"env_id": "GuessTheNumber-v0"})])  # fmt: skip
def test_gym_reset_with_a_seed_starts_the_same_episode_again(tok, make, env_kwargs):
    """``reset(seed=0)`` of a gymnasium-wrapped text env, a few steps, ``reset(seed=0)``: the same episode again."""
    env = GymTokenEnv(make, tokenizer=tok, batch_size=1, max_new_tokens=16, max_length=1024, **env_kwargs)
    actions = [*tok.encode("5"), tok.eos_token_id, *tok.encode("[7]"), tok.eos_token_id, *tok.encode("3")]
    first = gym_episode(env, actions)
    assert first[0][1]["metadata"]["episode"] == 0 and len(first) == 1 + len(actions)  # two turns and one token
    again = gym_episode(env, actions)  # mid-episode: the episode the slot held ends
    assert repr(again) == repr(first)
    assert env.env.turns.backend.live == [0]
    assert gym_episode(env, actions, seed=1)[0][1]["metadata"]["seed"] != first[0][1]["metadata"]["seed"]
    env.env.close()


def test_a_finite_episode_env_is_evaluated_in_one_call(tok, lm):
    """num_episodes makes an episode env end, so evaluate() takes it (each episode once)."""
    from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
    from tokengym.evaluation import evaluate

    env = make_text_env(functools.partial(Counter, 2), tok, batch_size=2, max_turns=3, max_new_tokens=20,
                        max_length=128, eos_token_ids=END_IDS, model_config=lm.config, num_episodes=3)  # fmt: skip
    result = evaluate(env, TransformersPolicy(lm, env, sampling=SamplingConfig(), seed=0))
    assert result.metrics["prompts"] == 3 and result.metrics["samples"] == 3
