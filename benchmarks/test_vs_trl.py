"""The ``make demo`` job in tokengym and in TRL's ``GRPOTrainer``, side by side in one run.

The job (``tokengym/_demo.py``): the demo's tiny Qwen2 after its supervised warm start, saved with
``save_pretrained`` and loaded by every contestant; 8 prompts x 8 samples per iteration, 4 new tokens,
full-vocabulary sampling at temperature 1, the demo's exact-match arithmetic reward, a KL penalty of
0.02 against the warm-started model (tokengym: k3 in the reward, adaptive; TRL: ``beta`` in the loss),
clipped ratio 0.2, two optimizer steps per iteration, Adam at lr 1e-3, gradients clipped at 1.0.

Interleaved: TRL trains in its own loop; a callback runs one tokengym iteration of each tokengym
contestant after every TRL iteration (two TRL steps: ``num_iterations=2``), so all see the same machine
load. Seconds per iteration are medians after the first ``WARMUP`` iterations, and tokengym ÷ TRL is the
median of the ratios of each tokengym iteration to the TRL iteration just before it; the reward curves are
the mean reward of each iteration's 64 samples. Needs the ``bench`` extra (``pip install trl``).
"""

from __future__ import annotations

import copy
import statistics
import time

import pytest
import torch

from tokengym._demo import DemoConfig, split_problems, warm_start
from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, SequenceActor, TransformersPolicy
from tokengym.llm_envs import TokenEnv
from tokengym.llm_envs.tasks import arithmetic_reward
from tokengym.testing import tiny_model, tiny_tokenizer
from tokengym.transforms import AdaptiveKLController, GroupAdvantage, KLRewardTransform

trl = pytest.importorskip("trl", reason="the TRL comparison needs the bench extra: pip install trl")

ITERATIONS = 30
WARMUP = 3

# the job this comparison has always measured (the demo's defaults before it held out 30 commuted problems): kept so
# that its figure stays comparable across releases
TRL_JOB = DemoConfig(max_operand=4, held_out=5, warm_start_steps=40, lr=1e-3)


def _warm_started(config: DemoConfig, path: str):
    """The demo's model after its warm start, saved (and its tokenizer) to ``path``."""
    torch.manual_seed(config.seed)
    tok = tiny_tokenizer()
    model = tiny_model(tok, seed=config.seed)
    train_problems, _ = split_problems(config)
    warm_start(model, tok, train_problems, config.warm_start_steps)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return train_problems


class _TokengymJob:
    """One demo iteration per call, as ``tokengym/_demo.py`` runs it, with ``slots`` env slots and a step source."""

    def __init__(self, config: DemoConfig, path: str, problems: list[dict], *, slots: int, source: str = "step") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        ref = copy.deepcopy(self.model).eval()
        env = TokenEnv(problems, tok, arithmetic_reward(), batch_size=slots, max_new_tokens=config.max_new_tokens,
                       group_size=config.group_size, model_config=self.model.config, max_length=64, shuffle=True,
                       seed=config.seed)  # fmt: skip
        policy = TransformersPolicy(self.model, env, sampling=SamplingConfig(temperature=1.0), seed=config.seed)
        kl = KLRewardTransform(controller=AdaptiveKLController(0.02, target=2.0, horizon=2000), ref_model=ref,
                               estimator="k3", pad_id=tok.pad_token_id)  # fmt: skip
        self.collector = TokenCollector(env, policy, mode="trajectories", batch_size=config.trajectories, postproc=kl,
                                        source=source)  # fmt: skip
        self.batches = iter(self.collector)
        from torchrl.objectives import ClipPPOLoss

        actor = SequenceActor(self.model, pad_token_id=tok.pad_token_id)
        self.loss = ClipPPOLoss(actor, critic_network=None, entropy_bonus=False, functional=False, clip_epsilon=0.2)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        self.advantage = GroupAdvantage("grpo")
        self.times: list[tuple[float, float]] = []  # (collect s, train s) per iteration
        self.rewards: list[float] = []

    def iteration(self) -> None:
        start = time.perf_counter()
        batch = self.advantage(next(self.batches))
        collected = time.perf_counter()
        self.model.train()
        for _ in range(2):  # two optimizer steps per batch, PPO-style reuse
            out = self.loss(batch)
            self.optim.zero_grad()
            out["loss_objective"].backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optim.step()
        self.model.eval()
        self.collector.update_policy_weights_()
        self.times.append((collected - start, time.perf_counter() - collected))
        self.rewards.append(self.collector.metrics["mean_reward"])


