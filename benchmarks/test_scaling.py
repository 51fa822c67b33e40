"""Scale-out and overlap: Ray workers, weight sync, and the demo job synchronous vs asynchronous.

Every table is measured in one run with its contestants interleaved, one torch thread per process.
Each table has a calibration row: the machine's available parallelism, i.e. how much faster two
processes get a fixed CPU job done than one (2.0 on two idle cores; less when other jobs share them).
Read a scaling ratio against it.

- ``test_ray_scaling``: real tokens/s of one in-process :class:`TokenCollector` (the baseline), a
  :class:`RayTokenCollector` with 1 worker and with 2 workers (each worker: the same env and model as
  the baseline, STEPS batches of ``B`` slots x ``T`` steps). Ray's overhead per batch = a 1-worker
  batch's time minus an in-process batch's time (checkpoint of the worker, consolidate, transfer).
- ``test_weight_sync``: ``ray.put`` + two actors loading the weights (a copy into their own tensors),
  for the tiny and small models and a synthetic 500 MiB state_dict: tensors as they are (Ray pickles
  them), the same with ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1``, and tokengym's packing (what
  ``RayTokenCollector.update_policy_weights_`` sends: uint8 NumPy views, zero-copy without the
  variable). Each configuration runs in a fresh process (``benchmarks/_weight_sync.py``).
- ``test_demo_sync_vs_async``: the ``make demo`` job (``DemoConfig()`` defaults; ``TOKENGYM_DEMO_ITERS``
  overrides the iterations), built from ``tokengym._demo``'s pieces: synchronous (the demo as it is),
  asynchronous in this process (``AsyncCollector``, ``max_staleness=1``, in-flight trajectories continued
  or dropped) and asynchronous over one Ray worker. Iterations/s and reward curves; the contestants
  run in chunks of iterations, round robin.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402

from tokengym._demo import DemoConfig, build, split_problems  # noqa: E402
from tokengym.collectors import CollectorOptions, TokenCollector  # noqa: E402
from tokengym.collectors.async_collector import AsyncCollector  # noqa: E402
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy  # noqa: E402
from tokengym.collectors.ray_collector import RayConfig, RayTokenCollector  # noqa: E402
from tokengym.llm_envs import TokenEnv, keys  # noqa: E402
from tokengym.llm_envs.tasks import arithmetic_reward  # noqa: E402
from tokengym.testing import tiny_model, tiny_tokenizer  # noqa: E402
from tokengym.transforms import GroupAdvantage  # noqa: E402

torch.set_num_threads(1)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import benchmark modules by name

B, T, BATCHES, ROUNDS = 8, 32, 2, 3
_TABLES: dict[str, list[str]] = {}


@pytest.fixture(scope="module", autouse=True)
def local_ray(request):
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # other jobs' memory must not kill workers
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
    _report(request.config)


def _report(config) -> None:
    if not _TABLES:
        return
    lines = []
    for title, rows in _TABLES.items():
        lines += ["", f"### {title}", f"date: {datetime.date.today().isoformat()}; machine: {_machine()}", *rows]
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        reporter.write_line(line) if reporter else print(line)
    os.makedirs(".benchmarks", exist_ok=True)
    with open(os.path.join(".benchmarks", "scaling.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _machine() -> str:
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{platform.machine()}, {os.cpu_count()} cores{load}; torch {torch.__version__}, ray {ray.__version__}"


# -- calibration: how much parallel CPU the machine gives two processes right now --
class Spinner:
    def spin(self, n: int) -> float:
        torch.set_num_threads(1)
        a = torch.randn(192, 192)
        start = time.perf_counter()
        for _ in range(n):
            a @ a
        return time.perf_counter() - start


def _parallelism(spinners, n: int = 1500) -> float:
    """Work rate of two processes at once ÷ one process alone (2.0: two free cores)."""
    alone = ray.get(spinners[0].spin.remote(n))
    both = max(ray.get([s.spin.remote(n) for s in spinners]))
    return 2 * alone / both


@pytest.fixture(scope="module")
def spinners():
    actors = [ray.remote(num_cpus=1)(Spinner).remote() for _ in range(2)]
    ray.get([a.spin.remote(1) for a in actors])
    return actors


# -- scaling --
def _scaling_env(size: str):
    tok = tiny_tokenizer(512 if size == "tiny" else 2048)
    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
    return TokenEnv(prompts, tok, batch_size=B, max_new_tokens=T, max_length=64)


def _scaling_policy(env, size: str):
    return TransformersPolicy(tiny_model(env.tokenizer, size=size), env)


def _timed_batches(iterator, n: int) -> tuple[int, float]:
    start, tokens = time.perf_counter(), 0
    for _ in range(n):
        tokens += int(next(iterator)[keys.MASK].sum())
    return tokens, time.perf_counter() - start


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_ray_scaling(benchmark, spinners, size):
    env_fn, policy_fn = functools.partial(_scaling_env, size), functools.partial(_scaling_policy, size=size)
    env = env_fn()
    contestants = {"in-process": TokenCollector(env, policy_fn(env), mode="steps", batch_size=T)}
    rays = {n: RayTokenCollector(env_fn, policy_fn, num_workers=n, mode="steps", batch_size=T,
                                 ray_config=RayConfig(max_restarts=0)) for n in (1, 2)}  # fmt: skip
    contestants.update({f"ray {n} worker{'s' * (n > 1)}": c for n, c in rays.items()})
    iterators = {name: iter(c) for name, c in contestants.items()}
    for it in iterators.values():
        next(it)  # warm: worker start, first prefill
    rates: dict[str, list[float]] = {name: [] for name in iterators}
    batch_s: dict[str, list[float]] = {name: [] for name in iterators}
    parallelism: list[float] = []

    def run():
        names = list(iterators)
        for r in range(ROUNDS):
            parallelism.append(_parallelism(spinners))
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
                tokens, seconds = _timed_batches(iterators[name], BATCHES)
                rates[name].append(tokens / seconds)
                batch_s[name].append(seconds / BATCHES)

    try:
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        for c in rays.values():
            c.shutdown()
    med = {name: statistics.median(v) for name, v in rates.items()}
    overhead_ms = 1000 * (statistics.median(batch_s["ray 1 worker"]) - statistics.median(batch_s["in-process"]))
    ratio = med["ray 2 workers"] / med["ray 1 worker"]
    benchmark.extra_info.update(tokens_per_s=med, ratio_2_over_1=ratio, ray_overhead_ms_per_batch=overhead_ms,
                                parallelism=statistics.median(parallelism))  # fmt: skip
    rows = _TABLES.setdefault("Ray workers: real tokens/s (benchmarks/test_scaling.py::test_ray_scaling)", [
        f"Per worker: B={B} slots, STEPS batches of {T} steps, {BATCHES} batches per measurement, median of "
        f"{ROUNDS} interleaved rounds; full-vocabulary sampling at temperature 1; one torch thread per process.",
        "| model | in-process | ray 1 worker | ray 2 workers | 2 workers ÷ 1 | available parallelism | "
        "Ray overhead per batch (ms) | in-process batch (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ])  # fmt: skip
    rows.append(f"| {size} | {med['in-process']:.0f} | {med['ray 1 worker']:.0f} | {med['ray 2 workers']:.0f} | "
                f"{ratio:.2f} | {statistics.median(parallelism):.2f} | {overhead_ms:.0f} | "
                f"{1000 * statistics.median(batch_s['in-process']):.0f} |")  # fmt: skip


# -- weight sync --
def test_weight_sync(benchmark):
    script = os.path.join(os.path.dirname(__file__), "_weight_sync.py")
    results = {}

    def run():
        for zero_copy in ("0", "1"):
            env = {**os.environ, "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": zero_copy, "RAY_memory_monitor_refresh_ms": "0"}
            out = subprocess.run([sys.executable, script, "3", "500"], env=env, capture_output=True, text=True,
                                 check=True, timeout=1200)  # fmt: skip
            results[zero_copy] = json.loads(out.stdout.strip().splitlines()[-1])

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(results)
    rows = _TABLES.setdefault("Weight sync: ray.put + 2 actors load (benchmarks/test_scaling.py::test_weight_sync)", [
        "Median of 3 interleaved rounds, ms; one process per column pair (Ray reads the variable at import).",
        "| state_dict | MiB | tensors, Ray default | tensors, RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1 | "
        "tokengym packed (default) | tokengym packed, with the variable |",
        "|---|---|---|---|---|---|",
    ])  # fmt: skip
    for name, plain in results["0"].items():
        zc = results["1"][name]
        rows.append(f"| {name} | {plain['mb']:.1f} | {1000 * plain['torch']:.0f} | {1000 * zc['torch']:.0f} | "
                    f"{1000 * plain['packed']:.0f} | {1000 * zc['packed']:.0f} |")  # fmt: skip


# -- the demo job, synchronous vs asynchronous --
def _demo_env(config: DemoConfig, problems: list[dict]):
    """The env of ``tokengym._demo.build``, built on a Ray worker."""
    tok = tiny_tokenizer()
    return TokenEnv(problems, tok, arithmetic_reward(), batch_size=16, max_new_tokens=config.max_new_tokens,
                    group_size=config.group_size, max_length=64, shuffle=True, seed=config.seed)  # fmt: skip


def _demo_policy(env, config: DemoConfig, weights: dict):
    model = tiny_model(env.tokenizer, seed=config.seed)
    model.load_state_dict(weights)
    return TransformersPolicy(model, env, sampling=SamplingConfig(temperature=1.0), seed=config.seed)


class _Trainer:
    """One contestant: the demo's model, loss and optimizer, and a collector it trains from."""

    def __init__(self, config: DemoConfig, kind: str) -> None:
        problems, _ = split_problems(config)
        self.model, _, collector, self.loss, self.optim = build(config, problems)
        self.kind, self.rewards, self.seconds, self.advantage = kind, [], 0.0, GroupAdvantage("grpo")
        if kind == "sync":
            self.collector = collector
            self.publish = lambda: collector.update_policy_weights_()  # the model was trained in place
        elif kind.startswith("async thread"):
            in_flight = kind.split(", ")[1]
            policy = TransformersPolicy(copy.deepcopy(self.model), collector.env, seed=config.seed,
                                        sampling=SamplingConfig(temperature=1.0))  # the collector's own copy
            inner = TokenCollector(collector.env, policy, mode="trajectories", batch_size=config.trajectories,
                                   postproc=collector.postproc, options=CollectorOptions(in_flight=in_flight))
            self.collector = AsyncCollector(inner, max_staleness=1)
            self.publish = lambda: self.collector.update_policy_weights_(self.model.state_dict())
        else:  # async over one Ray worker
            weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            inner = RayTokenCollector(functools.partial(_demo_env, config, problems),
                                      functools.partial(_demo_policy, config=config, weights=weights), num_workers=1,
                                      mode="trajectories", batch_size=config.trajectories, postproc=collector.postproc,
                                      seed=config.seed)  # fmt: skip
            self.collector = AsyncCollector(inner, max_staleness=1)
            self.publish = lambda: self.collector.update_policy_weights_(self.model.state_dict())
        self.iterator = iter(self.collector)

    def step(self, is_timed: bool) -> None:
        """One demo iteration: take a batch, two optimizer steps, publish the weights."""
        start = time.perf_counter()
        batch = self.advantage(next(self.iterator))
        self.model.train()
        for _ in range(2):
            out = self.loss(batch)
            self.optim.zero_grad()
            out["loss_objective"].backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optim.step()
        self.model.eval()
        self.publish()
        self.rewards.append(float(self.collector.metrics["mean_reward"]))
        if is_timed:
            self.seconds += time.perf_counter() - start

    def close(self) -> None:
        self.collector.shutdown()


