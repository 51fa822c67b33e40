"""``python -m tokengym recipe-reasoning-gym``: GRPO of the offline tiny model on a reasoning-gym task, with held-out problems.

The default task is reasoning-gym's ``chain_sum`` with two one-digit terms (``State the final answer
to the following arithmetic problem: 7 - 2 =``, answered as ``<answer>5</answer>``), scored by the
dataset's own ``score_answer``. The 200 distinct problems are split by ``seed``: a fifth are held out,
never trained on (neither in the supervised warm start nor in RL). The warm start teaches the answer
format and part of the table; GRPO with the reasoning-gym reward goes on from there. Greedy accuracy
on the training and the held-out problems is printed at random init, after the warm start and every
``eval_every`` RL iterations, so each stage's share of a held-out gain can be read off; at the end, pass@k,
mean@k and maj@k of ``samples`` sampled answers per held-out problem (:func:`tokengym.evaluation.evaluate`).

``--seeds N`` runs seeds ``seed .. seed + N - 1``, each twice from the same warm start: with the
reasoning-gym reward and with a random 0/1 reward (the control), and prints the table of held-out
changes per seed with each arm's mean and spread, and the machine's CPU capability (a single seed of this
chaotic run ends elsewhere on another CPU: the claim is the table over seeds)."""

from __future__ import annotations

import copy
import dataclasses
import platform
import statistics
import time

import torch
from torchrl.objectives import ClipPPOLoss

from tokengym import training
from tokengym.collectors import CollectorOptions, DynamicSampling, TokenCollector
from tokengym.collectors.policies import SamplingConfig, SharedPrefixActor, TransformersPolicy
from tokengym.evaluation import Evaluation, evaluate
from tokengym.llm_envs import PromptSource, TokenEnv
from tokengym.llm_envs.adapters import (
    ReasoningGymReward,
    ReasoningGymSpec,
    held_out_split,
    reasoning_gym_prompts,
)
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions
from tokengym.transforms import (
    AdaptiveKLController,
    GroupAdvantage,
    KLRewardTransform,
    WeightedLoss,
    to_padded,
)
from tokengym.warm_start import supervised_warm_start


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
    samples: int = 8
    """Sampled answers per held-out problem for the final pass@k / mean@k / maj@k (at ``temperature``)."""
    seeds: int = 1
    """Seeds to run (from ``seed``); more than 1 also runs a random-reward control per seed and prints the table."""
    dynamic_sampling: bool = False
    """Batches of groups whose rewards spread only (DAPO; tokengym.collectors.DynamicSampling, at most 10 batches' worth
    of groups drawn per batch). Off by default: with chain_sum at temperature 1 it draws 1.04 groups per kept one."""

    def __post_init__(self) -> None:
        for name in ("iterations", "epochs", "trajectories", "group_size", "max_new_tokens", "eval_every", "warmup_iterations",
                     "samples", "seeds"):
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
    items = reasoning_gym_prompts(spec, system_prompt=None, use_chat=False)
    train_problems, held_out = held_out_split(items, held_out=config.held_out_fraction, seed=config.seed)
    return spec, train_problems, held_out


def greedy_accuracy(model, tok, reward, problems: list[dict], max_new_tokens: int) -> float:
    """Fraction of ``problems`` answered right (reasoning-gym's ``score_answer``) with greedy decoding."""
    return evaluate_problems(model, tok, reward, problems, max_new_tokens, SamplingConfig(greedy=True), 1).metrics["pass@1"]


