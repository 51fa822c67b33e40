"""A word-chain game as a turn handler: a referee scores each turn and may end the game, an opponent from outside
answers (run: python examples/word_game.py). The worked example of the turn-handler guide.

The policy and an outside opponent take turns naming words; each word must start with the last letter of the one
before and must not repeat. The referee gives 1 per valid word; an invalid one is a strike, two strikes end the game;
an opponent with no word left concedes (a bonus of 1). Written against ``tokengym.llm_envs.turns`` alone: no env
subclass, no private state.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs.turns import HeldEpisode, Turn, TurnHandler
from tokengym.testing import tiny_model, tiny_tokenizer

WORDS = ["apple", "egg", "goat", "tiger", "rabbit", "tea", "ant", "tree", "eel", "lemon", "nut", "toe"]


class Opponent:
    """The other player, outside the env (a script here; a server or a person would do): it names a word."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def reply(self, word: str, used: set[str]) -> str | None:
        """A word starting with ``word``'s last letter, not used yet; ``None``: it has none and concedes."""
        return next((w for w in self.words if w[0] == word[-1] and w not in used), None)


@dataclasses.dataclass
class Game:
    opening: str
    last: str  # the word the policy must chain on
    used: set[str]
    strikes: int = 0


class WordChain(TurnHandler):
    """The referee: serves each game's opening, scores each turn, asks the opponent, ends the game."""

    name = "the word-chain referee"

    def __init__(self, opponent: Opponent, *, max_strikes: int = 2) -> None:
        self.opponent, self.max_strikes = opponent, max_strikes
        self.games: dict[int, Game] = {}  # per episode id: the env gives it in every hook
        self.counts = collections.Counter(valid_words=0, invalid_words=0, conceded=0)

    def bind(self, facts) -> None:
        if facts.max_turns < 2:
            raise ValueError(f"a word chain needs turns: build the env with max_turns >= 2, got {facts.max_turns}")
        super().bind(facts)

    def serve(self, draw, episode: int):
        opening = draw.text.strip()  # the prompt source draws the opening words
        self.games[episode] = Game(opening, opening, {opening})
        return [{"role": "user", "content": f"Word chain. Say one word that starts with '{opening[-1]}'. I say: "
                                            f"{opening}"}]  # fmt: skip

    def end_turns(self, turns):
        return [self.referee(turns.episodes[i], text, turns.is_final[i]) for i, text in enumerate(turns.responses)]

    def referee(self, episode: int, text: str, is_final: bool) -> Turn:
        game = self.games[episode]
        word = text.strip().lower()
        if not (word.isalpha() and word[0] == game.last[-1] and word not in game.used):
            self.counts["invalid_words"] += 1
            game.strikes += 1
            if game.strikes >= self.max_strikes:
                return Turn(0.0, done=True)  # the referee ends the game
            return Turn(0.0, f"'{word[:20]}' does not count. A word that starts with '{game.last[-1]}', please.")
        self.counts["valid_words"] += 1
        game.used.add(word)
        try:
            answer = None if is_final else self.opponent.reply(word, game.used)
        except Exception as err:  # the opponent is outside: losing it fails this game alone
            return Turn.failed(err)
        if is_final:  # the env ends the game here (max_turns, the budget): nothing to answer
            return Turn(1.0, done=True)
        if answer is None:
            self.counts["conceded"] += 1
            return Turn(2.0, done=True)
        game.used.add(answer)
        game.last = answer
        return Turn(1.0, f"I say: {answer}. Your word starts with '{answer[-1]}'.")

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)

    def release(self, held: list[HeldEpisode]) -> None:
        for h in held:
            self.games.pop(h.episode, None)

    def restart(self, dropped: list[HeldEpisode], restarted: list[HeldEpisode]) -> None:
        for h in restarted:  # the game starts over from its opening (the episode id stays)
            opening = self.games[h.episode].opening
            self.games[h.episode] = Game(opening, opening, {opening})

    def fork(self, parent: HeldEpisode, child: HeldEpisode) -> None:
        game = self.games[parent.episode]
        self.games[child.episode] = Game(game.opening, game.last, set(game.used), game.strikes)


def make_env(tok, *, batch_size: int = 4, model_config=None) -> TokenEnv:
    """The game as a token env: the opening words are the prompts, the referee is the turn handler."""
    return TokenEnv(["apple", "goat", "lemon"], tok, turns=WordChain(Opponent(WORDS)), max_turns=4,
                    batch_size=batch_size, group_size=2, max_new_tokens=24, max_turn_tokens=6, max_length=256,
                    model_config=model_config)  # fmt: skip


def main(batches: int = 2) -> dict[str, float]:
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=0)
    env = make_env(tok, model_config=model.config)
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)
    for i, batch in enumerate(collector):
        metrics = collector.metrics
        print(f"batch {i}: {batch.shape[0]} games, mean reward {metrics['mean_reward']:.2f}, "
              f"valid words {metrics['valid_words']}, invalid {metrics['invalid_words']}, "
              f"turns that went on {metrics['feedback_turns']}")  # fmt: skip
        if i + 1 >= batches:
            break
    collector.shutdown()
    return collector.metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2)
    main(parser.parse_args().batches)
