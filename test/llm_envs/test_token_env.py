"""TokenEnv: sources, groups, partial resets, the tokens buffer, termination, resume and bad input."""

import copy

import datasets
import pytest
import torch
from tensordict import TensorDict
from torchrl.envs.utils import check_env_specs

from tokengym.errors import ResetNeeded, RewardFunctionError
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.llm_envs.errors import PromptError

EOS, PAD = 1, 0
A, B_, NL = 40, 41, 206  # "A", "B", "\n" in the tiny tokenizer
PROMPTS = ["1+1=", "2+2=", "abc", "hello world"]


def make(tokenizer, prompts=PROMPTS, **kw):
    kw.setdefault("batch_size", 2)
    kw.setdefault("max_new_tokens", 4)
    kw.setdefault("max_length", 32)
    return TokenEnv(prompts, tokenizer, **kw)


def act(td, *actions):
    return td.set(keys.ACTION, torch.tensor(actions, dtype=torch.int64))


def flags(nxt):
    """done, terminated, truncated of a step's ``"next"`` tensordict, as lists."""
    return [nxt[name].reshape(-1).tolist() for name in keys.DONE_KEYS]


class Recorder:
    """A reward fn that records its calls and returns the response length."""

    def __init__(self):
        self.calls = []

    def __call__(self, responses, prompts, metadata):
        self.calls.append((responses, prompts, metadata))
        return [float(len(r)) for r in responses]


# -- reset and observation --
def test_reset_observation(tokenizer):
    env = make(tokenizer)
    td = env.reset()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS[:2]]
    assert set(keys.OBSERVATION_KEYS) <= set(td.keys())
    assert td[keys.SEQ_LEN].tolist() == td[keys.PROMPT_LEN].tolist() == [len(i) for i in ids]
    assert td[keys.TOKEN].tolist() == [i[-1] for i in ids]
    assert td[keys.RESPONSE_LEN].tolist() == [0, 0] and td[keys.TURN].tolist() == [0, 0]
    assert td[keys.TRAJ_ID].tolist() == [0, 1] and td[keys.GROUP_ID].tolist() == [0, 1]
    assert td[keys.ACTIVE].tolist() == [True, True]
    for b, i in enumerate(ids):
        assert env.tokens[b, : len(i)].tolist() == i
        assert env.slot_prompt(b).text == PROMPTS[b]
    assert env.observation_spec.is_in(td.select(*keys.OBSERVATION_KEYS))


def test_check_env_specs(tokenizer):
    check_env_specs(make(tokenizer, stop_strings=["\n"], reward_fn=Recorder()))


def test_chat_prompts(tokenizer):
    env = make(tokenizer, [[{"role": "user", "content": "hi"}]], batch_size=1)
    td = env.reset()
    n = int(td[keys.PROMPT_LEN][0])
    assert tokenizer.decode(env.tokens[0, :n]) == "<|user|>hi<|end|><|assistant|>"
    assert int(td[keys.TOKEN][0]) == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_token_id_prompts(tokenizer):
    env = make(tokenizer, [[50, 51, 52], torch.tensor([60, 61])])
    td = env.reset()
    assert env.tokens[0, :3].tolist() == [50, 51, 52] and env.tokens[1, :2].tolist() == [60, 61]
    assert td[keys.TOKEN].tolist() == [52, 61] and td[keys.PROMPT_LEN].tolist() == [3, 2]