def evaluate_problems(model, tok, reward, problems: list[dict], max_new_tokens: int, sampling: SamplingConfig, n: int,
                      *, seed: int = 0) -> Evaluation:  # fmt: skip
    """pass@k, mean@n and maj@n of ``n`` answers per problem sampled with ``sampling`` (correct: reward 1)."""
    source = PromptSource(problems, tok, group_size=n, epochs=1)
    env = TokenEnv(source, tok, reward, batch_size=n * max(1, 64 // n), max_new_tokens=max_new_tokens, max_length=96,
                   model_config=model.config)  # fmt: skip
    # maj@k votes on the answer the reward scores (the last <answer>...</answer>), else on the whole text
    return evaluate(env, TransformersPolicy(model, env, sampling=sampling, seed=seed),
                    answer_fn=lambda text: reward.extract(text) or text.strip())  # fmt: skip


class RandomReward:
    """The control arm's reward: 0 or 1 at random (seeded), whatever the response says."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, responses, prompts, metadata) -> torch.Tensor:
        return torch.randint(0, 2, (len(responses),), generator=self.generator).float()


def build(config: RecipeConfig, model, tok, reward: ReasoningGymReward, train_problems: list[dict]):
    """Collector (KL to the model as it is now), loss and optimizer of the RL phase."""
    ref = copy.deepcopy(model).eval()
    env = TokenEnv(train_problems, tok, reward, batch_size=config.trajectories, max_new_tokens=config.max_new_tokens,
                   group_size=config.group_size, model_config=model.config, max_length=96, shuffle=True,
                   seed=config.seed)  # fmt: skip
    policy = TransformersPolicy(model, env, sampling=SamplingConfig(temperature=config.temperature), seed=config.seed)
    kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=ref,
                           estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
    options = CollectorOptions(dynamic_sampling=DynamicSampling(max_num_gen_batches=10)) if config.dynamic_sampling else None
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=config.trajectories, postproc=kl,
                               options=options)  # fmt: skip
    # the shared-prefix layout: each group's prompt runs once in the training forward (0.42x the loss step's time
    # of the step layout here); WeightedLoss averages the per-token objective over the generated tokens
    actor = SharedPrefixActor(model, temperature=config.temperature)
    loss = WeightedLoss(ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False, clip_epsilon=0.2,
                                    reduction="none"))  # fmt: skip
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    return collector, loss, optim


_HEADER = f"{'iter':>4} {'reward':>7} {'kl':>7} {'tok/s':>7} {'acc_train':>9} {'acc_held':>9}"


def warm_started(config: RecipeConfig, *, log=print):
    """The problems, the tokenizer, the reward and the model after the warm start, with the evaluations so far."""
    spec, train_problems, held_out = split_problems(config)
    log(f"reasoning-gym {config.task} {TASKS[config.task]}: {len(train_problems)} training problems, {len(held_out)} held out "
        f"(never trained on); warm start {config.warm_start_steps} supervised steps; seed {config.seed}")  # fmt: skip
    torch.manual_seed(config.seed)
    tok = tiny_tokenizer(512 if config.model_size == "tiny" else 2048)
    model = tiny_model(tok, size=config.model_size, seed=config.seed)
    reward = ReasoningGymReward(spec)
    evals = [_evaluate(config, model, tok, reward, train_problems, held_out, "init")]
    log(f"random init: greedy accuracy training {evals[0]['train']:.3f}, held-out {evals[0]['held_out']:.3f}")
    targets = [{"prompt": p["prompt"], "answer": f"<answer>{p['answer']}</answer>"} for p in train_problems]
    targets = targets[: max(1, round(len(targets) * config.warm_start_fraction))]
    supervised_warm_start(model, tok, targets, config.warm_start_steps)  # the training problems only
    evals.append(_evaluate(config, model, tok, reward, train_problems, held_out, "warm start"))
    log(f"after the warm start: greedy accuracy training {evals[1]['train']:.3f}, held-out {evals[1]['held_out']:.3f}")
    return (train_problems, held_out), tok, reward, model, evals


def _evaluate(config, model, tok, reward, train_problems, held_out, i) -> dict:
    return {"iter": i, "train": greedy_accuracy(model, tok, reward, train_problems, config.max_new_tokens),
            "held_out": greedy_accuracy(model, tok, reward, held_out, config.max_new_tokens)}  # fmt: skip


def _prepare(batch):
    """Group advantages, then the padded layout the shared-prefix actor reads."""
    return to_padded(GroupAdvantage("grpo")(batch))


def rl(config: RecipeConfig, model, tok, reward, problems, evals: list[dict], *, train_reward=None, log=print) -> list[dict]:
    """The GRPO phase from ``model`` as it is (``train_reward`` replaces the reward the policy is trained on, e.g.
    :class:`RandomReward`; evaluation always uses the task's reward); appends to ``evals`` and returns it."""
    train_problems, held_out = problems
    collector, loss, optim = build(config, model, tok, train_reward or reward, train_problems)
    # Adam's first steps move every weight by ~lr whatever its gradient: a linear warm-up keeps them small
    warmup = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / (2 * config.warmup_iterations)))
    log(_HEADER)

    def show(r: dict, _batch) -> None:
        is_last = r["iter"] + 1 >= config.iterations
        e = None
        if (r["iter"] + 1) % config.eval_every == 0 or is_last:
            e = _evaluate(config, model, tok, reward, train_problems, held_out, r["iter"])
            evals.append(e)
        acc = f"{e['train']:>9.3f} {e['held_out']:>9.3f}" if e else ""
        log(f"{r['iter']:>4} {r['reward']:>7.3f} {r['kl']:>7.3f} {r['tokens_per_s']:>7.0f} {acc}".rstrip())

    training.train(collector, loss, optim, iterations=config.iterations, options=TrainOptions(epochs=config.epochs),
                   prepare=_prepare, on_iteration=show, scheduler=warmup)  # fmt: skip
    collector.shutdown()
    return evals