def _trl_reward(rewards: list[float]):
    reward = arithmetic_reward()

    def exact_match(completions, prompts, answer, **kwargs) -> list[float]:
        values = reward(completions, prompts, [{"answer": a} for a in answer])
        rewards.append(float(values.mean()))
        return values.tolist()

    return exact_match


def _trl_trainer(config: DemoConfig, path: str, problems: list[dict], out_dir: str, rewards: list[float]):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=config.trajectories, num_generations=config.group_size,
        max_completion_length=config.max_new_tokens, num_iterations=2, beta=0.02, epsilon=0.2,
        learning_rate=config.lr, lr_scheduler_type="constant", max_grad_norm=1.0, temperature=1.0, top_k=0,
        top_p=1.0, max_steps=2 * ITERATIONS, seed=config.seed, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=_trl_reward(rewards), args=args,
                       train_dataset=Dataset.from_list(problems), processing_class=tok)  # fmt: skip


def _interleave(trainer, jobs: dict[str, _TokengymJob]):
    """A callback timing each TRL iteration (2 steps) and running one iteration of every tokengym job after it."""
    from transformers import TrainerCallback

    class Interleave(TrainerCallback):
        def __init__(self) -> None:
            self.start, self.times = 0.0, []

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % 2 == 0:
                self.times.append(time.perf_counter() - self.start)
                for job in jobs.values():
                    job.iteration()

    callback = Interleave()
    trainer.add_callback(callback)
    return callback


def _generation_timer(trainer) -> list[float]:
    """Seconds of each TRL generate-and-score call (its collection), timed around the trainer's method."""
    times: list[float] = []
    inner = trainer._generate_and_score_completions  # TRL's collection phase; timed, not changed

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    trainer._generate_and_score_completions = timed
    return times


def _median(values: list[float]) -> float:
    return statistics.median(values[WARMUP:]) if len(values) > WARMUP else float("nan")


# TRL warns at import about the installed vLLM's version (unused here: generation is transformers')
@pytest.mark.filterwarnings("ignore::UserWarning:trl")
def test_demo_job_vs_trl(benchmark, trl_table, tmp_path):
    config = TRL_JOB
    torch.manual_seed(0)
    path = str(tmp_path / "warm_started")
    problems = _warm_started(config, path)
    jobs = {f"tokengym ({slots} slots, {source})": _TokengymJob(config, path, problems, slots=slots, source=source)
            for slots, source in [(16, "step"), (64, "step"), (64, "wave")]}  # fmt: skip
    trl_rewards: list[float] = []
    trainer = _trl_trainer(config, path, problems, str(tmp_path / "trl"), trl_rewards)
    callback = _interleave(trainer, jobs)
    generation = _generation_timer(trainer)
    benchmark.pedantic(trainer.train, rounds=1, iterations=1, warmup_rounds=0)

    trl_table["_info"] = {"description": (
        f"{ITERATIONS} iterations each, interleaved; medians after {WARMUP}. Job: the make-demo model after its "
        f"warm start (save_pretrained), {config.trajectories // config.group_size} prompts x {config.group_size} "
        f"samples, {config.max_new_tokens} new tokens, 2 optimizer steps per iteration, exact-match reward, "
        f"KL 0.02, trl {trl.__version__} (beta=0.02, num_iterations=2, CPU, fp32).")}  # fmt: skip
    trl_table["trl"] = {"s_per_iter": _median(callback.times), "collect_s": _median(generation),
                        "train_s": _median([t - g for t, g in zip(callback.times, generation, strict=False)]),
                        "rewards": trl_rewards}  # fmt: skip
    for name, job in jobs.items():
        totals = [c + t for c, t in job.times]
        trl_table[name] = {"s_per_iter": _median(totals), "collect_s": _median([c for c, _ in job.times]),
                           "train_s": _median([t for _, t in job.times]), "rewards": job.rewards,
                           # each tokengym iteration ran right after a TRL iteration: the pair saw one load
                           "vs_trl": _median([a / b for a, b in zip(totals, callback.times, strict=True)])}  # fmt: skip
    benchmark.extra_info.update({f"s_per_iter[{k}]": v["s_per_iter"] for k, v in trl_table.items() if k != "_info"})
    assert len(callback.times) == ITERATIONS
