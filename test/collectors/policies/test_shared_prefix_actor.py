"""SharedPrefixActor gives PaddedSequenceActor's log-probs and a loss step's gradients from one forward over the
prefix-shared layout: single- and multi-turn batches, sdpa and eager attention, GRPOLoss, ClipPPOLoss with a value
head, WeightedLoss, the reference's log-probs."""

import copy

import pytest
import torch
from tensordict.nn import TensorDictModule
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    MaskedCategorical,
    PaddedSequenceActor,
    SamplingConfig,
    SharedPrefixActor,
    TransformersPolicy,
)
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.turns import FeedbackTurns, Turn
from tokengym.testing import make_trajectory_batch, tiny_model
from tokengym.transforms import (
    GroupAdvantage,
    KLRewardTransform,
    WeightedLoss,
    padded_to_steps,
    step_log_probs,
    to_padded,
    to_shared_prefix,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _feedback(responses, prompts, metadata, turns):
    """Two turns: the env answers the first (feedback tokens inside the row), the second ends the episode."""
    return [Turn(float(len(r) % 3), "again") if t == 0 else Turn(1.0) for r, t in zip(responses, turns, strict=True)]


@pytest.fixture(scope="module")
def multi_turn(tokenizer, model):
    """A collected multi-turn TRAJECTORIES batch: groups of 4 samples of different prompts, sampled at 0.7 with a
    banned token (the actors score with both)."""
    env = TokenEnv(["1+1=", "12+30=", "7*8="], tokenizer, turns=FeedbackTurns(_feedback), max_turns=2, batch_size=8,
                   max_new_tokens=4, group_size=4, model_config=model.config, eos_token_ids=list(range(100, 160)))  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=0.7, banned_token_ids=(7,)), seed=0)
    batch = next(iter(TokenCollector(env, policy, mode="trajectories", batch_size=8)))
    assert bool((batch[keys.TURN] > 0).any())
    return GroupAdvantage("grpo")(batch)


def _single_turn():
    """Groups of 3 with prompts of 4, 5, 6 tokens, a one-sample group, rows sharing more than the prompt."""
    batch = make_trajectory_batch([3, 5, 2, 4, 1, 3, 6, 2, 5, 4], group_size=3, prompt_len=4, seed=3)
    batch[keys.ACTION][1, :2] = batch[keys.ACTION][0, :2]  # rows 0 and 1 share 2 response tokens beyond the prompt
    return GroupAdvantage("grpo", use_partial_groups=True)(batch)


def _batch(name, multi_turn):
    return to_padded(multi_turn if name == "multi-turn" else _single_turn())


def _with_attention(model, attention):
    if attention == "sdpa":
        return model
    other = copy.deepcopy(model)
    other.set_attn_implementation(attention)
    return other


def _grads(model, loss, data):
    model.zero_grad()
    out = loss(data.clone())
    critic = out.get("loss_critic", None)
    (out.get("loss_objective") + (0.0 if critic is None else critic)).backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["single-turn", "multi-turn"])
def test_log_probs_and_grpo_gradients_equal_the_padded_layout(model, multi_turn, attention, name):
    model = _with_attention(model, attention)
    padded = _batch(name, multi_turn)
    layout = to_shared_prefix(padded)
    assert layout.tokens.numel() < padded[keys.TOKENS].numel()  # the shared layout is smaller
    shared, plain = SharedPrefixActor(model), PaddedSequenceActor(model)
    with torch.no_grad():
        lp, expected = shared.log_prob(padded), plain.log_prob(padded)
    torch.testing.assert_close(lp, expected, **TOL)
    assert float(lp.abs().sum()) > 0
    if name == "multi-turn":  # the collector's log-probs, at its temperature 0.7
        torch.testing.assert_close(lp, padded[keys.LOG_PROBS], atol=2e-5, rtol=1e-5)
    out, grads = _grads(model, GRPOLoss(shared, entropy_bonus=True), padded)
    ref_out, ref_grads = _grads(model, GRPOLoss(plain, entropy_bonus=True), padded)
    torch.testing.assert_close(out.loss_objective, ref_out.loss_objective, **TOL)
    # loss_entropy is masked; the logged `entropy` is GRPOLoss's mean over every column (padding included)
    torch.testing.assert_close(out.loss_entropy, ref_out.loss_entropy, **TOL)
    torch.testing.assert_close(out.kl_approx, ref_out.kl_approx, **TOL)
    for param, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[param], **TOL, msg=param)
    assert any(float(g.abs().max()) > 1e-4 for g in grads.values())


def test_dist_logits_equal_wherever_a_token_precedes(model, multi_turn):
    padded = _batch("multi-turn", multi_turn)
    with torch.no_grad():
        dist = SharedPrefixActor(model, full_logits=True).get_dist(padded)
        expected = PaddedSequenceActor(model, full_logits=True).get_dist(padded)
    has = to_shared_prefix(padded).predictor >= 0
    torch.testing.assert_close(dist.logits[has], expected.logits[has], **TOL)
    assert torch.equal(dist.mask, padded[keys.ACTION_MASK]) and isinstance(dist, MaskedCategorical)
    # kept packed, it answers as the categorical over its (N, L, V) logits does, at every column
    dense = torch.distributions.Categorical(logits=dist.logits)
    tokens = padded[keys.TOKENS]
    torch.testing.assert_close(dist.log_prob(tokens), dense.log_prob(tokens), **TOL)
    torch.testing.assert_close(dist.entropy(), dense.entropy(), **TOL)
    banned = torch.isinf(dist.logits[..., 7])  # the batch's banned token: -inf where a token precedes, else uniform
    assert bool(banned[has].all()) and not bool(banned[~has].any())


