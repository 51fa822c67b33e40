"""The main job behind ``make demo``: GRPO-style RL of an offline tiny model with TorchRL's ClipPPOLoss.

The task is ``a+b=`` with operands in ``[0, max_operand]``. Some of these problems are held out: never
trained on (neither in the warm start nor in RL), they show whether what RL teaches carries over to
problems the model never saw. A held-out ``a+b=`` always has its commuted twin ``b+a=`` among the
training problems (the same operands in the other order), so a 2-layer model can carry over what it
learns. A short supervised warm start makes a partial solver (a third to two thirds of the training
sums right); RL with an exact-match reward then raises the fraction of correct answers. Every
``eval_every`` iterations the model answers every training and held-out problem greedily.

``--seeds N`` runs seeds ``seed .. seed + N - 1``, each twice from the same warm start: with the task's
reward and with a random 0/1 reward (the control), and prints the held-out table and its verdict.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import random
import sys
import time

import torch
from torchrl.objectives import ClipPPOLoss

from tokengym import training
from tokengym._recipe_reasoning_gym import RandomReward
from tokengym.collectors import CollectorOptions, TokenCollector
from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.policies import SamplingConfig, SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs.tasks import arithmetic_reward
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions
from tokengym.transforms import AdaptiveKLController, GroupAdvantage, KLRewardTransform
from tokengym.warm_start import supervised_warm_start


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Settings of the demo run; ``python -m tokengym demo --help`` lists each as a flag."""

    iterations: int = 200
    """Collected batches (one optimizer phase each)."""
    trajectories: int = 64
    """Trajectories per batch (prompts per batch x group_size)."""
    group_size: int = 8
    """Samples per prompt for the group-relative advantage (TRL's num_generations, verl's rollout.n)."""
    lr: float = 3e-4
    """Adam learning rate of RL (from a short sweep over 5 seeds: 1e-3 and 5e-4 gained fewer held-out problems)."""
    max_new_tokens: int = 4
    """Response budget (tokens)."""
    max_operand: int = 9
    """Operands lie in [0, max_operand]: (max_operand + 1)^2 distinct problems."""
    held_out: int = 30
    """Problems never trained on, evaluated to tell learning that carries over from memorisation; each one's
    commuted twin (b+a= for a+b=) is a training problem, so at most max_operand * (max_operand + 1) / 2."""
    eval_every: int = 10
    """Greedy evaluation on the training and held-out problems every this many iterations."""
    warm_start_steps: int = 60
    """Supervised steps on the training answers before RL; a random-init 2-layer model does not find
    addition by RL alone in minutes (it learns the format only), so RL starts from a partial solver
    (0.3-0.7 of the training sums right)."""
    seed: int = 0
    """Seed of the model init, the held-out split, prompt order and sampling."""
    seeds: int = 1
    """Seeds to run (from seed); more than 1 runs each from its warm start twice, with the task's reward and with a
    random 0/1 reward (the control), and prints the held-out table and its verdict."""
    workers: int = 0
    """Ray rollout workers (pip install 'tokengym[ray]'); 0 collects in this process."""
    async_: bool = False
    """Collect the next batch while training on this one (AsyncCollector, max_staleness=1)."""
    out_dir: str = "demo_out"
    """Where the reward curve PNG goes."""

    def __post_init__(self) -> None:
        for name in ("iterations", "trajectories", "group_size", "max_new_tokens", "max_operand", "eval_every", "seeds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("held_out", "warm_start_steps", "seed", "workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.trajectories % self.group_size:
            raise ValueError(
                f"trajectories ({self.trajectories}) must be a multiple of group_size ({self.group_size}), "
                "so every batch holds whole groups"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        pairs = self.max_operand * (self.max_operand + 1) // 2
        if self.held_out > pairs:
            raise ValueError(
                f"held_out must be <= {pairs}, the pairs a != b of max_operand={self.max_operand} (a held-out a+b= "
                f"keeps its twin b+a= in training), got {self.held_out}; raise max_operand or hold out fewer"
            )
        if self.seeds > 1 and (self.workers or self.async_):
            raise ValueError(f"seeds={self.seeds} runs every seed in this process; drop --workers / --async")


def split_problems(config: DemoConfig) -> tuple[list[dict], list[dict]]:
    """Every ``a+b=`` problem of the config, shuffled by ``seed``: (training problems, held-out problems).

    The held-out problems are the first ``held_out`` of the shuffled order with ``a != b`` whose twin ``b+a=``
    is not held out already: every held-out sum's operands appear in training, in the other order."""
    m = config.max_operand
    pairs = [(a, b) for a in range(m + 1) for b in range(m + 1)]
    random.Random(config.seed).shuffle(pairs)
    held: set[tuple[int, int]] = set()
    for a, b in pairs:
        if len(held) < config.held_out and a != b and (b, a) not in held:
            held.add((a, b))
    problem = lambda a, b: {"prompt": f"{a}+{b}=", "answer": str(a + b)}  # noqa: E731
    return ([problem(a, b) for a, b in pairs if (a, b) not in held],
            [problem(a, b) for a, b in pairs if (a, b) in held])  # fmt: skip


def warm_start(model, tok, prompts: list[dict], steps: int, *, lr: float = 3e-3) -> None:
    """A short supervised start: teacher-forced cross-entropy on ``answer + eos`` after each prompt
    (:func:`tokengym.warm_start.supervised_warm_start`)."""
    supervised_warm_start(model, tok, prompts, steps, lr=lr)


@torch.no_grad()
def accuracy(model, tok, problems: list[dict], max_new_tokens: int) -> float:
    """Fraction of ``problems`` the model answers right with greedy decoding (the task's exact reward)."""
    if not problems:
        return float("nan")
    prompts = [p["prompt"] for p in problems]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return float(arithmetic_reward()(texts, prompts, problems).mean())


def warm_started(config: DemoConfig, train_problems: list[dict]):
    """The demo's model (seeded by ``config.seed``) after its warm start on ``train_problems``, and its tokenizer."""
    torch.manual_seed(config.seed)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=config.seed)
    warm_start(model, tok, train_problems, config.warm_start_steps)
    return model, tok


def build(config: DemoConfig, train_problems: list[dict], *, show_bar: bool = False):
    """Model (after the warm start), tokenizer, collector, loss and optimizer of the demo."""
    model, tok = warm_started(config, train_problems)
    return model, tok, *rl_parts(config, model, tok, train_problems, show_bar=show_bar)


def rl_parts(config: DemoConfig, model, tok, train_problems: list[dict], *, reward=None, show_bar: bool = False):
    """Collector (KL to ``model`` as it is now), loss and optimizer of the RL phase; ``reward`` replaces the task's
    exact-match reward (e.g. the control's random reward)."""
    ref = copy.deepcopy(model).eval()
    reward = reward or arithmetic_reward()
    env = TokenEnv(train_problems, tok, reward, batch_size=config.trajectories, max_new_tokens=config.max_new_tokens,
                   group_size=config.group_size, model_config=model.config, max_length=64, shuffle=True,
                   seed=config.seed)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=config.seed)
    kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=ref,
                           estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=config.trajectories, total_steps=-1,
                               postproc=kl, options=CollectorOptions(use_progress_bar=show_bar))  # fmt: skip
    actor = SequenceActor(model, pad_token_id=tok.pad_token_id)
    loss = ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False, clip_epsilon=0.2)
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    return collector, loss, optim