def test_dataset_prompts_and_metadata_reach_reward_fn(tokenizer):
    ds = datasets.Dataset.from_list(
        [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4"}]
    )
    reward = Recorder()
    env = make(tokenizer, ds, reward_fn=reward)
    td = env.reset()
    out = env.step(act(td, A, EOS))
    assert reward.calls == [([""], ["2+2="], [{"answer": "4"}])]
    assert out[keys.REWARD].reshape(-1).tolist() == [0.0, 0.0]  # empty response: length 0


def test_mapping_metadata_reaches_reward_fn(tokenizer):
    reward = Recorder()
    env = make(tokenizer, [{"prompt": "1+1=", "answer": "2", "id": 7}], batch_size=1, reward_fn=reward)
    td = env.reset()
    td = env.step(act(td, A))["next"]
    out = env.step(act(td, EOS))
    assert reward.calls == [(["A"], ["1+1="], [{"answer": "2", "id": 7}])]
    assert out[keys.REWARD].tolist() == [[1.0]]


def test_generator_is_read_once_then_slots_go_inactive(tokenizer):
    env = make(tokenizer, (p for p in ["a", "b", "c"]), batch_size=2)
    td = env.reset()
    assert td[keys.ACTIVE].tolist() == [True, True] and not env.is_exhausted
    out, td = env.step_and_maybe_reset(act(td, EOS, EOS))
    assert td[keys.ACTIVE].tolist() == [True, False] and env.slot_prompt(1) is None
    assert env.source.is_exhausted and not env.is_exhausted
    out, td = env.step_and_maybe_reset(act(td, A, A))
    assert flags(out["next"])[0] == [False, False]  # the idle slot never finishes
    assert td[keys.SEQ_LEN][1] == 0 and td[keys.RESPONSE_LEN][1] == 0
    out, td = env.step_and_maybe_reset(act(td, EOS, A))
    assert td[keys.ACTIVE].tolist() == [False, False] and env.is_exhausted


def test_exhausted_slot_after_max_length_keeps_stepping(tokenizer):
    # a slot truncated at max_length and then left idle must not index past the buffer
    env = make(tokenizer, iter(["1+1="]), batch_size=1, max_new_tokens=5, max_length=6)
    td = env.reset()
    for _ in range(2):
        out, td = env.step_and_maybe_reset(act(td, A))
    assert flags(out["next"])[2] == [True]
    out, td = env.step_and_maybe_reset(act(td, A))
    assert env.is_exhausted and flags(out["next"])[0] == [False]


def test_epochs_through_a_prompt_source(tokenizer):
    env = make(tokenizer, PromptSource(["a", "b"], tokenizer, epochs=2), batch_size=1)
    td, seen = env.reset(), []
    while not env.is_exhausted:
        if td[keys.ACTIVE][0]:
            seen.append(env.slot_prompt(0).text)
        _, td = env.step_and_maybe_reset(act(td, EOS))
    assert seen == ["a", "b", "a", "b"]


def test_group_size(tokenizer):
    env = make(tokenizer, ["a", "b"], batch_size=4, group_size=3)
    td = env.reset()
    assert td[keys.GROUP_ID].tolist() == [0, 0, 0, 1] and td[keys.SAMPLE_ID].tolist() == [0, 1, 2, 0]
    _, td = env.step_and_maybe_reset(act(td, EOS, A, A, EOS))
    assert td[keys.GROUP_ID].tolist() == [1, 0, 0, 1] and td[keys.SAMPLE_ID].tolist() == [1, 1, 2, 2]
    assert td[keys.TRAJ_ID].tolist() == [4, 1, 2, 5]


def _prompt_order(tokenizer, seed):
    env = make(tokenizer, [str(i) for i in range(12)], batch_size=3, shuffle=True, seed=seed)
    td, order = env.reset(), []
    for _ in range(8):
        order += [env.slot_prompt(b).index for b in range(3)]
        _, td = env.step_and_maybe_reset(act(td, EOS, EOS, EOS))
    return order


def test_shuffle_order_is_deterministic_under_a_seed(tokenizer):
    first = _prompt_order(tokenizer, 5)
    assert first == _prompt_order(tokenizer, 5)
    assert first != _prompt_order(tokenizer, 6)
    assert sorted(first[:12]) == list(range(12))


# -- stepping --
def test_step_appends_to_the_tokens_buffer(tokenizer):
    env = make(tokenizer, max_new_tokens=8)
    td = env.reset()
    p_len = td[keys.PROMPT_LEN].tolist()
    actions = [(A, 50), (B_, 51), (42, 52)]
    for t, pair in enumerate(actions):
        td = env.step(act(td, *pair))["next"]
        assert td[keys.SEQ_LEN].tolist() == [n + t + 1 for n in p_len]
        assert td[keys.RESPONSE_LEN].tolist() == [t + 1, t + 1]
        assert td[keys.TOKEN].tolist() == list(pair)
    for b in range(2):
        assert env.tokens[b, p_len[b] : p_len[b] + 3].tolist() == [a[b] for a in actions]
        assert env.response_ids(b).tolist() == [a[b] for a in actions]
        assert env.tokens[b, p_len[b] + 3 :].eq(0).all()


def test_outputs_of_earlier_steps_are_not_mutated(tokenizer):
    env = make(tokenizer)
    td0 = env.reset()
    snapshot = td0.clone()
    out, td1 = env.step_and_maybe_reset(act(td0, EOS, A))
    env.step_and_maybe_reset(act(td1, EOS, EOS))
    assert (td0.select(*keys.OBSERVATION_KEYS) == snapshot.select(*keys.OBSERVATION_KEYS)).all()
    assert out["next", keys.TRAJ_ID].tolist() == [0, 1]


def test_partial_reset_refills_only_finished_slots(tokenizer):
    env = make(tokenizer, batch_size=3)
    td = env.reset()
    td = env.step(act(td, A, A, A))["next"]
    out, td = env.step_and_maybe_reset(act(td, A, EOS, A))
    assert flags(out["next"])[0] == [False, True, False]
    assert td[keys.TRAJ_ID].tolist() == [0, 3, 2]
    assert td[keys.RESPONSE_LEN].tolist() == [2, 0, 2]
    assert td[keys.SEQ_LEN][1] == td[keys.PROMPT_LEN][1] and env.slot_prompt(1).text == PROMPTS[3]
    assert env.response_ids(0).tolist() == [A, A]


def test_explicit_partial_reset(tokenizer):
    env = make(tokenizer, batch_size=2)
    td = env.step(act(env.reset(), A, A))["next"]
    # TorchRL keeps the input's entries for slots not reset, so pass the current observation
    td = env.reset(td.set("_reset", torch.tensor([[False], [True]])))
    assert td[keys.TRAJ_ID].tolist() == [0, 2] and td[keys.RESPONSE_LEN].tolist() == [1, 0]


def test_rollout(tokenizer):
    env = make(tokenizer, batch_size=2, max_new_tokens=3)
    data = env.rollout(7, break_when_any_done=False)
    assert data.shape == (2, 7)
    assert data["next", "done"].sum() == 4  # every third step, both slots truncate


# -- termination --
def test_eos_terminates(tokenizer):
    env = make(tokenizer)
    out = env.step(act(env.reset(), EOS, A))["next"]
    assert flags(out) == [[True, False], [True, False], [False, False]]
    assert env.response_ids(0).tolist() == [EOS]


def test_custom_eos_token_ids(tokenizer):
    env = make(tokenizer, eos_token_ids=[A, 7])
    out = env.step(act(env.reset(), EOS, 7))["next"]
    assert flags(out)[1] == [False, True]


def test_model_config_eos_and_vocab(tokenizer):
    from tokengym.testing import tiny_model

    config = tiny_model(tokenizer).config
    config.eos_token_id = [EOS, 7]
    config.vocab_size = 520  # padded embedding: ids past len(tokenizer) are valid actions
    env = make(tokenizer, model_config=config)
    assert env.eos_token_ids == {EOS, 7} and env.vocab_size == 520
    out = env.step(act(env.reset(), 519, 7))["next"]
    assert flags(out)[1] == [False, True]


def test_max_new_tokens_truncates(tokenizer):
    env = make(tokenizer, max_new_tokens=2)
    td = env.reset()
    td = env.step(act(td, A, A))["next"]
    out = env.step(act(td, A, EOS))["next"]
    assert flags(out) == [[True, True], [False, True], [True, False]]  # EOS wins at the last token


def test_max_length_truncates(tokenizer):
    env = make(tokenizer, ["1+1=", "a"], max_new_tokens=5, max_length=6)
    td = env.reset()
    td = env.step(act(td, A, A))["next"]
    out = env.step(act(td, A, A))["next"]
    assert td[keys.SEQ_LEN][0] == 5 and flags(out) == [[True, False], [False, False], [True, False]]


@pytest.mark.parametrize(
    ("stop", "actions", "hit_at"),
    [("\n", [A, NL], 1), ("AB", [B_, A, B_], 2), ("B\nA", [B_, NL, A], 2), ("BB", [B_, A, B_], None)],
)
def test_stop_strings_terminate(tokenizer, stop, actions, hit_at):
    env = make(tokenizer, batch_size=1, max_new_tokens=10, stop_strings=[stop])
    td = env.reset()
    for t, a in enumerate(actions):
        out = env.step(act(td, a))["next"]
        assert flags(out)[1] == [t == hit_at], (t, stop)
        td = out


def test_stop_string_in_the_prompt_does_not_stop(tokenizer):
    env = make(tokenizer, ["1+1="], batch_size=1, stop_strings=["=A"])
    out = env.step(act(env.reset(), A))["next"]
    assert flags(out)[0] == [False]


def test_reward_only_at_the_last_step(tokenizer):
    reward = Recorder()
    env = make(tokenizer, max_new_tokens=3, reward_fn=reward)
    td = env.reset()
    rewards = []
    for pair in [(A, A), (B_, EOS), (EOS, A)]:
        out, td = env.step_and_maybe_reset(act(td, *pair))
        rewards.append(out[keys.REWARD].reshape(-1).tolist())
    assert rewards == [[0.0, 0.0], [0.0, 1.0], [2.0, 0.0]]
    assert [c[0] for c in reward.calls] == [["A"], ["AB"]]  # EOS is not part of the decoded response


# -- resume --
def _run(env, td, steps, gen):
    outs = []
    for _ in range(steps):
        use_eos = torch.rand(2, generator=gen) < 0.3
        action = torch.where(use_eos, EOS, torch.randint(8, 300, (2,), generator=gen))
        out, td = env.step_and_maybe_reset(td.set(keys.ACTION, action))
        outs.append(out)
    return torch.stack(outs), td


def test_state_dict_resume_equals_uninterrupted(tokenizer):
    kw = {"max_new_tokens": 3, "group_size": 2, "shuffle": True, "seed": 2, "reward_fn": Recorder()}
    gen = torch.Generator().manual_seed(0)
    env = make(tokenizer, **kw)
    _, td = _run(env, env.reset(), 5, gen)
    state, td_saved, gen_state = env.state_dict(), td.clone(), gen.get_state()
    full, _ = _run(env, td, 10, gen)

    resumed = make(tokenizer, **kw)
    resumed.load_state_dict(state)
    gen.set_state(gen_state)
    again, _ = _run(resumed, td_saved, 10, gen)
    assert (full == again).all()
    assert torch.equal(env.tokens, resumed.tokens)


# -- bad input --
def test_empty_prompt_list(tokenizer):
    with pytest.raises(ValueError, match="prompts is empty"):
        make(tokenizer, [])


def test_empty_prompt(tokenizer):
    env = make(tokenizer, ["a", ""], batch_size=2)
    with pytest.raises(ValueError, match="prompt item 1 is empty"):
        env.reset()


def test_prompt_longer_than_max_length(tokenizer):
    env = make(tokenizer, ["x" * 40], max_length=16)
    with pytest.raises(PromptError, match=r"prompt 0 'x+' has 40 tokens, more than the 15 a prompt may have.*raise max_length"):
        env.reset()


@pytest.mark.parametrize(
    ("action", "err", "match"),
    [
        ([512, 3], ValueError, r"action 512 is out of the vocabulary \[0, 512\)"),
        ([-1, 3], ValueError, r"action -1 is out of the vocabulary"),
        (
            torch.tensor([1, 2], dtype=torch.int32),
            TypeError,
            "action must be int64 token ids, got dtype torch.int32",
        ),
        (torch.tensor([1.0, 2.0]), TypeError, "got dtype torch.float32; use action.long()"),
        (
            torch.tensor([[1, 2], [3, 4]]),
            ValueError,
            r"action must have shape \(2,\) \(one token per slot\), got \(2, 2\)",
        ),
    ],
)
def test_bad_action(tokenizer, action, err, match):
    env = make(tokenizer)
    td = env.reset()
    before = env.state_dict()
    action = action if isinstance(action, torch.Tensor) else torch.tensor(action)
    with pytest.raises(err, match=match):
        env.step(td.set(keys.ACTION, action))
    _assert_same_state(before, env.state_dict())


def _assert_same_state(a, b):
    assert torch.equal(a["tokens"], b["tokens"])
    assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    assert a["source"] == b["source"] and a["next_traj"] == b["next_traj"]
    assert torch.equal(a["done"], b["done"])


@pytest.mark.parametrize(
    ("reward_fn", "match"),
    [
        (
            lambda r, p, m: [1.0, 2.0],
            r"returned 2 values for 1 finished responses in slots \[1\] \(first: prompt 1 '2\+2='\)",
        ),
        (
            lambda r, p, m: [float("nan")],
            r"returned nan for slot 1, prompt 1 '2\+2='; rewards must be finite",
        ),
        (lambda r, p, m: ["x"], r"must return 1 numbers for slots \[1\]"),
        (
            lambda r, p, m: 1 / 0,
            r"raised ZeroDivisionError: division by zero while scoring slots \[1\] \(first: prompt 1 '2\+2='",
        ),
    ],
    ids=["count", "nan", "type", "raises"],
)
def test_bad_reward_fn_leaves_the_env_unchanged(tokenizer, reward_fn, match):
    env = make(tokenizer, reward_fn=reward_fn)
    td = env.reset()
    td = env.step(act(td, A, A))["next"]
    before = env.state_dict()
    with pytest.raises(RewardFunctionError, match=match):
        env.step(act(td.clone(), B_, EOS))
    _assert_same_state(before, env.state_dict())
    env.reward_fn = Recorder()
    out = env.step(act(td, B_, EOS))
    assert out[keys.REWARD].reshape(-1).tolist() == [0.0, 1.0]
    assert env.response_ids(0).tolist() == [A, B_] and out["next", keys.RESPONSE_LEN].tolist() == [2, 2]


@pytest.mark.parametrize("attr", ["pad_token", "eos_token"])
def test_tokenizer_without_pad_or_eos(tokenizer, attr):
    broken = copy.deepcopy(tokenizer)
    setattr(broken, attr, None)
    with pytest.raises(ValueError, match=f"the tokenizer has no {attr}_id"):
        make(broken)


@pytest.mark.parametrize("name", ["max_new_tokens", "batch_size", "max_length"])
@pytest.mark.parametrize("value", [0, -3, 2.0, True])
def test_bad_sizes(tokenizer, name, value):
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got {value!r}"):
        make(tokenizer, **{name: value})


@pytest.mark.parametrize("group_size", [0, -1])
def test_bad_group_size(tokenizer, group_size):
    with pytest.raises(
        ValueError, match=f"group_size must be a positive int .samples per prompt., got {group_size}"
    ):
        make(tokenizer, group_size=group_size)


def test_bad_reward_fn_type(tokenizer):
    with pytest.raises(TypeError, match="reward_fn must be callable"):
        make(tokenizer, reward_fn=3)


def test_bad_eos_token_ids(tokenizer):
    with pytest.raises(ValueError, match=r"eos token ids \[999\] are outside the vocabulary \[0, 512\)"):
        make(tokenizer, eos_token_ids=[999])


@pytest.mark.parametrize("stop", [[""], [3], ["ok", None]])
def test_bad_stop_string(tokenizer, stop):
    with pytest.raises(ValueError, match="stop_strings must be non-empty strings"):
        make(tokenizer, stop_strings=stop)


def test_stop_strings_none_or_a_single_string(tokenizer):
    assert not make(tokenizer, stop_strings=None)._stop.is_enabled
    assert make(tokenizer, stop_strings="\n")._stop.stop_strings == ("\n",)


def test_step_before_reset(tokenizer):
    env = make(tokenizer)
    td = TensorDict({keys.ACTION: torch.tensor([A, A])}, batch_size=[2])
    with pytest.raises(ResetNeeded, match=r"stepped before reset\(\); call env.reset\(\) first"):
        env.step(td)


def test_step_a_done_slot_without_reset(tokenizer):
    env = make(tokenizer)
    td = env.step(act(env.reset(), EOS, A))["next"]
    with pytest.raises(ResetNeeded, match=r"slots \[0\] are done; reset them"):
        env.step(act(td, A, A))


def test_staggered_limits_end_each_slot_at_its_own_step(tokenizer):
    """Slots refilled at different steps, with prompts of different lengths, reach the budget, the context and the
    turn limit at their own steps (the step skips the limit comparison while no slot can reach one): each trajectory
    ends exactly when a rule says so, and ``ended_slots`` names the slots whose ``("next", "done")`` is set."""
    prompts = ["1+1=", "hello world, how", "abc", "2+2=", "a much longer prompt here", "x"]
    env = make(tokenizer, prompts, batch_size=3, max_new_tokens=7, max_length=24, max_turn_tokens=5)
    td = env.reset()
    gen = torch.Generator().manual_seed(0)
    ends = 0
    for _ in range(60):
        seq, resp, p_len = td[keys.SEQ_LEN].clone(), td[keys.RESPONSE_LEN].clone(), td[keys.PROMPT_LEN].clone()
        action = torch.randint(40, 60, (3,), generator=gen)
        action[torch.rand(3, generator=gen) < 0.1] = EOS
        step, td = env.step_and_maybe_reset(act(td, *action.tolist()))
        done = step["next", "done"].reshape(-1)
        expect = (action == EOS) | (resp + 1 >= 7) | (seq + 1 >= 24) | (seq + 1 - p_len >= 5)
        assert done.tolist() == expect.tolist()
        assert env.ended_slots(step["next", "done"]) == done.nonzero().squeeze(-1).tolist()
        assert env.ended_slots(step["next", "done"].clone()) is None  # other flags (a transform's) must be read
        ends += int(done.sum())
    assert ends > 10
