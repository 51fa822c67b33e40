"""Benchmarks of the transforms: KL shaping, advantage estimators, padded layout vs a per-sequence loop."""

import time

import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import KLRewardTransform, TurnDiscount, make_advantage, to_padded

torch.set_num_threads(1)


def _batch(n, steps, group_size=8):
    lengths = torch.randint(1, steps + 1, (n,), generator=torch.Generator().manual_seed(0))
    lengths[0] = steps
    return make_trajectory_batch(lengths.tolist(), group_size=group_size, steps=steps, prompt_len=16)


def test_kl_shaping_b32_t256(benchmark):
    batch = _batch(32, 256)
    transform = KLRewardTransform(beta=0.1, estimator="k3")
    benchmark.pedantic(lambda td: transform(td), setup=lambda: ((batch.clone(),), {}), rounds=30, warmup_rounds=2)
    benchmark.extra_info["tokens"] = int(batch[keys.MASK].sum())


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_advantage_4096_sequences(benchmark, estimator):
    batch = _batch(4096, 32)
    batch[keys.STATE_VALUE] = torch.rand(*batch.batch_size, 1)
    transform = make_advantage(estimator)
    benchmark.pedantic(lambda td: transform(td), setup=lambda: ((batch.clone(),), {}), rounds=5, warmup_rounds=1)


def _interleaved_median(fns, rounds):
    """Median seconds of each callable, timed in interleaved rounds (one call of each per round)."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [sorted(t)[len(t) // 2] for t in times]


@pytest.mark.parametrize("masked_steps", ["skip", "zero"])
def test_gae_mask_holes_vs_no_holes_4096(benchmark, masked_steps):
    """GAE on a batch with 10% of its steps masked (holes: the rows are compacted) vs the same batch without."""
    batch = _batch(4096, 32)
    batch[keys.STATE_VALUE] = torch.rand(*batch.batch_size, 1)
    holed = batch.clone()
    holes = torch.rand(batch.batch_size, generator=torch.Generator().manual_seed(1)) < 0.1
    holed[keys.MASK] = holed[keys.MASK] & ~holes
    transform = make_advantage("gae", masked_steps=masked_steps)
    plain_s, holed_s = _interleaved_median([lambda: transform(batch.clone()), lambda: transform(holed.clone())], 5)
    benchmark.pedantic(lambda td: transform(td), setup=lambda: ((holed.clone(),), {}), rounds=5, warmup_rounds=1)
    benchmark.extra_info.update(tokens=int(holed[keys.MASK].sum()), no_holes_s=plain_s, holes_s=holed_s,
                                holes_over_no_holes=holed_s / plain_s)  # fmt: skip
    print(f"\nGAE 4096x32 ({masked_steps}): no holes {plain_s * 1e3:.1f} ms, 10% holes {holed_s * 1e3:.1f} ms, "
          f"{holed_s / plain_s:.2f}x")


def test_turn_discount_4096_four_turns(benchmark):
    batch = _batch(4096, 32)
    batch[keys.TURN] = (torch.arange(32) // 8).expand(4096, 32).clone()  # turns of 8 tokens
    transform = TurnDiscount(0.9)
    benchmark.pedantic(lambda td: transform(td), setup=lambda: ((batch.clone(),), {}), rounds=5, warmup_rounds=1)
    benchmark.extra_info["tokens"] = int(batch[keys.MASK].sum())


def _loop_padded(batch, table, pad_id=0):
    """The straightforward per-sequence layout (TorchRL / Trinity seeds): cat per sequence, pad, stack."""
    mask = batch[keys.MASK]
    action, logp, group = batch[keys.ACTION], batch[keys.ACTION_LOG_PROB], batch[keys.GROUP_ID]
    seqs, logps, amasks = [], [], []
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        prompt = table.ids(int(group[i, 0]))
        seqs.append(torch.cat([prompt, action[i, :n]]))
        logps.append(torch.cat([torch.zeros(len(prompt)), logp[i, :n]]))
        amasks.append(torch.cat([torch.zeros(len(prompt), dtype=torch.bool), torch.ones(n, dtype=torch.bool)]))
    width = max(len(s) for s in seqs)
    pad = [width - len(s) for s in seqs]
    tokens = torch.stack([torch.cat([torch.full((p,), pad_id), s]) for p, s in zip(pad, seqs, strict=True)])
    logp = torch.stack([torch.cat([torch.zeros(p), s]) for p, s in zip(pad, logps, strict=True)])
    amask = torch.stack([torch.cat([torch.zeros(p, dtype=torch.bool), s]) for p, s in zip(pad, amasks, strict=True)])
    return tokens, logp, amask


def test_padded_layout_4096_vs_loop(benchmark):
    batch = _batch(4096, 64)
    table = batch.get_non_tensor(keys.PROMPTS)
    start = time.perf_counter()
    for _ in range(3):
        _loop_padded(batch, table)
    loop_s = (time.perf_counter() - start) / 3
    result = benchmark.pedantic(lambda: to_padded(batch), rounds=20, warmup_rounds=2)
    assert result.shape[0] == 4096
    ratio = loop_s / benchmark.stats.stats.median  # median: robust to a noisy shared machine
    benchmark.extra_info["loop_s"] = loop_s
    benchmark.extra_info["speedup_vs_loop"] = ratio
    print(f"\npadded layout: loop {loop_s * 1e3:.1f} ms, vectorized {benchmark.stats.stats.median * 1e3:.2f} ms, {ratio:.1f}x")