def _env_on_worker(config: DemoConfig, problems: list[dict]) -> TokenEnv:
    """The env of :func:`build`, built on a Ray worker."""
    return TokenEnv(problems, tiny_tokenizer(), arithmetic_reward(), batch_size=16, max_new_tokens=config.max_new_tokens,
                    group_size=config.group_size, max_length=64, shuffle=True, seed=config.seed)  # fmt: skip


def _policy_on_worker(env, config: DemoConfig, weights: dict) -> TransformersPolicy:
    model = tiny_model(env.tokenizer, seed=config.seed)
    model.load_state_dict(weights)
    return TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=config.seed)


def scale_out(config: DemoConfig, model, collector: TokenCollector, problems: list[dict]):
    """The collector of ``--workers N`` (Ray) and ``--async`` (overlapped with training); the collector
    then holds its own copy of the weights, so the trainer publishes them after each phase."""
    if config.workers:
        from tokengym.collectors.ray_collector import RayTokenCollector

        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        collector = RayTokenCollector(functools.partial(_env_on_worker, config, problems),
                                      functools.partial(_policy_on_worker, config=config, weights=weights),
                                      num_workers=config.workers, mode="trajectories", batch_size=config.trajectories,
                                      postproc=collector.postproc, seed=config.seed)  # fmt: skip
    elif config.async_:
        policy = TransformersPolicy(copy.deepcopy(model), collector.env, sampling=SamplingConfig(temperature=1.0),
                                    seed=config.seed)  # fmt: skip
        collector = TokenCollector(collector.env, policy, mode="trajectories", batch_size=config.trajectories,
                                   postproc=collector.postproc)  # fmt: skip
    return AsyncCollector(collector, max_staleness=1) if config.async_ else collector


def _print_flush(line: str) -> None:
    """``print`` that flushes, so ``make demo > log`` shows each line as it comes."""
    print(line, flush=True)


