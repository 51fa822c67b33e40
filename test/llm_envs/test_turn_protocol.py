"""The turn-handler protocol is the whole contract: a handler serves episodes, fails one, learns the env's facts,
reports counters, keys its state by ids and copies it at a fork, through llm_envs/turns/protocol.py alone."""

from __future__ import annotations

import logging
import pathlib
import runpy
import sys

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.errors import EpisodeError, PromptError, RewardFunctionError
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.tools import ToolRegistry, ToolTurns, calculator
from tokengym.llm_envs.turns import EnvFacts, HeldEpisode, Turn, TurnHandler
from tokengym.testing import tiny_model, tiny_tokenizer

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "word_game.py"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def game():
    """The worked example's module namespace (its main() not run)."""
    return runpy.run_path(str(EXAMPLE), run_name="word_game")


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _end(tok):
    return tok.convert_tokens_to_ids("<|end|>")


def _step(env, td, actions):
    """One step of every slot with ``actions``: ``(the step, the next observation)``."""
    return env.step_and_maybe_reset(td.set(keys.ACTION, torch.tensor(actions)))


def _script(tok, turns: dict[int, list[str]]):
    """A step policy (a plain function) writing ``turns[slot][turn]`` then the turn's end token (log-prob 0)."""

    def policy(td):
        turn, pos = td.get(keys.TURN).tolist(), (td.get(keys.SEQ_LEN) - td.get(keys.PROMPT_LEN)).tolist()
        action = []
        for b in range(len(turn)):
            script = turns[b % len(turns)]
            ids = _ids(tok, script[min(turn[b], len(script) - 1)]) + [_end(tok)]
            action.append(ids[pos[b]] if pos[b] < len(ids) else _end(tok))
        td.set(keys.ACTION, torch.tensor(action))
        td.set(keys.ACTION_LOG_PROB, torch.zeros(len(turn)))
        return td.set(keys.POLICY_VERSION, torch.zeros(len(turn), dtype=torch.int64))

    return policy


