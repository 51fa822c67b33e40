"""Trajectories whose turns go on across waves are kept as chains of references to their wave rows: the batches
they give equal stepping's, a checkpoint taken while chains are open resumes exactly (twice in a row: the
restored prefix is itself a piece), and dynamic sampling scores a chain by its whole trajectory's reward."""

import sys
from pathlib import Path

import pytest
import torch

from tokengym.collectors import CollectorOptions, DynamicSampling, TokenCollector
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.llm_envs.turns import FeedbackTurns, Turn
from tokengym.llm_envs.waves import WaveResult

sys.path.insert(0, str(Path(__file__).parents[1] / "property"))
from test_step_wave_equality import PROMPTS, TOK, ScriptedPolicy, _token  # noqa: E402


class SampledPolicy(ScriptedPolicy):
    """The scripted tokens, also depending on the sample's index in its group (a group's samples differ)."""

    def _key(self, slot: int) -> int:
        return int(self.env.history(slot, 0, 4).sum()) + 131 * self.env.slot_prompt(slot).sample_id

    def __call__(self, td):
        seq = td.get(keys.SEQ_LEN)
        td.set(keys.ACTION, torch.tensor([_token(self._key(b), int(seq[b]), self.p_end) for b in range(len(seq))]))
        td.set(keys.ACTION_LOG_PROB, -torch.ones(len(seq)))
        return td.set(keys.POLICY_VERSION, torch.zeros(len(seq), dtype=torch.int64))

    def generate(self, request):
        T = max(int(request.max_new_tokens.max()), 1)
        rows = [[_token(self._key(int(b)), len(p) + t, self.p_end) for t in range(T)]
                for b, p in zip(request.slots, request.prompts, strict=True)]  # fmt: skip
        actions = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), T)
        return WaveResult(actions, request.max_new_tokens.clone(), -torch.ones(actions.shape, dtype=torch.float32))


def _feedback(responses, prompts, metadata, turns):
    """One or three turns (slots fall out of step); a continued turn's reward spreads, an episode's last is 1."""
    return [Turn(float(len(r) % 3), "again") if t < 2 and (t or len(r) % 2) else Turn(1.0)
            for r, t in zip(responses, turns, strict=True)]  # fmt: skip


def _collector(source: str, *, group_size: int = 1, batch_size: int = 2, options=None) -> TokenCollector:
    env = TokenEnv(PromptSource(PROMPTS, TOK, group_size=group_size), TOK, turns=FeedbackTurns(_feedback),
                   max_turns=3, batch_size=3, max_new_tokens=20, max_length=128)  # fmt: skip
    return TokenCollector(env, SampledPolicy(env, p_end=3), mode="trajectories", batch_size=batch_size,
                          source=source, options=options)  # fmt: skip


def _batches(collector: TokenCollector, n: int) -> list:
    it = iter(collector)
    return [next(it) for _ in range(n)]


def _assert_equal(expected, got) -> None:
    assert set(expected.keys(True, True)) == set(got.keys(True, True))
    for key in expected.keys(True, True):
        x, y = expected.get(key), got.get(key)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key


def _by_trajectory(batches) -> dict:
    """Each trajectory's real steps, by trajectory id (stepping and waves finish trajectories in other orders)."""
    out = {}
    for batch in batches:
        for i in range(batch.shape[0]):
            row = batch[i]
            out[int(row.get(keys.TRAJ_ID)[0])] = row[row.get(keys.MASK)]
    return out


def _assert_same_trajectories(step_batches, wave_batches) -> None:
    step, wave = _by_trajectory(step_batches), _by_trajectory(wave_batches)
    common = step.keys() & wave.keys()
    assert len(common) >= len(wave) // 2
    for traj in common:
        _assert_equal(step[traj], wave[traj])


def test_multi_turn_wave_batches_equal_stepped_batches():
    waves = _batches(_collector("wave"), 6)
    assert max(int(b[keys.TURN].max()) for b in waves) == 2  # trajectories of three turns, over three waves
    _assert_same_trajectories(_batches(_collector("step"), 6), waves)


def test_waves_come_as_their_real_steps_once_trajectories_go_on_across_them():
    """Multi-turn: the source switches to ``unroll_cells`` (a batch copies chained steps anyway); single-turn: waves
    stay padded (a batch that is one wave's rows is those tensors, not a copy)."""
    multi = _collector("wave")
    asked = _cells_asked(multi)
    _batches(multi, 2)
    assert not asked[0] and asked[-1]  # padded until a trajectory went on across a wave, real steps from then on
    assert asked == sorted(asked)  # the switch is for good
    env = TokenEnv(PromptSource(PROMPTS, TOK), TOK, lambda r, p, m: [0.0] * len(r), batch_size=3, max_new_tokens=20,
                   max_length=128)  # fmt: skip
    single = TokenCollector(env, SampledPolicy(env, p_end=3), mode="trajectories", batch_size=3, source="wave")
    asked = _cells_asked(single)
    _batches(single, 3)
    assert asked and not any(asked)


def _cells_asked(collector) -> list[bool]:
    """The ``cells`` argument of each of the collector's source advances, as they happen."""
    asked, advance = [], collector.source.advance

    def spy(**kwargs):
        asked.append(kwargs["cells"])
        return advance(**kwargs)

    collector.source.advance = spy
    return asked


def test_a_checkpoint_with_open_chains_resumes_exactly_twice():
    straight = _batches(_collector("wave", batch_size=1), 40)
    first = _collector("wave", batch_size=1)
    it, done = iter(first), 0
    while not first.recorder.open:  # a batch boundary where trajectories go on across waves
        next(it)
        done += 1
    second = _collector("wave", batch_size=1)
    second.load_state_dict(first.state_dict())
    got, it = [], iter(second)

    def is_restored_open() -> bool:  # a chain that began before the checkpoint, still going on
        restored = second.recorder.chains.live
        return any(pieces[0][0] is restored for pieces in (second.recorder.open or {}).values())

    while not (got and is_restored_open()):
        got.append(next(it))
        assert len(got) < 20
    third = _collector("wave", batch_size=1)
    third.load_state_dict(second.state_dict())  # the chain starting with the restored prefix is saved again
    got += _batches(third, 8)
    assert done + len(got) <= len(straight)
    for expected, batch in zip(straight[done : done + len(got)], got, strict=True):
        _assert_equal(expected, batch)


@pytest.mark.parametrize("source", ["step", "wave"])
def test_dynamic_sampling_scores_a_chain_by_its_whole_trajectory(source):
    """The batches are the groups of the stream without the option whose summed rewards spread (over all turns of
    a trajectory: its last turn's reward alone never spreads), in the same order."""
    stream = _batches(_collector(source, group_size=2, batch_size=2), 16)
    spread = [b for b in stream if float(_scores(b).max() - _scores(b).min()) > 0]
    assert 3 <= len(spread) < len(stream) and any(int(b[keys.TURN].max()) == 2 for b in spread)
    options = CollectorOptions(dynamic_sampling=DynamicSampling(max_num_gen_batches=20))
    collector = _collector(source, group_size=2, batch_size=2, options=options)
    for expected, got in zip(spread[:3], _batches(collector, 3), strict=True):
        _assert_equal(expected, got)
    assert collector.metrics["dropped_zero_spread_groups"] > 0


def _scores(batch) -> torch.Tensor:
    return (batch[keys.REWARD].squeeze(-1) * batch[keys.MASK]).sum(1)