_HEADER = f"{'iter':>4} {'reward':>7} {'kl':>7} {'beta':>7} {'tok/s':>7} {'loss':>8} {'acc_train':>9} {'acc_held':>9}"


def train(config: DemoConfig, *, log=None) -> tuple[list[dict], list[dict]]:
    """Run the demo for ``config.seed``; returns one row of metrics per iteration and one row per evaluation.

    ``log`` prints the table; by default ``print`` when stdout is not a terminal (a log file stays
    line by line, with no progress bar), else ``tqdm.write`` above a bar on stderr.
    """
    is_tty = sys.stdout.isatty() and sys.stderr.isatty()
    if log is None:
        if is_tty:
            from tqdm.auto import tqdm

            log = tqdm.write
        else:
            log = _print_flush
    problems = split_problems(config)
    model, tok = warm_started(config, problems[0])
    return rl(config, model, tok, problems, log=log, show_bar=is_tty)


def rl(config: DemoConfig, model, tok, problems: tuple[list[dict], list[dict]], *, reward=None, log=_print_flush,
       show_bar: bool = False) -> tuple[list[dict], list[dict]]:
    """The RL phase from ``model`` as it is, on ``problems`` = (training, held-out); ``reward`` replaces the reward
    it trains on (the control's random one), evaluation always scores the exact answer. Returns the metrics of each
    iteration and the evaluations, the first one (``iter`` -1) before RL."""
    train_problems, held_out = problems
    collector, loss, optim = rl_parts(config, model, tok, train_problems, reward=reward, show_bar=show_bar)
    is_scaled = bool(config.workers or config.async_)
    if is_scaled:
        collector = scale_out(config, model, collector, train_problems)
    evals: list[dict] = []

    def evaluate(i: int) -> dict:
        evals.append({"iter": i, "train": accuracy(model, tok, train_problems, config.max_new_tokens),
                      "held_out": accuracy(model, tok, held_out, config.max_new_tokens)})  # fmt: skip
        return evals[-1]

    evaluate(-1)  # after the warm start, before RL
    log(_HEADER)

    def show(r: dict, _batch) -> None:
        is_last = r["iter"] + 1 >= config.iterations
        e = evaluate(r["iter"]) if (r["iter"] + 1) % config.eval_every == 0 or is_last else None
        acc = f"{e['train']:>9.3f} {e['held_out']:>9.3f}" if e else f"{'':>9} {'':>9}"
        log(f"{r['iter']:>4} {r['reward']:>7.3f} {r['kl']:>7.3f} {r['beta']:>7.4f} {r['tokens_per_s']:>7.0f} "
            f"{r['loss']:>8.4f} {acc}".rstrip())  # fmt: skip

    # two optimizer steps per batch (PPO-style reuse); a scaled-out collector holds its own copy of the weights
    rows = training.train(collector, loss, optim, iterations=config.iterations, options=TrainOptions(epochs=2),
                          prepare=GroupAdvantage("grpo"), on_iteration=show,
                          weights=model.state_dict if is_scaled else None)  # fmt: skip
    collector.shutdown()
    return rows, evals


def seed_table(config: DemoConfig, *, log=_print_flush) -> list[dict]:
    """Each seed from its warm start twice: RL with the task's reward and with a random 0/1 reward (the control);
    one row each: the evaluation after the warm start, after RL and after the control's RL."""
    rows = []
    for seed in range(config.seed, config.seed + config.seeds):
        cfg = dataclasses.replace(config, seed=seed, seeds=1)
        problems = split_problems(cfg)
        model, tok = warm_started(cfg, problems[0])
        control = copy.deepcopy(model)
        _, evals = rl(cfg, model, tok, problems, log=lambda _line: None)
        _, control_evals = rl(cfg, control, tok, problems, reward=RandomReward(seed), log=lambda _line: None)
        rows.append({"seed": seed, "warm": evals[0], "grpo": evals[-1], "control": control_evals[-1]})
        log(f"seed {seed}: held-out {_count(evals[0], cfg)} after the warm start, {_count(evals[-1], cfg)} after RL, "
            f"{_count(control_evals[-1], cfg)} after the random-reward control (of {cfg.held_out})")  # fmt: skip
    return rows


MIN_GAIN = 2
"""Held-out problems RL must gain over the warm start (on at least 4 of 5 seeds) for ``--seeds`` to call it learning."""


def _count(e: dict, config: DemoConfig) -> int:
    """Held-out problems answered right in evaluation ``e``."""
    return round(e["held_out"] * config.held_out)


