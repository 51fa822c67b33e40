"""MismatchCorrection and WeightedLoss: weights and metrics against the formulas on a batch with a known mismatch
(sampled by a perturbed copy of the model, scored teacher-forced by the model), and the gradient of TorchRL's
ClipPPOLoss / GRPOLoss through WeightedLoss against the weighted objective written out by hand."""

import copy

import numpy as np
import pytest
import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PaddedSequenceActor,
    SamplingConfig,
    SequenceActor,
    TransformersPolicy,
)
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import to_steps_layout
from tokengym.transforms import (
    GroupAdvantage,
    MismatchCorrection,
    RatioWindowWeights,
    WeightedLoss,
    mismatch_metrics,
    mismatch_weights,
    to_padded,
)

PROMPTS = ["1+1=", "2+3=", "4+4=", "5+1="]
EOS_IDS = list(range(100, 140))  # many end ids: trajectories of different lengths, so rows are padded
TEMPERATURE = 0.7


def _length_reward(responses, prompts, metadata):
    return torch.tensor([float(len(r) % 3) for r in responses])


def _perturbed(model, scale: float, seed: int):
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return out


def collect(tokenizer, sampler, *, temperature=TEMPERATURE, n=8, seed=0):
    """One TRAJECTORIES batch of ``n`` trajectories (groups of 4) sampled by ``sampler``, with GRPO advantages."""
    env = TokenEnv(PROMPTS, tokenizer, _length_reward, batch_size=n, max_new_tokens=10, group_size=4,
                   model_config=sampler.config, eos_token_ids=EOS_IDS)  # fmt: skip
    policy = TransformersPolicy(sampler, env, sampling=SamplingConfig(temperature=temperature), seed=seed)
    return GroupAdvantage("grpo")(next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=n))))


def by_hand_log_probs(model, batch, temperature=TEMPERATURE, grad=False):
    """Teacher-forced log-probs (N, T) of the actions, one forward per row; 0 on padding."""
    table, mask = batch.get_non_tensor(keys.PROMPTS), batch[keys.MASK]
    out = torch.zeros(mask.shape)
    rows = []
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        prompt, actions = table.ids(int(batch[keys.GROUP_ID][i, 0])), batch[keys.ACTION][i, :n]
        with torch.set_grad_enabled(grad):
            logits = model(torch.cat([prompt, actions])[None]).logits[0, len(prompt) - 1 : -1].float() / temperature
            rows.append(logits.log_softmax(-1).gather(-1, actions[:, None]).squeeze(-1))
    if grad:
        return rows
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


@pytest.fixture(scope="module")
def mismatched(tokenizer, model):
    """A batch sampled by a perturbed copy of ``model``, and ``model``'s own log-probs of it, by hand."""
    batch = collect(tokenizer, _perturbed(model, 0.05, seed=1))
    return batch, by_hand_log_probs(model, batch)


def _expected_weights(trainer, sampler, mask, mode, level, cap, low):
    delta = np.where(mask, trainer - sampler, 0.0).astype(np.float64)
    if level == "sequence":
        delta = np.where(mask, delta.sum(-1, keepdims=True), 0.0)
    ratio = np.exp(delta)
    if mode == "truncate":
        w = np.minimum(ratio, cap)
    elif mode == "mask":
        w = np.where((ratio >= low) & (ratio <= cap), ratio, 0.0)
    else:
        w = ratio
    units = ratio[mask] if level == "token" else ratio[:, 0][mask.any(-1)]
    return np.where(mask, w, 0.0), units


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize(("mode", "cap", "low"), [("truncate", 1.0, 0.0), ("mask", 1.0, 0.3), ("none", 1.0, 0.0)])
def test_weights_and_metrics_match_the_formulas(mismatched, model, mode, level, cap, low):
    batch, trainer = mismatched
    batch = batch.clone()
    correction = MismatchCorrection(mode, level=level, cap=cap, low=low, trainer=SequenceActor(model).log_prob)
    out = correction(batch)
    mask = batch[keys.MASK].numpy()
    sampler = batch[keys.ACTION_LOG_PROB].numpy()
    torch.testing.assert_close(out[keys.TRAINER_LOG_PROB], trainer, atol=2e-5, rtol=1e-5)
    expected, units = _expected_weights(trainer.numpy(), sampler, mask, mode, level, cap, low)
    if mode == "none":
        assert keys.LOSS_WEIGHT not in out.keys()
    else:
        np.testing.assert_allclose(out[keys.LOSS_WEIGHT].numpy(), expected, rtol=1e-4, atol=1e-6)
    d = (trainer.numpy() - sampler)[mask].astype(np.float64)
    ratio = np.exp(d)
    m = correction.metrics()
    np.testing.assert_allclose(m["mismatch_k3"], np.mean(ratio - 1 - d), rtol=1e-3)
    np.testing.assert_allclose(m["mismatch_abs_log_ratio_mean"], np.abs(d).mean(), rtol=1e-4)
    np.testing.assert_allclose(m["mismatch_abs_log_ratio_max"], np.abs(d).max(), rtol=1e-4)
    for q in ("05", "50", "95"):
        np.testing.assert_allclose(m[f"mismatch_ratio_q{q}"], np.quantile(units, int(q) / 100), rtol=1e-3)
    np.testing.assert_allclose(m["mismatch_ratio_max"], units.max(), rtol=1e-3)
    assert m["mismatch_truncated_fraction"] == pytest.approx(np.mean(units > cap))
    assert m["mismatch_masked_fraction"] == pytest.approx(np.mean((units < low) | (units > cap)))
    assert m["mismatch_weight_mean"] == pytest.approx(1.0 if mode == "none" else expected[mask].mean(), rel=1e-4)
    assert m["mismatch_k3"] > 1e-3 and 0 < m["mismatch_truncated_fraction"] < 1  # the mismatch is real
    assert mismatch_metrics(out[keys.TRAINER_LOG_PROB], batch[keys.ACTION_LOG_PROB], batch[keys.MASK], level=level,
                            cap=cap, low=low)["mismatch_k3"] == pytest.approx(m["mismatch_k3"])  # fmt: skip


