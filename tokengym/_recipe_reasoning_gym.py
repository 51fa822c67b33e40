"""``python -m tokengym recipe-reasoning-gym``: GRPO of the offline tiny model on a reasoning-gym task, with held-out problems.

The default task is reasoning-gym's ``chain_sum`` with two one-digit terms (``State the final answer
to the following arithmetic problem: 7 - 2 =``, answered as ``<answer>5</answer>``), scored by the
dataset's own ``score_answer``. The 200 distinct problems are split by ``seed``: a fifth are held out,
never trained on (neither in the supervised warm start nor in RL). The warm start teaches the answer
format and part of the table; GRPO with the reasoning-gym reward goes on from there. Greedy accuracy
on the training and the held-out problems is printed at random init, after the warm start and every
``eval_every`` RL iterations, so each stage's share of a held-out gain can be read off."""

from __future__ import annotations

import copy
import dataclasses
import random
import time

import torch
from torchrl.objectives import ClipPPOLoss

from tokengym import training
from tokengym._demo import warm_start
from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs.adapters.reasoning_gym import (
    ReasoningGymReward,
    ReasoningGymSpec,
    reasoning_gym_prompts,
)
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions
from tokengym.transforms import AdaptiveKLController, GroupAdvantage, KLRewardTransform


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """Settings of the reasoning-gym recipe; each is a flag of ``python -m tokengym recipe-reasoning-gym``."""

    iterations: int = 40
    """Collected batches (one optimizer phase each)."""
    trajectories: int = 128
    """Trajectories per batch (prompts per batch x group_size)."""
    group_size: int = 8
    """Samples per prompt for the group-relative advantage."""
    lr: float = 1e-4
    """Adam learning rate of the RL phase."""
    epochs: int = 2
    """Optimizer steps on each collected batch."""
    max_new_tokens: int = 12
    """Response budget (tokens)."""
    held_out_fraction: float = 0.2
    """Fraction of the distinct problems held out (never trained on)."""
    warm_start_steps: int = 300
    """Supervised steps on the training problems before RL (the answer format and part of the table)."""
    warm_start_fraction: float = 1.0
    """Fraction of the training problems the warm start sees; GRPO trains on all of them."""
    warmup_iterations: int = 5
    """Iterations over which the learning rate rises linearly to ``lr``."""
    eval_every: int = 10
    """Greedy evaluation every this many iterations."""
    temperature: float = 1.0
    """Sampling temperature of the RL phase (the loss's actor uses the same, so the PPO ratio stays exact)."""
    model_size: str = "tiny"
    """``tiny`` (2 layers x 64) or ``small`` (4 layers x 256), from :mod:`tokengym.testing`."""
    seed: int = 0
    """Seed of the problems, the split, the model init and sampling."""
    task: str = "chain_sum"
    """The reasoning-gym dataset: chain_sum (two one-digit terms, + or -) or basic_arithmetic (a + b, one digit)."""

    def __post_init__(self) -> None:
        for name in ("iterations", "epochs", "trajectories", "group_size", "max_new_tokens", "eval_every", "warmup_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("warm_start_steps", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.trajectories % self.group_size:
            raise ValueError(f"trajectories ({self.trajectories}) must be a multiple of group_size ({self.group_size})")
        if not 0 < self.warm_start_fraction <= 1:
            raise ValueError(f"warm_start_fraction must be in (0, 1], got {self.warm_start_fraction}")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.model_size not in ("tiny", "small"):
            raise ValueError(f"model_size must be 'tiny' or 'small', got {self.model_size!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS)}, got {self.task!r}")


# reasoning-gym datasets small enough for the tiny model, with their configs
TASKS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ("+",),
                         "allow_parentheses": False, "allow_negation": False},
}  # fmt: skip


def split_problems(config: RecipeConfig) -> tuple[ReasoningGymSpec, list[dict], list[dict]]:
    """The spec and its distinct problems, shuffled by ``seed``: (spec, training problems, held-out problems)."""
    spec = ReasoningGymSpec.parse(config.task, config=TASKS[config.task], size=2000, seed=config.seed)
    distinct: dict[str, dict] = {}
    for item in reasoning_gym_prompts(spec, system_prompt=None, use_chat=False):
        distinct.setdefault(item["prompt"], item)
    questions = sorted(distinct)
    random.Random(config.seed).shuffle(questions)
    n_held = max(1, round(len(questions) * config.held_out_fraction))
    return spec, [distinct[q] for q in questions[n_held:]], [distinct[q] for q in questions[:n_held]]


