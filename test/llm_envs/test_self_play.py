"""Self-play (issue #42 item 3): the policy plays every seat of a two-player game, one slot per player."""

from __future__ import annotations

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.errors import RewardFunctionError
from tokengym.llm_envs import TokenEnv, keys, make_self_play_env
from tokengym.llm_envs.turns import Turn, TurnHandler, Wake
from tokengym.llm_envs.turns.self_play import SYSTEM_PROMPT, CountingGame
from tokengym.testing import tiny_model, tiny_tokenizer


class Nim:
    """Two players take 1 or 2 stones in turn; who takes the last stone wins (+1, the other -1). Anything else
    written takes 1."""

    num_players = 2

    def reset(self, seed: int) -> None:
        self.pile, self.turn, self.winner = 3 + seed % 3, 0, None
        self.news = [f"Nim: {self.pile} stones. Take 1 or 2.", f"Nim: {self.pile} stones. You move second."]

    def to_move(self) -> int:
        return self.turn % 2

    def observe(self, player: int) -> str:
        text, self.news[player] = self.news[player], ""
        return text

    def play(self, action: str) -> None:
        player = self.to_move()
        take = 2 if action.strip().startswith("2") else 1
        self.pile = max(self.pile - take, 0)
        if self.pile == 0:
            self.winner = player
        self.turn += 1
        self.news[1 - player] = f"{self.news[1 - player]} The other took {take}; {self.pile} left.".strip()

    def result(self) -> list[float] | None:
        if self.winner is None:
            return None
        return [1.0, -1.0] if self.winner == 0 else [-1.0, 1.0]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok, seed=0)


def _drive(env, tok, moves: dict[int, list[str]], *, steps: int = 60, stop_after: int | None = None, run=None):
    """Step ``env`` by hand: each active slot writes its seat's next move, token by token, then the end of turn.
    Returns the run ``(obs, script positions, rewards by trajectory)``; ``run`` goes on from one."""
    end = tok.convert_tokens_to_ids("<|end|>")
    script = {b: [tok.encode(m, add_special_tokens=False) + [end] for m in ms] for b, ms in moves.items()}
    obs, where, rewards = run if run is not None else (env.reset(), {b: [0, 0] for b in moves}, {})
    for t in range(steps):
        if stop_after is not None and t == stop_after:
            break
        action = []
        for b in range(env.batch_size[0]):
            if not bool(obs[keys.ACTIVE][b]):
                action.append(0)  # ignored: the slot waits
                continue
            turn, i = where[b]
            move = script[b][turn] if turn < len(script[b]) else script[b][-1]  # past the script: its last move
            action.append(move[i])
            where[b] = [turn, i + 1] if i + 1 < len(move) else [turn + 1, 0]
        td, obs = env.step_and_maybe_reset(obs.clone().set(keys.ACTION, torch.tensor(action)))
        reward, traj = td[keys.NEXT][keys.REWARD_NAME].view(-1), td[keys.TRAJ_ID]
        for b in td[keys.ACTIVE].nonzero().view(-1).tolist():
            rewards[int(traj[b])] = rewards.get(int(traj[b]), 0.0) + float(reward[b])
        if env.is_exhausted:
            break
    return obs, where, rewards


def _template(tok, conversation: list[dict], *, last: str | None = None) -> str:
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=last is not None)
    return text + (last or "")


def test_each_player_sees_its_own_view_and_the_rewards_are_zero_sum(tok):
    env = make_self_play_env(Nim, tok, batch_size=2, max_new_tokens=16, max_length=512, num_games=1)
    # pile 3: player 0 takes 1, player 1 takes 1, player 0 takes the last: player 0 wins
    _, _, rewards = _drive(env, tok, {0: ["1", "1"], 1: ["1"]})
    assert rewards == {0: 1.0, 1: -1.0}
    seqs = env.pop_finished_sequences()
    system = {"role": "system", "content": SYSTEM_PROMPT}
    p0 = [system, {"role": "user", "content": "Nim: 3 stones. Take 1 or 2."}, {"role": "assistant", "content": "1"},
          {"role": "user", "content": "The other took 1; 1 left."}, {"role": "assistant", "content": "1"}]
    assert tok.decode(seqs[0]) == _template(tok, p0)
    # player 1's prompt is the shared system message; its first wake is its view of the game; it loses on the other's
    # move, reads the end and its trajectory ends after one token (its reward there)
    p1 = [system, {"role": "user", "content": "Nim: 3 stones. You move second. The other took 1; 2 left."},
          {"role": "assistant", "content": "1"},
          {"role": "user", "content": "The other took 1; 0 left.\nThe game is over."}]
    assert tok.decode(seqs[1][:-1]) == _template(tok, p1, last="")  # and its one closing token
    assert env.turn_metrics["games_finished"] == 1


