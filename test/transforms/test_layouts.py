import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import GroupAdvantage, dpo_pairs, padded_to_steps, to_packed, to_padded


def test_padded_layout_and_round_trip():
    batch = GroupAdvantage(use_partial_groups=True)(make_trajectory_batch([2, 4, 1], group_size=2, steps=5))
    padded = to_padded(batch)
    table = batch.get_non_tensor(keys.PROMPTS)
    width = padded.get_non_tensor(keys.RESPONSE_START)
    assert padded.batch_size == (3, width + 5)
    for i, n in enumerate([2, 4, 1]):
        prompt = table.ids(i // 2)
        row = padded[keys.TOKENS][i][padded[keys.ATTENTION_MASK][i]]
        assert row.tolist() == torch.cat([prompt, batch[keys.ACTION][i, :n]]).tolist()
        assert padded[keys.ACTION_MASK][i].sum() == n
        assert padded[keys.POSITION_IDS][i, width - len(prompt)] == 0
    aligned = padded[keys.ACTION_LOG_PROB][padded[keys.ACTION_MASK]]
    assert torch.equal(aligned, batch[keys.ACTION_LOG_PROB][batch[keys.MASK]])
    assert torch.equal(padded[keys.ADVANTAGE][:, width:], batch[keys.ADVANTAGE])
    back = padded_to_steps(padded)
    assert (back == batch).all()
    assert set(back.keys(True, True)) == set(batch.keys(True, True))
    assert back.get_non_tensor(keys.PROMPTS) is table


def test_packed_layout():
    batch = make_trajectory_batch([2, 4, 1], group_size=1)
    padded = to_padded(batch)
    packed = to_packed(batch)
    offsets = packed[keys.SEQ_OFFSETS]
    lengths = padded[keys.ATTENTION_MASK].sum(-1)
    assert offsets.tolist() == [0, *lengths.cumsum(0).tolist()]
    for i in range(3):
        seg = slice(int(offsets[i]), int(offsets[i + 1]))
        assert packed[keys.TOKENS][0, seg].tolist() == padded[keys.TOKENS][i][padded[keys.ATTENTION_MASK][i]].tolist()
        assert packed[keys.POSITION_IDS][0, seg].tolist() == list(range(int(lengths[i])))
    assert packed[keys.ACTION_MASK].sum() == 7


def test_dpo_pairs():
    batch = make_trajectory_batch([2, 3, 1, 2, 3, 3], [0.5, 1.0, 0.0, 1.0, 1.0, 1.0], group_size=3)
    pairs = dpo_pairs(batch)
    padded = to_padded(batch)
    assert pairs.batch_size[0] == 1  # group 1 is all ties: no pair
    assert torch.equal(pairs[keys.CHOSEN, keys.TOKENS][0], padded[keys.TOKENS][1])
    assert torch.equal(pairs[keys.REJECTED, keys.TOKENS][0], padded[keys.TOKENS][2])


def test_bad_input():
    batch = make_trajectory_batch([2, 3])
    with pytest.raises(KeyError, match="padded_to_steps reads 'response_start'"):
        padded_to_steps(to_padded(batch).exclude(keys.RESPONSE_START))
    with pytest.raises(KeyError, match=r"padded_to_steps reads \('tokens', 'full'\)"):
        padded_to_steps(batch)
    with pytest.raises(KeyError, match="reads the PromptTable"):
        to_padded(batch.exclude(keys.PROMPTS))


# -- KL in the loss: GRPOLoss(kl_to_ref_coeff=...) reads the reference log-probs to_padded writes --


@pytest.fixture(scope="module")
def kl_batch():
    """A collected TRAJECTORIES batch with per-token reference log-probs (a reference policy stepped alongside)."""
    from tokengym.collectors import TokenCollector
    from tokengym.collectors.policies import PolicyWithReference, StepwiseReference, TransformersPolicy
    from tokengym.llm_envs import TokenEnv
    from tokengym.llm_envs.tasks import arithmetic_prompts
    from tokengym.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model, reference = tiny_model(tok), tiny_model(tok)
    with torch.no_grad():  # other weights: the KL is not 0
        for p in reference.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    env = TokenEnv(arithmetic_prompts(8), tok, lambda r, p, m: [float(len(x)) for x in r], batch_size=4,
                   max_new_tokens=5, group_size=2, model_config=model.config)  # fmt: skip
    policy = PolicyWithReference(TransformersPolicy(model, env), StepwiseReference(reference, env))
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=4)))
    return model, reference, tok, GroupAdvantage()(batch)


def test_grpo_loss_with_kl_to_ref_on_a_collected_batch(kl_batch):
    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors.policies import PaddedSequenceActor
    from tokengym.transforms import step_log_probs

    model, _, tok, batch = kl_batch
    padded = to_padded(batch)  # pad id: the env tokenizer's, recorded by the collector
    assert padded[keys.TOKENS][~padded[keys.ATTENTION_MASK]].eq(tok.pad_token_id).all()
    ref = padded[keys.REF_LOG_PROBS]
    assert ref.shape == padded[keys.TOKENS].shape
    assert torch.equal(ref[padded[keys.ACTION_MASK]], batch[keys.REF_LOG_PROB][batch[keys.MASK]])
    loss = GRPOLoss(PaddedSequenceActor(model), kl_to_ref_coeff=0.04, entropy_bonus=False)
    out = loss(padded)
    # torchrl: mean over (N, L) of k3 = exp(ref - cur) - (ref - cur) - 1 on generated tokens, 0 elsewhere
    with torch.no_grad():
        cur = step_log_probs(model, batch)
    diff = torch.zeros_like(ref)
    diff[padded[keys.ACTION_MASK]] = (batch[keys.REF_LOG_PROB] - cur)[batch[keys.MASK]]
    expected = (diff.expm1() - diff).mean()
    assert float(out.kl_to_ref) > 1e-3
    torch.testing.assert_close(out.kl_to_ref, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.loss_kl_to_ref, 0.04 * expected, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    (out.loss_objective + out.loss_kl_to_ref).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert (padded_to_steps(padded) == batch).all()  # the layout keys leave no trace in the steps


def test_kl_reward_transform_reference_reaches_the_loss(kl_batch):
    from tokengym.transforms import KLRewardTransform

    _, reference, _, batch = kl_batch
    shaped = KLRewardTransform(beta=0.0, ref_model=reference)(batch.exclude(keys.REF_LOG_PROB))
    padded = to_padded(shaped)
    torch.testing.assert_close(padded[keys.REF_LOG_PROBS][padded[keys.ACTION_MASK]],
                               batch[keys.REF_LOG_PROB][batch[keys.MASK]], rtol=1e-4, atol=1e-4)  # fmt: skip
    assert keys.REF_LOG_PROBS not in to_padded(batch.exclude(keys.REF_LOG_PROB)).keys(True)


def test_pad_id_is_explicit_or_the_collectors(kl_batch):
    batch = make_trajectory_batch([2, 3])
    table = batch.get_non_tensor(keys.PROMPTS)
    assert to_padded(batch, pad_id=7)[keys.TOKENS][0, -1] == 7
    table.pad_token_id = None  # a table not built by a collector, no pad id given
    with pytest.raises(ValueError, match=r"to_padded needs a pad token id .* pass pad_id=tokenizer.pad_token_id"):
        to_padded(batch)