@torch.no_grad()
def accuracy(model, tok, reward: ReasoningGymReward, problems: list[dict], max_new_tokens: int) -> float:
    """Fraction of ``problems`` answered right (reasoning-gym's ``score_answer``) with greedy decoding."""
    enc = tok([p["prompt"] for p in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return float(reward(texts, [p["prompt"] for p in problems], problems).mean())


def build(config: RecipeConfig, model, tok, reward: ReasoningGymReward, train_problems: list[dict]):
    """Collector (KL to the model as it is now), loss and optimizer of the RL phase."""
    ref = copy.deepcopy(model).eval()
    env = TokenEnv(train_problems, tok, reward, batch_size=config.trajectories, max_new_tokens=config.max_new_tokens,
                   group_size=config.group_size, model_config=model.config, max_length=96, shuffle=True,
                   seed=config.seed)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=config.temperature), seed=config.seed)
    kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=ref,
                           estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=config.trajectories, postproc=kl)
    loss = ClipPPOLoss(SequenceActor(model, pad_token_id=tok.pad_token_id, temperature=config.temperature), critic_network=None,
                       entropy_bonus=False, functional=False, clip_epsilon=0.2)  # fmt: skip
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    return collector, loss, optim


_HEADER = f"{'iter':>4} {'reward':>7} {'kl':>7} {'tok/s':>7} {'acc_train':>9} {'acc_held':>9}"


def train(config: RecipeConfig, *, log=print) -> list[dict]:
    """Run the recipe; returns the evaluations (at init, after the warm start, then during RL)."""
    spec, train_problems, held_out = split_problems(config)
    log(f"reasoning-gym {config.task} {TASKS[config.task]}: {len(train_problems)} training problems, {len(held_out)} held out "
        f"(never trained on); warm start {config.warm_start_steps} supervised steps")  # fmt: skip
    torch.manual_seed(config.seed)
    tok = tiny_tokenizer(512 if config.model_size == "tiny" else 2048)
    model = tiny_model(tok, size=config.model_size, seed=config.seed)
    reward = ReasoningGymReward(spec)
    evals: list[dict] = []

    def evaluate(i) -> dict:
        evals.append({"iter": i, "train": accuracy(model, tok, reward, train_problems, config.max_new_tokens),
                      "held_out": accuracy(model, tok, reward, held_out, config.max_new_tokens)})  # fmt: skip
        return evals[-1]

    e = evaluate("init")
    log(f"random init: greedy accuracy training {e['train']:.3f}, held-out {e['held_out']:.3f}")
    targets = [{"prompt": p["prompt"], "answer": f"<answer>{p['answer']}</answer>"} for p in train_problems]
    targets = targets[: max(1, round(len(targets) * config.warm_start_fraction))]
    warm_start(model, tok, targets, config.warm_start_steps)  # the training problems only
    e = evaluate("warm start")
    log(f"after the warm start: greedy accuracy training {e['train']:.3f}, held-out {e['held_out']:.3f}")
    collector, loss, optim = build(config, model, tok, reward, train_problems)
    # Adam's first steps move every weight by ~lr whatever its gradient: a linear warm-up keeps them small
    warmup = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / (2 * config.warmup_iterations)))
    log(_HEADER)

    def show(r: dict, _batch) -> None:
        is_last = r["iter"] + 1 >= config.iterations
        e = evaluate(r["iter"]) if (r["iter"] + 1) % config.eval_every == 0 or is_last else None
        acc = f"{e['train']:>9.3f} {e['held_out']:>9.3f}" if e else ""
        log(f"{r['iter']:>4} {r['reward']:>7.3f} {r['kl']:>7.3f} {r['tokens_per_s']:>7.0f} {acc}".rstrip())

    training.train(collector, loss, optim, iterations=config.iterations, options=TrainOptions(epochs=config.epochs),
                   prepare=GroupAdvantage("grpo"), on_iteration=show, scheduler=warmup)  # fmt: skip
    collector.shutdown()
    return evals


def main(config: RecipeConfig | None = None) -> list[dict]:
    """Train, print the table and the accuracy at init, after the warm start and after RL."""
    config = config or RecipeConfig()
    torch.set_num_threads(1)
    start = time.perf_counter()
    evals = train(config, log=lambda line: print(line, flush=True))
    init, warm, last = evals[0], evals[1], evals[-1]
    for name, key in (("training problems", "train"), ("held-out problems (never trained on)", "held_out")):
        print(f"greedy accuracy, {name}: random init {init[key]:.3f} -> warm start {warm[key]:.3f} -> "
              f"{config.iterations} RL iterations {last[key]:.3f}", flush=True)  # fmt: skip
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    return evals
