"""TextArena two-player games in self-play: the policy plays both seats of TicTacToe through a TokenCollector."""

from __future__ import annotations

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import TextArenaGame, make_textarena_self_play_env

SEED = 7


class Recording(TextArenaGame):
    """A TicTacToe game that records its seed, the moves played and the result into ``log``."""

    def __init__(self, log: list) -> None:
        super().__init__("TicTacToe-v0")
        self.log = log

    def reset(self, seed: int) -> None:
        super().reset(seed)
        self.record = {"seed": seed, "moves": [], "result": None}
        self.log.append(self.record)

    def play(self, action: str) -> None:
        super().play(action)
        self.record["moves"].append(action)
        self.record["result"] = self.result()


def test_a_scripted_game_shows_each_player_its_own_view():
    game = TextArenaGame("TicTacToe-v0")
    game.reset(seed=0)
    assert game.num_players == 2 and game.to_move() == 0
    assert game.observe(1) == ""  # not its turn: nothing shown yet, it reads everything on its turn
    first = game.observe(0)
    assert "You are Player 0 in Tic Tac Toe" in first and "Available Moves" in first
    game.play("[4]")
    assert game.result() is None and game.to_move() == 1
    view = game.observe(1)
    assert "You are Player 1" in view and "Player 0 placed their symbol (O) in cell 4" in view
    game.play("[0]")
    later = game.observe(0)  # only what player 0 has not seen
    assert "You are Player 0" not in later and "cell 0" in later
    for move in ["[1]", "[7]", "[2]", "[6]", "[3]", "[5]", "[8]"]:
        game.play(move)
    assert game.result() == [0.0, 0.0]  # a draw
    assert "draw" in game.observe(1)  # the end, as the game tells it


def test_an_invalid_move_is_shown_to_its_player_who_moves_again():
    game = TextArenaGame("TicTacToe-v0")
    game.reset(seed=0)
    game.observe(0)
    game.play("no move here")
    assert game.result() is None and game.to_move() == 0
    assert "invalid move" in game.observe(0)
    game.play("still nothing")
    assert game.result() == [-1.0, 1.0]  # a second invalid move loses


@pytest.mark.parametrize("source", ["step", "wave"])
def test_self_play_collects_both_seats_and_their_zero_sum_rewards(tok, lm, source):
    log: list = []
    env = make_textarena_self_play_env("TicTacToe-v0", tok, game_factory=lambda: Recording(log), batch_size=4,
                                       seed=SEED, max_new_tokens=64, max_turn_tokens=6, max_length=2048,
                                       model_config=lm.config)  # fmt: skip
    policy = TransformersPolicy(lm, env, seed=0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=8, source=source)
    batch = next(iter(collector))
    collector.shutdown()
    group, sample = batch[keys.GROUP_ID][:, 0], batch[keys.SAMPLE_ID][:, 0]
    returns = batch[keys.NEXT][keys.REWARD_NAME].squeeze(-1).sum(1)
    games = {r["seed"]: r for r in log}
    assert len(group.unique()) == 4  # one game per group: four games, both seats of each in the batch
    for g in group.unique().tolist():
        seats = group == g
        assert sorted((sample[seats] % 2).tolist()) == [0, 1]
        record = games[SEED * 100_003 + g]  # the group's game seed
        assert record["result"] is not None, "a game was abandoned: raise the token limits"
        by_role = {int(s) % 2: float(r) for s, r in zip(sample[seats], returns[seats], strict=True)}
        assert [by_role[0], by_role[1]] == record["result"]
        assert sum(record["result"]) == 0.0  # TicTacToe is zero-sum
        replay = TextArenaGame("TicTacToe-v0")  # a fresh game replaying the recorded moves ends the same
        replay.reset(record["seed"])
        for move in record["moves"]:
            replay.play(move)
        assert replay.result() == record["result"]
    assert sum(len(r["moves"]) for r in log if r["seed"] - SEED * 100_003 in group.tolist()) >= 8  # two moves a game
    mask = batch[keys.MASK]
    torch.testing.assert_close(batch[keys.ACTION_LOG_PROB][mask],
                               policy.teacher_forced_log_probs(batch)[mask], atol=2e-5, rtol=0)  # fmt: skip


def test_bad_ids_name_the_two_player_games(tok):
    with pytest.raises(ValueError, match="TicTacToe-v0"):
        make_textarena_self_play_env("GuessTheNumber-v0", tok, max_length=256)
    with pytest.raises(TypeError, match="env_id must be a TextArena id"):
        TextArenaGame(3)