# -- the worked example --
def test_the_worked_example_runs(game, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["word_game.py", "--batches", "1"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("batch 0: 4 games") and "invalid" in out


def _play(env, words, tok):
    """Teacher-force slot 0 through one word per turn; each turn's reward and done flag, and the episode's tokens."""
    td, out = env.reset(), []
    for word in words:
        for token in _ids(tok, word) + [_end(tok)]:
            step, td = _step(env, td, [token])
        out.append((step[keys.REWARD].item(), bool(step[keys.DONE])))
        if out[-1][1]:
            return out, env.pop_finished_sequences()[int(step[keys.TRAJ_ID])]
    return out, None


def test_the_word_game_referee_scores_turns_and_ends_the_game(game, tok):
    env = game["make_env"](tok, batch_size=1)
    env.reset()
    assert env.slot_prompt(0).messages[0]["content"].endswith("I say: apple")  # served by the referee
    turns, sequence = _play(env, ["egg", "toe", "lemon", "tea"], tok)  # every word chains on the opponent's
    assert turns == [(1.0, False), (1.0, False), (1.0, False), (1.0, True)]  # max_turns=4 ends the game
    text = tok.decode(sequence)
    assert "I say: goat" in text and "I say: eel" in text and "I say: nut" in text
    conversation = [{"role": "user", "content": "Word chain. Say one word that starts with 'e'. I say: apple"},
                    {"role": "assistant", "content": "egg"},
                    {"role": "user", "content": "I say: goat. Your word starts with 't'."}]  # fmt: skip
    expected = _ids(tok, tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True))
    assert sequence.tolist()[: len(expected)] == expected  # the chat template's tokens for the conversation
    turns, _ = _play(env, ["zebra", "12"], tok)  # two strikes: the referee ends the game
    assert turns == [(0.0, False), (0.0, True)]
    assert env.turns.metrics() == {"valid_words": 4, "invalid_words": 2, "conceded": 0}
    assert list(env.turns.games) == [env.held_episode(0).episode]  # the finished games were released with their slot


def test_the_env_facts_reach_the_handler_once_without_patching(tok):
    class Facts(TurnHandler):
        told: list[EnvFacts] = []

        def bind(self, facts):
            self.told.append(facts)
            super().bind(facts)

        def end_turns(self, turns):
            return torch.zeros(len(turns))

    handler = Facts()
    env = TokenEnv(["hi"], tok, turns=handler, max_turns=3, batch_size=2, group_size=2, max_new_tokens=8,
                   max_turn_tokens=4, max_length=64, stop_strings=("STOP",))  # fmt: skip
    assert env.config()["turns"] == "Facts()"
    (facts,) = handler.told
    assert facts is handler.facts and facts.tokenizer is env.tokenizer
    assert facts.eos_token_ids == frozenset(env.eos_token_ids) and _end(tok) in facts.eos_token_ids
    assert (facts.max_turns, facts.max_length, facts.max_new_tokens, facts.max_turn_tokens) == (3, 64, 8, 4)
    assert (facts.batch_size, facts.group_size, facts.max_prompt_length, facts.stop_strings) == (2, 2, 63, ("STOP",))

    class Refuses(Facts):
        def bind(self, facts):
            if facts.max_turns < 2:
                raise ValueError(f"needs max_turns >= 2, got {facts.max_turns}")

    with pytest.raises(ValueError, match="needs max_turns >= 2, got 1"):
        TokenEnv(["hi"], tok, turns=Refuses(), batch_size=1, max_new_tokens=8, max_length=32)


def test_an_agent_env_learns_its_facts_by_the_hook(tok):
    from tokengym.llm_envs.agents import make_agent_env

    async def agent(client, task):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": task}])
        return 1.0

    env = make_agent_env(agent, ["1+1="], tok, batch_size=1, max_new_tokens=8, max_length=48)
    try:
        assert env.turns.facts.max_length == 48 and env.turns.facts.eos_token_ids == frozenset(env.eos_token_ids)
        assert not hasattr(env.turns, "eos_token_ids") and not hasattr(env.turns, "max_length")  # nothing patched in
    finally:
        env.close()


# -- one episode fails, its neighbours go on --
class LosesSlotOne(TurnHandler):
    """Fails the episode of trajectory 1 at its first turn (a lost session); the others get feedback, then 1.0."""

    def __init__(self):
        self.released: list[HeldEpisode] = []

    def end_turns(self, turns):
        return [Turn.failed(ConnectionError("the session was lost")) if traj == 1
                else Turn(0.0, "go on") if turn == 0 else Turn(1.0)
                for traj, turn in zip(turns.trajectories, turns.turns, strict=True)]  # fmt: skip

    def release(self, held):
        self.released += held


def test_a_failed_episode_ends_alone_and_its_error_comes_at_the_refill(tok):
    handler = LosesSlotOne()
    env = TokenEnv(["a", "b", "c", "d"], tok, turns=handler, max_turns=2, batch_size=3, max_new_tokens=16,
                   max_length=64)  # fmt: skip
    td = env.reset()
    with pytest.raises(PromptError, match=r"1 episode\(s\) failed .*ConnectionError: the session was lost") as caught:
        _step(env, td, [_end(tok)] * 3)
    err = caught.value
    assert isinstance(err.__cause__, EpisodeError) and err.slots == []  # no slot left to refill: slot 1 took "d"
    step, obs = err.step, err.observation
    assert step[keys.DONE].squeeze(-1).tolist() == [False, True, False] and step[keys.REWARD].sum() == 0
    assert obs[keys.TURN].tolist() == [1, 0, 1] and obs[keys.TRAJ_ID].tolist() == [0, 3, 2]  # neighbours go on
    assert [(h.slot, h.trajectory) for h in handler.released] == [(1, 1)]
    assert env.turn_metrics["failed_episodes"] == 1
    step, obs = _step(env, obs, [_end(tok)] * 3)  # the neighbours' second turns: their episodes end with 1.0
    assert step[keys.REWARD].squeeze(-1).tolist() == [1.0, 0.0, 1.0] and step[keys.DONE].squeeze(-1).tolist() == [True, False, True]


@pytest.mark.parametrize("source", ["step", "wave"])
def test_a_collector_goes_on_past_failed_episodes_and_counts_them(tok, source):
    model = tiny_model(tok, seed=0)
    env = TokenEnv([f"{i}" for i in range(8)], tok, turns=LosesSlotOne(), max_turns=2, batch_size=3,
                   max_new_tokens=16, max_turn_tokens=3, max_length=64, model_config=model.config)  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=3,
                               source=source)  # fmt: skip
    it, batches, errors = iter(collector), [], []
    while len(batches) < 2:
        try:
            batches.append(next(it))
        except EpisodeError as err:  # as the docs write it: a failed episode's own kind, and still a PromptError
            errors.append(err)
    assert len(errors) == 1 and isinstance(errors[0], PromptError) and isinstance(errors[0].__cause__, EpisodeError)
    assert collector.metrics["failed_episodes"] == 1 and collector.metrics["failed_prompts"] == 0  # nothing skipped
    rewards = torch.cat([b[keys.REWARD].squeeze(-1).sum(-1) for b in batches])
    assert sorted(rewards.tolist()) == [0.0] + [1.0] * 5  # the failed one scored 0, nothing else lost