def test_sequence_weights_follow_trajectories_in_a_steps_batch(mismatched):
    """Several trajectories per row (a STEPS batch): each gets the product of its own tokens' ratios."""
    batch, trainer = mismatched
    batch = batch.clone().set(keys.TRAINER_LOG_PROB, trainer)
    correction = MismatchCorrection("truncate", level="sequence", cap=1e9)
    steps = correction(to_steps_layout(batch, rows=3))
    expected = mismatch_weights(trainer, batch[keys.ACTION_LOG_PROB], batch[keys.MASK], mode="none", level="sequence")
    per_traj = dict(zip(batch[keys.TRAJ_ID][:, 0].tolist(), expected[:, 0].tolist(), strict=True))
    valid = steps[keys.MASK]
    got = steps[keys.LOSS_WEIGHT][valid]
    want = torch.tensor([per_traj[t] for t in steps[keys.TRAJ_ID][valid].tolist()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the units of the ratio quantiles are the 8 trajectories, not the 3 rows
    assert correction.metrics()["mismatch_ratio_q50"] == pytest.approx(float(np.quantile(expected[:, 0], 0.5)), rel=1e-4)


def test_weights_multiply_an_existing_weight_and_padding_is_zero(mismatched):
    batch, trainer = mismatched
    batch = batch.clone().set(keys.TRAINER_LOG_PROB, trainer)
    plain = MismatchCorrection("truncate")(batch.clone())[keys.LOSS_WEIGHT]
    halved = MismatchCorrection("truncate")(batch.clone().set(keys.LOSS_WEIGHT, torch.full(trainer.shape, 0.5)))
    torch.testing.assert_close(halved[keys.LOSS_WEIGHT], plain * 0.5)
    assert bool((plain[~batch[keys.MASK]] == 0).all()) and not bool(batch[keys.MASK].all())


def test_on_policy_batch_has_no_mismatch(tokenizer, model):
    """Sampled and scored by the same weights (stepwise KV cache vs one forward): k3 ~ 0, ratios ~ 1, nothing cut."""
    batch = collect(tokenizer, model)
    correction = MismatchCorrection("mask", low=0.9, cap=1.1, trainer=SequenceActor(model).log_prob)
    correction(batch)
    m = correction.metrics()
    assert m["mismatch_k3"] < 1e-9 and m["mismatch_abs_log_ratio_max"] < 1e-4
    assert m["mismatch_masked_fraction"] == 0.0 and m["mismatch_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_bad_arguments_name_the_fix(mismatched):
    batch, _ = mismatched
    with pytest.raises(ValueError, match="unknown mode 'tis'"):
        MismatchCorrection("tis")
    with pytest.raises(ValueError, match="unknown level 'geo'"):
        MismatchCorrection(level="geo")
    with pytest.raises(ValueError, match=r"cap must be in \(0.0, inf\], got 0.0"):
        MismatchCorrection(cap=0)
    with pytest.raises(ValueError, match=r"low must be in \[0.0, 2.0\], got 3.0"):
        MismatchCorrection("mask", low=3.0)
    with pytest.raises(TypeError, match="trainer must be callable"):
        MismatchCorrection(trainer=1.0)
    with pytest.raises(KeyError, match="MismatchCorrection reads 'trainer_log_prob'"):
        MismatchCorrection()(batch.clone())
    with pytest.raises(ValueError, match=r"must return the log-prob of every step of the batch, shape \(8, 10\)"):
        MismatchCorrection(trainer=lambda td: torch.zeros(3))(batch.clone())


# -- the gradient: WeightedLoss against the weighted objective written out by hand --


def _hand_objective(rows, old, adv, weight, mask, *, eps=0.2, aggregation="token_mean"):
    """-sum(mask * w * min(r A, clip(r) A)) / #tokens (or the mean over rows of each row's token mean)."""
    per_row = []
    for i, cur in enumerate(rows):
        n = len(cur)
        r = (cur - old[i, :n]).exp()
        gain = torch.minimum(r * adv[i, :n], r.clamp(1 - eps, 1 + eps) * adv[i, :n])
        per_row.append(-(weight[i, :n] * gain))
    if aggregation == "token_mean":
        return torch.cat(per_row).sum() / mask.sum()
    return torch.stack([row.mean() for row in per_row]).mean()


def _grads(model, loss_value):
    model.zero_grad()
    loss_value.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["clip_ppo_tis_token", "grpo_icepop_sequence", "clip_ppo_ratio_window"])
def test_gradient_equals_the_weighted_objective_by_hand(tokenizer, model, mismatched, case):
    batch, _ = mismatched
    batch = batch.clone()
    trained = copy.deepcopy(model)
    is_decoupled = case != "clip_ppo_ratio_window"
    if case == "clip_ppo_tis_token":
        batch = MismatchCorrection("truncate", cap=1.5, trainer=SequenceActor(trained).log_prob)(batch)
    elif case == "grpo_icepop_sequence":
        batch = MismatchCorrection("mask", level="sequence", low=0.3, cap=3.0, trainer=SequenceActor(trained).log_prob)(batch)
    else:  # the existing weight transforms take the same path: a window on trainer / sampler, ratio vs the sampler
        batch = RatioWindowWeights(low=0.8, high=1.25)(batch.set(keys.RAW_LOG_PROB, by_hand_log_probs(trained, batch)))
    # a later epoch: the trained weights moved away from those at the step's start, so some ratios are clipped
    with torch.no_grad():
        for p, q in zip(trained.parameters(), _perturbed(model, 0.03, seed=2).parameters(), strict=True):
            p.copy_(q)
    mask, adv = batch[keys.MASK], batch[keys.ADVANTAGE].squeeze(-1)
    weight = batch[keys.LOSS_WEIGHT]
    old = batch[keys.TRAINER_LOG_PROB] if is_decoupled else batch[keys.ACTION_LOG_PROB]
    assert 0 < float((weight[mask] == 0).float().mean() + (weight[mask] != 1).float().mean())  # weights matter
    if case.startswith("grpo"):
        loss = WeightedLoss(GRPOLoss(PaddedSequenceActor(trained), entropy_bonus=False, aggregation="none"),
                            aggregation="sequence_mean", is_decoupled=True)  # fmt: skip
        out = loss(to_padded(batch))
        aggregation = "sequence_mean"
    else:
        ppo = ClipPPOLoss(SequenceActor(trained), critic_network=None, entropy_bonus=False, functional=False,
                          reduction="none", clip_epsilon=0.2)  # fmt: skip
        out = WeightedLoss(ppo, is_decoupled=is_decoupled)(batch)
        aggregation = "token_mean"
    got = _grads(trained, out["loss_objective"])
    rows = by_hand_log_probs(trained, batch, grad=True)
    clipped = sum(int(((cur - old[i, : len(cur)]).abs() > 0.18).sum()) for i, cur in enumerate(rows))
    assert clipped > 0, "no ratio left the clip range: the check would not cover clipping"
    want_value = _hand_objective(rows, old, adv, weight, mask, aggregation=aggregation)
    want = _grads(trained, want_value)
    torch.testing.assert_close(out["loss_objective"].detach(), want_value.detach(), atol=1e-6, rtol=1e-4)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)


def test_weighted_loss_refuses_a_reduced_loss_and_a_batch_without_trainer_log_probs(model, mismatched):
    batch, _ = mismatched
    with pytest.raises(ValueError, match="reduces it itself .reduction='mean'.; build it with reduction='none'"):
        WeightedLoss(ClipPPOLoss(SequenceActor(model), critic_network=None, functional=False))
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        WeightedLoss(GRPOLoss(PaddedSequenceActor(model), aggregation="none"), aggregation="sum")
    loss = WeightedLoss(ClipPPOLoss(SequenceActor(model), critic_network=None, functional=False, reduction="none",
                                    entropy_bonus=False), is_decoupled=True)  # fmt: skip
    with pytest.raises(KeyError, match=r"reads the trainer's log-probs 'trainer_log_prob'.*run MismatchCorrection"):
        loss(batch.clone())
