"""check_loss_inputs (issue 41, row "a guard before TorchRL's losses"): a batch, a loss and its actor that do not fit
are refused with the tokengym call that fixes them, before TorchRL's own messages; the setups that fit pass.

Each bad setup is built as a user meets it, and the TorchRL message it gives without the check is asserted too:
the errors reference (docs/reference/errors.md) quotes these messages in its symptom -> fix table.
"""

import pathlib
import re
import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PaddedSequenceActor,
    SequenceActor,
    SharedPrefixActor,
    TransformersPolicy,
)
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model
from tokengym.training import check_loss_inputs, train
from tokengym.transforms import GroupAdvantage, MismatchCorrection, WeightedLoss, to_padded

PROMPTS = ["1+1=", "2+3=", "4+4=", "3+5="]
ERRORS_PAGE = pathlib.Path(__file__).parents[1] / "docs" / "reference" / "errors.md"


def _reward(responses, prompts, metadata):
    return torch.arange(len(responses), dtype=torch.float32)  # spread within every group: nonzero advantages


def _collector(tokenizer, model):
    env = TokenEnv(PROMPTS, tokenizer, _reward, batch_size=4, max_new_tokens=3, group_size=2, model_config=model.config,
                   seed=0)  # fmt: skip
    return TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)


@pytest.fixture(scope="module")
def collected(tokenizer, model):
    """A TRAJECTORIES batch as a collector yields it (no advantage yet)."""
    return next(iter(_collector(tokenizer, model)))


def _ppo(actor, **kwargs):
    return ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False, **kwargs)


def _grpo(actor, **kwargs):
    return GRPOLoss(actor, entropy_bonus=False, **kwargs)


