"""Issue 47 ("Nothing silent, round two"): rows of self-play, failed episodes and checkpoint fingerprints, each with
the inputs a user gives; the warning rows also check that the same setup done right gives no warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.errors import EpisodeError, PromptError, TokenGymWarning
from tokengym.llm_envs import PromptSource, TokenEnv, keys, make_self_play_env
from tokengym.llm_envs.agents import AgentError
from tokengym.llm_envs.errors import refill_error
from tokengym.llm_envs.turns import Turn, TurnHandler
from tokengym.llm_envs.turns.self_play import CountingGame
from tokengym.transforms import RoleAdvantage


# -- self-play with the defaults (games_per_group=1) and RoleAdvantage --
def _self_play(tokenizer, model, games_per_group):
    env = make_self_play_env(lambda: CountingGame(rounds=1), tokenizer, batch_size=4, games_per_group=games_per_group,
                             max_new_tokens=12, max_turn_tokens=4, max_length=256, model_config=model.config)  # fmt: skip
    return TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)


def test_role_advantage_over_one_game_per_group_warns_naming_games_per_group_and_the_metric_counts_roles(tokenizer,
                                                                                                        model):
    collector = _self_play(tokenizer, model, games_per_group=1)  # make_self_play_env's default
    batch = next(iter(collector))
    advantage = RoleAdvantage(num_players=2)
    with pytest.warns(TokenGymWarning, match=r"RoleAdvantage: every \(group, role\) of the batch holds one trajectory "
                                             r"\(4 of them: games_per_group=1.*trains on nothing; .*"
                                             r"make_self_play_env\(\.\.\., games_per_group=4\) \(games_per_group >= 2\)"):  # fmt: skip
        out = advantage(batch.clone())
    assert not bool(out[keys.ADVANTAGE].any())  # every advantage 0: what the warning is about
    assert collector.metrics["zero_std_group_fraction"] == 1.0  # every (group, role) is one trajectory
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        advantage(batch.clone())  # once per transform


def test_role_advantage_over_two_games_per_group_gives_no_warning(tokenizer, model):
    collector = _self_play(tokenizer, model, games_per_group=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RoleAdvantage(num_players=2)(next(iter(collector)))


# -- RoleAdvantage(num_players=3) on a two-player batch, or on a batch with no roles --
def test_role_advantage_with_another_number_of_players_is_refused_naming_the_roles_seen(tokenizer, model):
    batch = next(iter(_self_play(tokenizer, model, games_per_group=2)))
    with pytest.raises(ValueError, match=r"RoleAdvantage\(num_players=3\) got a batch of 2-player games \(roles seen "
                                         r"\[0, 1\], .*the wrong seats; build RoleAdvantage\(num_players=2\)"):  # fmt: skip
        RoleAdvantage(num_players=3)(batch)


def test_role_advantage_on_a_batch_with_no_roles_is_refused(tokenizer, model):
    env = TokenEnv(["1+1=", "2+3="], tokenizer, lambda r, p, m: [float(len(x)) for x in r], batch_size=4,
                   group_size=4, max_new_tokens=3, model_config=model.config, seed=0)  # fmt: skip
    batch = next(iter(TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)))
    with pytest.raises(ValueError, match=r"RoleAdvantage\(num_players=2\) got a batch with no roles: its prompts carry "
                                         r"no 'role' metadata .*make_self_play_env.*or use GroupAdvantage"):  # fmt: skip
        RoleAdvantage(num_players=2)(batch)


# -- a failed episode: the docs promise an EpisodeError at the slot's refill --
class LosesSlotOne(TurnHandler):
    """Fails the episode of trajectory 1 at its first turn (a lost session); the others end with 1.0."""

    def end_turns(self, turns):
        return [Turn.failed(ConnectionError("the session was lost")) if traj == 1 else Turn(1.0)
                for traj in turns.trajectories]  # fmt: skip


def _end(tokenizer):
    return tokenizer.convert_tokens_to_ids("<|end|>")


def test_a_failed_episode_raises_an_episode_error_at_the_refill(tokenizer):
    env = TokenEnv(["a", "b", "c", "d"], tokenizer, turns=LosesSlotOne(), max_turns=2, batch_size=3, max_new_tokens=16,
                   max_length=64)  # fmt: skip
    td = env.reset()
    with pytest.raises(EpisodeError, match=r"1 episode\(s\) failed .*ConnectionError: the session was lost") as caught:
        env.step_and_maybe_reset(td.set(keys.ACTION, torch.full((3,), _end(tokenizer))))
    err = caught.value
    assert isinstance(err, PromptError)  # code catching PromptError still catches it
    assert isinstance(err.__cause__, EpisodeError) and err.step is not None and err.slots == []


def test_an_episode_error_raised_in_serve_is_an_episode_error_at_the_refill(tokenizer):
    class Serves(TurnHandler):
        def serve(self, draw, episode):
            if draw.text == "b":
                raise EpisodeError(f"episode {episode}: the game server refused it")
            return draw

        def end_turns(self, turns):
            return torch.ones(len(turns))

    env = TokenEnv(["a", "b", "c"], tokenizer, turns=Serves(), batch_size=2, max_new_tokens=4, max_length=32)
    with pytest.raises(EpisodeError, match="the game server refused it") as caught:
        env.reset()
    assert caught.value.slots == [1]


def test_a_prompt_that_cannot_load_stays_a_prompt_error_and_an_agent_failure_an_agent_error():
    prompt = refill_error([(0, PromptError("prompt 7 has 900 tokens"))], slots=[0], observation=None)
    assert type(prompt) is PromptError and prompt.slots == [0]
    agent = refill_error([(1, AgentError("the program raised"))], slots=[], observation=None)
    assert type(agent) is AgentError and agent.what == AgentError.what
    mixed = refill_error([(1, AgentError("raised")), (2, EpisodeError("lost")), (0, PromptError("too long"))],
                         slots=[0], observation=None)  # fmt: skip
    assert type(mixed) is EpisodeError and str(mixed).startswith("1 agent episode(s) failed")


# -- a checkpoint loaded into a run whose prompts differ only outside the 16 the fingerprint sampled --
PROMPTS = [f"{i}+{i}=" for i in range(40)]
CHANGED = PROMPTS[:1] + ["7*7="] + PROMPTS[2:]  # index 1: the old fingerprint sampled 0, 3, 5, ... of 40


def test_the_fingerprint_counts_every_prompt(tokenizer):
    same, other = PromptSource(PROMPTS, tokenizer).fingerprint(), PromptSource(CHANGED, tokenizer).fingerprint()
    assert same == PromptSource(list(PROMPTS), tokenizer).fingerprint()
    assert other["count"] == same["count"] and other["first"] == same["first"] and other["digest"] != same["digest"]
    # metadata counts too, and every kind of item
    tagged = [{"prompt": p, "answer": str(i)} for i, p in enumerate(PROMPTS)]
    retagged = [dict(item, answer="0") if i == 20 else item for i, item in enumerate(tagged)]
    assert PromptSource(tagged, tokenizer).fingerprint() != PromptSource(retagged, tokenizer).fingerprint()
    ids = [torch.tensor([5, 6, i]) for i in range(20)]
    assert PromptSource(ids, tokenizer).fingerprint() != PromptSource(ids[:9] + [torch.tensor([5, 6, 0])] + ids[10:],
                                                                      tokenizer).fingerprint()  # fmt: skip
    assert PromptSource(iter(PROMPTS), tokenizer).fingerprint() is None  # read once: not hashed ahead


def _collector(tokenizer, model, prompts):
    env = TokenEnv(prompts, tokenizer, lambda r, p, m: [1.0] * len(r), batch_size=2, max_new_tokens=3,
                   model_config=model.config, seed=0)  # fmt: skip
    return TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=2)


def test_a_checkpoint_over_prompts_differing_in_one_unsampled_prompt_is_refused(tokenizer, model):
    saved = _collector(tokenizer, model, PROMPTS)
    next(iter(saved))
    state = saved.state_dict()
    other = _collector(tokenizer, model, CHANGED)
    with pytest.raises(ValueError, match=r"taken on other prompts \(40 prompts, digest \w{16}, first '0\+0='\) than "
                                         r"this collector's env holds \(40 prompts, digest \w{16}, first '0\+0='\)"):  # fmt: skip
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)  # the explicit override
    _collector(tokenizer, model, PROMPTS).load_state_dict(state)  # the same prompts: accepted


def test_a_checkpoint_with_the_old_sampled_fingerprint_is_refused_unless_strict_is_false(tokenizer, model):
    saved = _collector(tokenizer, model, PROMPTS)
    next(iter(saved))
    state = saved.state_dict()
    old = dict(state, prompt_source={"count": 40, "digest": "0123456789abcdef", "first": "0+0="})  # no scheme
    resumed = _collector(tokenizer, model, PROMPTS)
    with pytest.raises(ValueError, match=r"fingerprint of its prompts \(40 prompts, digest 0123456789abcdef, first "
                                         r"'0\+0='\) is of the old kind, a digest of 16 sampled prompts.*"
                                         r"collector\.load_state_dict\(state, strict=False\)"):  # fmt: skip
        resumed.load_state_dict(old)
    resumed.load_state_dict(old, strict=False)
    assert next(iter(resumed)).shape[0] == 2
    older = dict(old, prompt_source={"count": 3, "digest": "0123456789abcdef", "first": "9+9="})
    with pytest.raises(ValueError, match="taken on other prompts"):  # what can be compared differs
        _collector(tokenizer, model, PROMPTS).load_state_dict(older)