def test_an_episode_that_cannot_start_fails_alone(tok):
    class Serves(TurnHandler):
        def serve(self, draw, episode):
            if draw.text == "b":
                raise EpisodeError(f"episode {episode}: the game server refused it")
            return [{"role": "user", "content": f"play {draw.text}"}]

        def end_turns(self, turns):
            return torch.ones(len(turns))

    env = TokenEnv(["a", "b", "c"], tok, turns=Serves(), batch_size=2, max_new_tokens=4, max_length=32)
    with pytest.raises(PromptError, match="the game server refused it") as caught:
        env.reset()
    assert caught.value.slots == [1] and env.turn_metrics["failed_episodes"] == 1
    assert env.slot_prompt(0).text == tok.apply_chat_template([{"role": "user", "content": "play a"}], tokenize=False,
                                                              add_generation_prompt=True)  # fmt: skip
    env.refill([1])
    assert env.slot_prompt(1).messages == [{"role": "user", "content": "play c"}]
    assert [env.held_episode(b).episode for b in range(2)] == [0, 2]  # the failed draw was episode 1


# -- counters reach the collector --
def test_tool_calls_are_counted_in_a_collectors_metrics(tok):
    answer = lambda responses, prompts, metadata, turns: [Turn(float("42" in r)) for r in responses]  # noqa: E731
    env = TokenEnv(["q1", "q2"], tok, turns=ToolTurns(ToolRegistry({"calculator": calculator}), answer, tokenizer=tok),
                   max_turns=2, batch_size=2, max_new_tokens=48, max_length=160)  # fmt: skip
    collector = TokenCollector(env, _script(tok, {0: ["<tool>calculator: 6*7</tool>", "42"],
                                                  1: ["<tool>calculator: oops</tool>", "41"]}),
                               mode="trajectories", batch_size=2)  # fmt: skip
    batch = next(iter(collector))
    assert sorted(batch[keys.REWARD].squeeze(-1).sum(-1).tolist()) == [0.0, 1.0]
    metrics = collector.metrics
    assert metrics["tool_calls"] >= 2 and metrics["tool_errors"] >= 1 and metrics["tool_failures"] >= 1
    assert metrics["tool_calls"] == env.turn_metrics["tool_calls"] and metrics["feedback_turns"] >= 2


# -- nothing dropped silently --
def test_feedback_to_a_single_turn_env_raises_and_leaves_no_trace(tok):
    class Talks(TurnHandler):
        def end_turns(self, turns):
            return [Turn(1.0, "tell me more") for _ in turns.slots]

    env = TokenEnv(["hi"], tok, turns=Talks(), batch_size=1, max_new_tokens=8, max_length=32)
    td = env.reset()
    with pytest.raises(RewardFunctionError, match=r"feedback 'tell me more' for slot 0 .* single-turn \(max_turns=1\)"):
        env.step(td.set(keys.ACTION, torch.tensor([tok.eos_token_id])))
    assert env.response_ids(0).tolist() == []  # the step was rolled back

    class Splits(TurnHandler):
        may_split = True

        def end_turns(self, turns):
            return [Turn(0.0, torch.tensor(_ids(tok, "again")), new_trajectory=True) for _ in turns.slots]

    env = TokenEnv(["hi"], tok, turns=Splits(), batch_size=1, max_new_tokens=8, max_length=32)
    with pytest.raises(RewardFunctionError, match=r"split the episode \(new_trajectory=True\)"):
        env.step(env.reset().set(keys.ACTION, torch.tensor([tok.eos_token_id])))


