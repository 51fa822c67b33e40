"""Self-play: the policy plays every seat of a multi-player text game, one env slot per player.

A game of ``n`` players takes ``n`` slots. Each player's turn is what the game shows that player (its own view),
rendered with the chat template after the player's last move; its tokens are its own trajectory, with its own reward
(the game's, at the player's last step). A player waits while the others move: its slot holds its tokens and produces
no step (:meth:`~tokengym.llm_envs.turns.Turn.waiting`), until the handler wakes it with the next observation
(:class:`~tokengym.llm_envs.turns.Wake`). Every seat starts waiting (:class:`~tokengym.llm_envs.turns.Wait`) on the
same prompt, the system prompt (without the generation prompt: every seat of a group has the same prompt); its first
wake is its first observation, a user message, when its first turn comes.

**The end.** The player whose move ends the game gets its reward at that move. The others were waiting: each is woken
with its view of the end and its trajectory ends after one more token, at which its reward is written (a trajectory's
reward sits on one of its own steps). A game that a player's limit ends (its token budget, the context, ``max_turns``)
is abandoned: every player scores 0.

**Groups and roles.** ``games_per_group`` games are played from one game seed; their ``games_per_group * n`` player
trajectories share a ``group_id`` (the env's ``group_size``), and player ``r`` of game ``j`` has ``sample_id = j * n +
r``: its role is ``sample_id % n``. Advantages should compare a role with itself
(:class:`~tokengym.transforms.RoleAdvantage`: per-role GRPO groups by ``(group_id, sample_id % n)``, which needs
``games_per_group >= 2``, or SPIRAL's moving-average baseline per role). TextArena's games of several players:
:func:`~tokengym.llm_envs.adapters.make_textarena_self_play_env`.

**Checkpoints.** A live game cannot be saved: :meth:`SelfPlayTurns.state_dict` keeps each game's seed and the calls
made on it (moves and observations, in order) and loading replays them on a new game.

**The env.** :func:`~tokengym.llm_envs.make_self_play_env` builds a ``TokenEnv`` with these seats and this handler (it
lives beside the env: this package does not import the env module, which imports it).

Example:
    >>> from tokengym.llm_envs import make_self_play_env
    >>> from tokengym.testing import tiny_tokenizer
    >>> env = make_self_play_env(CountingGame, tiny_tokenizer(), batch_size=2, max_new_tokens=16, max_length=256)
    >>> obs = env.reset()
    >>> obs["active"].tolist()  # player 0 moves first; player 1 waits
    [True, False]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from tokengym.llm_envs import keys
from tokengym.llm_envs.errors import RewardFunctionError
from tokengym.llm_envs.prompts import Prompt, PromptSource
from tokengym.llm_envs.turns.protocol import (
    EnvFacts,
    FinishedTurns,
    HeldEpisode,
    Turn,
    TurnHandler,
    Wait,
    Wake,
)

__all__ = ["CountingGame", "SeatSource", "SelfPlayTurns", "TurnGame", "batch_players"]

GAME, ROLE, SEED, PLAYERS = "game", "role", "seed", "players"  # prompt-metadata fields of a seat's draw
GAME_OVER = "The game is over."
SYSTEM_PROMPT = "You play a turn-based game against other players. Answer each turn with your move."


class TurnGame(Protocol):
    """A turn-based text game of ``num_players`` players, as :class:`SelfPlayTurns` plays it (one object per game)."""

    num_players: int

    def reset(self, seed: int) -> None:
        """Start a game from ``seed``."""

    def to_move(self) -> int:
        """The player whose turn it is."""

    def observe(self, player: int) -> str:
        """What ``player`` has not been shown yet (its first call: the rules and the position), in its own view."""

    def play(self, action: str) -> None:
        """The player to move plays ``action`` (the text the model wrote)."""

    def result(self) -> list[float] | None:
        """``None`` while the game goes on; each player's reward once it is over."""


