"""The main job behind ``make demo``: GRPO-style RL of an offline tiny model with TorchRL's ClipPPOLoss.

A short supervised warm start teaches the answer format (and some answers); RL with an exact-match
reward then raises the fraction of correct answers.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time

import torch
from torchrl.objectives import ClipPPOLoss

from tokengym.collectors import SamplingConfig, SequenceActor, TokenCollector, TransformersPolicy
from tokengym.llm_envs import MathAnswerReward, TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.transforms import AdaptiveKLController, GroupAdvantage, KLRewardTransform


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of the demo run."""

    iterations: int = 200
    """Collected batches (one optimizer phase each)."""
    trajectories: int = 64
    """Trajectories per batch (8 prompts x group_size)."""
    group_size: int = 8
    """Samples per prompt for the group-relative advantage."""
    lr: float = 1e-3
    """Adam learning rate."""
    max_new_tokens: int = 4
    """Response budget (tokens)."""
    max_operand: int = 4
    """Operands of the built-in arithmetic task lie in [0, max_operand]."""
    warm_start_steps: int = 40
    """Supervised steps on the task's answers before RL; a random-init 2-layer model does not find
    addition by RL alone in minutes (it learns the format only), so RL starts from a partial solver."""
    seed: int = 0
    """Seed of the model init, prompt order and sampling."""
    out_dir: str = "demo_out"
    """Where the reward curve PNG goes."""


def warm_start(model, tok, prompts: list[dict], steps: int, *, lr: float = 3e-3) -> None:
    """A short supervised start: teacher-forced cross-entropy on ``answer + eos`` after each prompt."""
    if steps <= 0:
        return
    rows = [(tok(p["prompt"], add_special_tokens=False)["input_ids"],
             tok(str(p["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for p in prompts]  # fmt: skip
    width = max(len(a) + len(b) for a, b in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):  # left-pad, so every answer ends at the last column
        seq = prompt + answer
        ids[i, width - len(seq) :] = torch.tensor(seq)
        labels[i, width - len(answer) :] = torch.tensor(answer)
        attention[i, width - len(seq) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        out = model(input_ids=ids, attention_mask=attention, position_ids=positions, labels=labels)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
    model.eval()


def build(config: DemoConfig):
    """Model, env, collector, loss and optimizer of the demo."""
    torch.manual_seed(config.seed)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=config.seed)
    prompts = arithmetic_prompts(64, seed=config.seed, max_operand=config.max_operand, ops="+")
    warm_start(model, tok, prompts, config.warm_start_steps)
    ref = copy.deepcopy(model).eval()
    env = TokenEnv(prompts, tok, MathAnswerReward(), batch_size=16, max_new_tokens=config.max_new_tokens, group_size=config.group_size,
                   model_config=model.config, max_length=64, shuffle=True, seed=config.seed)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=config.seed)
    kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=ref,
                           estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=config.trajectories,
                               total_steps=-1, postproc=kl, use_progress_bar=True)  # fmt: skip
    actor = SequenceActor(model, pad_token_id=tok.pad_token_id)
    loss = ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False, clip_epsilon=0.2)
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    return model, collector, loss, optim, GroupAdvantage("grpo")


def train(config: DemoConfig, *, log=None) -> list[dict]:
    """Run the demo; returns one row of metrics per iteration."""
    if log is None:
        from tqdm.auto import tqdm

        log = tqdm.write  # rows print above the progress bar
    model, collector, loss, optim, advantage = build(config)
    rows: list[dict] = []
    log(f"{'iter':>4} {'reward':>7} {'correct':>7} {'kl':>7} {'beta':>7} {'tok/s':>7} {'loss':>8}")
    for i, batch in enumerate(collector):
        batch = advantage(batch)
        model.train()
        for _ in range(2):  # two optimizer steps per batch, PPO-style reuse
            out = loss(batch)
            optim.zero_grad()
            out["loss_objective"].backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
        model.eval()
        collector.update_policy_weights_()
        m = collector.metrics
        correct = float((batch.get(keys.REWARD_RAW).squeeze(-1).sum(-1) >= 1.0).float().mean())
        rows.append({"iter": i, "reward": m["mean_reward"], "correct": correct, "kl": m.get("kl", float("nan")),
                     "beta": m.get("beta", float("nan")), "tokens_per_s": m["tokens_per_s"],
                     "loss": float(out["loss_objective"].detach())})  # fmt: skip
        r = rows[-1]
        log(f"{i:>4} {r['reward']:>7.3f} {r['correct']:>7.3f} {r['kl']:>7.3f} {r['beta']:>7.4f} "
            f"{r['tokens_per_s']:>7.0f} {r['loss']:>8.4f}")  # fmt: skip
        if i + 1 >= config.iterations:
            break
    return rows


def plot(rows: list[dict], path: str) -> str:
    """Save the reward curve to ``path`` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["iter"] for r in rows], [r["reward"] for r in rows], label="mean reward")
    ax.plot([r["iter"] for r in rows], [r["correct"] for r in rows], label="fraction correct")
    ax.set_xlabel("iteration")
    ax.set_title("tokengym demo: GRPO on arithmetic (tiny Qwen2, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(config: DemoConfig | None = None) -> list[dict]:
    """Train, print the table and the before/after rewards, save the curve."""
    config = config or DemoConfig()
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = train(config)
    k = max(1, min(10, len(rows) // 5))
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    os.makedirs(config.out_dir, exist_ok=True)
    path = plot(rows, os.path.join(config.out_dir, "reward_curve.png"))
    print(f"mean reward: first {k} iterations {first:.3f} -> last {k} iterations {last:.3f} "
          f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    print(f"reward curve: {os.path.abspath(path)}")
    return rows
