"""Held-out pass@k on reasoning-gym before and after a few GRPO iterations
(run: python examples/reasoning_gym_heldout.py; needs pip install 'tokengym[reasoning-gym]').

Two envs over the same problems (chain_sum, two one-digit terms) and the same split seed: the training split, and
the held-out split served once (``epochs=1``) for ``evaluate``; no problem is in both. A supervised warm start on the
training answers comes first: a random tiny model never writes ``<answer>...</answer>``, so RL alone gets no reward.
``--tree L,W`` samples each group of 8 as a tree instead (``SegmentRule(L, W)``: every L tokens each branch forks
into W) and trains with ``TreeAdvantage("treerl")``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import CollectorOptions, SegmentRule, TokenCollector
from tokengym.collectors.policies import SamplingConfig, SharedPrefixActor, TransformersPolicy
from tokengym.evaluation import evaluate
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import make_reasoning_gym_env
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions, train
from tokengym.transforms import (
    AdaptiveKLController,
    GroupAdvantage,
    KLRewardTransform,
    TreeAdvantage,
    WeightedLoss,
    to_padded,
)
from tokengym.warm_start import supervised_warm_start

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--iterations", type=int, default=30, help="GRPO iterations")
parser.add_argument("--warm-start-steps", type=int, default=300)
parser.add_argument("--tree", default=None, metavar="L,W", help="sample trees: fork every L tokens into W branches")
args = parser.parse_args()
tree = None if args.tree is None else SegmentRule(*(int(x) for x in args.tree.split(",")))

torch.set_num_threads(1)  # a tiny model runs fastest on one thread
start = time.perf_counter()
tok = tiny_tokenizer()
model = tiny_model(tok, seed=0)
problems = dict(tokenizer=tok, config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, size=2000,
                seed=0, system_prompt=None, held_out=0.2, split_seed=0, max_new_tokens=12, max_length=96,
                model_config=model.config, group_size=8)  # fmt: skip
train_env = make_reasoning_gym_env("chain_sum", split="train", batch_size=64, shuffle=True, **problems)
sampling = SamplingConfig(temperature=1.0)


def held_out_pass_at_k():
    """pass@k of 8 sampled answers per held-out problem: one call on an env that serves each problem once."""
    env = make_reasoning_gym_env("chain_sum", split="held_out", epochs=1, batch_size=64, **problems)
    return evaluate(env, TransformersPolicy(model, env, sampling=sampling, seed=0), ks=(1, 8))


def show(when: str, result) -> None:
    m = result.metrics
    print(f"held-out ({m['prompts']} problems) {when:<26} pass@1 {m['pass@1']:.3f}, pass@8 {m['pass@8']:.3f}, "
          f"maj@8 {m['maj@8']:.3f}")  # fmt: skip


train_problems = train_env.source.prompts
show("at random init:", held_out_pass_at_k())
targets = [{"prompt": p["prompt"], "answer": f"<answer>{p['answer']}</answer>"} for p in train_problems]
supervised_warm_start(model, tok, targets, steps=args.warm_start_steps)
before = held_out_pass_at_k()
show("after the warm start:", before)

policy = TransformersPolicy(model, train_env, sampling=sampling, seed=0)
kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=copy.deepcopy(model),
                       estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
collector = TokenCollector(train_env, policy, mode="trajectories", batch_size=64, postproc=kl,
                           options=CollectorOptions(tree=tree))  # fmt: skip
advantage = GroupAdvantage("grpo") if tree is None else TreeAdvantage("treerl")
loss = WeightedLoss(ClipPPOLoss(SharedPrefixActor(model, temperature=1.0), critic_network=None, entropy_bonus=False,
                                functional=False, reduction="none"))  # fmt: skip
trained_on: set[str] = set()  # the prompt of every group collected for training


def record(row: dict, batch) -> None:
    table = batch.get_non_tensor(keys.PROMPTS)  # the batch's prompts, by group
    trained_on.update(table.text(g) for g in table.group_ids())


rows = train(collector, loss, torch.optim.Adam(model.parameters(), lr=1e-4), iterations=args.iterations,
             options=TrainOptions(epochs=2), prepare=lambda b: to_padded(advantage(b)), on_iteration=record)  # fmt: skip
collector.shutdown()
after = held_out_pass_at_k()
show(f"after {args.iterations} GRPO iterations:", after)
first, last = (sum(r["reward"] for r in part) / len(part) for part in (rows[:5], rows[-5:]))
print(f"{len(train_problems)} training problems, mean reward {first:.3f} (first 5 iterations) -> {last:.3f} (last 5); "
      f"held-out problems trained on: {len({p['text'] for p in after.per_prompt} & trained_on)}")
print(f"({time.perf_counter() - start:.0f} s)")