class CountingGame:
    """A tiny two-player game (for examples and tests): players alternate saying a number; a player who says the
    number one above the last one scores a point; after ``rounds`` moves each, more points wins (+1 / -1, 0 on a tie).

    Example:
        >>> g = CountingGame(rounds=1)
        >>> g.reset(seed=3)
        >>> g.observe(0)
        'Counting game, you are player 0. Say the number after 3.'
        >>> g.play("4"); g.observe(1)
        'You are player 1. Player 0 said 4. Say the number after 4.'
        >>> g.play("6"); g.result()
        [1.0, -1.0]
    """

    num_players = 2

    def __init__(self, rounds: int = 2) -> None:
        self.rounds = rounds

    def reset(self, seed: int) -> None:
        self.last, self.moves, self.points = seed % 10, 0, [0, 0]
        self.news = [f"Counting game, you are player 0. Say the number after {self.last}.",
                     "You are player 1."]  # fmt: skip

    def to_move(self) -> int:
        return self.moves % 2

    def observe(self, player: int) -> str:
        text, self.news[player] = self.news[player], ""
        return text

    def play(self, action: str) -> None:
        player, word = self.to_move(), action.strip().split(" ")[0]
        if word.isdigit() and int(word) == self.last + 1:
            self.points[player] += 1
        self.last = int(word) if word.isdigit() else self.last
        self.moves += 1
        other = 1 - player
        said = f"Player {player} said {action.strip()[:20]}."
        self.news[other] = f"{self.news[other]} {said} Say the number after {self.last}.".strip()

    def result(self) -> list[float] | None:
        if self.moves < 2 * self.rounds:
            return None
        a, b = self.points
        return [0.0, 0.0] if a == b else ([1.0, -1.0] if a > b else [-1.0, 1.0])