def sampled(config: RecipeConfig, model, tok, reward, held_out: list[dict]) -> Evaluation:
    """pass@k, mean@k and maj@k of ``config.samples`` answers per held-out problem, at the RL temperature."""
    return evaluate_problems(model, tok, reward, held_out, config.max_new_tokens,
                             SamplingConfig(temperature=config.temperature), config.samples, seed=config.seed)  # fmt: skip


def train(config: RecipeConfig, *, log=print) -> list[dict]:
    """Run the recipe for ``config.seed``; returns the evaluations (at init, after the warm start, then during RL)."""
    problems, tok, reward, model, evals = warm_started(config, log=log)
    rl(config, model, tok, reward, problems, evals, log=log)
    log(f"held-out, {config.samples} samples per problem at temperature {config.temperature}: "
        f"{sampled(config, model, tok, reward, problems[1])}")  # fmt: skip
    return evals


def seed_table(config: RecipeConfig, *, log=print) -> list[dict]:
    """Each seed from the same warm start twice: GRPO with the task's reward and with a random reward; one row each."""
    rows = []
    for seed in range(config.seed, config.seed + config.seeds):
        cfg = dataclasses.replace(config, seed=seed, seeds=1)
        problems, tok, reward, model, evals = warm_started(cfg, log=log)
        control = copy.deepcopy(model)
        row = {"seed": seed, "warm": evals[-1]}
        for arm, m, train_reward in (("grpo", model, None), ("control", control, RandomReward(seed))):
            arm_evals = rl(cfg, m, tok, reward, problems, list(evals), train_reward=train_reward, log=lambda _line: None)
            row[arm] = arm_evals[-1]
            row[f"{arm}_sampled"] = sampled(cfg, m, tok, reward, problems[1]).metrics
            log(f"seed {seed} {arm}: training {row[arm]['train']:.3f}, held-out {row[arm]['held_out']:.3f}, "
                f"held-out pass@{cfg.samples} {row[f'{arm}_sampled'][f'pass@{cfg.samples}']:.3f}")  # fmt: skip
        rows.append(row)
    return rows


def format_table(rows: list[dict], config: RecipeConfig) -> str:
    """The seed table as printed: per seed the warm start, each arm's end and held-out change; then each arm's mean and
    standard deviation of the change."""
    k = config.samples
    lines = [f"greedy accuracy training / held-out ({len(rows)} seeds; held-out change = after RL - after "
             f"the warm start; pass@{k} of {k} samples per held-out problem after RL)",
             f"| seed | after the warm start | GRPO | GRPO's held-out change | GRPO pass@{k} | random-reward control | "
             f"control's held-out change | control pass@{k} |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    changes = {"grpo": [], "control": []}
    for r in rows:
        cells = [str(r["seed"]), f"{r['warm']['train']:.3f} / {r['warm']['held_out']:.3f}"]
        for arm in ("grpo", "control"):
            change = r[arm]["held_out"] - r["warm"]["held_out"]
            changes[arm].append(change)
            cells += [f"{r[arm]['train']:.3f} / {r[arm]['held_out']:.3f}", f"{change:+.3f}",
                      f"{r[f'{arm}_sampled'][f'pass@{k}']:.3f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    for arm, name in (("grpo", "GRPO"), ("control", "random-reward control")):
        values = changes[arm]
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"{name}: held-out change mean {statistics.mean(values):+.3f}, standard deviation {spread:.3f}, "
                     f"min {min(values):+.3f}, max {max(values):+.3f}")  # fmt: skip
    lines.append(f"CPU: {_cpu_name()}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, torch "
                 f"{torch.__version__}, {torch.get_num_threads()} torch thread(s)")  # fmt: skip
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return platform.processor() or "unknown"


def main(config: RecipeConfig | None = None) -> list[dict]:
    """Train, print the table and the accuracy at init, after the warm start and after RL (or, with ``seeds`` > 1,
    the seed table with its control); returns the evaluations (the seed table's rows with ``seeds`` > 1)."""
    config = config or RecipeConfig()
    torch.set_num_threads(1)
    start = time.perf_counter()
    if config.seeds > 1:
        rows = seed_table(config, log=lambda line: print(line, flush=True))
        print(format_table(rows, config), flush=True)
        print(f"({time.perf_counter() - start:.0f} s)", flush=True)
        return rows
    evals = train(config, log=lambda line: print(line, flush=True))
    init, warm, last = evals[0], evals[1], evals[-1]
    for name, key in (("training problems", "train"), ("held-out problems (never trained on)", "held_out")):
        print(f"greedy accuracy, {name}: random init {init[key]:.3f} -> warm start {warm[key]:.3f} -> "
              f"{config.iterations} RL iterations {last[key]:.3f}", flush=True)  # fmt: skip
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    return evals