def test_weighted_grpo_and_clip_ppo_with_a_value_head_train_as_on_the_padded_layout(model):
    """ClipPPOLoss reads the padded layout's step keys (action, action_log_prob, advantage, value_target) and a critic
    (a value head over the hidden states in which each token is chosen, taken from the same shared forward)."""
    padded = _batch("single-turn", None)
    padded[keys.ADVANTAGE] = padded[keys.ADVANTAGE] * padded[keys.MASK][..., None]
    padded[keys.VALUE_TARGET] = torch.randn(*padded.shape, 1) * padded[keys.MASK][..., None]
    with torch.no_grad():
        hidden = SharedPrefixActor(model).hidden_states(padded)
        out = model(input_ids=padded[keys.TOKENS], attention_mask=padded[keys.ATTENTION_MASK].long(),
                    position_ids=padded[keys.POSITION_IDS], output_hidden_states=True)  # fmt: skip
    valid = padded[keys.ACTION_MASK]
    torch.testing.assert_close(hidden[:, 1:][valid[:, 1:]], out.hidden_states[-1][:, :-1][valid[:, 1:]], **TOL)
    padded["hidden"] = hidden
    head = torch.nn.Linear(model.config.hidden_size, 1)
    critic = TensorDictModule(head, in_keys=["hidden"], out_keys=[keys.STATE_VALUE])
    results = []
    for actor in (SharedPrefixActor(model), PaddedSequenceActor(model)):
        ppo = ClipPPOLoss(actor, critic_network=critic, entropy_bonus=False, functional=False, reduction="none")
        grpo = GRPOLoss(actor, entropy_bonus=False, aggregation="none")
        head.zero_grad()
        ppo_out, ppo_grads = _grads(model, WeightedLoss(ppo), padded)
        grpo_out, grpo_grads = _grads(model, WeightedLoss(grpo), padded)
        results.append((ppo_out, ppo_grads, head.weight.grad.clone(), grpo_out, grpo_grads))
    (a, a_grads, a_head, b, b_grads), (c, c_grads, c_head, d, d_grads) = results
    torch.testing.assert_close(a["loss_objective"], c["loss_objective"], **TOL)
    torch.testing.assert_close(a["loss_critic"], c["loss_critic"], **TOL)
    torch.testing.assert_close(a_head, c_head, **TOL)
    torch.testing.assert_close(b["loss_objective"], d["loss_objective"], **TOL)
    for param in a_grads:
        torch.testing.assert_close(a_grads[param], c_grads[param], **TOL, msg=param)
        torch.testing.assert_close(b_grads[param], d_grads[param], **TOL, msg=param)


def test_reference_log_probs_on_the_shared_layout(tokenizer, model, multi_turn):
    """The reference's log-probs from the same layout: for GRPOLoss(kl_to_ref_coeff=...) and for KL in the reward."""
    reference = tiny_model(tokenizer, seed=1)
    batch = multi_turn.clone()
    padded = to_padded(batch)
    with torch.no_grad():
        ref = SharedPrefixActor(reference, temperature=None).log_prob(padded.exclude(keys.PROMPTS))
    padded[keys.REF_LOG_PROBS] = ref  # what GRPOLoss(kl_to_ref_coeff=...) reads
    padded[keys.REF_LOG_PROB] = ref
    steps = padded_to_steps(padded)[keys.REF_LOG_PROB]  # back to the step batch, for KLRewardTransform
    expected = step_log_probs(reference, batch)
    torch.testing.assert_close(steps, expected, **TOL)
    batch[keys.REF_LOG_PROB] = steps
    shaped = KLRewardTransform(beta=0.1)(batch.clone())
    reshaped = KLRewardTransform(beta=0.1, ref_model=reference)(multi_turn.clone().exclude(keys.REF_LOG_PROB))
    torch.testing.assert_close(shaped[keys.REWARD], reshaped[keys.REWARD], **TOL)
    out = GRPOLoss(SharedPrefixActor(model), kl_to_ref_coeff=0.04, entropy_bonus=False)(padded)
    assert float(out.kl_to_ref) > 0


def test_an_attention_without_4d_masks_is_refused(model):
    other = copy.deepcopy(model)
    other.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match=r"'flex_attention' attention does not take.*set_attn_implementation\('sdpa'\)"):
        SharedPrefixActor(other).log_prob(_batch("single-turn", None))
    with pytest.raises(ValueError, match="to_shared_prefix reads a padded layout"):
        SharedPrefixActor(model).log_prob(_single_turn().exclude(keys.ACTION))


def test_a_model_with_learned_positions_scores_alike(tokenizer):
    """GPT-2 (learned position embeddings) takes the packed position ids and the block mask too."""
    gpt2 = tiny_model(tokenizer, family="gpt2")
    padded = _batch("single-turn", None)
    with torch.no_grad():
        torch.testing.assert_close(SharedPrefixActor(gpt2).log_prob(padded), PaddedSequenceActor(gpt2).log_prob(padded),
                                   **TOL)  # fmt: skip