def test_feedback_that_does_not_fit_ends_the_episode_counted_and_logged(tok, caplog):
    class Verbose(TurnHandler):
        def end_turns(self, turns):
            return [Turn(0.5, "a long answer " * 20) for _ in turns.slots]

    env = TokenEnv(["hi"], tok, turns=Verbose(), max_turns=3, batch_size=1, max_new_tokens=8, max_length=48)
    td = env.reset()
    with caplog.at_level(logging.INFO, logger="tokengym.llm_envs"):
        step = env.step(td.set(keys.ACTION, torch.tensor([_end(tok)])))
    assert bool(step[keys.DONE]) and bool(step[keys.TRUNCATED]) and not bool(step[keys.TERMINATED])
    assert step[keys.REWARD].item() == 0.5  # the turn is still scored
    assert env.turn_metrics["feedback_did_not_fit"] == 1 and env.turn_metrics["feedback_turns"] == 0
    assert any("did not fit" in r.getMessage() for r in caplog.records)


# -- ids in the hooks: split, restart, fork --
def test_a_split_episode_keeps_its_episode_id_and_gets_its_next_prompt(tok):
    class Rewrites(TurnHandler):
        may_split = True

        def __init__(self):
            self.seen: list[tuple[int, int]] = []

        def end_turns(self, turns):
            self.seen += list(zip(turns.trajectories, turns.episodes, strict=True))
            return [Turn(0.0, [{"role": "user", "content": "from the top"}], new_trajectory=True) if t == 0
                    else Turn(1.0) for t in turns.turns]  # fmt: skip

    handler = Rewrites()
    env = TokenEnv(["hi"], tok, turns=handler, max_turns=2, batch_size=1, max_new_tokens=8, max_length=64)
    step, td = _step(env, env.reset(), [_end(tok)])
    assert bool(step[keys.TRUNCATED]) and env.pop_parts() == [0]
    held = env.held_episode(0)
    assert (held.trajectory, held.episode, held.prompt.group_id, held.prompt.sample_id) == (1, 0, 0, 0)
    assert held.prompt.messages == [{"role": "user", "content": "from the top"}]
    assert handler.seen == [(0, 0)]


def test_restart_hands_the_dropped_and_the_new_trajectory_of_one_episode(tok):
    class Restarts(TurnHandler):
        def end_turns(self, turns):
            return torch.zeros(len(turns))

        def restart(self, dropped, restarted):
            self.pairs = [(d.trajectory, r.trajectory, d.episode, r.episode) for d, r in zip(dropped, restarted, strict=True)]

    handler = Restarts()
    env = TokenEnv(["a", "b"], tok, turns=handler, batch_size=2, max_new_tokens=8, max_length=32)
    env.reset()
    env.restart([1])
    assert handler.pairs == [(1, 2, 1, 1)]


def test_fork_copies_the_per_episode_state_the_way_the_env_calls_it(game, tok):
    env = game["make_env"](tok, batch_size=2)
    handler = env.turns
    td = env.reset()
    for t in _ids(tok, "egg") + [_end(tok)]:  # slot 0 plays a word; then the env forks it into slot 1
        _, td = _step(env, td, [t, tok.eos_token_id if t == _end(tok) else t])
    parent, spare = env.held_episode(0), env.held_episode(1)
    child = HeldEpisode(slot=1, trajectory=99, episode=1000, prompt=parent.prompt)  # what the env gives a child
    handler.fork(parent, child)
    assert handler.games[1000] == handler.games[parent.episode] and handler.games[1000] is not handler.games[parent.episode]
    handler.games[1000].used.add("zzz")  # the child's game is its own
    assert "zzz" not in handler.games[parent.episode].used and spare.episode in handler.games
    TurnHandler().fork(parent, child)  # the base keeps nothing per episode: a no-op

    from tokengym.llm_envs.agents import AgentTurns

    with pytest.raises(ValueError, match="an agent program cannot be forked"):
        AgentTurns.fork(None, parent, child)


def test_episode_ids_survive_a_checkpoint(tok):
    env = TokenEnv(["a", "b", "c"], tok, lambda r, p, m: [0.0] * len(r), batch_size=2, max_new_tokens=4, max_length=32)
    env.reset()
    env.refill([0])
    state = env.state_dict()
    again = TokenEnv(["a", "b", "c"], tok, lambda r, p, m: [0.0] * len(r), batch_size=2, max_new_tokens=4,
                     max_length=32)  # fmt: skip
    again.load_state_dict(state)
    assert [again.held_episode(b).episode for b in range(2)] == [2, 1]
    again.refill([1])
    assert again.held_episode(1).episode == 3