class SeatSource(PromptSource):
    """The draws of self-play seats: draw ``k`` is player ``k % n`` of game ``k // n``.

    Game ``g`` belongs to group ``g // games_per_group`` and is reset with that group's seed (``seed * 100_003 +
    group``); a draw has ``group_id`` = its group, ``sample_id = (g % games_per_group) * n + role`` and metadata
    ``{"game": g, "role": r, "seed": ..., "players": n}`` (a batch's prompt table carries it: :func:`batch_players`). ``num_games=None`` runs forever; a finite run ends after whole games.
    """

    def __init__(self, tokenizer, *, num_players: int, games_per_group: int = 1, num_games: int | None = None,
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__([None], tokenizer, seed=seed)
        for name, value in (("num_players", num_players), ("games_per_group", games_per_group)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_games is not None and (isinstance(num_games, bool) or not isinstance(num_games, int) or num_games < 1):
            raise ValueError(f"num_games must be a positive int or None (endless), got {num_games!r}")
        self.num_players, self.games_per_group, self.num_games = num_players, games_per_group, num_games
        self.group_size = games_per_group * num_players
        self.is_sized, self.next_draw = False, 0
        self.epochs = None if num_games is None else 1

    def game_seed(self, group: int) -> int:
        """The seed every game of ``group`` starts from."""
        return self.seed * 100_003 + group

    def next(self) -> Prompt | None:
        """The next seat's draw (``None`` after ``num_games`` games)."""
        n = self.num_players
        while True:
            k = self.next_draw
            game, role = divmod(k, n)
            if self.num_games is not None and game >= self.num_games:
                self.is_exhausted = True
                return None
            self.next_draw += 1
            group = game // self.games_per_group
            if group % self.num_shards == self.shard_index:
                break
        sample = (game % self.games_per_group) * n + role
        meta = {GAME: game, ROLE: role, SEED: self.game_seed(group), PLAYERS: n}
        return Prompt(torch.zeros(1, dtype=torch.int64), "", meta, game, group, sample)

    def state_dict(self) -> dict:
        return {"next_draw": self.next_draw}

    def load_state_dict(self, state) -> None:
        self.next_draw, self.is_exhausted = int(state["next_draw"]), False


@dataclasses.dataclass
class _Game:
    """One game being played: the game object, its seed, the calls made on it, its seats (role -> episode id)."""

    game: TurnGame
    seed: int
    log: list = dataclasses.field(default_factory=list)  # ["play", text] / ["observe", player], in order
    seats: dict[int, int] = dataclasses.field(default_factory=dict)
    started: set[int] = dataclasses.field(default_factory=set)  # roles woken for their first turn
    ended: set[int] = dataclasses.field(default_factory=set)  # roles whose trajectory ended (or is closing)
    result: list[float] | None = None

    def observe(self, player: int) -> str:
        self.log.append(["observe", player])
        return self.game.observe(player)

    def play(self, text: str) -> None:
        self.log.append(["play", text])
        self.game.play(text)


class SelfPlayTurns(TurnHandler):
    """The turn handler of self-play: each slot is one seat of a game; see the module docstring.

    Args:
        game_factory: ``game_factory()`` -> a new :class:`TurnGame` (one per game).
        system_prompt: the system message every seat starts from (the prompt of every trajectory).
    """

    name = "the self-play referee"

    def __init__(self, game_factory: Callable[[], TurnGame], *, system_prompt: str = SYSTEM_PROMPT) -> None:
        if not callable(game_factory):
            raise TypeError(f"game_factory must be callable() -> a TurnGame, got {game_factory!r}")
        self.game_factory, self.system_prompt = game_factory, system_prompt
        self.games: dict[int, _Game] = {}
        self.seat_of: dict[int, tuple[int, int]] = {}  # episode id -> (game, role)
        self.queued: list[Wake] = []
        self.counts = {"games_finished": 0, "games_abandoned": 0}

    def bind(self, facts: EnvFacts) -> None:
        if facts.max_turns < 2:
            raise ValueError(f"self-play needs turns: build the env with max_turns >= 2, got {facts.max_turns}")
        super().bind(facts)
        self.intro = [{"role": "system", "content": self.system_prompt}]
        self.intro_ids = self.render(self.intro, is_generation=False)

    def serve(self, draw: Prompt, episode: int) -> Wait:
        g, role = int(draw.metadata[GAME]), int(draw.metadata[ROLE])
        game = self.games.get(g)
        if game is None:
            game = self.games[g] = _Game(self.game_factory(), int(draw.metadata[SEED]))
            game.game.reset(game.seed)
        game.seats[role] = episode
        self.seat_of[episode] = (g, role)
        if game.result is not None:  # the game ended before this seat was served: it closes at once
            self._close_seat(game, role)
        elif game.game.to_move() == role:
            self._wake_seat(game, role)
        return Wait(self.intro_ids)

    def render(self, messages: list[dict], *, is_generation: bool) -> torch.Tensor:
        """Token ids of ``messages`` under the chat template (with the generation prompt or not)."""
        tok = self.facts.tokenizer
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=is_generation)
        return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)

    def first_wake(self, text: str) -> torch.Tensor:
        """The ids that follow a seat's prompt for its first turn: a user message and the generation prompt, as the
        template writes the whole conversation."""
        full = self.render([*self.intro, {"role": "user", "content": text}], is_generation=True)
        if not torch.equal(full[: len(self.intro_ids)], self.intro_ids):
            raise ValueError("the chat template rewrites the system message when a user message follows it, so a "
                             "player's first observation cannot be appended; use a template that renders messages "
                             "in order")  # fmt: skip
        return full[len(self.intro_ids) :]

    def end_turns(self, turns: FinishedTurns) -> list[Turn]:
        return [self.answer(turns, i) for i in range(len(turns))]

    def answer(self, turns: FinishedTurns, i: int) -> Turn:
        """The answer to one player's finished turn (its move played, the next player woken)."""
        g, role = self.seat_of[turns.episodes[i]]
        game = self.games[g]
        if game.result is not None:  # a closing turn: the game ended on another's move
            return Turn(game.result[role], done=True)
        try:
            game.play(turns.responses[i])
            result = game.game.result()
        except Exception as err:  # the game itself broke: this game ends, its players score 0
            self._abandon(game, role)
            return Turn.failed(err)
        if result is not None:
            if len(result) != len(game.seats) and len(result) != game.game.num_players:
                raise RewardFunctionError(f"game {g} gave {len(result)} rewards for {game.game.num_players} players")
            game.result = [float(r) for r in result]
            self.counts["games_finished"] += 1
            self._end_game(game, role)
            return Turn(game.result[role], done=True)
        if turns.is_final[i]:  # this player's limit ends the game: abandoned, every player scores 0
            self._abandon(game, role)
            return Turn(0.0, done=True)
        nxt = game.game.to_move()
        if nxt == role:
            return Turn(0.0, game.observe(role))
        self._wake_seat(game, nxt)
        return Turn.waiting()

    def _wake_seat(self, game: _Game, role: int) -> None:
        """Queue the wake of ``role``'s seat with what it has not seen (nothing when it is not served yet: its
        first observation is served then)."""
        episode = game.seats.get(role)
        if episode is None:
            return
        self.queued.append(self._wake(game, role, game.observe(role)))

    def _wake(self, game: _Game, role: int, text: str, *, is_last: bool = False) -> Wake:
        """The wake of ``role``'s seat with ``text`` (its first turn's: rendered after its intro)."""
        if role in game.started:
            return Wake(game.seats[role], text, is_last=is_last)
        game.started.add(role)
        return Wake(game.seats[role], self.first_wake(text), is_last=is_last)

    def _end_game(self, game: _Game, role: int, active: int | None = None) -> None:
        """``role``'s move ended the game: every other seat served closes (but ``active``, in its turn)."""
        game.ended.add(role)
        for other in game.seats:
            if other not in game.ended and other != active:
                self._close_seat(game, other)

    def _close_seat(self, game: _Game, role: int) -> None:
        """Wake ``role`` with its view of the end; its trajectory ends after one token (its reward there)."""
        game.ended.add(role)
        text = game.observe(role)
        self.queued.append(self._wake(game, role, f"{text}\n{GAME_OVER}" if text else GAME_OVER, is_last=True))

    def _abandon(self, game: _Game, role: int, active: int | None = None) -> None:
        """The game cannot go on: it ends with reward 0 for every player."""
        game.result = [0.0] * game.game.num_players
        self.counts["games_abandoned"] += 1
        self._end_game(game, role, active)

    def wakes(self) -> list[Wake]:
        queued, self.queued = self.queued, []
        return queued

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def release(self, held: list[HeldEpisode]) -> None:
        touched = {}
        for h in held:
            seat = self.seat_of.pop(h.episode, None)
            if seat is not None and seat[0] in self.games:
                touched[seat[0]] = seat[1]
                self.games[seat[0]].seats.pop(seat[1], None)
        for g, role in touched.items():
            game = self.games[g]
            if game.result is None:  # a seat left a game going on (a reset, a seat that could not load)
                mover = game.game.to_move()  # a seat in its turn is not waiting: its turn's end gets the result
                self._abandon(game, role, active=mover if mover in game.seats and mover in game.started else None)
            if not game.seats:
                del self.games[g]

    def restart(self, dropped: list[HeldEpisode], restarted: list[HeldEpisode]) -> None:
        raise RewardFunctionError("self-play games cannot restart one player's trajectory mid-game; collect without "
                                  "restarts (no interrupting weight updates)")  # fmt: skip

    def state_dict(self) -> dict:
        """Each game's seed and the calls made on it, its seats and where each stands (plain data)."""
        games = [[g, game.seed, [list(e) for e in game.log], sorted([r, e] for r, e in game.seats.items()),
                  sorted(game.started), sorted(game.ended), game.result] for g, game in self.games.items()]  # fmt: skip
        return {"games": games, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        """Replay each saved game on a new game object (live games cannot be saved)."""
        self.games, self.seat_of, self.queued = {}, {}, []
        for g, seed, log, seats, started, ended, result in state["games"]:
            game = _Game(self.game_factory(), int(seed))
            game.game.reset(game.seed)
            for kind, value in log:
                game.observe(value) if kind == "observe" else game.play(value)
            game.seats = {int(r): int(e) for r, e in seats}
            game.started, game.ended = set(started), set(ended)
            game.result = None if result is None else [float(r) for r in result]
            self.games[int(g)] = game
            self.seat_of.update({e: (int(g), r) for r, e in game.seats.items()})
        self.counts.update(state.get("counts", {}))


def batch_players(batch) -> int | None:
    """The players per game of a collected self-play batch, read from its prompt table (``keys.PROMPTS``, the seats'
    metadata): ``n`` for a self-play batch, ``0`` for a batch a collector recorded whose prompts carry no role (not
    self-play), ``None`` when the batch says nothing (no prompt table, or one no collector recorded: a table without
    sampling settings, as a batch built by hand has).

    Example:
        >>> from tokengym.llm_envs import PromptTable, keys
        >>> from tensordict import TensorDict
        >>> table = PromptTable()
        >>> table.add(0, torch.tensor([1]), metadata={"game": 0, "role": 0, "seed": 0, "players": 2})
        >>> batch_players(TensorDict({}, []).set_non_tensor(keys.PROMPTS, table))
        2
    """
    try:
        table = batch.get_non_tensor(keys.PROMPTS)
    except KeyError:
        return None
    if table is None or not len(table):
        return None
    meta = table.metadata(table.group_ids()[0])
    if ROLE not in meta:
        return 0 if table.sampling is not None else None
    players = meta.get(PLAYERS)
    return None if players is None else int(players)

