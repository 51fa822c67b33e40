"""Self-play: the policy plays both seats of a two-player game, and each seat is trained against itself
(run: python examples/self_play.py; ``--game TicTacToe-v0`` plays a TextArena game instead).

A game is a :class:`~tokengym.llm_envs.turns.self_play.TurnGame`: ``reset(seed)``, ``to_move()``, ``observe(player)``
(what that player has not been shown yet), ``play(text)`` and ``result()``. The env gives each player a slot and a
trajectory of its own; a player's slot waits while the other moves. ``games_per_group`` games are played from one seed,
and :class:`~tokengym.transforms.RoleAdvantage` compares each player with the same seat of the group's other games.
"""

from __future__ import annotations

import argparse

import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import keys, make_self_play_env
from tokengym.llm_envs.adapters import make_textarena_self_play_env
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.transforms import RoleAdvantage


class RaceToTen:
    """Two players add 1, 2 or 3 to a running total in turn (the first of those digits in their answer; none: 1); who
    brings it to 10 wins (+1, the other -1)."""

    num_players = 2

    def reset(self, seed: int) -> None:
        self.total, self.moves, self.winner = seed % 3, 0, None
        rules = f"Race to 10: add 1, 2 or 3 to the total, now {self.total}; who reaches 10 wins."
        self.unseen = [f"{rules} You start.", f"{rules} The other player starts."]  # what each player has not read

    def to_move(self) -> int:
        return self.moves % 2

    def observe(self, player: int) -> str:
        text, self.unseen[player] = self.unseen[player], ""
        return text

    def play(self, text: str) -> None:
        player, digits = self.to_move(), [c for c in text if c in "123"]
        step = int(digits[0]) if digits else 1
        self.total, self.moves = min(self.total + step, 10), self.moves + 1
        if self.total == 10:
            self.winner = player
        self.unseen[1 - player] = f"{self.unseen[1 - player]} The other added {step}: {self.total}.".strip()

    def result(self) -> list[float] | None:
        return None if self.winner is None else [1.0 if p == self.winner else -1.0 for p in range(2)]


def make_env(tok, game: str = "race", *, model_config=None):
    """Four slots (two games at a time), two games per group: a group holds four trajectories, two per seat."""
    options = {"batch_size": 4, "games_per_group": 2, "max_turn_tokens": 6, "model_config": model_config}
    if game == "race":
        return make_self_play_env(RaceToTen, tok, max_new_tokens=40, max_length=512, **options)
    return make_textarena_self_play_env(game, tok, max_new_tokens=64, max_length=2048, **options)


def main(batches: int = 2, game: str = "race") -> list[dict]:
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=0)
    env = make_env(tok, game, model_config=model.config)
    advantage = RoleAdvantage(num_players=2)  # per-role GRPO; baseline="ema" for SPIRAL's role baseline
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=8,
                               postproc=advantage)  # fmt: skip
    summary = []
    for i, batch in enumerate(collector):
        returns = batch[keys.NEXT][keys.REWARD_NAME].squeeze(-1).sum(1)
        role = batch[keys.SAMPLE_ID][:, 0] % 2
        row = {"games": batch.shape[0] // 2, "first seat": float(returns[role == 0].mean()),
               "second seat": float(returns[role == 1].mean()), "advantage": float(batch[keys.ADVANTAGE].abs().max())}
        summary.append(row)
        print(f"batch {i}: {row['games']} games, mean return first seat {row['first seat']:+.2f}, second seat "
              f"{row['second seat']:+.2f}, largest |advantage| {row['advantage']:.2f}")  # fmt: skip
        if i + 1 >= batches:
            break
    collector.shutdown()
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--game", default="race", help="'race' or a two-player TextArena id, e.g. TicTacToe-v0")
    args = parser.parse_args()
    main(args.batches, args.game)