def test_demo_sync_vs_async(benchmark, spinners):
    config = DemoConfig(iterations=int(os.environ.get("TOKENGYM_DEMO_ITERS", DemoConfig.iterations)))
    kinds = ["sync", "async thread, continue", "async thread, drop", "async ray 1 worker"]
    trainers = {kind: _Trainer(config, kind) for kind in kinds}
    chunk = max(5, config.iterations // 8)
    parallelism: list[float] = []
    timed: dict[str, int] = dict.fromkeys(kinds, 0)

    def run():
        done = 0
        while done < config.iterations:
            parallelism.append(_parallelism(spinners))
            n = min(chunk, config.iterations - done)
            for kind in kinds[done // chunk % len(kinds) :] + kinds[: done // chunk % len(kinds)]:
                for j in range(n):
                    # the first iteration of a chunk is not timed: an async contestant collected ahead meanwhile
                    trainers[kind].step(is_timed=j > 0)
                    timed[kind] += j > 0
            done += n

    try:
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        metrics = {kind: dict(t.collector.metrics) for kind, t in trainers.items()}
        for t in trainers.values():
            t.close()
    its = {kind: timed[kind] / t.seconds for kind, t in trainers.items()}
    last = {kind: sum(t.rewards[-10:]) / len(t.rewards[-10:]) for kind, t in trainers.items()}
    benchmark.extra_info.update(iterations_per_s=its, last10_reward=last,
                                rewards={k: t.rewards for k, t in trainers.items()})  # fmt: skip
    title = "The make demo job, synchronous vs asynchronous (benchmarks/test_scaling.py::test_demo_sync_vs_async)"
    rows = _TABLES.setdefault(title, [
        f"DemoConfig defaults, {config.iterations} iterations each, seed {config.seed}; chunks of {chunk} iterations "
        f"round robin; available parallelism (median): {statistics.median(parallelism):.2f}.",
        "| trainer | iterations/s | ÷ sync | mean reward, last 10 | − sync | staleness mean | dropped tokens |",
        "|---|---|---|---|---|---|---|",
    ])  # fmt: skip
    for kind in kinds:
        m = metrics[kind]
        rows.append(f"| {kind} | {its[kind]:.2f} | {its[kind] / its['sync']:.2f} | {last[kind]:.3f} | "
                    f"{last[kind] - last['sync']:+.3f} | {m.get('staleness_mean', 0.0):.2f} | "
                    f"{int(m.get('dropped_tokens', 0))} |")  # fmt: skip
    window = max(1, config.iterations // 10)
    rows.append(f"Reward curves (mean over windows of {window} iterations):")
    for kind, t in trainers.items():
        means = [sum(t.rewards[i : i + window]) / len(t.rewards[i : i + window]) for i in range(0, len(t.rewards), window)]
        rows.append(f"- {kind}: " + " ".join(f"{x:.2f}" for x in means))
