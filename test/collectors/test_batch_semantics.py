"""Issue 20 (items 1, 2, 4): whole groups in TRAJECTORIES batches, TorchRL frame counts, replay buffers."""

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.policies import SequenceActor
from tokengym.collectors.sinks import extend_checked
from tokengym.errors import PromptError, TokenGymWarning
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.llm_envs.waves import WaveResult
from tokengym.transforms import GroupAdvantage

PROMPTS = [f"{a}+{b}=" for a in range(10) for b in range(10)]


class InstantPolicy:
    """Random tokens of random lengths, no model: one token per slot (steps) or whole waves."""

    def __init__(self, vocab: int, eos: int, *, p_eos: float = 0.15, seed: int = 0) -> None:
        self.vocab, self.eos, self.p_eos, self.version = vocab, eos, p_eos, 0
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, td):
        B = td.batch_size[0]
        action = torch.randint(self.eos + 1, self.vocab, (B,), generator=self.gen)
        action = torch.where(torch.rand(B, generator=self.gen) < self.p_eos, self.eos, action)
        td.set(keys.ACTION, action)
        td.set(keys.ACTION_LOG_PROB, torch.zeros(B))
        return td.set(keys.POLICY_VERSION, torch.full((B,), self.version))

    def generate(self, request):
        n, T = len(request), int(request.max_new_tokens.max())
        actions = torch.randint(self.eos + 1, self.vocab, (n, T), generator=self.gen)
        lengths = (torch.rand(n, generator=self.gen) * request.max_new_tokens).long().clamp(min=1) if n else torch.zeros(0, dtype=torch.long)
        return WaveResult(actions, lengths, torch.zeros(n, T), version=self.version)

    def update_weights(self, weights=None) -> int:
        self.version += 1
        return self.version

    def set_seed(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def collection_state(self) -> dict:
        return {"version": self.version, "rng": self.gen.get_state()}

    def load_collection_state(self, state) -> None:
        self.version = state["version"]
        self.gen.set_state(state["rng"])

    def close(self) -> None:
        pass


def make(tokenizer, *, source="step", batch_size=8, slots=16, group_size=4, prompts=PROMPTS, options=None, **kwargs):
    env = TokenEnv(PromptSource(prompts, tokenizer, group_size=group_size), tokenizer, batch_size=slots,
                   max_new_tokens=12, max_length=64)  # fmt: skip
    policy = InstantPolicy(len(tokenizer), tokenizer.eos_token_id)
    return TokenCollector(env, policy, mode="trajectories", batch_size=batch_size, source=source, options=options,
                          **kwargs)  # fmt: skip


def split_groups(batches, group_size: int) -> int:
    """Groups whose samples are not all in one batch (the issue's count)."""
    seen: dict[int, set[int]] = {}
    for i, batch in enumerate(batches):
        for g in batch[keys.GROUP_ID][:, 0].tolist():
            seen.setdefault(g, set()).add(i)
    counts: dict[int, int] = {}
    for batch in batches:
        for g in batch[keys.GROUP_ID][:, 0].tolist():
            counts[g] = counts.get(g, 0) + 1
    return sum(1 for g in seen if len(seen[g]) > 1 or counts[g] != group_size)


@pytest.mark.parametrize("source", ["step", "wave"])
def test_trajectory_batches_hold_whole_groups(tokenizer, source):
    collector = make(tokenizer, source=source)
    batches = [b for b, _ in zip(collector, range(10), strict=False)]
    lengths = torch.cat([b[keys.MASK].sum(1) for b in batches])
    assert len(batches) == 10 and len(set(lengths.tolist())) > 4  # variable lengths
    assert split_groups(batches, 4) == 0
    assert all(b.shape == (8, 12) for b in batches)  # fixed width (max_new_tokens) by default
    assert 0 < max(collector.metrics["waiting_trajectories"], 1) <= (16 + 1) * 3  # bounded wait
    for batch in batches:
        GroupAdvantage("grpo")(batch)  # raises on a fragment


def test_groups_split_without_the_option_and_batch_size_must_be_whole_groups(tokenizer):
    loose = make(tokenizer, batch_size=6, options=CollectorOptions(is_whole_groups=False))
    assert split_groups([b for b, _ in zip(loose, range(10), strict=False)], 4) > 0  # the check has teeth
    with pytest.raises(ValueError, match="batch_size=6 trajectories is not a multiple of the env's group_size=4"):
        make(tokenizer, batch_size=6)


def test_async_collection_keeps_whole_groups(tokenizer):
    inner = make(tokenizer, source="wave")
    got = []
    with AsyncCollector(inner, max_staleness=0) as collector, pytest.warns(TokenGymWarning, match="max_staleness=0"):
        for batch, _ in zip(collector, range(10), strict=False):
            got.append(batch)
            collector.update_policy_weights_({})  # stale trajectories are dropped with their groups
    assert collector.metrics["dropped_tokens"] > 0
    assert split_groups(got, 4) == 0


class FailingSample(PromptSource):
    """Sample 1 of group 1 fails to load (it is drawn, then raises): its group can never complete."""

    def next(self):
        prompt = super().next()
        if prompt is not None and (prompt.group_id, prompt.sample_id) == (1, 1):
            raise PromptError("sample 1 of group 1 cannot be loaded")
        return prompt


@pytest.mark.parametrize("source", ["step", "wave"])
def test_group_whose_prompt_failed_is_dropped_whole_and_counted(tokenizer, source):
    env = TokenEnv(FailingSample(PROMPTS[:8], tokenizer, group_size=4, epochs=1), tokenizer, batch_size=6,
                   max_new_tokens=6, max_length=32)  # fmt: skip
    collector = TokenCollector(env, InstantPolicy(len(tokenizer), tokenizer.eos_token_id), mode="trajectories",
                               batch_size=4, source=source)  # fmt: skip
    batches, errors = [], 0
    while True:
        try:
            batches += list(collector)
            break
        except PromptError:
            errors += 1
    groups = [g for b in batches for g in b[keys.GROUP_ID][:, 0].tolist()]
    assert errors == 1 and sorted(set(groups)) == [0, *range(2, 8)] and split_groups(batches, 4) == 0
    assert collector.metrics["dropped_groups"] == 1 and collector.metrics["dropped_trajectories"] == 3
    assert collector.metrics["waiting_trajectories"] == 0


# -- item 2: TorchRL frames --


def test_frames_are_torchrl_frames(tokenizer):
    env = TokenEnv(PROMPTS, tokenizer, batch_size=4, max_new_tokens=6, max_length=32)
    collector = TokenCollector(env, InstantPolicy(len(tokenizer), tokenizer.eos_token_id), mode="steps",
                               frames_per_batch=40, total_frames=80)  # fmt: skip
    assert [tuple(b.shape) for b in collector] == [(4, 10), (4, 10)]  # as TorchRL: 40 frames = 4 envs x 10 steps
    with pytest.raises(ValueError, match="frames_per_batch=42 is not a multiple of the env's 4 slots"):
        TokenCollector(env, collector.policy, mode="steps", frames_per_batch=42)
    with pytest.raises(ValueError, match=r"frames_per_batch=40 counts TorchRL frames .* pass batch_size=N"):
        TokenCollector(env, collector.policy, mode="trajectories", frames_per_batch=40)
    with pytest.raises(ValueError, match=r"batch_size=3 and frames_per_batch=40 \(4 slots x 10 steps\) disagree"):
        TokenCollector(env, collector.policy, mode="steps", batch_size=3, frames_per_batch=40)
    budget = TokenCollector(env, collector.policy, mode="trajectories", batch_size=2, total_frames=10)
    assert budget.total_steps == 3  # 10 frames of 4 slots: rounded up to whole env steps


# -- item 4: replay buffers --


def test_two_different_batches_through_lazy_tensor_storage_into_a_loss(tokenizer, model):
    collector = make(tokenizer, source="wave", batch_size=4, group_size=2)
    buffer = ReplayBuffer(storage=LazyTensorStorage(32), batch_size=6)
    first, second = [GroupAdvantage("grpo")(b) for b, _ in zip(collector, range(2), strict=False)]
    assert not torch.equal(first[keys.MASK].sum(1), second[keys.MASK].sum(1))  # different content and lengths
    buffer.extend(first)
    buffer.extend(second)
    assert len(buffer) == 8
    loss = ClipPPOLoss(SequenceActor(model, pad_token_id=tokenizer.pad_token_id), critic_network=None,
                       entropy_bonus=False, functional=False)  # fmt: skip
    out = loss(buffer.sample())
    assert torch.isfinite(out["loss_objective"])


def test_bad_extend_leaves_the_buffer_untouched(tokenizer):
    buffer = ReplayBuffer(storage=LazyTensorStorage(32))
    collector = make(tokenizer, source="wave", batch_size=4, group_size=2)
    extend_checked(buffer, next(iter(collector)))
    before = buffer.storage.get(torch.arange(4)).clone()
    narrow = make(tokenizer, source="wave", batch_size=4, group_size=2, options=CollectorOptions(is_fixed_width=False))
    batch = next(iter(narrow))
    assert batch.shape[1] < 12
    with pytest.raises(ValueError, match=r"does not fit the replay buffer's storage: .* \(nothing was written\)"):
        extend_checked(buffer, batch)
    sink = make(tokenizer, source="wave", batch_size=4, group_size=2, sink=buffer,
                options=CollectorOptions(is_fixed_width=False))  # fmt: skip
    with pytest.raises(ValueError, match="does not fit the replay buffer's storage"):
        next(iter(sink))
    assert len(buffer) == 4 and (buffer.storage.get(torch.arange(4)) == before).all()
