"""check_env: passes on TokenEnv in every configuration, and names the broken check otherwise."""

import pytest
import torch

from tokengym.errors import TokenGymError
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.checker import check_env
from tokengym.llm_envs.errors import ContractError

CHAT = [{"role": "user", "content": "hi"}]
CONFIGS = {
    "strings": {},
    "chat_and_ids": {"prompts": [CHAT, [50, 51, 52], {"prompt": "x", "answer": "1"}]},
    "exhausted_generator": {"prompts": iter(["a", "b", "c", "d", "e"]), "max_new_tokens": 3},
    "groups_shuffled": {"group_size": 3, "shuffle": True, "seed": 4, "batch_size": 5},
    "stop_strings": {"stop_strings": ["A", "\n", "th"], "max_new_tokens": 20},
    "tight_max_length": {"max_length": 12, "max_new_tokens": 11},
    "reward_fn": {"reward_fn": lambda r, p, m: [len(x) + 1.0 for x in r]},
    "one_slot": {"batch_size": 1},
}


def make(tokenizer, **kw):
    prompts = kw.pop("prompts", ["1+1=", "2+2=", "the answer", "abc"])
    kw.setdefault("batch_size", 3)
    kw.setdefault("max_new_tokens", 6)
    kw.setdefault("max_length", 32)
    return TokenEnv(prompts, tokenizer, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_token_env_conforms(tokenizer, name):
    check_env(make(tokenizer, **CONFIGS[name]), steps=40)


def test_check_env_leaves_the_global_rng_alone(tokenizer):
    state = torch.get_rng_state()
    check_env(make(tokenizer), steps=4)
    assert torch.equal(state, torch.get_rng_state())


def test_contract_error_is_a_value_error():
    assert issubclass(ContractError, ValueError) and issubclass(ContractError, TokenGymError)


@pytest.mark.parametrize("steps", [0, -1, 1.5, True])
def test_bad_steps(tokenizer, steps):
    with pytest.raises(ValueError, match="steps must be a positive int"):
        check_env(make(tokenizer), steps=steps)


# -- broken envs: each breaks one rule of the contract --
def broken(tokenizer, corrupt, **kw):
    """A TokenEnv whose step output (and buffer) ``corrupt(env, out)`` edits after the real step."""

    def _step(self, tensordict):
        return corrupt(self, TokenEnv._step(self, tensordict))

    env = make(tokenizer, **kw)
    env.__class__ = type("BrokenTokenEnv", (TokenEnv,), {"_step": _step})
    return env


def _reward_not_done(env, out):
    return out.set("reward", torch.ones_like(out["reward"]))


def _both_flags(env, out):
    return out.set("truncated", out["terminated"].clone())


def _done_not_or(env, out):
    return out.set("done", torch.zeros_like(out["done"]))


def _seq_len_stuck(env, out):
    return out.set(keys.SEQ_LEN, out[keys.SEQ_LEN] - 1)


def _prompt_len_moves(env, out):
    return out.set(keys.PROMPT_LEN, out[keys.PROMPT_LEN] + 1)


def _traj_id_moves(env, out):
    return out.set(keys.TRAJ_ID, out[keys.TRAJ_ID] + 100)


def _token_not_action(env, out):
    return out.set(keys.TOKEN, (out[keys.TOKEN] + 1) % env.vocab_size)


def _buffer_not_written(env, out):
    env.tokens[torch.arange(env.batch_size[0]), out[keys.SEQ_LEN] - 1] = 3
    return out


def _response_len_not_reset(env, out):
    return out.set(keys.RESPONSE_LEN, out[keys.RESPONSE_LEN] + out["done"].squeeze(-1))


def _wrong_dtype(env, out):
    return out.set(keys.SEQ_LEN, out[keys.SEQ_LEN].int())


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (_reward_not_done, r"reward only where done or a turn ends failed at step 0, slot 0: reward 1.0 but done=False"),
        (_both_flags, r"terminated and truncated never both failed at step \d+, slot \d"),
        (
            _done_not_or,
            r"done == terminated \| truncated failed at step \d+, slot \d: done=False terminated=True",
        ),
        (
            _seq_len_stuck,
            r"seq_len grows by 1 per active slot failed at step 0, slot 0: seq_len (\d+) -> \1, active=True",
        ),
        (
            _prompt_len_moves,
            r"prompt_len fixed within a trajectory failed at step 0, slot 0: prompt_len \d+ -> \d+",
        ),
        (_traj_id_moves, r"traj_id fixed within a trajectory failed at step 0, slot 0: traj_id \d+ -> \d+"),
        (_token_not_action, "token is the action failed at step 0, slot 0: action"),
        (
            _buffer_not_written,
            r"tokens buffer holds prompt \+ actions failed at step 0, slot 0: position \d+",
        ),
        (_response_len_not_reset, r"response_len grows by 1 per active slot failed at step \d+, slot \d"),
        (_wrong_dtype, "check_env_specs failed"),
    ],
)
def test_broken_env_is_named(tokenizer, corrupt, match):
    with pytest.raises(ContractError, match=match):
        check_env(broken(tokenizer, corrupt, max_new_tokens=20), steps=40)


def test_reused_traj_id_is_named(tokenizer):
    env = make(tokenizer)

    original = env._loader.load

    def load(loaded):
        out = original(loaded)
        for b, _ in loaded:
            env._slots.state[keys.TRAJ_ID][b] = 0  # every trajectory gets id 0
        return out

    env._loader.load = load
    with pytest.raises(
        ContractError, match="traj ids unique per new trajectory failed at step -1, slot 1: traj_id 0"
    ):
        check_env(env, steps=4)


def test_stale_response_len_after_reset_is_named(tokenizer):
    env = make(tokenizer)

    original = env._loader.load

    def load(loaded):
        out = original(loaded)
        for b, _ in loaded:
            env._slots.state[keys.RESPONSE_LEN][b] = 2
        return out

    env._loader.load = load
    with pytest.raises(
        ContractError, match="a new trajectory starts empty failed at step -1, slot 0: response_len 2"
    ):
        check_env(env, steps=4)
