"""GRPO across ranks under torchrun: each rank collects its share of the prompts, the ranks train one model.

Run (2 processes on the CPU with gloo; on GPUs use nccl and one process per GPU):

    torchrun --nproc-per-node 2 examples/distributed_grpo.py --iterations 20
    torchrun --nproc-per-node 2 examples/distributed_grpo.py --iterations 20 --fsdp

Each rank builds the same env settings over :func:`tokengym.distributed.shard_prompts` (its prompts, so a group's
answers are all on one rank), its own policy and collector of :func:`tokengym.distributed.rank_batch_size` rows, and
calls :func:`tokengym.train` as one process would: the ranks' gradients are summed so that the step is the one-process
step on the union batch (2 x 16 rows here). Without ``--fsdp`` every rank holds the whole model and its policy
generates with it (data parallel); with ``--fsdp`` the trained model is sharded (:func:`~tokengym.distributed.shard_model`,
FSDP2) and each rank's policy generates with a whole copy that gets the full weights after every step
(:func:`~tokengym.distributed.full_state_dict`). The KL controller and the rows printed by rank 0 see every rank's
batch.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import PaddedSequenceActor, TransformersPolicy
from tokengym.distributed import full_state_dict, rank_batch_size, shard_model, shard_prompts
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs.tasks import arithmetic_prompts
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import train
from tokengym.transforms import AdaptiveKLController, GroupAdvantage, KLRewardTransform, to_padded


def digit_reward(responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """1 for the right answer, plus up to 0.5 for a digits-only response (a dense format signal)."""
    out = []
    for response, meta in zip(responses, metadata, strict=True):
        chars = response.replace(" ", "")
        out.append(float(chars == str(meta["answer"])) + 0.5 * sum(c.isdigit() for c in chars) / max(len(chars), 1))
    return torch.tensor(out)


def prepare(batch):
    return to_padded(GroupAdvantage("grpo")(batch))


def main(iterations: int = 20, fsdp: bool = False, quick: bool = False, seed: int = 0) -> list[dict]:
    """Train on this rank; returns the logged rows (the same, global, on every rank)."""
    torch.set_num_threads(1)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend)
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    try:
        tok = tiny_tokenizer()
        model = tiny_model(tok, seed=seed).to(device)  # the same initial weights on every rank
        ref = copy.deepcopy(model).eval()
        group_size = 4
        rows = rank_batch_size(16 if quick else 32, group_size=group_size)  # this rank's share of a step
        prompts = shard_prompts(arithmetic_prompts(64, seed=seed, max_operand=4, ops="+"))
        env = TokenEnv(prompts, tok, digit_reward, batch_size=rows, max_new_tokens=3, group_size=group_size,
                       max_length=64, model_config=model.config, shuffle=True, seed=seed + rank)  # fmt: skip
        sampler = model
        if fsdp:  # the policy generates with a whole copy; the trained model is sharded over the ranks
            sampler = copy.deepcopy(model)
            shard_model(model)
        policy = TransformersPolicy(sampler, env, seed=seed + rank)
        kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=ref,
                               estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
        collector = TokenCollector(env, policy, mode="trajectories", batch_size=rows, postproc=kl)
        loss = GRPOLoss(PaddedSequenceActor(model), clip_epsilon=0.2, entropy_bonus=False)
        optim = torch.optim.Adam(model.parameters(), lr=3e-3)  # built on the sharded parameters with --fsdp

        def log(row: dict, data) -> None:
            if rank == 0:
                print(f"iter {row['iter']:3d}  reward {row['reward']:.3f}  kl {row['kl']:.3f}  "
                      f"loss {row['loss']:+.4f}  tokens/s {row['tokens_per_s']:.0f}", flush=True)  # fmt: skip

        weights = (lambda: full_state_dict(model)) if fsdp else None
        return train(collector, loss, optim, iterations=iterations, prepare=prepare, on_iteration=log,
                     device=device if backend == "nccl" else None, weights=weights)  # fmt: skip
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--fsdp", action="store_true", help="shard the trained model with FSDP2")
    parser.add_argument("--quick", action="store_true", help="a smaller batch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.iterations, fsdp=args.fsdp, quick=args.quick, seed=args.seed)