def format_table(rows: list[dict], config: DemoConfig) -> list[str]:
    """The seed table as printed (greedy accuracy, training fraction / held-out problems right) and its verdict."""
    n = config.held_out
    lines = [f"greedy accuracy: training (fraction of {(config.max_operand + 1) ** 2 - n}) / held-out (problems right "
             f"of {n}, never trained on); {config.iterations} RL iterations from the same warm start per seed",
             "| seed | after the warm start | after RL | RL's held-out gain | random-reward control | RL - control |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    gains, leads = [], []
    for r in rows:
        warm, grpo, control = (_count(r[k], config) for k in ("warm", "grpo", "control"))
        gains.append(grpo - warm)
        leads.append(grpo - control)
        lines.append(f"| {r['seed']} | {r['warm']['train']:.3f} / {warm} | {r['grpo']['train']:.3f} / {grpo} | "
                     f"{grpo - warm:+d} | {r['control']['train']:.3f} / {control} | {grpo - control:+d} |")  # fmt: skip
    need = math.ceil(0.8 * len(rows))
    gained, ahead = sum(g >= MIN_GAIN for g in gains), sum(lead > 0 for lead in leads)
    met = gained >= need and ahead >= need
    lines.append(f"verdict: RL gains >= {MIN_GAIN} held-out problems over the warm start on {gained} of {len(rows)} "
                 f"seeds and ends above the random-reward control on {ahead} of {len(rows)} (bar: {need} of "
                 f"{len(rows)} each): {'learning that carries over' if met else 'NOT shown'}")  # fmt: skip
    return lines


def plot(rows: list[dict], evals: list[dict], path: str, *, held_out: int) -> str:
    """Save the training reward and the greedy accuracy curves to ``path`` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot([r["iter"] for r in rows], [r["reward"] for r in rows], alpha=0.5,
            label="mean reward, training prompts (sampled)")  # fmt: skip
    x = [e["iter"] + 1 for e in evals]  # evaluated after that many iterations
    ax.plot(x, [e["train"] for e in evals], "o-", label="accuracy, training prompts (greedy)")
    ax.plot(x, [e["held_out"] for e in evals], "s-", label=f"accuracy, {held_out} held-out prompts (greedy)")
    ax.set_xlabel("iteration")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("tokengym demo: GRPO on a+b= (tiny Qwen2, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def summary(rows: list[dict], evals: list[dict], config: DemoConfig, seconds: float) -> list[str]:
    """The closing lines: mean training reward first -> last iterations, greedy accuracy start -> end, the
    held-out line of the curve and the held-out problems answered right before and after RL."""
    k = max(1, min(10, len(rows) // 5))
    first = sum(r["reward"] for r in rows[:k]) / k
    last = sum(r["reward"] for r in rows[-k:]) / k
    n_train = (config.max_operand + 1) ** 2 - config.held_out
    start, end = evals[0], evals[-1]
    curve = " ".join(f"{e['held_out']:.3f}" for e in evals)
    before, after = _count(start, config), _count(end, config)
    return [
        f"mean reward (training prompts, sampled): first {k} iterations {first:.3f} -> last {k} iterations {last:.3f}",
        f"greedy accuracy: training prompts ({n_train}) {start['train']:.3f} -> {end['train']:.3f}, "
        f"held-out prompts ({config.held_out}) {start['held_out']:.3f} -> {end['held_out']:.3f} "
        f"({len(rows)} iterations, {seconds:.0f} s)",
        f"held-out greedy accuracy, after the warm start, every {config.eval_every} iterations and after the last: {curve}",
        f"held-out problems answered right (never trained on): {before} of {config.held_out} after the warm start -> "
        f"{after} of {config.held_out} after RL ({after - before:+d})",
    ]


def main(config: DemoConfig | None = None):
    """Train, print the table, the before/after numbers and the wall time, save the curves (or, with ``seeds`` > 1,
    print the seed table and its verdict); returns (rows, evaluations), or the seed table's rows."""
    config = config or DemoConfig()
    torch.set_num_threads(1)
    start = time.perf_counter()
    if config.seeds > 1:
        table = seed_table(config)
        for line in format_table(table, config):
            print(line, flush=True)
        print(f"wall time: {time.perf_counter() - start:.0f} s", flush=True)
        return table
    rows, evals = train(config)
    os.makedirs(config.out_dir, exist_ok=True)
    path = plot(rows, evals, os.path.join(config.out_dir, "reward_curve.png"), held_out=config.held_out)
    for line in summary(rows, evals, config, time.perf_counter() - start):
        print(line, flush=True)
    print(f"reward curve: {os.path.abspath(path)}", flush=True)
    print(f"wall time: {time.perf_counter() - start:.1f} s (after imports)", flush=True)
    return rows, evals
