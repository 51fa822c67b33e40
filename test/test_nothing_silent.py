"""Issue 41: setups that would run and learn nothing (or the wrong thing) end in an error or a TokenGymWarning.

One test per row of the issue's table, with the inputs a user gives; the warning rows also check that the same
setup done right gives no warning.
"""

import functools
import itertools
import pathlib
import re
import warnings

import pytest
import torch
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, SequenceActor, TransformersPolicy
from tokengym.collectors.policies.sampling import batch_sampling
from tokengym.errors import TokenGymWarning
from tokengym.llm_envs import MultiTurnTokenEnv, TokenEnv, keys
from tokengym.llm_envs.turns import Turn
from tokengym.testing import tiny_model
from tokengym.training import train
from tokengym.transforms import GroupAdvantage

PROMPTS = ["1+1=", "2+3=", "4+4=", "3+5="]
GUIDE = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "real-models.md"


_SCORES = itertools.count()


def _reward(responses, prompts, metadata):
    return [float(next(_SCORES)) for _ in responses]  # a new score each time: rewards spread within every group


def _collector(tok, model, **env_kwargs):
    env = TokenEnv(PROMPTS, tok, _reward, batch_size=4, max_new_tokens=3, model_config=model.config, seed=0,
                   **env_kwargs)  # fmt: skip
    return TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)


# -- row 1: GroupAdvantage over groups of one (the env's default group_size=1) --
def test_group_advantage_over_groups_of_one_warns_once_and_the_metric_counts_them(tokenizer, model):
    collector = _collector(tokenizer, model)  # group_size left at its default, 1
    advantage, batches = GroupAdvantage("grpo"), iter(collector)
    with pytest.warns(TokenGymWarning, match=r"every group in the batch has one sample \(4 groups of group_size=1.*"
                                              r"trains on nothing; .*TokenEnv\(\.\.\., group_size=8\)"):  # fmt: skip
        out = advantage(next(batches))
    assert not bool(out[keys.ADVANTAGE].any())  # every advantage 0: what the warning is about
    assert collector.metrics["zero_std_group_fraction"] == 1.0  # groups of one count as zero-std
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        advantage(next(batches))  # once per transform


def test_group_advantage_over_whole_groups_gives_no_warning(tokenizer, model):
    collector = _collector(tokenizer, model, group_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = GroupAdvantage("grpo")(next(iter(collector)))
    assert bool(out[keys.ADVANTAGE].any()) and collector.metrics["zero_std_group_fraction"] == 0.0


# -- row 2: train() without weights= while the policy generates with a second copy of the model --
def _loss(model):
    return ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)


def test_train_refuses_a_policy_on_a_second_copy_of_the_model_before_the_first_batch(tokenizer):
    model, copy = tiny_model(tokenizer, seed=0), tiny_model(tokenizer, seed=0)  # two from_pretrained of one model
    collector = _collector(tokenizer, copy, group_size=2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"holds none of the optimizer's \d+ parameters .* policy\.version advances\. "
                                         r"Build the policy on the trained model .* weights=model\.state_dict"):  # fmt: skip
        train(collector, _loss(model), optim, iterations=1, prepare=GroupAdvantage("grpo"))
    assert collector.policy.version == 0 and collector.steps_done == 0  # refused before anything was collected
    rows = train(collector, _loss(model), optim, iterations=1, prepare=GroupAdvantage("grpo"),
                 weights=model.state_dict)  # fmt: skip
    assert len(rows) == 1 and collector.policy.last_update_bytes > 0  # the weights went to the copy


def test_train_in_place_on_a_peft_model_is_accepted(tokenizer):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(tokenizer, seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    collector = _collector(tokenizer, model, group_size=2)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)  # the adapter's alone
    rows = train(collector, _loss(model), optim, iterations=1, prepare=GroupAdvantage("grpo"))
    assert len(rows) == 1 and collector.policy.version == 1


# -- row 3: a response budget the sequence cannot hold --
def test_max_new_tokens_that_cannot_fit_in_max_length_is_refused_at_construction(tokenizer):
    with pytest.raises(ValueError, match=r"max_new_tokens=64 cannot fit in max_length=32: .* at most 31 tokens; pass "
                                         r"max_new_tokens=31 or less, or max_length=65 or more"):  # fmt: skip
        TokenEnv(PROMPTS, tokenizer, max_new_tokens=64, max_length=32)
    assert TokenEnv(PROMPTS, tokenizer, max_new_tokens=31, max_length=32).max_new_tokens == 31


