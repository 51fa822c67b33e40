"""train_step's micro-batches give the whole batch's gradient; mini-batches, checkpointing and modes."""

import copy

import pytest
import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym._micro_batches import micro_batches, mini_batch_rows
from tokengym.collectors.policies import PaddedSequenceActor, SequenceActor, SharedPrefixActor
from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.training import TrainOptions, train_step
from tokengym.transforms import GroupAdvantage, WeightedLoss, to_padded

LOSSES = {  # name -> (loss from an actor, actor class, layout)
    "GRPOLoss token_mean": (lambda a: GRPOLoss(a, entropy_bonus=True), PaddedSequenceActor, "padded"),
    "GRPOLoss prompt_mean": (lambda a: GRPOLoss(a, entropy_bonus=False, aggregation="prompt_mean"),
                             PaddedSequenceActor, "padded"),
    "GRPOLoss kl_to_ref": (lambda a: GRPOLoss(a, entropy_bonus=False, kl_to_ref_coeff=0.1), PaddedSequenceActor,
                           "padded"),
    "GRPOLoss(SharedPrefixActor)": (lambda a: GRPOLoss(a, entropy_bonus=False), SharedPrefixActor, "padded"),
    "WeightedLoss token_mean": (lambda a: WeightedLoss(GRPOLoss(a, entropy_bonus=False, aggregation="none")),
                                PaddedSequenceActor, "padded"),
    "WeightedLoss sequence_mean": (lambda a: WeightedLoss(GRPOLoss(a, entropy_bonus=False, aggregation="none"),
                                                          aggregation="sequence_mean"), PaddedSequenceActor, "padded"),
    "ClipPPOLoss(SequenceActor)": (lambda a: ClipPPOLoss(a, critic_network=None, entropy_bonus=True, functional=False),
                                   SequenceActor, "steps"),
}  # fmt: skip
SPLITS = {"one row each": {"micro_batch_rows": 1}, "uneven rows": {"micro_batch_rows": 4},
          "token budget": {"micro_batch_tokens": 14}}  # fmt: skip


def _data(layout: str):
    batch = GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1, 5, 2], group_size=2, seed=3))
    if layout == "steps":
        return batch
    padded = to_padded(batch)
    gen = torch.Generator().manual_seed(1)
    padded.set(keys.REF_LOG_PROBS, padded[keys.LOG_PROBS] - torch.rand(padded.batch_size, generator=gen) * 0.2)
    padded.set(keys.LOSS_WEIGHT, torch.rand(padded.batch_size, generator=gen))
    return padded


def _update(model, name: str, **options):
    """The parameters' change after one SGD step (lr 1, no clipping) of ``train_step``, and its row."""
    make, actor, layout = LOSSES[name]
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = make(actor(model, chunk_size=5))
    row = train_step(_data(layout), loss, torch.optim.SGD(model.parameters(), lr=1.0),
                     options=TrainOptions(max_grad_norm=None, **options))  # fmt: skip
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, row


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", list(LOSSES))
def test_micro_batches_give_the_whole_batchs_gradient_and_metrics(model, name, split):
    whole, whole_row = _update(model, name)
    micro, micro_row = _update(model, name, **SPLITS[split])
    assert any(float(d.abs().max()) > 1e-4 for d in whole.values())
    for key, delta in whole.items():
        torch.testing.assert_close(micro[key], delta, atol=1e-6, rtol=1e-5, msg=key)
    assert micro_row.keys() == whole_row.keys()
    for key in ("loss", *[k for k in whole_row if k.startswith("loss_")]):
        assert micro_row[key] == pytest.approx(whole_row[key], abs=1e-6), key


def test_a_token_budget_packs_rows_by_length_and_cuts_their_padding(model):
    data = _data("padded")
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    parts = micro_batches(data, loss, max_tokens=14)
    widths = data[keys.ATTENTION_MASK].long().cumsum(-1).argmax(-1) + 1
    assert sum(p.data.batch_size[0] for p in parts) == data.batch_size[0]
    for part in parts:
        n, width = part.data.batch_size
        assert n * width <= 14 or n == 1  # within the budget, or a row alone
    assert max(p.data.batch_size[1] for p in parts) == int(widths.max())
    assert min(p.data.batch_size[1] for p in parts) < data.batch_size[1]  # short rows lose their padding
    assert sum(p.share for p in parts) == pytest.approx(1.0)


