"""PPO on the arithmetic task with TorchRL's ClipPPOLoss + GAE (run: python examples/ppo.py --iterations 20).

Pieces: TokenEnv (one step = one token) -> TokenCollector(mode="trajectories") gives [N, T] batches,
right-padded (``keys.MASK`` False on padding) -> KLRewardTransform shapes the reward with a KL penalty
to a frozen reference model -> a small critic (a linear value head on the LM's last hidden states)
writes ``state_value`` / ``("next", "state_value")`` -> torchrl ``GAE`` computes advantage and
value_target -> ``ClipPPOLoss`` trains the policy; the value head is trained with an MSE on the targets.
:func:`tokengym.training.train` runs the loop; GAE and the value head are its two callbacks.
"""

from __future__ import annotations

import argparse
import copy

import torch
from tensordict import TensorDictBase
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts, arithmetic_reward
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions, train
from tokengym.transforms import AdaptiveKLController, KLRewardTransform
from tokengym.transforms.sequences import sequence_layout


@torch.no_grad()
def last_hidden(model, batch: TensorDictBase, pad_id: int) -> torch.Tensor:
    """Hidden state (N, T, H) that predicts each response step: column P-1+t of one teacher-forced forward."""
    layout = sequence_layout(batch, pad_id=pad_id)
    tokens, attention_mask, width = layout.tokens, layout.attention_mask, layout.response_start
    attention_mask = attention_mask.long()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=tokens, attention_mask=attention_mask, position_ids=positions,
                output_hidden_states=True, use_cache=False)  # fmt: skip
    steps = batch.shape[1]
    # column P-1+t sees the prompt and response steps < t: the state in which step t is chosen
    # (columns P..P+T hold the state after each step, i.e. the "next" state)
    return out.hidden_states[-1][:, width - 1 : width + steps].float()  # (N, T+1, H)


def add_values(batch: TensorDictBase, model, value_head: torch.nn.Module, pad_id: int) -> torch.Tensor:
    """Write ``state_value`` and ``("next", "state_value")`` [N, T, 1]; returns the hidden states used."""
    hidden = last_hidden(model, batch, pad_id)
    with torch.no_grad():
        values = value_head(hidden)  # (N, T+1, 1)
    mask = batch.get(keys.MASK).unsqueeze(-1)
    done = batch.get(keys.DONE)
    batch.set(keys.STATE_VALUE, torch.where(mask, values[:, :-1], 0.0))
    # the value after the last step of a trajectory is 0 (terminal or truncated: the episode ends there)
    batch.set(("next", keys.STATE_VALUE), torch.where(mask & ~done, values[:, 1:], 0.0))
    return hidden[:, :-1]


def answer_reward(responses: list[str], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
    """The task's exact-answer reward (1.0) plus up to 0.5 for a digits-only response (a dense signal)."""
    exact = arithmetic_reward()(responses, prompts, metadata)
    digits = [
        sum(c.isdigit() for c in r.replace(" ", "")) / max(len(r.replace(" ", "")), 1) for r in responses
    ]
    return exact + 0.5 * torch.tensor(digits)


def main(iterations: int = 30, quick: bool = False, seed: int = 0) -> list[float]:
    """Train; returns the mean (KL-free) task reward of every iteration."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=seed)
    ref = copy.deepcopy(model).eval()  # frozen reference policy for the KL penalty
    value_head = torch.nn.Linear(model.config.hidden_size, 1)
    n_traj = 16 if quick else 32

    prompts = arithmetic_prompts(64, seed=seed, max_operand=4, ops="+")
    env = TokenEnv(prompts, tok, answer_reward, batch_size=n_traj, max_new_tokens=3, max_length=64,
                   model_config=model.config, shuffle=True, seed=seed)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=seed)
    kl = KLRewardTransform(controller=AdaptiveKLController(0.05, target=2.0, horizon=2000), ref_model=ref,
                           estimator="k1", pad_id=tok.pad_token_id)  # fmt: skip
    collector = TokenCollector(
        env, policy, mode="trajectories", batch_size=n_traj, total_steps=-1, postproc=kl
    )

    # values are precomputed, so GAE needs no value network; it reads state_value / ("next", "state_value")
    gae = GAE(gamma=1.0, lmbda=0.95, value_network=None)
    actor = SequenceActor(model, pad_token_id=tok.pad_token_id)
    loss = ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False, clip_epsilon=0.2)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    value_optim = torch.optim.Adam(value_head.parameters(), lr=1e-2)

    hidden = None  # the states the value head saw, kept for its update after the policy's

    def prepare(batch: TensorDictBase) -> TensorDictBase:
        nonlocal hidden
        hidden = add_values(batch, model, value_head, tok.pad_token_id)
        gae(batch)  # writes keys.ADVANTAGE and keys.VALUE_TARGET [N, T, 1] (GAE runs along dim -2 = time)
        mask = batch.get(keys.MASK).unsqueeze(-1)
        batch.set(keys.ADVANTAGE, torch.where(mask, batch.get(keys.ADVANTAGE), 0.0))  # padding: no signal
        return batch  # loss_objective is a mean over valid steps (("collector", "mask") is honoured)

    def train_value_head(row: dict, batch: TensorDictBase) -> None:
        # critic: MSE between the value head and GAE's value target, on valid steps only
        value_error = (value_head(hidden) - batch.get(keys.VALUE_TARGET)).pow(2)
        value_loss = value_error[batch.get(keys.MASK).unsqueeze(-1)].mean()
        value_optim.zero_grad()
        value_loss.backward()
        value_optim.step()
        print(f"iter {row['iter']:3d}  reward {row['reward']:.3f}  kl-beta {kl.beta:.4f}  "
              f"policy loss {row['loss']:+.4f}  value loss {float(value_loss.detach()):.4f}")  # fmt: skip

    # two PPO epochs over each batch, then the value head
    rows = train(collector, loss, optim, iterations=iterations, options=TrainOptions(epochs=2, max_grad_norm=1.0),
                 prepare=prepare, on_iteration=train_value_head)  # fmt: skip
    return [row["reward"] for row in rows]  # the collector's mean task reward (KL-free) of each batch


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="smaller batches (tests)")
    args = parser.parse_args()
    main(iterations=args.iterations, quick=args.quick)