# (loss builder, prepare: collected batch -> what the loss is called on, TorchRL's message, the check's message)
BAD = {
    "GRPOLoss on the step batch (to_padded forgotten)": (
        lambda m: _grpo(PaddedSequenceActor(m)), GroupAdvantage("grpo"),
        re.escape("Action key ('tokens', 'full') not in tensordict."),
        r"GRPOLoss\(PaddedSequenceActor\) reads the padded layout \[N, L\] .*but got a step batch of shape \[4, 3\] "
        r".*tokengym\.transforms\.to_padded\(batch\)",
    ),
    "GRPOLoss(SequenceActor) on the padded layout": (
        lambda m: _grpo(SequenceActor(m)), lambda b: to_padded(GroupAdvantage("grpo")(b)),
        re.escape("SequenceActor.get_dist() got an unexpected keyword argument 'logits_key'"),
        r"GRPOLoss\(SequenceActor\): .*get_dist\(\.\.\., logits_key=\).* Build GRPOLoss\(PaddedSequenceActor\(model\)\) "
        r"\(or SharedPrefixActor\(model\)\) and call it on to_padded\(batch\)",
    ),
    "GRPOLoss(SequenceActor) on the step batch": (
        lambda m: _grpo(SequenceActor(m)), GroupAdvantage("grpo"),
        re.escape("Action key ('tokens', 'full') not in tensordict."),
        r"GRPOLoss\(SequenceActor\): .* Build GRPOLoss\(PaddedSequenceActor\(model\)\)",
    ),
    "GRPOLoss with no advantage": (
        lambda m: _grpo(PaddedSequenceActor(m)), to_padded,
        re.escape("Advantage key advantage not in tensordict."),
        r"GRPOLoss\(PaddedSequenceActor\) reads the advantage 'advantage', but the batch holds none .*no critic.* "
        r"to_padded\(GroupAdvantage\('grpo'\)\(batch\)\)",
    ),
    "ClipPPOLoss with no advantage": (
        lambda m: _ppo(SequenceActor(m)), lambda b: b,
        re.escape("Critic network is not specified, cannot compute advantage within forward."),
        r"ClipPPOLoss\(SequenceActor\) reads the advantage 'advantage', .*GroupAdvantage\('grpo'\)\(batch\) .*"
        r"GAEAdvantage\(\).*prepare=GroupAdvantage\('grpo'\)",
    ),
    "ClipPPOLoss(SequenceActor) on the padded layout": (
        lambda m: _ppo(SequenceActor(m)), lambda b: to_padded(GroupAdvantage("grpo")(b)),
        r"sequence_layout needs a TRAJECTORIES batch .* but row 0 is not one",
        r"ClipPPOLoss\(SequenceActor\) scores a TRAJECTORIES step batch \[N, T\], but got the padded layout of "
        r"to_padded .*ClipPPOLoss\(PaddedSequenceActor\(model\)\)",
    ),
    "ClipPPOLoss(SharedPrefixActor) on the step batch": (
        lambda m: _ppo(SharedPrefixActor(m)), GroupAdvantage("grpo"),
        re.escape("'NoneType' object has no attribute 'device'"),
        r"ClipPPOLoss\(SharedPrefixActor\) reads the padded layout .*to_padded\(batch\)",
    ),
    "WeightedLoss(GRPOLoss(SequenceActor))": (
        lambda m: WeightedLoss(_grpo(SequenceActor(m), aggregation="none")),
        lambda b: to_padded(GroupAdvantage("grpo")(b)),
        re.escape("SequenceActor.get_dist() got an unexpected keyword argument 'logits_key'"),
        r"GRPOLoss\(SequenceActor\): .*PaddedSequenceActor",
    ),
    "GRPOLoss(kl_to_ref_coeff=0.04) with no reference log-probs": (
        lambda m: _grpo(PaddedSequenceActor(m), kl_to_ref_coeff=0.04),
        lambda b: to_padded(GroupAdvantage("grpo")(b)),
        re.escape("Couldn't find the ref log-prob ('next', 'ref_log_probs', 'full') in the input data"),
        r"GRPOLoss\(PaddedSequenceActor\) with kl_to_ref_coeff reads the reference log-probs under "
        r"\('next', 'ref_log_probs', 'full'\).*PolicyWithReference\(policy, reference\)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("setup", list(BAD))
def test_a_bad_setup_is_refused_with_the_fix_where_torchrl_names_none(setup, collected, model):
    make_loss, prepare, torchrl_says, we_say = BAD[setup]
    data = prepare(collected.clone())
    with pytest.raises(Exception, match=torchrl_says):  # what a user meets without the check
        make_loss(model)(data.clone())
    expected = TypeError if "SequenceActor)" in setup and "GRPOLoss" in setup else ValueError
    with pytest.raises(expected, match=we_say):
        check_loss_inputs(data, make_loss(model))


def test_a_decoupled_loss_without_the_trainers_log_probs_names_mismatch_correction(collected, model):
    loss = WeightedLoss(_grpo(PaddedSequenceActor(model), aggregation="none"), is_decoupled=True)
    with pytest.raises(ValueError, match=r"reads the sampler's log-probs under 'trainer_log_prob'.*"
                                         r"MismatchCorrection\(trainer=actor\.log_prob\)"):  # fmt: skip
        check_loss_inputs(to_padded(GroupAdvantage("grpo")(collected.clone())), loss)


def test_a_batch_that_is_not_a_tensordict_is_a_type_error(model):
    with pytest.raises(TypeError, match="check_loss_inputs reads a TensorDict batch, got dict"):
        check_loss_inputs({"action": torch.zeros(2)}, _ppo(SequenceActor(model)))


def _padded_decoupled(model):
    def prepare(batch):
        return MismatchCorrection("truncate", cap=2.0, trainer=PaddedSequenceActor(model).log_prob)(
            to_padded(GroupAdvantage("grpo")(batch))
        )

    return prepare


GOOD = {
    "ClipPPOLoss(SequenceActor), step batch": (lambda m: _ppo(SequenceActor(m)), GroupAdvantage("grpo")),
    "GRPOLoss(PaddedSequenceActor), padded": (lambda m: _grpo(PaddedSequenceActor(m)),
                                              lambda b: to_padded(GroupAdvantage("grpo")(b))),
    "ClipPPOLoss(PaddedSequenceActor), padded": (lambda m: _ppo(PaddedSequenceActor(m)),
                                                 lambda b: to_padded(GroupAdvantage("grpo")(b))),
    "GRPOLoss(SharedPrefixActor), padded": (lambda m: _grpo(SharedPrefixActor(m)),
                                            lambda b: to_padded(GroupAdvantage("grpo")(b))),
    "WeightedLoss(ClipPPOLoss(SharedPrefixActor)), padded (the recipe's)": (
        lambda m: WeightedLoss(_ppo(SharedPrefixActor(m), reduction="none")),
        lambda b: to_padded(GroupAdvantage("grpo")(b))),
    "WeightedLoss(GRPOLoss(PaddedSequenceActor), decoupled), padded + MismatchCorrection": (
        lambda m: WeightedLoss(_grpo(PaddedSequenceActor(m), aggregation="none"), is_decoupled=True), _padded_decoupled),
}  # fmt: skip


@pytest.mark.parametrize("setup", list(GOOD))
def test_a_setup_that_fits_passes_without_a_warning_and_the_loss_runs(setup, collected, model):
    make_loss, prepare = GOOD[setup]
    prepare = prepare(model) if prepare is _padded_decoupled else prepare
    data, loss = prepare(collected.clone()), make_loss(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_loss_inputs(data, loss)
    out = loss(data)
    assert torch.isfinite(out.get("loss_objective")).all()


def test_a_loss_with_a_critic_may_compute_its_own_advantage(collected, model):
    critic = TensorDictModule(torch.nn.Linear(1, 1), in_keys=[keys.TOKEN], out_keys=[keys.STATE_VALUE])
    loss = ClipPPOLoss(SequenceActor(model), critic_network=critic, entropy_bonus=False, functional=False)
    check_loss_inputs(collected, loss)  # no advantage in the batch: the loss's value estimator writes it


def test_a_loss_that_is_not_a_torchrl_loss_is_not_checked(collected):
    class Custom(torch.nn.Module):
        def forward(self, td):
            return TensorDict({"loss_objective": td[keys.ACTION_LOG_PROB].sum()})

    check_loss_inputs(collected, Custom())


# -- train() runs the check on its first batch, before any optimizer step --
@pytest.mark.parametrize(
    ("make_loss", "prepare", "error", "match"),
    [
        (lambda m: _grpo(PaddedSequenceActor(m)), GroupAdvantage("grpo"), ValueError, r"to_padded\(batch\)"),
        (lambda m: _grpo(SequenceActor(m)), lambda b: to_padded(GroupAdvantage("grpo")(b)), TypeError,
         r"GRPOLoss\(PaddedSequenceActor\(model\)\)"),
        (lambda m: _ppo(SequenceActor(m)), None, ValueError, r"reads the advantage 'advantage'.*prepare=GroupAdvantage"),
    ],
    ids=["unpadded", "sequence-actor", "no-advantage"],
)  # fmt: skip
def test_train_refuses_a_bad_setup_before_training_anything(tokenizer, make_loss, prepare, error, match):
    model = tiny_model(tokenizer, seed=0)
    collector = _collector(tokenizer, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        train(collector, make_loss(model), torch.optim.Adam(model.parameters(), lr=1e-2), iterations=2, prepare=prepare)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # no step was taken
    assert collector.policy.version == 0  # no weights went out


def test_train_on_the_padded_layout_with_the_shared_prefix_actor_runs(tokenizer):
    model = tiny_model(tokenizer, seed=0)
    collector = _collector(tokenizer, model)
    loss = WeightedLoss(_ppo(SharedPrefixActor(model), reduction="none"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rows = train(collector, loss, torch.optim.Adam(model.parameters(), lr=1e-3), iterations=2,
                     prepare=lambda b: to_padded(GroupAdvantage("grpo")(b)))  # fmt: skip
    assert [row["iter"] for row in rows] == [0, 1] and collector.policy.version == 2


def test_the_errors_reference_quotes_the_torchrl_messages_and_names_the_check():
    page = ERRORS_PAGE.read_text()
    assert "check_loss_inputs" in page
    for quoted in ("Action key ('tokens', 'full') not in tensordict.",
                   "get_dist() got an unexpected keyword argument 'logits_key'",
                   "Advantage key advantage not in tensordict.",
                   "Critic network is not specified, cannot compute advantage within forward.",
                   "'NoneType' object has no attribute 'device'"):  # fmt: skip
        assert quoted in page, quoted


# -- issue 47: loss weights (keys.LOSS_WEIGHT) the loss would not read --
@pytest.mark.parametrize(
    ("make_loss", "prepare", "owner"),
    [
        (lambda m: _ppo(SequenceActor(m)), GroupAdvantage("grpo"), r"ClipPPOLoss\(SequenceActor\)"),
        (lambda m: _grpo(PaddedSequenceActor(m)), lambda b: to_padded(GroupAdvantage("grpo")(b)),
         r"GRPOLoss\(PaddedSequenceActor\)"),  # to_padded carries the weights over, under the same key
    ],
    ids=["ppo-step-batch", "grpo-padded"],
)  # fmt: skip
def test_loss_weights_a_plain_loss_would_not_read_are_refused_naming_weighted_loss(collected, model, make_loss,
                                                                                   prepare, owner):  # fmt: skip
    batch = collected.clone()
    batch.set(keys.LOSS_WEIGHT, torch.ones(batch.shape))  # all ones: still weights, and the loss would not read them
    data = prepare(batch)
    assert keys.LOSS_WEIGHT in data.keys()
    with pytest.raises(ValueError, match=owner + r" does not read.*WeightedLoss\(loss\).*batch\.exclude\('loss_weight'\)"):
        check_loss_inputs(data, make_loss(model))
    check_loss_inputs(data.exclude(keys.LOSS_WEIGHT), make_loss(model))  # the fix named for ignoring them on purpose
