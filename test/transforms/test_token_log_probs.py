"""Chunked log-probs from hidden states: equal to the whole logits' (values and gradients), and never (K, V) at once."""

import pytest
import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors.policies import PaddedSequenceActor, SequenceActor, SharedPrefixActor
from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import GroupAdvantage, TokenScorer, WeightedLoss, sequence_log_probs, to_padded
from tokengym.transforms.token_log_probs import final_hidden_states

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


@pytest.fixture
def batch():
    return GroupAdvantage("grpo")(make_trajectory_batch([3, 2, 4, 1, 5, 2], group_size=2, seed=3))


def _whole(model, temperature=1.0, banned=None):
    logits = model(input_ids=IDS).logits[:, :-1].float() / temperature  # (2, 5, V)
    if banned is not None:
        logits = logits.index_fill(-1, banned, -float("inf"))
    return logits.log_softmax(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 100])
@pytest.mark.parametrize(("temperature", "banned"), [(1.0, None), (0.7, torch.tensor([3, 4]))])
def test_log_probs_and_entropies_equal_the_whole_logits(model, chunk_size, temperature, banned):
    hidden, head, cap = final_hidden_states(model, input_ids=IDS)
    scorer = TokenScorer(hidden.flatten(0, 1), head, temperature=temperature, banned=banned, chunk_size=chunk_size)
    rows = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10])  # each row's first five positions
    tokens = IDS[:, 1:].reshape(-1)
    logp = _whole(model, temperature, banned)
    expected = logp.gather(-1, IDS[:, 1:, None]).reshape(-1)
    torch.testing.assert_close(scorer.log_probs(rows, tokens), expected, atol=1e-6, rtol=0)
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).reshape(-1)
    torch.testing.assert_close(scorer.entropies(rows), entropy, atol=1e-5, rtol=0)


def test_gradients_equal_the_whole_logits_and_reach_the_head(model):
    hidden, head, _ = final_hidden_states(model, input_ids=IDS)
    rows = torch.arange(5)
    (TokenScorer(hidden.flatten(0, 1), head, chunk_size=2).log_probs(rows, IDS[0, 1:]).sum()
     + TokenScorer(hidden.flatten(0, 1), head, chunk_size=3).entropies(rows).sum()).backward()  # fmt: skip
    chunked = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logp = _whole(model)[0]
    (logp.gather(-1, IDS[0, 1:, None]).sum() - (logp.exp() * logp).sum()).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(chunked[name], param.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert float(model.get_output_embeddings().weight.grad.abs().max()) > 0


def test_the_head_never_sees_more_than_a_chunk(model, batch):
    """The memory claim as an outcome: every output-layer call of a loss step holds at most chunk_size positions."""
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    try:
        out = GRPOLoss(PaddedSequenceActor(model, chunk_size=4), entropy_bonus=True)(to_padded(batch))
        (out.loss_objective + out.loss_entropy).backward()
    finally:
        hook.remove()
    generated = int(to_padded(batch)[keys.ACTION_MASK].sum())
    assert shapes and all(len(s) == 2 and s[0] <= 4 for s in shapes), shapes
    assert sum(s[0] for s in shapes) >= 2 * generated  # log-probs and entropies, forward and the backward's recompute


def _grads(model, loss, data):
    model.zero_grad()
    out = loss(data)
    total = sum(out.get(k) for k in out.keys() if isinstance(k, str) and k.startswith("loss_"))
    total.backward()
    return total.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


LOSSES = {
    "GRPOLoss(PaddedSequenceActor)": (lambda a: GRPOLoss(a, entropy_bonus=True), PaddedSequenceActor, True),
    "GRPOLoss(SharedPrefixActor)": (lambda a: GRPOLoss(a, entropy_bonus=True), SharedPrefixActor, True),
    "WeightedLoss(GRPOLoss)": (lambda a: WeightedLoss(GRPOLoss(a, entropy_bonus=False, aggregation="none")),
                               PaddedSequenceActor, True),
    "ClipPPOLoss(SequenceActor)": (lambda a: ClipPPOLoss(a, critic_network=None, entropy_bonus=True, functional=False),
                                   SequenceActor, False),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_step_equals_the_whole_logits_path(model, batch, name):
    make, actor, padded = LOSSES[name]
    data = to_padded(batch) if padded else batch
    value, grads = _grads(model, make(actor(model, chunk_size=3)), data.clone())
    ref_value, ref_grads = _grads(model, make(actor(model, full_logits=True)), data.clone())
    torch.testing.assert_close(value, ref_value, atol=1e-6, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[key], atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("actor", [SequenceActor, PaddedSequenceActor, SharedPrefixActor])
def test_actor_log_probs_equal_the_whole_logits(model, batch, actor):
    data = batch if actor is SequenceActor else to_padded(batch)
    with torch.no_grad():
        chunked, whole = actor(model, chunk_size=2).log_prob(data), actor(model, full_logits=True).log_prob(data)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)


def test_sequence_log_probs_are_chunked_and_equal(model):
    mask = torch.ones_like(IDS, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    lp = sequence_log_probs(model, IDS, mask, temperature=0.5)
    logits = model(input_ids=IDS[:1]).logits[0, :-1] / 0.5
    torch.testing.assert_close(lp[0, 1:], logits.log_softmax(-1).gather(-1, IDS[0, 1:, None]).squeeze(-1),
                               atol=1e-6, rtol=0)  # fmt: skip
    assert lp[1, :3].tolist() == [0.0, 0.0, 0.0]


class _LogitsOnly(torch.nn.Module):
    """A causal LM that gives only its logits (no decoder / output layer to split): the whole-logits path."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, **kwargs):
        return self.inner(**kwargs)


def test_a_model_without_a_separate_output_layer_scores_its_whole_logits(model, batch):
    assert final_hidden_states(_LogitsOnly(model), input_ids=IDS) is None
    data = to_padded(batch)
    with torch.no_grad():
        lp = PaddedSequenceActor(_LogitsOnly(model)).log_prob(data)
        torch.testing.assert_close(lp, PaddedSequenceActor(model).log_prob(data), atol=1e-6, rtol=0)


def test_a_model_whose_logits_differ_from_its_head_keeps_the_whole_logits(model):
    class Scaled(torch.nn.Module):  # logits scaled after the head (Cohere's logit_scale, Granite's logits_scaling)
        def __init__(self, model):
            super().__init__()
            self.model = model

        def get_decoder(self):
            return self.model.get_decoder()

        def get_output_embeddings(self):
            return self.model.get_output_embeddings()

        def forward(self, **kwargs):
            out = self.model(**kwargs)
            out.logits = out.logits * 0.5
            return out

    assert final_hidden_states(Scaled(model), input_ids=IDS) is None


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_a_bad_chunk_size_is_refused(model, bad):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        PaddedSequenceActor(model, chunk_size=bad)


def test_the_one_time_check_leaves_every_modules_mode_as_it_found_it(tokenizer):
    """A PEFT model is in train mode at the top with its base model's dropout in eval: the check must not switch the
    dropout on (a GPT-2's teacher-forced log-probs then moved by 0.15)."""
    from tokengym.testing import tiny_model

    model = tiny_model(tokenizer, family="gpt2")
    model.training = True  # the top in train mode, every submodule in eval, as peft.get_peft_model leaves it
    modes = {name: m.training for name, m in model.named_modules()}
    final_hidden_states(model, input_ids=IDS)
    assert {name: m.training for name, m in model.named_modules()} == modes
