"""Self-play throughput: the policy playing both seats of a game ÷ the same game against a scripted opponent.

The game is :class:`~tokengym.llm_envs.turns.self_play.CountingGame` (``ROUNDS`` moves per player). Self-play: both players are
the policy, one slot per player (:func:`~tokengym.llm_envs.make_self_play_env`); a player's slot waits while the
other moves. Scripted: the same game, player 1 answered by a script inside the game (a one-player game through the same
env), so every slot always moves. End-of-turn ids are banned from sampling: every turn is ``TURN_TOKENS`` tokens, and
the two setups do the same work per policy move. ``B`` slots, ``GAMES`` games per run (a finite source: a run is every
game's trajectories), the tiny model, one torch thread.

Reported per setup and source: games/s (an episode is one game: both roles in self-play) and policy tokens/s, medians
over interleaved rounds; ratio: the median of the per-round ratios self-play ÷ scripted (games/s). A self-play game
generates twice the tokens of a scripted one, so the ratio of an ideal engine is 0.5 in games and 1 in tokens.

Run: ``.venv/bin/python -m pytest -p no:cacheprovider benchmarks/test_self_play.py`` (the table is printed).
"""

from __future__ import annotations

import datetime
import statistics
import time

import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy
from tokengym.llm_envs import keys, make_self_play_env
from tokengym.llm_envs.turns.self_play import CountingGame
from tokengym.testing import tiny_model, tiny_tokenizer

B, GAMES, ROUNDS, TURN_TOKENS, REPEATS = 8, 32, 3, 16, 5
SOURCES = ("step", "wave")


class ScriptedCounting:
    """:class:`CountingGame` with player 1 scripted (it says the right number at once): a one-player game."""

    num_players = 1

    def __init__(self) -> None:
        self.game = CountingGame(rounds=ROUNDS)

    def reset(self, seed: int) -> None:
        self.game.reset(seed)

    def to_move(self) -> int:
        return 0

    def observe(self, player: int) -> str:
        return self.game.observe(0)

    def play(self, action: str) -> None:
        self.game.play(action)
        if self.game.result() is None:
            self.game.observe(1)
            self.game.play(str(self.game.last + 1))

    def result(self) -> list[float] | None:
        result = self.game.result()
        return None if result is None else result[:1]


def _run(tok, model, *, scripted: bool, source: str) -> tuple[float, int, int]:
    """One run of ``GAMES`` games: (seconds, games, policy tokens)."""
    factory = ScriptedCounting if scripted else (lambda: CountingGame(rounds=ROUNDS))
    players = 1 if scripted else 2
    env = make_self_play_env(factory, tok, batch_size=B, num_games=GAMES, max_new_tokens=ROUNDS * TURN_TOKENS + 1,
                             max_turn_tokens=TURN_TOKENS, max_length=1024, model_config=model.config)  # fmt: skip
    banned = tuple(sorted(env.eos_token_ids))
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(banned_token_ids=banned), seed=0)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=GAMES * players, source=source)
    start = time.perf_counter()
    batch = next(iter(collector))
    seconds = time.perf_counter() - start
    collector.shutdown()
    assert batch.shape[0] == GAMES * players
    assert env.turn_metrics["games_finished"] == GAMES  # no game abandoned: the same games in every run
    return seconds, GAMES, int(batch[keys.MASK].sum())


def test_self_play_throughput(write_uncaptured):
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=0)
    setups = [(source, scripted) for source in SOURCES for scripted in (False, True)]
    for source, scripted in setups:  # warm-up
        _run(tok, model, scripted=scripted, source=source)
    games: dict = {s: [] for s in setups}
    tokens: dict = {s: [] for s in setups}
    ratios: dict = {source: [] for source in SOURCES}
    for r in range(REPEATS):
        order = setups[r % len(setups) :] + setups[: r % len(setups)]  # rotated each round
        rate = {}
        for setup in order:
            seconds, n, toks = _run(tok, model, scripted=setup[1], source=setup[0])
            rate[setup] = n / seconds
            games[setup].append(n / seconds)
            tokens[setup].append(toks / seconds)
        for source in SOURCES:
            ratios[source].append(rate[(source, False)] / rate[(source, True)])

    def table(write) -> None:
        write("")
        write("### Self-play throughput (benchmarks/test_self_play.py)")
        write(f"date: {datetime.date.today().isoformat()}; CountingGame, {ROUNDS} moves per player of {TURN_TOKENS} "
              f"tokens, {B} slots, {GAMES} games per run, tiny model, {torch.get_num_threads()} torch thread; medians "
              f"of {REPEATS} interleaved rounds")  # fmt: skip
        write("| source | self-play games/s | scripted games/s | self-play ÷ scripted (games/s) | "
              "self-play tokens/s | scripted tokens/s |")  # fmt: skip
        write("|---|---|---|---|---|---|")
        for source in SOURCES:
            sp, sc = (source, False), (source, True)
            write(f"| {source} | {statistics.median(games[sp]):.2f} | {statistics.median(games[sc]):.2f} | "
                  f"{statistics.median(ratios[source]):.2f} | {statistics.median(tokens[sp]):.0f} | "
                  f"{statistics.median(tokens[sc]):.0f} |")  # fmt: skip

    write_uncaptured(table)
    assert all(r > 0 for rs in ratios.values() for r in rs)
