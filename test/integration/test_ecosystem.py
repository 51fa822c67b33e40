"""tokengym with the TorchRL ecosystem: replay buffers, loggers, collector conventions, GRPOLoss, chat templates."""

from __future__ import annotations

import csv

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss
from torchrl.record.loggers import CSVLogger

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import PaddedSequenceActor, SequenceActor, TransformersPolicy
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts, arithmetic_reward
from tokengym.transforms import GroupAdvantage, decode, to_packed, to_padded


@pytest.fixture
def make_collector(tokenizer, model):
    def make(**kwargs):
        env = TokenEnv(arithmetic_prompts(16, seed=0, max_operand=4), tokenizer, arithmetic_reward(), batch_size=4,
                       max_new_tokens=5, group_size=2, max_length=64, model_config=model.config,
                       eos_token_ids=list(range(1, 512, 11)))  # fmt: skip
        return TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", **kwargs)

    return make


def test_replay_buffer_round_trip_into_clip_ppo_and_layouts(make_collector, tokenizer, model):
    collector = make_collector(batch_size=4)  # max_new_tokens wide by default
    buffer = ReplayBuffer(storage=LazyTensorStorage(64), batch_size=6)
    advantage = GroupAdvantage("grpo")
    widths = []
    for batch, _ in zip(collector, range(4), strict=False):
        widths.append(batch.shape[1])
        buffer.extend(advantage(batch))
    assert len(buffer) == 16 and set(widths) == {5}  # fixed width: every batch is max_new_tokens wide
    loss = ClipPPOLoss(SequenceActor(model, pad_token_id=tokenizer.pad_token_id), critic_network=None,
                       entropy_bonus=False, functional=False)  # fmt: skip
    for _ in range(3):
        minibatch = buffer.sample()
        out = loss(minibatch)
        assert torch.isfinite(out["loss_objective"])
        out["loss_objective"].backward()
        padded = to_padded(minibatch, pad_id=tokenizer.pad_token_id)
        mask = minibatch[keys.MASK]
        for i in range(minibatch.shape[0]):  # the padded rows hold the prompt the row was collected from
            row = padded[keys.TOKENS][i][padded[keys.ATTENTION_MASK][i]]
            assert row[-int(mask[i].sum()) :].tolist() == minibatch[keys.ACTION][i][mask[i]].tolist()
        assert to_packed(minibatch)[keys.SEQ_OFFSETS].shape == (7,)
    assert len(decode(minibatch, tokenizer, with_prompt=True)) == 6


def test_grpo_loss_runs_on_a_collected_batch_with_default_keys(make_collector, tokenizer, model):
    batch = next(iter(make_collector(batch_size=4)))
    mask = batch[keys.MASK]  # random advantages: an untrained model's rewards may all be equal
    batch.set(keys.ADVANTAGE, torch.where(mask, torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)), 0.0)[..., None])
    out = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)(to_padded(batch, pad_id=tokenizer.pad_token_id))
    assert torch.isfinite(out.loss_objective)
    out.loss_objective.backward()
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
    model.zero_grad()


def test_csv_logger_gets_every_batch_metrics(make_collector, tmp_path):
    logger = CSVLogger("run", log_dir=str(tmp_path))
    collector = make_collector(batch_size=4, total_frames=160, logger=logger)
    n = sum(1 for _ in collector)
    path = tmp_path / "run" / "scalars"
    expected = {"mean_reward", "reward_std", "zero_std_group_fraction", "mean_response_len", "max_response_len",
                "truncated_fraction", "tokens_per_s", "staleness_mean", "staleness_max", "policy_version"}  # fmt: skip
    logged = {p.stem for p in path.glob("*.csv")}
    assert expected <= logged
    with open(path / "tokens_per_s.csv") as f:
        rows = list(csv.reader(f))
    assert len(rows) == n > 0 and all(float(r[1]) > 0 for r in rows)


def test_torchrl_names_are_accepted(make_collector):
    collector = make_collector(batch_size=4, total_frames=64)  # TorchRL frames: env steps of one slot (4 slots)
    assert collector.batch_size == 4 and collector.total_steps == 16
    with pytest.raises(ValueError, match="frames_per_batch=4 counts TorchRL frames .* pass batch_size=N"):
        make_collector(frames_per_batch=4)  # a TRAJECTORIES batch counts trajectories
    assert collector.set_seed(3) == 3
    with collector:
        next(iter(collector))
    with pytest.raises(TypeError, match=r"unexpected arguments \['frames'\]"):
        make_collector(batch_size=4, frames=3)


def test_chat_template_kwargs_reach_the_template():
    from tokengym.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if greeting %}HI{% endif %}"
    messages = [[{"role": "user", "content": "1+1="}]]
    plain = PromptSource(messages, tok, epochs=1)
    kwargs = PromptSource(messages, tok, epochs=1, chat_template_kwargs={"greeting": True})
    assert next(iter(plain)).text == "1+1=" and next(iter(kwargs)).text == "1+1=HI"
