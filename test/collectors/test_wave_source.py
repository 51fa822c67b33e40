import functools

import pytest
import torch

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig
from tokengym.llm_envs import keys

EOS_IDS = list(range(1, 512, 7))  # many end ids, so trajectories stop at different steps


def _first_wave(collector_cls, make_env, make_policy, sampling, **env_kwargs):
    env = make_env(batch_size=4, max_new_tokens=10, eos_token_ids=EOS_IDS, **env_kwargs)
    policy = make_policy(env, sampling=sampling, seed=7)
    rows = []
    for batch in collector_cls(env, policy, mode="trajectories", batch_size=4):
        # stepping refills slots as they finish, so trajectory 4 may end before trajectory 1
        rows += [batch[i] for i in range(batch.shape[0]) if int(batch["traj_id"][i, 0]) < 4]
        if len(rows) == 4:
            break
    width = max(r.shape[0] for r in rows)
    rows = [torch.cat([r, r[-1:].expand(width - r.shape[0]).clone().zero_()]) if r.shape[0] < width else r
            for r in sorted(rows, key=lambda r: int(r["traj_id"][0]))]  # fmt: skip
    out = torch.stack(rows)
    return out[:, : int(out[keys.MASK].sum(1).max())]  # drop padding columns from other trajectories


@pytest.mark.parametrize("sampling", [SamplingConfig(greedy=True), SamplingConfig(temperature=1.3, top_k=40, top_p=0.95)],
                         ids=["greedy", "sampled"])  # fmt: skip
@pytest.mark.parametrize("stop_strings, turn_limit", [((), None), (("a",), None), ((), 6)],
                         ids=["eos", "stop-string", "turn-limit"])  # fmt: skip
def test_unroll_equals_stepping(make_env, make_policy, sampling, stop_strings, turn_limit):
    kw = dict(stop_strings=stop_strings, max_turn_tokens=turn_limit)
    step = _first_wave(TokenCollector, make_env, make_policy, sampling, **kw)
    unroll = _first_wave(functools.partial(TokenCollector, source="wave"), make_env, make_policy, sampling, **kw)
    assert step["traj_id"][:, 0].tolist() == unroll["traj_id"][:, 0].tolist() == [0, 1, 2, 3]
    mask = step[keys.MASK]
    assert torch.equal(mask, unroll[keys.MASK])
    if not sampling.greedy:
        assert len(set(mask.sum(1).tolist())) > 1  # trajectories really ended at different steps
    for key in step.keys(True, True):
        a, b = step.get(key), unroll.get(key)
        if not isinstance(a, torch.Tensor):
            continue
        a, b = a[mask], b[mask]
        if a.is_floating_point():
            assert torch.allclose(a, b, atol=1e-5), key
        else:
            assert torch.equal(a, b), key


def test_unroll_steps_mode_is_a_wave_scheme(make_env, make_policy):
    env = make_env(batch_size=3, max_new_tokens=6, eos_token_ids=EOS_IDS)
    padded = next(iter(TokenCollector(env, make_policy(env), mode="trajectories", batch_size=5,
                                      total_steps=30, source="wave")))  # fmt: skip
    assert bool((~padded[keys.MASK]).any())
    assert not bool(padded["action"][~padded[keys.MASK]].any())  # padding is zeros, not generate's pads
    env = make_env(batch_size=3, max_new_tokens=6)
    batches = list(TokenCollector(env, make_policy(env), mode="steps", batch_size=4, total_steps=12, source="wave"))
    assert [tuple(b.shape) for b in batches] == [(3, 4)] * 3
    resp = torch.cat(batches, 1)["response_len"]
    assert resp[0].tolist() == [0, 1, 2, 3, 4, 5] * 2  # every slot restarts when the wave ends


def test_unroll_needs_a_bare_env_and_a_generating_policy(make_env, make_policy, random_policy):
    from torchrl.envs import TransformedEnv

    env = make_env()
    with pytest.raises(TypeError, match=r"source='wave' needs a policy with generate\(WaveRequest\) -> WaveResult, got FunctionPolicy"):
        TokenCollector(env, random_policy(512), mode="steps", batch_size=2, source="wave")
    with pytest.raises(TypeError, match=r"source='wave' needs a bare TokenEnv"):
        TokenCollector(TransformedEnv(env), make_policy(env), mode="steps", batch_size=2, source="wave")
