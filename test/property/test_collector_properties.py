"""Properties of collected batches, with a cheap random policy (no model)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokengym.collectors import TokenCollector
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer

TOK = tiny_tokenizer()


def _policy(seed):
    gen = torch.Generator().manual_seed(seed)

    def policy(td):
        B = td.batch_size[0]
        td.set(keys.ACTION, torch.randint(0, 40, (B,), generator=gen))  # ids < 40 include eos (1)
        td.set(keys.ACTION_LOG_PROB, torch.zeros(B))
        td.set(keys.POLICY_VERSION, torch.zeros(B, dtype=torch.int64))
        return td

    return policy


def _env(B, max_new):
    return TokenEnv(["1+1=", "hello", "abc", "x"], TOK, batch_size=B, max_new_tokens=max_new, max_length=32)


@settings(deadline=None, max_examples=15)
@given(B=st.integers(1, 4), T=st.integers(1, 7), n=st.integers(1, 4), max_new=st.integers(1, 6), seed=st.integers(0, 99))
def test_steps_batches_are_exact_and_partition_trajectories(B, T, n, max_new, seed):
    batches = list(TokenCollector(_env(B, max_new), _policy(seed), mode="steps", batch_size=T, total_steps=T * n))
    assert [tuple(b.shape) for b in batches] == [(B, T)] * n
    seen: dict[int, list[tuple[int, bool]]] = {}
    for b in batches:
        flat = zip(b["traj_id"].reshape(-1).tolist(), b["response_len"].reshape(-1).tolist(),
                   b["next", "done"].reshape(-1).tolist(), strict=True)  # fmt: skip
        for traj, resp, done in flat:
            seen.setdefault(traj, []).append((resp, done))
    for steps in seen.values():
        # each trajectory's steps appear once each, from 0, with no gap, across batch boundaries
        assert sorted(r for r, _ in steps) == list(range(len(steps)))
        # at most one done, and only at its last step
        dones = [r for r, d in steps if d]
        assert len(dones) <= 1 and (not dones or dones[0] == len(steps) - 1)


@settings(deadline=None, max_examples=15)
@given(B=st.integers(1, 4), N=st.integers(1, 5), max_new=st.integers(1, 6), seed=st.integers(0, 99))
def test_trajectory_batches_have_no_gap_or_overlap(B, N, max_new, seed):
    collector = TokenCollector(_env(B, max_new), _policy(seed), mode="trajectories", batch_size=N)
    ids = []
    for i, batch in enumerate(collector):
        mask = batch[keys.MASK]
        ids += batch["traj_id"][:, 0].tolist()
        assert bool((batch["group_id"] == batch["group_id"][:, :1])[mask].all())
        assert bool((batch[keys.VERSION_START] == 0).all())
        if i == 3:
            break
    assert len(ids) == len(set(ids)) == 4 * N