# -- row 4: a two-argument reward function --
def test_a_two_argument_reward_function_is_refused_at_construction(tokenizer):
    def reward(responses, prompts):
        return [1.0] * len(responses)

    with pytest.raises(TypeError, match=r"reward_fn reward\(responses, prompts\) cannot be called as "
                                        r"reward_fn\(responses, prompts, metadata\) .*define it as "
                                        r"def reward\(responses, prompts, metadata\)"):  # fmt: skip
        TokenEnv(PROMPTS, tokenizer, reward, max_new_tokens=4, max_length=32)


class _Scorer:
    def __call__(self, responses, prompts, metadata):
        return [0.0] * len(responses)


@pytest.mark.parametrize(
    "reward",
    [
        _reward,
        _Scorer(),
        functools.partial(lambda scale, responses, prompts, metadata: [scale] * len(responses), 2.0),
        lambda *args: [0.0] * len(args[0]),
        lambda prompts, completions, **kwargs: [0.0] * len(completions),  # a TRL reward function
        max,  # a builtin: no signature to read, accepted as it is
    ],
)
def test_reward_functions_that_take_three_arguments_are_accepted(tokenizer, reward):
    TokenEnv(PROMPTS, tokenizer, reward, max_new_tokens=4, max_length=32)


def test_a_turn_fn_takes_four_arguments(tokenizer):
    MultiTurnTokenEnv(PROMPTS, tokenizer, lambda r, p, m, t: [Turn(0.0)] * len(r), max_new_tokens=4, max_length=32)
    with pytest.raises(TypeError, match=r"turn_fn <lambda>\(r, p, m\) cannot be called as "
                                        r"turn_fn\(responses, prompts, metadata, turns\)"):  # fmt: skip
        MultiTurnTokenEnv(PROMPTS, tokenizer, lambda r, p, m: [Turn(0.0)] * len(r), max_new_tokens=4, max_length=32)


# -- row 5: the real-models guide's sampling example is trainable as written --
def test_the_real_models_guide_samples_what_a_trainer_can_score(tokenizer, model):
    calls = re.findall(r"SamplingConfig\([^)]*\)", GUIDE.read_text())
    assert calls, "the guide shows a SamplingConfig"
    for call in calls:
        sampling = eval(call, {"SamplingConfig": SamplingConfig})
        env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, max_new_tokens=3, model_config=model.config)
        policy = TransformersPolicy(model, env, sampling=sampling, seed=0)
        batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4)))
        assert SequenceActor(model).log_prob(batch).shape == batch.shape, call  # a filtered batch raises here


# -- row 6: an agent env told one sampling temperature, a policy sampling at another --
async def _chat_agent(client, task):
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task}],
                                                 temperature=0.7)  # fmt: skip
    return float(len(reply.choices[0].message.content) > 0)


def _agent_env(tok, model):
    from tokengym.llm_envs.agents import make_agent_env

    return make_agent_env(_chat_agent, PROMPTS, tok, temperature=0.7, batch_size=4, max_new_tokens=4, max_length=64,
                          model_config=model.config)  # fmt: skip


def test_an_agent_env_at_one_temperature_refuses_a_policy_sampling_at_another(tokenizer, model):
    env = _agent_env(tokenizer, model)
    try:
        with pytest.raises(ValueError, match=r"tells its agent programs temperature=0\.7 .* TransformersPolicy samples "
                                             r"at temperature=1\.0: .*TransformersPolicy\(model, env, "
                                             r"sampling=SamplingConfig\(temperature=0\.7\)\), or build the env with "
                                             r"temperature=1\.0"):  # fmt: skip
            TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)
        policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=0.7), seed=0)
        batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, total_steps=400)))
        assert batch.shape[0] == 4 and batch_sampling(batch).temperature == 0.7  # sampled at what the agent asked
    finally:
        env.close()


# -- row 7: a collector checkpoint loaded into a run with other prompts --
def test_a_checkpoint_from_other_prompts_is_refused_unless_strict_is_false(tokenizer, model):
    saved = _collector(tokenizer, model, group_size=2)
    next(iter(saved))
    state = saved.state_dict()
    other = TokenCollector(env := TokenEnv(["9+9=", "8+1="], tokenizer, _reward, batch_size=4, max_new_tokens=3,
                                           model_config=model.config, seed=0, group_size=2),
                           TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"taken on other prompts \(4 prompts, digest \w{16}, first '1\+1='\) than "
                                         r"this collector's env holds \(2 prompts, digest \w{16}, first '9\+9='\).* "
                                         r"collector\.load_state_dict\(state, strict=False\)"):  # fmt: skip
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)  # the explicit override
    assert next(iter(other)).shape[0] == 4
    same = _collector(tokenizer, model, group_size=2)
    same.load_state_dict(state)  # the same prompts: accepted
    old = {k: v for k, v in state.items() if k != "prompt_source"}  # a checkpoint from before the fingerprint
    other.load_state_dict(old)
