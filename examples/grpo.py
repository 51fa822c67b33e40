"""GRPO with TorchRL's ``GRPOLoss`` on the arithmetic task (run: python examples/grpo.py --iterations 20).

``torchrl.objectives.llm.GRPOLoss`` works on a padded sequence layout with TorchRL's LLM keys.
:func:`tokengym.transforms.to_padded` writes exactly those (``("tokens", "full")``,
``("log_probs", "full")``, ``"advantage"`` token-aligned) and :class:`~tokengym.collectors.PaddedSequenceActor`
is the actor it expects, so the loss runs on a collected batch with its default keys, no adapter.
The KL to the reference model is shaped into the reward by ``KLRewardTransform`` before the group
advantage, as in the demo. :func:`tokengym.training.train` runs the loop.

``--correction truncate`` (or ``mask``) adds rollout-trainer mismatch correction as AReaL / verl do it: at the start
of each training step ``MismatchCorrection`` scores the batch once with the trained model (the PPO ratio's old
log-probs) and writes truncated (TIS) or masked (MIS / IcePop) importance weights from the sampler's log-probs to
them; ``WeightedLoss`` puts the weights into ``GRPOLoss``'s per-token objective. Here the sampler is the trained
model itself, so the mismatch it prints is ~0; with a vLLM sampler or asynchronous collection it is not.
"""

from __future__ import annotations

import argparse
import copy

import torch
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import PaddedSequenceActor, SamplingConfig, TransformersPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs.tasks import arithmetic_prompts
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions, train
from tokengym.transforms import (
    AdaptiveKLController,
    GroupAdvantage,
    KLRewardTransform,
    MismatchCorrection,
    WeightedLoss,
    to_padded,
)


def digit_reward(responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """1 for the right answer, plus up to 0.5 for a digits-only response (a dense format signal)."""
    out = []
    for response, meta in zip(responses, metadata, strict=True):
        chars = response.replace(" ", "")
        exact = float(chars == str(meta["answer"]))
        out.append(exact + 0.5 * sum(c.isdigit() for c in chars) / max(len(chars), 1))
    return torch.tensor(out)


def main(iterations: int = 30, quick: bool = False, seed: int = 0, correction: str = "none") -> list[float]:
    """Train; returns the mean (KL-free) task reward of every iteration. ``correction``: ``"none"``, ``"truncate"``
    or ``"mask"`` (rollout-trainer mismatch correction, see the module docstring)."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=seed)
    ref = copy.deepcopy(model).eval()
    group_size, n_traj = 4, (16 if quick else 32)

    prompts = arithmetic_prompts(64, seed=seed, max_operand=4, ops="+")
    env = TokenEnv(prompts, tok, digit_reward, batch_size=n_traj, max_new_tokens=3, group_size=group_size,
                   max_length=64, model_config=model.config, shuffle=True, seed=seed)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=seed)
    kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=ref,
                           estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
    collector = TokenCollector(
        env, policy, mode="trajectories", batch_size=n_traj, total_steps=-1, postproc=kl
    )
    advantage = GroupAdvantage("grpo")  # (r - mean_group) / std_group, on every valid step of the trajectory
    actor = PaddedSequenceActor(model)  # scores with the batch's sampling settings (temperature, banned ids)
    if correction == "none":
        loss = GRPOLoss(actor, clip_epsilon=0.2, entropy_bonus=False)
        mismatch = None
    else:
        # the trainer's log-probs at the step's start are the ratio's old log-probs; TIS / MIS weights correct the rest
        mismatch = MismatchCorrection(correction, cap=2.0, low=0.5 if correction == "mask" else 0.0, trainer=actor.log_prob)
        loss = WeightedLoss(GRPOLoss(actor, clip_epsilon=0.2, entropy_bonus=False, aggregation="none"), is_decoupled=True)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)

    def prepare(batch):
        data = to_padded(advantage(batch), pad_id=tok.pad_token_id)
        return data if mismatch is None else mismatch(data)  # once per training step, before the first optimizer step

    def show(row: dict, data) -> None:
        extra = "" if mismatch is None else f"  mismatch k3 {mismatch.metrics()['mismatch_k3']:.2e}"
        print(f"iter {row['iter']:3d}  reward {row['reward']:.3f}  loss {row['loss']:+.4f}  "
              f"clip {row['clip_fraction']:.3f}  ESS {row['ESS']:.3f}{extra}")  # fmt: skip

    rows = train(collector, loss, optim, iterations=iterations, options=TrainOptions(epochs=2, max_grad_norm=1.0),
                 prepare=prepare, on_iteration=show)  # fmt: skip
    return [row["reward"] for row in rows]  # the collector's mean task reward (KL-free) of each batch


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smaller batches (tests)")
    parser.add_argument("--correction", choices=["none", "truncate", "mask"], default="none",
                        help="rollout-trainer mismatch correction (TIS / MIS)")  # fmt: skip
    args = parser.parse_args()
    main(iterations=args.iterations, quick=args.quick, correction=args.correction)
