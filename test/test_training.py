"""tokengym.training.train: the loop the demo, the recipe and the examples share."""

import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions, train
from tokengym.transforms import GroupAdvantage

DOCUMENTED = {"iter", "reward", "kl", "beta", "tokens_per_s", "loss"}


def _reward(responses, prompts, metadata):
    return torch.arange(len(responses), dtype=torch.float32)  # differs within each group: nonzero advantages


@pytest.fixture
def tiny_run():
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=0)
    env = TokenEnv(["1+1=", "2+3=", "4+4="], tok, _reward, batch_size=4, max_new_tokens=3, group_size=2,
                   model_config=model.config, seed=0)  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=0), mode="trajectories", batch_size=4)
    loss = ClipPPOLoss(SequenceActor(model), critic_network=None, entropy_bonus=False, functional=False)
    return model, collector, loss


def test_one_iteration_changes_the_parameters(tiny_run):
    model, collector, loss = tiny_run
    before = [p.detach().clone() for p in model.parameters()]
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    rows = train(collector, loss, optim, iterations=1, prepare=GroupAdvantage("grpo"))
    assert len(rows) == 1 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not model.training  # back in eval mode for the next collection
    assert collector.policy.version == 1  # the weights went out once


def test_one_row_per_iteration_with_the_documented_keys(tiny_run):
    model, collector, loss = tiny_run
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 0.5)
    seen, sent = [], []

    def on_iteration(row, data):
        seen.append(row["iter"])
        row["extra"] = float(data.get(keys.ADVANTAGE).abs().sum())

    def weights():
        sent.append(1)
        return model.state_dict()

    rows = train(collector, loss, optim, iterations=3, options=TrainOptions(epochs=2, max_grad_norm=None),
                 prepare=GroupAdvantage("grpo"), on_iteration=on_iteration, scheduler=warmup, weights=weights)  # fmt: skip
    assert [r["iter"] for r in rows] == seen == [0, 1, 2] and len(sent) == 3
    assert warmup.last_epoch == 3 * 2  # stepped after every optimizer step
    for row in rows:
        assert DOCUMENTED | {"loss_objective", "clip_fraction", "extra"} <= set(row)
        assert row["loss"] == row["loss_objective"] and math.isnan(row["kl"])  # no KL transform here
        assert all(isinstance(v, int | float) for v in row.values())


class _Collector:
    """The least a collector needs: batches, metrics, update_policy_weights_."""

    def __init__(self, batches):
        self.batches, self.metrics, self.updates = batches, {"mean_reward": 0.5, "tokens_per_s": 10.0}, []

    def __iter__(self):
        return iter(self.batches)

    def update_policy_weights_(self, weights=None):
        self.updates.append(weights)


class _Loss(torch.nn.Module):
    def __init__(self, name="loss_objective"):
        super().__init__()
        self.w, self.name = torch.nn.Parameter(torch.ones(2)), name

    def forward(self, td):
        return TensorDict({self.name: (self.w * td["x"]).sum(), "note": torch.tensor(3.0)})


def test_the_loss_terms_are_summed_and_the_collector_may_end_early():
    loss = _Loss()
    collector = _Collector([TensorDict({"x": torch.ones(2)})] * 2)
    rows = train(collector, loss, torch.optim.SGD(loss.parameters(), lr=0.1), iterations=5)
    assert len(rows) == 2 and collector.updates == [None, None] and rows[0]["note"] == 3.0
    assert torch.allclose(loss.w, torch.full((2,), 1 - 2 * 0.1 / math.sqrt(2)))  # the gradient (1, 1) clipped to norm 1


_OK = {"iterations": 1}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"iterations": 0}, ValueError, r"iterations must be a positive int, got 0: .* e\.g\. iterations=100"),
        ({"iterations": 2.0}, ValueError, "iterations must be a positive int, got 2.0"),
        ({**_OK, "options": {"epochs": 2}}, TypeError, r"options must be a TrainOptions, got dict: TrainOptions\(epochs=2\)"),
        ({**_OK, "prepare": 3}, TypeError, "prepare must be callable or None, got int 3"),
        ({**_OK, "scheduler": 0.1}, TypeError, r"scheduler must have step\(\) .*got float"),
        ({**_OK, "optimizer": "adam"}, TypeError, r"optimizer must be a torch.optim.Optimizer, got str; build one over the model"),
        ({**_OK, "collector": [1, 2]}, TypeError, "collector must have update_policy_weights_ and metrics .* got list"),
        ({**_OK, "loss": _Loss("objective")}, KeyError, r"no 'loss_\*' term \(keys: \['note', 'objective'\]\)"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kwargs, error, match):
    loss = kwargs.pop("loss", _Loss())
    args = {"collector": _Collector([TensorDict({"x": torch.ones(2)})]), "loss": loss,
            "optimizer": torch.optim.SGD(loss.parameters(), lr=0.1), **kwargs}  # fmt: skip
    with pytest.raises(error, match=match):
        train(args.pop("collector"), args.pop("loss"), args.pop("optimizer"), **args)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epochs": 0}, r"epochs must be a positive int, got 0\. Use epochs=1"),
        ({"max_grad_norm": 0}, r"max_grad_norm must be a number > 0 or None, got 0\. Use None to turn clipping off"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainOptions(**kwargs)


def test_a_collector_writing_to_a_sink_is_refused():
    loss = _Loss()
    with pytest.raises(TypeError, match="yielded None .* drop sink="):
        train(_Collector([None]), loss, torch.optim.SGD(loss.parameters(), lr=0.1), iterations=1)
