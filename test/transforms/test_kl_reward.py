import math

import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer, to_steps_layout
from tokengym.transforms import (
    AdaptiveKLController,
    KLEstimator,
    KLRewardTransform,
    kl_estimate,
    step_log_probs,
)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [("k1", [1.0, -1.0]), ("k2", [0.5, 0.5]), ("abs", [1.0, 1.0]),
     ("k3", [math.exp(-1) + 1 - 1, math.exp(1) - 1 - 1])],
)
def test_estimators_hand_computed(estimator, expected):
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(kl_estimate(lp, ref, estimator), torch.tensor(expected))
    torch.testing.assert_close(kl_estimate(lp, ref, KLEstimator(estimator)), torch.tensor(expected))


def test_k3_clamped_is_finite():
    out = kl_estimate(torch.tensor([0.0]), torch.tensor([-1000.0]), "k3")
    assert torch.isfinite(out).all() and out.item() > 0


def test_batch_shaping_masked_and_keys():
    batch = make_trajectory_batch([3, 1], [1.0, 2.0], steps=4)
    reward = batch[keys.REWARD].clone()
    t = KLRewardTransform(beta=0.2, estimator="k1")
    out = t(batch)
    kl = out[keys.ACTION_LOG_PROB] - out[keys.REF_LOG_PROB]
    kl = kl * out[keys.MASK]
    torch.testing.assert_close(out[keys.KL], kl)
    torch.testing.assert_close(out[keys.REWARD_RAW], reward)
    torch.testing.assert_close(out[keys.REWARD_KL], -0.2 * kl.unsqueeze(-1))
    torch.testing.assert_close(out[keys.REWARD], reward - 0.2 * kl.unsqueeze(-1))
    assert out[keys.REWARD][1, 1:].eq(0).all()  # padding untouched
    assert t.metrics()["kl"] == pytest.approx(kl.sum(-1).mean().item(), rel=1e-5)
    assert t.ref_source == "td" and "ref_source='td'" in repr(t)


def test_custom_log_prob_key():
    batch = make_trajectory_batch([2])
    batch[keys.RAW_LOG_PROB] = batch[keys.REF_LOG_PROB].clone()
    out = KLRewardTransform(beta=1.0, log_prob_key=keys.RAW_LOG_PROB)(batch)
    assert out[keys.KL].abs().max() == 0


def test_ref_model_scores_once_per_batch():
    model = tiny_model(tiny_tokenizer())
    batch = make_trajectory_batch([3, 2], group_size=2, vocab=400).exclude(keys.REF_LOG_PROB)
    t = KLRewardTransform(beta=0.1, ref_model=model, estimator="k3")
    assert t.ref_source == "model" and "ref_source='model'" in repr(t)
    out = t(batch)
    torch.testing.assert_close(out[keys.REF_LOG_PROB], step_log_probs(model, batch))
    assert (out[keys.KL] >= 0).all()
    assert not any("ref_model" in k for k in t.state_dict())


def test_controller_updated_once_per_batch_and_state_dict():
    ctl = AdaptiveKLController(0.1, target=0.01, horizon=10)
    t = KLRewardTransform(controller=ctl)
    batch = make_trajectory_batch([3, 3])
    t(batch)
    assert ctl.beta > 0.1 and t.metrics()["beta"] == 0.1  # beta used for that batch
    state = t.state_dict()
    t2 = KLRewardTransform(controller=AdaptiveKLController(1.0, target=1.0, horizon=1))
    t2.load_state_dict(state)
    assert t2.beta == ctl.beta


def test_env_step_and_already_shaped_batch():
    t = KLRewardTransform(beta=0.5)
    root = {keys.ACTION_LOG_PROB: torch.tensor([-1.0, -1.0]), keys.REF_LOG_PROB: torch.tensor([-2.0, -1.0]),
            keys.ACTIVE: torch.tensor([True, False])}
    from tensordict import TensorDict

    td = TensorDict(root, [2])
    nxt = TensorDict({"reward": torch.zeros(2, 1)}, [2])
    nxt = t._step(td, nxt)
    assert nxt["reward"].flatten().tolist() == [-0.5, 0.0]
    assert nxt["reward_kl"].flatten().tolist() == [-0.5, 0.0]
    assert td[keys.KL].tolist() == [1.0, 0.0]
    batch = make_trajectory_batch([2])
    batch[keys.REWARD_KL] = torch.zeros(1, 2, 1)
    batch[keys.KL] = torch.ones(1, 2)
    before = batch[keys.REWARD].clone()
    t(batch)
    assert torch.equal(batch[keys.REWARD], before) and t.metrics()["kl"] == 2.0