def test_a_waiting_slot_produces_no_step_and_holds_its_tokens(tok):
    env = make_self_play_env(Nim, tok, batch_size=2, max_new_tokens=16, max_length=512, num_games=1)
    obs = env.reset()
    assert obs[keys.ACTIVE].tolist() == [True, False]
    held = env.history(1).clone()
    end = tok.convert_tokens_to_ids("<|end|>")
    one = tok.encode("1", add_special_tokens=False)[0]
    td, obs = env.step_and_maybe_reset(obs.clone().set(keys.ACTION, torch.tensor([one, 5])))
    assert torch.equal(env.history(1), held) and obs[keys.SEQ_LEN][1] == len(held)  # slot 1 wrote nothing
    td, obs = env.step_and_maybe_reset(obs.clone().set(keys.ACTION, torch.tensor([end, 5])))
    assert obs[keys.ACTIVE].tolist() == [False, True]  # player 0 waits, player 1 woken with its view
    assert not td[keys.NEXT][keys.DONE_NAME].any()
    assert obs[keys.TURN].tolist() == [1, 1] and obs[keys.SEQ_LEN][1] > len(held)  # a first wake starts turn 1


def test_checkpoint_replays_each_game_and_resumes_exactly_mid_game(tok):
    moves = {0: ["2", "1", "1"], 1: ["1", "1", "2"], 2: ["1", "2", "1"], 3: ["2", "2", "1"]}

    def build():
        return make_self_play_env(Nim, tok, batch_size=4, max_new_tokens=16, max_length=512, num_games=4, seed=1)

    whole = build()
    *_, expected = _drive(whole, tok, moves)
    expected_seqs = whole.pop_finished_sequences()
    assert sum(expected.values()) == 0.0 and len(expected) == 8  # four games, two players each, zero-sum
    first = build()
    obs, where, rewards = _drive(first, tok, moves, stop_after=7)  # mid-game: players waiting, games half played
    state = first.state_dict()
    assert any(game[2] for game in state["turns"]["games"])  # each game's seed and the calls made on it
    done_seqs = first.pop_finished_sequences()
    resumed = build()  # live games cannot be saved: loading replays them on new game objects
    resumed.load_state_dict(state)
    for g, game in first.turns.games.items():
        assert resumed.turns.games[g].game.pile == game.game.pile
    *_, rewards = _drive(resumed, tok, moves, run=(obs.clone(), where, dict(rewards)))
    assert rewards == expected
    seqs = {**done_seqs, **resumed.pop_finished_sequences()}
    assert seqs.keys() == expected_seqs.keys()
    assert all(torch.equal(seqs[k], expected_seqs[k]) for k in seqs)


def test_waking_an_episode_that_does_not_wait_is_a_handler_bug(tok):
    class Rude(TurnHandler):
        def end_turns(self, turns):
            return [Turn(0.0, "go on") for _ in turns.slots]

        def wakes(self):
            return [Wake(0, "wake up")]

    env = TokenEnv(["a", "b"], tok, turns=Rude(), max_turns=3, batch_size=2, max_new_tokens=8, max_length=64)
    with pytest.raises(RewardFunctionError, match="no slot holds that episode waiting"):
        env.reset()  # the env asks for wakes after each refill too


def test_waiting_in_a_single_turn_env_raises(tok):
    class Waits(TurnHandler):
        def end_turns(self, turns):
            return [Turn.waiting() for _ in turns.slots]

    env = TokenEnv(["a"], tok, turns=Waits(), batch_size=1, max_new_tokens=8, max_length=64)
    obs = env.reset()
    with pytest.raises(RewardFunctionError, match="single-turn"):
        env.step_and_maybe_reset(obs.clone().set(keys.ACTION, torch.tensor([tok.eos_token_id])))


def test_bad_arguments_name_the_fix(tok):
    with pytest.raises(ValueError, match="every seat of a game needs a slot"):
        make_self_play_env(Nim, tok, batch_size=1, max_length=256)
    with pytest.raises(ValueError, match="games_per_group"):
        make_self_play_env(Nim, tok, group_size=2, max_length=256)
    with pytest.raises(ValueError, match="max_turns >= 2"):
        make_self_play_env(Nim, tok, max_turns=1, max_length=256)


@pytest.mark.parametrize("source", ["step", "wave"])
def test_both_roles_in_one_batch_with_their_own_rewards(tok, model, source):
    env = make_self_play_env(lambda: CountingGame(rounds=2), tok, batch_size=4, games_per_group=2, max_new_tokens=24,
                             max_turn_tokens=6, max_length=256, model_config=model.config)  # fmt: skip
    policy = TransformersPolicy(model, env, seed=0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source=source)
    batch = next(iter(collector))
    batch = next(iter(collector))  # a second batch: seats of new games served while others wait
    group, sample = batch[keys.GROUP_ID][:, 0], batch[keys.SAMPLE_ID][:, 0]
    assert len(group.unique()) == 2  # two groups of 2 games x 2 players
    for g in group.unique():
        roles = (sample[group == g] % 2).tolist()
        assert sorted(roles) == [0, 0, 1, 1]
    returns = batch[keys.NEXT][keys.REWARD_NAME].squeeze(-1).sum(1)
    game = group * 2 + sample // 2
    for k in game.unique():  # each game's two players: zero-sum
        assert float(returns[game == k].sum()) == 0.0
    # the sampling log-probs of both roles are the teacher-forced ones (the step source: a waiting slot's cache row
    # holds its tokens while the other player moves and slots are refilled, and takes the wake's tokens)
    forced = policy.teacher_forced_log_probs(batch)
    mask = batch[keys.MASK]
    torch.testing.assert_close(batch[keys.ACTION_LOG_PROB][mask], forced[mask], atol=2e-5, rtol=0)
    collector.shutdown()
