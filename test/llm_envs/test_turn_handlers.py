"""A new kind of turn is one handler written against llm_envs/turns/protocol.py: no env subclass, no private state."""

import pytest
import torch

from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.turns import FinishedTurns, RewardTurns, Turn, TurnHandler
from tokengym.testing import tiny_tokenizer


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class GuessGame(TurnHandler):
    """Guess the number 7: a wrong guess gets a hint as a tool message and a user message; hooks are recorded."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.released, self.closed = [], False

    def end_turns(self, turns: FinishedTurns):
        out = []
        for i, (text, turn) in enumerate(zip(turns.responses, turns.turns, strict=True)):
            self.seen.append((turns.slots[i], turn, text, turns.is_final[i], len(turns.history(i))))
            if "7" in text:
                out.append(Turn(1.0))
            else:
                out.append(Turn(0.0, [{"role": "tool", "content": "higher"}, {"role": "user", "content": "again"}]))
        return out

    def release(self, held):
        self.released += [h.prompt.index for h in held]

    def close(self):
        self.closed = True


def _play(env, scripts):
    """Step slot 0 through ``scripts`` (one list of ids per turn, each ending the turn); return the steps."""
    td, steps = env.reset(), []
    for script in scripts:
        for token in script:
            td, nxt = env.step_and_maybe_reset(td.set(keys.ACTION, torch.tensor([token])))
            steps.append(td)
            td = nxt
    return steps


def test_a_handler_written_against_the_protocol_plays_a_game_in_chat_template_tokens():
    tok = tiny_tokenizer()
    game = GuessGame()
    env = TokenEnv([[{"role": "user", "content": "Guess a number."}]], tok, turns=game, max_turns=3, batch_size=1, max_new_tokens=32, max_length=128)
    end = int(env.turn_close_ids[0])
    assert end in env.eos_token_ids  # a multi-turn env ends a turn on the template's end-of-turn token
    steps = _play(env, [_ids(tok, "3") + [end], _ids(tok, "7") + [end]])
    assert [bool(s[keys.DONE]) for s in steps] == [False] * (len(steps) - 1) + [True]
    assert [s[keys.REWARD].item() for s in steps if bool(s["next", "turn"] != s["turn"]) or bool(s[keys.DONE])] == [0.0, 1.0]
    assert [(slot, turn, text, final) for slot, turn, text, final, _ in game.seen] == [(0, 0, "3", False), (0, 1, "7", False)]
    # the slot holds what the chat template writes for the conversation, the tool message included
    conversation = [{"role": "user", "content": "Guess a number."}, {"role": "assistant", "content": "3"},
                    {"role": "tool", "content": "higher"}, {"role": "user", "content": "again"},
                    {"role": "assistant", "content": "7"}]  # fmt: skip
    sequence = env.pop_finished_sequences()[0].tolist()
    closed = sequence + env.turn_close_ids[1:].tolist()  # the rest of the last turn's close, which nobody generates
    assert closed == _ids(tok, tok.apply_chat_template(conversation, tokenize=False))
    assert game.seen[1][4] == len(sequence)  # history: everything in the slot up to the turn's end
    assert game.released == [0]  # the finished episode's slot was refilled (one prompt, drawn again): released
    env.reset()
    assert game.released == [0, 0]  # and again by the reset
    env.close()
    assert game.closed


def test_done_with_feedback_ends_the_episode_and_max_turns_marks_the_last_turn_final():
    tok = tiny_tokenizer()

    class Stop(TurnHandler):
        def __init__(self):
            self.final = []

        def end_turns(self, turns):
            self.final += turns.is_final
            return [Turn(0.5, "bye", done=t == 1) for t in turns.turns]

    handler = Stop()
    env = TokenEnv(["hi"], tok, turns=handler, max_turns=3, batch_size=1, max_new_tokens=32, max_length=128)
    end = int(env.turn_close_ids[0])
    steps = _play(env, [[40, end], [41, end]])
    assert bool(steps[-1][keys.DONE]) and bool(steps[-1][keys.TERMINATED])
    assert handler.final == [False, False]
    env2 = TokenEnv(["hi"], tok, turns=Stop(), max_turns=1, batch_size=1, max_new_tokens=32, max_length=128)
    with pytest.raises(ValueError, match=r"gave feedback 'bye' for slot 0 .* but the env is single-turn \(max_turns=1\)"):
        _play(env2, [[40, tok.eos_token_id]])  # feedback it cannot write: a handler's bug, not dropped silently
    assert env2.turns.final == [True]


def test_handler_errors_name_the_cause():
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="pass reward_fn or turns="):
        TokenEnv(["hi"], tok, lambda r, p, m: [0.0] * len(r), turns=RewardTurns(), batch_size=1, max_length=32)
    with pytest.raises(TypeError, match="turns must be a TurnHandler .* got function"):
        TokenEnv(["hi"], tok, turns=lambda turns: [], batch_size=1, max_length=32)
    with pytest.raises(ValueError, match="max_turns must be an int >= 1, got 0"):
        TokenEnv(["hi"], tok, max_turns=0, batch_size=1, max_length=32)

    class Wrong(TurnHandler):
        def end_turns(self, turns):
            return [0.0]

    env = TokenEnv(["hi"], tok, turns=Wrong(), max_turns=2, batch_size=1, max_new_tokens=8, max_length=32)
    td = env.reset()
    with pytest.raises(ValueError, match=r"the turn handler must return one Turn per finished slot \(1 for slots \[0\]\)"):
        env.step(td.set(keys.ACTION, torch.tensor([tok.eos_token_id])))


def test_text_env_role_reaches_the_template():
    from tokengym.llm_envs.adapters import make_text_env

    class Calculator:
        def reset(self, seed=None):
            return "What is 2+2?", {}

        def step(self, text):
            return "4", 0.0, False, False, {"role": "tool"}

    tok = tiny_tokenizer()
    env = make_text_env(Calculator, tok, max_turns=2, batch_size=1, max_new_tokens=16, max_length=128)
    end = int(env.turn_close_ids[0])
    _play(env, [[40, end], [41, end]])
    sequence = env.pop_finished_sequences()[0].tolist()
    tool = _ids(tok, tok.apply_chat_template([{"role": "tool", "content": "4"}], tokenize=False))
    text = tok.decode(sequence)
    assert tok.decode(tool) in text and "<|user|>4" not in text
    env.close()


def test_feedback_ids_rendered_by_the_handler_are_appended_as_they_are():
    tok = tiny_tokenizer()

    class Echo(TurnHandler):
        def end_turns(self, turns):
            ids = torch.tensor(_ids(tok, "<|user|>go on<|end|><|assistant|>"))
            return [Turn(0.0, ids) if t == 0 else Turn(1.0) for t in turns.turns]

    env = TokenEnv(["hi"], tok, turns=Echo(), max_turns=2, batch_size=1, max_new_tokens=32, max_length=128)
    end = int(env.turn_close_ids[0])
    steps = _play(env, [[40, end], [41, end]])
    assert bool(steps[-1][keys.DONE])
    sequence = env.pop_finished_sequences()[0].tolist()
    assert sequence == _ids(tok, "hi") + [40, end] + _ids(tok, "<|user|>go on<|end|><|assistant|>") + [41, end]

    class Bad(TurnHandler):
        def end_turns(self, turns):
            return [Turn(0.0, torch.tensor([10_000]))]

    env = TokenEnv(["hi"], tok, turns=Bad(), max_turns=2, batch_size=1, max_new_tokens=8, max_length=64)
    td = env.reset()
    with pytest.raises(ValueError, match=r"feedback id 10000 for slot 0, outside the vocabulary \[0, 512\)"):
        env.step(td.set(keys.ACTION, torch.tensor([end])))