def test_bad_input():
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, inf\], got -1.0"):
        KLRewardTransform(beta=-1.0)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        KLRewardTransform(estimator="k9")
    with pytest.raises(ValueError, match="either beta"):
        KLRewardTransform(beta=0.1, controller=AdaptiveKLController(0.1, target=1, horizon=1))
    with pytest.raises(TypeError, match="controller must be a KLController"):
        KLRewardTransform(controller=0.1)
    with pytest.raises(TypeError, match="ref_model must be a causal LM"):
        KLRewardTransform(ref_model="gpt2")
    with pytest.raises(KeyError, match=r"KLRewardTransform reads 'ref_log_prob' .* but got keys"):
        KLRewardTransform()(make_trajectory_batch([2]).exclude(keys.REF_LOG_PROB))
    with pytest.raises(TypeError, match="expects a TensorDict batch"):
        KLRewardTransform()(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"batch dims \[N, T\]"):
        KLRewardTransform()(make_trajectory_batch([2])[0])
    with pytest.raises(ValueError, match="must share a shape"):
        kl_estimate(torch.zeros(2), torch.zeros(3))


# -- issue 12 regressions --


def test_k3_default_clamps_the_value_like_the_seeds():
    lp, ref = torch.tensor([-15.0, 0.0, -1.0]), torch.tensor([0.0, -15.0, -2.0])
    out = kl_estimate(lp, ref, "k3")  # ref - logp = 15: exp(15) - 16 before; the seeds clamp the value to 10
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, math.exp(-1) + 1 - 1]))
    old = kl_estimate(lp, ref, "k3", clamp_mode="log_ratio")
    assert old[0].item() == pytest.approx(math.exp(10) - 11, rel=1e-5)
    assert old[1].item() == pytest.approx(9.0 + math.exp(-10))
    assert kl_estimate(lp, ref, "k3", clamp=3.0).max().item() == 3.0
    extreme = kl_estimate(torch.tensor([-math.inf, 0.0]), torch.tensor([0.0, -math.inf]), "k3")
    assert extreme.tolist() == [10.0, 10.0]


def test_k3_penalty_of_a_token_is_at_most_beta_times_clamp():
    batch = make_trajectory_batch([3])
    batch[keys.ACTION_LOG_PROB][0, 1] = -30.0  # the policy made a token the reference likes far less likely
    batch[keys.REF_LOG_PROB][0, 1] = 0.0
    out = KLRewardTransform(beta=0.1, estimator="k3")(batch.clone())
    assert out[keys.REWARD_KL].min().item() == pytest.approx(-1.0)
    old = KLRewardTransform(beta=0.1, estimator="k3", k3_clamp="log_ratio")(batch)
    assert old[keys.REWARD_KL].min().item() < -2000


def test_masked_first_step_does_not_merge_trajectories_for_the_controller():
    # one row: trajectory 0 (2 steps), trajectory 1 (3 steps, the first masked); KL 1 per valid step
    steps = to_steps_layout(make_trajectory_batch([2, 3]), rows=1)
    steps[keys.MASK][0, 2] = False
    steps[keys.REF_LOG_PROB] = steps[keys.ACTION_LOG_PROB] - 1.0
    ctl = AdaptiveKLController(1.0, target=1.0, horizon=100)
    t = KLRewardTransform(controller=ctl, estimator="k1")
    t(steps)
    assert t.metrics()["kl"] == pytest.approx(2.0) and ctl.last_kl == pytest.approx(2.0)
    assert ctl.beta == pytest.approx(1.0 * (1 + 0.2 * 2 / 100))  # n_steps = 2 sequences


def test_k3_clamp_bad_input():
    with pytest.raises(ValueError, match=r"unknown k3 clamp mode 'exp'; use one of \['output', 'log_ratio'\]"):
        KLRewardTransform(estimator="k3", k3_clamp="exp")
    with pytest.raises(ValueError, match=r"clamp must be in \(0.0, inf\], got 0.0. The seeds use clamp=10."):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k3", clamp=0.0)
