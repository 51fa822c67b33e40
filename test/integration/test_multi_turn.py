"""Multi-turn end to end: KV-cached stepping across env-inserted turns == one teacher-forced forward."""

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import TransformersPolicy
from tokengym.collectors.policies.sequence_actor import SequenceActor
from tokengym.llm_envs import keys
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv, Turn
from tokengym.llm_envs.tasks import make_multi_turn_math_env
from tokengym.testing import tiny_model
from tokengym.transforms import padded_to_steps, step_log_probs, to_packed, to_padded


def _feedback(responses, prompts, metadata, turns):
    return [Turn(float(t), feedback=f"turn {t} done, go on") for t in turns]


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def collected(request, tokenizer):
    model = tiny_model(tokenizer, family=request.param)
    # many EOS ids: the random model ends its turns after a few tokens, so episodes span 3 turns
    eos = list(range(0, len(tokenizer), 6))
    env = MultiTurnTokenEnv(["1+1=", "2+3=", "7*8="], tokenizer, _feedback, max_turns=3, batch_size=3,
                            max_new_tokens=40, model_config=model.config, eos_token_ids=eos)  # fmt: skip
    policy = TransformersPolicy(model, env, return_raw_log_prob=True, seed=1)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4, total_steps=300)))
    return model, batch


def test_teacher_forced_log_probs_match_stepwise(collected, tokenizer):
    model, batch = collected
    mask = batch[keys.MASK]
    assert bool((batch[keys.TURN][mask] > 0).any())  # really multi-turn
    scored = step_log_probs(model, batch, pad_id=tokenizer.pad_token_id)
    torch.testing.assert_close(scored[mask], batch[keys.RAW_LOG_PROB][mask], atol=1e-5, rtol=1e-5)
    assert scored[~mask].eq(0).all()
    actor = SequenceActor(model, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        dist_logp = actor.get_dist(batch).log_prob(batch[keys.ACTION])
    torch.testing.assert_close(dist_logp[mask], batch[keys.RAW_LOG_PROB][mask], atol=1e-5, rtol=1e-5)


def test_layouts_round_trip(collected, tokenizer):
    _, batch = collected
    padded = to_padded(batch, pad_id=tokenizer.pad_token_id)
    back = padded_to_steps(padded)
    assert (back.exclude(keys.PROMPTS) == batch.exclude(keys.PROMPTS)).all()
    assert padded[keys.ACTION_MASK].sum().item() == batch[keys.MASK].sum().item()
    packed = to_packed(batch, pad_id=tokenizer.pad_token_id)
    table = batch.get_non_tensor(keys.PROMPTS)
    offsets = packed[keys.SEQ_OFFSETS].tolist()
    for i, traj in enumerate(batch[keys.TRAJ_ID][:, 0].tolist()):
        row = packed[keys.TOKENS][0, offsets[i] : offsets[i + 1]]
        if bool((batch[keys.TURN][i] > 0).any()):
            assert row.tolist() == table.sequence(traj).tolist()


def test_math_task_with_real_policy(tokenizer, model):
    env = make_multi_turn_math_env(tokenizer=tokenizer, batch_size=2, n_prompts=4, max_new_tokens=24,
                                   model_config=model.config,
                                   eos_token_ids=list(range(0, len(tokenizer), 5)))  # fmt: skip
    policy = TransformersPolicy(model, env, return_raw_log_prob=True)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=2, total_steps=200)))
    mask = batch[keys.MASK]
    scored = step_log_probs(model, batch, pad_id=tokenizer.pad_token_id)
    torch.testing.assert_close(scored[mask], batch[keys.RAW_LOG_PROB][mask], atol=1e-5, rtol=1e-5)


def test_wave_source_equals_stepping_across_turns(tokenizer):
    """Waves continue each slot's full history turn by turn: greedy waves == greedy stepping, every key."""
    from tokengym.collectors.policies import SamplingConfig

    model = tiny_model(tokenizer)
    eos = list(range(0, len(tokenizer), 6))

    def first_trajectories(source):
        env = MultiTurnTokenEnv(["1+1=", "2+3=", "7*8="], tokenizer, _feedback, max_turns=3, batch_size=3,
                                max_new_tokens=40, model_config=model.config, eos_token_ids=eos)  # fmt: skip
        policy = TransformersPolicy(model, env, sampling=SamplingConfig(greedy=True), return_raw_log_prob=True)
        rows = []
        for batch in TokenCollector(env, policy, mode="trajectories", batch_size=1, source=source):
            if int(batch[keys.TRAJ_ID][0, 0]) < 3:
                rows.append(batch)
            if len(rows) == 3:
                return sorted(rows, key=lambda b: int(b[keys.TRAJ_ID][0, 0]))
        raise AssertionError("the first three trajectories never finished")

    stepped, waved = first_trajectories("step"), first_trajectories("wave")
    assert any(bool((b[keys.TURN] > 0).any()) for b in stepped)  # really multi-turn
    for a, b in zip(stepped, waved, strict=True):
        assert a.shape == b.shape
        for key in a.keys(True, True):
            x, y = a.get(key), b.get(key)
            if not isinstance(x, torch.Tensor):
                continue
            if x.is_floating_point():
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(x, y), key
        assert torch.equal(a.get_non_tensor(keys.PROMPTS).sequence(int(a[keys.TRAJ_ID][0, 0])),
                           b.get_non_tensor(keys.PROMPTS).sequence(int(b[keys.TRAJ_ID][0, 0])))  # fmt: skip