def test_mini_batches_take_that_many_steps_over_every_row_once(model):
    gen = torch.Generator().manual_seed(0)
    parts = mini_batch_rows(6, 4, gen)
    assert sorted(torch.cat(parts).tolist()) == list(range(6)) and len(parts) == 4
    steps = []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: steps.append(i) or 1.0)
    steps.clear()
    train_step(_data("padded"), GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False), optimizer,
               options=TrainOptions(epochs=2, mini_batches=3, micro_batch_rows=1), scheduler=scheduler)  # fmt: skip
    assert len(steps) == 6


def test_gradient_checkpointing_is_on_during_the_step_and_off_after(model):
    original, model = model, copy.deepcopy(model)
    with torch.no_grad():  # the actor's one-time check that the decoder and head give the logits (in eval mode)
        PaddedSequenceActor(model).log_prob(_data("padded"))
    seen = []
    hook = model.get_decoder().register_forward_hook(lambda m, i, o: seen.append((model.is_gradient_checkpointing,
                                                                                  model.training)))  # fmt: skip
    loss = GRPOLoss(PaddedSequenceActor(model, chunk_size=5), entropy_bonus=True)
    with_ckpt, _ = _update_with(model, loss, gradient_checkpointing=True)
    hook.remove()
    assert seen and all(s == (True, True) for s in seen), seen
    assert not model.is_gradient_checkpointing and not model.training  # as found: eval, no checkpointing
    plain, _ = _update(original, "GRPOLoss token_mean")
    for key, delta in plain.items():
        torch.testing.assert_close(with_ckpt[key], delta, atol=1e-6, rtol=1e-5, msg=key)


def _update_with(model, loss, **options):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    row = train_step(_data("padded"), loss, torch.optim.SGD(model.parameters(), lr=1.0),
                     options=TrainOptions(max_grad_norm=None, **options))  # fmt: skip
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, row


def test_a_model_in_train_mode_stays_in_train_mode(model):
    model = copy.deepcopy(model).train()
    train_step(_data("padded"), GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False),
               torch.optim.SGD(model.parameters(), lr=0.0))  # fmt: skip
    assert model.training and all(m.training for m in model.modules())


@pytest.mark.parametrize(("options", "match"), [
    ({"micro_batch_rows": 0}, r"micro_batch_rows must be a positive int, got 0"),
    ({"micro_batch_tokens": True}, r"micro_batch_tokens must be a positive int, got True"),
    ({"mini_batches": 0}, r"mini_batches must be a positive int, got 0"),
    ({"micro_batch_rows": 2, "micro_batch_tokens": 100}, r"give micro_batch_rows \(2\) or micro_batch_tokens \(100\)"),
])  # fmt: skip
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        TrainOptions(**options)


def test_batch_statistics_are_refused_with_micro_batches(model):
    loss = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False,
                       normalize_advantage=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"normalize_advantage=True\) whitens the advantage over the batch"):
        train_step(_data("steps"), loss, torch.optim.SGD(model.parameters(), lr=0.0),
                   options=TrainOptions(micro_batch_rows=2))  # fmt: skip
    with pytest.raises(ValueError, match=r"mini_batches=7 is more than the batch's 6 rows"):
        train_step(_data("steps"), loss, torch.optim.SGD(model.parameters(), lr=0.0),
                   options=TrainOptions(mini_batches=7))  # fmt: skip


def test_checkpointing_without_a_transformers_actor_is_refused(model):
    class Plain(torch.nn.Module):
        def forward(self, td):
            return td

    loss = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)
    loss.actor_network.model = Plain()
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True enables it on the loss's actor model"):
        train_step(_data("steps"), loss, torch.optim.SGD(model.parameters(), lr=0.0),
                   options=TrainOptions(gradient_checkpointing=True))  # fmt: skip
