"""Trees against independent chains at an equal budget of generated tokens: held-out pass@k over seeds, with a
random-reward control (run: python benchmarks/tree_learning.py --seeds 5; prints a markdown report).

The task is the reasoning-gym recipe's (``examples/reasoning_gym_heldout.py``): chain_sum with two one-digit terms, a
training split and a held-out split of the same problems, a supervised warm start (a random tiny model never writes
``<answer>...</answer>``), then GRPO-style training (ClipPPOLoss through ``WeightedLoss``, one optimizer step per
batch) until the arm has generated ``--token-budget`` tokens. A tree's shared tokens count once (they are sampled
once): a tree arm trains on more leaves for the same budget. Arms, each from the same warm-started model per seed:

- ``chains``: 8 independent samples per problem, ``GroupAdvantage("grpo")``;
- ``tree``: 8-leaf trees, ``SegmentRule(L, W)`` (``--tree L,W``, default 3,2: forks at tokens 3, 6 and 9),
  ``TreeAdvantage("treerl")``;
- the same two with the reward replaced by a coin flip (the control: what training on noise gives).

Held-out pass@1 / pass@8 (8 samples per held-out problem, ``evaluate``) after the warm start and after training. The
tiny models' gains are small and noisy; the report claims only what the seeds show (mean and spread of the change).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time

import torch
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import CollectorOptions, SegmentRule, TokenCollector
from tokengym.collectors.policies import SamplingConfig, SharedPrefixActor, TransformersPolicy
from tokengym.evaluation import evaluate
from tokengym.llm_envs import keys
from tokengym.llm_envs.adapters import make_reasoning_gym_env
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import train
from tokengym.transforms import GroupAdvantage, TreeAdvantage, WeightedLoss, to_padded
from tokengym.warm_start import supervised_warm_start

ARMS = ("chains", "tree", "chains, random reward", "tree, random reward")


def problems(tok, model) -> dict:
    return dict(tokenizer=tok, config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, size=2000,
                seed=0, system_prompt=None, held_out=0.2, split_seed=0, max_new_tokens=12, max_length=96,
                model_config=model.config, group_size=8)  # fmt: skip


def held_out(model, tok, seed: int) -> dict:
    env = make_reasoning_gym_env("chain_sum", split="held_out", epochs=1, batch_size=64, **problems(tok, model))
    m = evaluate(env, TransformersPolicy(model, env, sampling=SamplingConfig(), seed=seed), ks=(1, 8)).metrics
    return {"pass@1": m["pass@1"], "pass@8": m["pass@8"]}


def run_arm(arm: str, model, tok, seed: int, budget: int, tree: tuple[int, int]) -> dict:
    env = make_reasoning_gym_env("chain_sum", split="train", batch_size=64, shuffle=True, **problems(tok, model))
    if "random" in arm:
        coin = random.Random(seed)
        env.reward_fn = lambda responses, prompts, metadata: [float(coin.random() < 0.5) for _ in responses]
    is_tree = arm.startswith("tree")
    options = CollectorOptions(tree=SegmentRule(*tree) if is_tree else None)
    collector = TokenCollector(env, TransformersPolicy(model, env, seed=seed), mode="trajectories", batch_size=64,
                               options=options)  # fmt: skip
    advantage = TreeAdvantage("treerl") if is_tree else GroupAdvantage("grpo")
    loss = WeightedLoss(ClipPPOLoss(SharedPrefixActor(model, temperature=1.0), critic_network=None,
                                    entropy_bonus=False, functional=False, reduction="none"))  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    spent = {"tokens": 0, "leaves": 0, "batches": 0}

    def prepare(batch):
        mask = batch.get(keys.MASK)
        own = mask & (batch.get(keys.BRANCH_ID) == batch.get(keys.TRAJ_ID)) if is_tree else mask
        spent["tokens"] += int(own.sum())
        spent["leaves"] += mask.shape[0]
        spent["batches"] += 1
        return to_padded(advantage(batch))

    start = time.perf_counter()
    while spent["tokens"] < budget:
        train(collector, loss, optimizer, iterations=1, prepare=prepare)
    collector.shutdown()
    return {**spent, "seconds": time.perf_counter() - start, **held_out(model, tok, seed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--token-budget", type=int, default=16_000, help="generated tokens per arm and seed")
    parser.add_argument("--warm-start-steps", type=int, default=300)
    parser.add_argument("--tree", default="3,2", metavar="L,W", help="the tree arms' SegmentRule(L, W)")
    args = parser.parse_args()
    tree = tuple(int(x) for x in args.tree.split(","))
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    start = time.perf_counter()
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        model = tiny_model(tok, seed=seed)
        env = make_reasoning_gym_env("chain_sum", split="train", batch_size=64, **problems(tok, model))
        targets = [{"prompt": p["prompt"], "answer": f"<answer>{p['answer']}</answer>"} for p in env.source.prompts]
        supervised_warm_start(model, tok, targets, steps=args.warm_start_steps)
        before = held_out(model, tok, seed)
        for arm in ARMS:
            torch.manual_seed(seed)
            out = run_arm(arm, copy.deepcopy(model), tok, seed, args.token_budget, tree)
            out.update({f"before {k}": v for k, v in before.items()})
            results[arm].append(out)
            print(f"seed {seed} {arm:<22} pass@1 {before['pass@1']:.3f} -> {out['pass@1']:.3f}, pass@8 "
                  f"{before['pass@8']:.3f} -> {out['pass@8']:.3f}, {out['leaves']} leaves in {out['batches']} "
                  f"batches, {out['tokens']} tokens, {out['seconds']:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    print(f"\nTrees (SegmentRule{tree}) vs chains at {args.token_budget:,} generated tokens per arm, {args.seeds} seeds "
          f"(chain_sum, tiny Qwen2, warm start {args.warm_start_steps} steps; {time.perf_counter() - start:.0f} s)\n")
    print("| arm | leaves trained on | tokens / leaf | held-out pass@1: before -> after (change, mean ± sd) | "
          "pass@8: before -> after (change, mean ± sd) | seeds where pass@1 rose |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        rows = results[arm]
        line = [arm, f"{statistics.mean(r['leaves'] for r in rows):.0f}",
                f"{statistics.mean(r['tokens'] / r['leaves'] for r in rows):.2f}"]  # fmt: skip
        for k in ("pass@1", "pass@8"):
            delta = [r[k] - r[f"before {k}"] for r in rows]
            sd = statistics.stdev(delta) if len(delta) > 1 else 0.0
            line.append(f"{statistics.mean(r[f'before {k}'] for r in rows):.3f} -> "
                        f"{statistics.mean(r[k] for r in rows):.3f} ({statistics.mean(delta):+.3f} ± {sd:.3f})")  # fmt: skip
        line.append(f"{sum(r['pass@1'] > r['before pass@1'] for r in rows)} / {len(rows)}")
        print("| " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
