"""GRPO with TorchRL's ``GRPOLoss`` on the arithmetic task (run: python examples/grpo.py --iterations 20).

``torchrl.objectives.llm.GRPOLoss`` works on a padded sequence layout, not on per-token steps. It needs:

* the tokens under ``("tokens", "full")`` (N, L) (a sub-TensorDict: our ``keys.TOKENS`` is "tokens" itself,
  so the adapter builds a fresh TensorDict) and the sampling log-probs, token-aligned, under
  ``("log_probs", "full")`` (N, L);
* ``"advantage"`` (N, L, 1) (same ndim as its log-weight);
* an actor with ``get_dist(td, logits_key=...)`` returning a distribution over the whole sequence whose
  ``log_prob(tokens)`` is (N, L) and which carries a boolean ``.mask`` (N, L): the tokens that enter
  the loss (here: the generated ones). The loss averages over ``mask`` (token_mean).

:func:`tokengym.transforms.to_padded` gives exactly that layout (left-padded prompt + right-padded
response, every step key copied token-aligned), so the adapter below is a few lines: alias the keys and
wrap the model so that column ``j`` of the distribution scores token ``j`` (the logits of column ``j-1``).
The KL to the reference model is shaped into the reward by ``KLRewardTransform`` before the group
advantage, as in the demo.
"""

from __future__ import annotations

import argparse
import copy

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives.llm import GRPOLoss

from tokengym.collectors import SamplingConfig, TokenCollector, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.transforms import AdaptiveKLController, GroupAdvantage, KLRewardTransform, to_padded


class MaskedCategorical(torch.distributions.Categorical):
    """A categorical over every column of the padded layout, with the loss mask GRPOLoss reads."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__(logits=logits, validate_args=False)
        self.mask = mask


class PaddedActor(TensorDictModuleBase):
    """GRPOLoss adapter: teacher-forced distribution over the padded layout of :func:`to_padded`."""

    in_keys = [("tokens", "full"), keys.ATTENTION_MASK, keys.ACTION_MASK, keys.POSITION_IDS]
    out_keys = ["logits"]

    def __init__(self, model, temperature: float = 1.0) -> None:
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        out = self.model(input_ids=td.get(("tokens", "full")), attention_mask=td.get(keys.ATTENTION_MASK).long(),
                         position_ids=td.get(keys.POSITION_IDS), use_cache=False)  # fmt: skip
        logits = out.logits.float() / self.temperature
        # the logits at column j-1 predict token j: shift right so column j scores token j
        td.set("logits", torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1))
        return td

    def get_dist(self, td: TensorDictBase, logits_key: str = "logits") -> MaskedCategorical:
        td = self(td.copy())
        return MaskedCategorical(td.get(logits_key), td.get(keys.ACTION_MASK))


def grpo_input(batch: TensorDictBase, pad_id: int) -> TensorDictBase:
    """Trajectory batch [N, T] (with advantages) -> the padded layout [N, P+T] under GRPOLoss's keys."""
    padded = to_padded(batch, pad_id=pad_id)
    # keys.TOKENS is "tokens", a tensor, while GRPOLoss wants a sub-TensorDict there: build a fresh one
    return TensorDict({
        "tokens": {"full": padded.get(keys.TOKENS)},
        "log_probs": {"full": padded.get(keys.ACTION_LOG_PROB)},  # 0 on the prompt, masked out anyway
        keys.ADVANTAGE: padded.get(keys.ADVANTAGE),  # (N, L, 1), 0 on the prompt
        keys.ATTENTION_MASK: padded.get(keys.ATTENTION_MASK),
        keys.ACTION_MASK: padded.get(keys.ACTION_MASK),
        keys.POSITION_IDS: padded.get(keys.POSITION_IDS),
    }, batch_size=padded.batch_size)  # fmt: skip


def digit_reward(responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """1 for the right answer, plus up to 0.5 for a digits-only response (a dense format signal)."""
    out = []
    for response, meta in zip(responses, metadata, strict=True):
        chars = response.replace(" ", "")
        exact = float(chars == str(meta["answer"]))
        out.append(exact + 0.5 * sum(c.isdigit() for c in chars) / max(len(chars), 1))
    return torch.tensor(out)


def main(iterations: int = 30, quick: bool = False, seed: int = 0) -> list[float]:
    """Train; returns the mean (KL-free) task reward of every iteration."""
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
    loss = GRPOLoss(PaddedActor(model), clip_epsilon=0.2, entropy_bonus=False)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)

    rewards: list[float] = []
    for i, batch in enumerate(collector):
        data = grpo_input(advantage(batch), tok.pad_token_id)
        model.train()
        for _ in range(2):
            out = loss(data)
            optim.zero_grad()
            out.loss_objective.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
        model.eval()
        collector.update_policy_weights_()
        rewards.append(float(batch.get(keys.REWARD_RAW).squeeze(-1).sum(-1).mean()))
        print(f"iter {i:3d}  reward {rewards[-1]:.3f}  loss {float(out.loss_objective.detach()):+.4f}  "
              f"clip {float(out.clip_fraction):.3f}  ESS {float(out.ESS):.3f}")  # fmt: skip
        if i + 1 >= iterations:
            break
    return rewards


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smaller batches (tests)")
    args = parser.parse_args()
    main(iterations=args.iterations, quick=args.quick)
