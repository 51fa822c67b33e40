"""Steps kept by reference and written in chunks give the same batches as steps written one by one."""

from __future__ import annotations

import pytest
import torch

from tokengym.collectors.recorders import StepRecorder, TrajectoryRecorder
from tokengym.collectors.sources import StepSource
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer


class _RandomTokens:
    """A step policy without a model: random tokens, EOS with probability ``p_end`` (short trajectories)."""

    version = 0

    def __init__(self, vocab: int, eos: int, p_end: float) -> None:
        self.vocab, self.eos, self.p_end = vocab, eos, p_end
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, td):
        B = td.batch_size[0]
        action = torch.randint(16, self.vocab, (B,), generator=self.gen)
        action = torch.where(torch.rand(B, generator=self.gen) < self.p_end, self.eos, action)
        td.set(keys.ACTION, action)
        td.set(keys.ACTION_LOG_PROB, -torch.rand(B, generator=self.gen))
        return td.set(keys.POLICY_VERSION, torch.zeros(B, dtype=torch.int64))


def _steps(n: int, *, group_size: int, p_end: float, max_new_tokens: int = 6):
    tok = tiny_tokenizer()
    prompts = [f"{a}+{a}=" for a in range(40)]
    env = TokenEnv(prompts, tok, lambda r, p, m: [float(len(x)) for x in r], batch_size=4, group_size=group_size,
                   max_new_tokens=max_new_tokens, max_length=32)  # fmt: skip
    source = StepSource(env, _RandomTokens(len(tok), tok.eos_token_id, p_end))
    source.start()
    return [source.advance().chunk for _ in range(n)]


def _batches(recorder, steps, *, flush_each: bool) -> list:
    out = []
    for step in steps:
        recorder.write(step)
        if flush_each:
            recorder.flush()
        while recorder.is_full:
            out.append(recorder.peek())
            recorder.commit()
    return out


@pytest.mark.parametrize("group_size,p_end", [(1, 0.4), (2, 0.3), (4, 0.1)])
def test_kept_steps_give_the_batches_of_steps_written_one_by_one(group_size, p_end):
    steps = _steps(150, group_size=group_size, p_end=p_end)
    ended = sum(len(s.ended) for s in steps)
    assert ended > 40  # slots end and start several trajectories within one chunk of kept steps
    make = lambda: TrajectoryRecorder(4 * group_size, 6, group_size=group_size)  # noqa: E731
    kept, one_by_one = make(), make()
    got, expected = _batches(kept, steps, flush_each=False), _batches(one_by_one, steps, flush_each=True)
    assert len(got) == len(expected) >= 3
    for a, b in zip(got, expected, strict=True):
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert torch.equal(a.get(key), b.get(key)), key
    # trajectories finished but not yet in a batch are the same too, and a checkpoint holds them
    assert kept.queued_trajectories() == one_by_one.queued_trajectories()
    assert kept.state_dict()["entries"] == one_by_one.state_dict()["entries"]


def test_a_batch_holds_each_trajectory_whole_and_in_order():
    steps = _steps(120, group_size=1, p_end=0.4)
    recorder = TrajectoryRecorder(4, 6, group_size=1)
    batches = _batches(recorder, steps, flush_each=False)
    finished = [(i, b) for i, s in enumerate(steps) for b in s.ended]  # (step, slot) in the order stepping ends them
    trajs = [int(steps[i][keys.TRAJ_ID][b]) for i, b in finished]
    got = [int(t) for batch in batches for t in batch.get(keys.TRAJ_ID)[:, 0]]
    assert got == trajs[: len(got)]
    for batch in batches:
        mask, traj = batch.get(keys.MASK), batch.get(keys.TRAJ_ID)
        assert bool((traj[mask] == traj[:, :1].expand_as(traj)[mask]).all())  # one trajectory per row
        assert bool((batch.get(keys.RESPONSE_LEN)[mask] == torch.arange(6).expand_as(mask)[mask]).all())


def test_step_recorder_stacks_kept_steps():
    steps = _steps(12, group_size=1, p_end=0.3)
    recorder = StepRecorder(6)
    for step in steps[:6]:
        recorder.write(step)
    batch = recorder.peek()
    assert batch.shape == (4, 6)
    for t, step in enumerate(steps[:6]):
        assert torch.equal(batch.get(keys.ACTION)[:, t], step[keys.ACTION])
        assert torch.equal(batch.get(("next", "done"))[:, t], step["next.done"])
