"""examples/self_play.py runs and plays both seats with per-role advantages (its imports: test_public_surface)."""

from __future__ import annotations

import pathlib
import runpy
import sys

from tokengym.llm_envs import keys
from tokengym.testing import tiny_tokenizer

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "self_play.py"


def test_the_example_runs(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["self_play.py", "--batches", "1"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("batch 0: 4 games") and "second seat" in out


def test_the_example_game_is_zero_sum_and_each_seat_sees_its_own_view():
    game = runpy.run_path(str(EXAMPLE), run_name="self_play")["RaceToTen"]()
    game.reset(seed=7)  # the total starts at 1
    assert game.observe(1).endswith("The other player starts.") and game.observe(1) == ""
    game.play("I add 3")
    assert game.result() is None and game.to_move() == 1
    assert game.observe(1) == "The other added 3: 4."
    for move in ["3", "3"]:  # 7, then 10: player 0 wins
        game.play(move)
    assert game.observe(1) == "The other added 3: 10." and game.result() == [1.0, -1.0]


def test_the_example_env_pairs_seats_in_groups():
    namespace = runpy.run_path(str(EXAMPLE), run_name="self_play")
    env = namespace["make_env"](tiny_tokenizer())
    obs = env.reset()
    assert obs[keys.ACTIVE].tolist() == [True, False, True, False]  # first seats move, second seats wait
    # two games of one seed: one group of four trajectories, player r of game j has sample id 2 * j + r
    assert obs[keys.GROUP_ID].tolist() == [0, 0, 0, 0] and obs[keys.SAMPLE_ID].tolist() == [0, 1, 2, 3]
