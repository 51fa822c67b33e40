"""Benchmark setup: one torch thread, as in the tests; same-run ratio tables printed at the end.

The tables are markdown with the date, the machine and the configuration, so the tables of docs/benchmarks.md
are regenerated from ``make bench`` output.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: the suites import _publishing

# benchmarks/gpu/ holds the GPU machine's script (run by run.sh, not by pytest): --doctest-modules would import it
collect_ignore_glob = ["gpu/*"]

_THROUGHPUT: dict = {}
_BYTES: dict = {}
_TRL: dict = defaultdict(dict)
_CEILING: dict = {}


@pytest.fixture(scope="session")
def throughput_table():
    """(config, B) -> (description, {contestant: median tokens/s}, {(a, b): median per-round ratio a / b})."""
    return _THROUGHPUT


@pytest.fixture(scope="session")
def bytes_table():
    """buffer length -> bytes stored per step and slot."""
    return _BYTES


@pytest.fixture(scope="session")
def ceiling_table():
    """case name -> {tokens_per_s, us_per_token, decode_share, ...}, from test_collector_ceiling.py."""
    return _CEILING


@pytest.fixture(scope="session")
def trl_table():
    """contestant -> {"s_per_iter": ..., "collect_s": ..., "train_s": ..., "rewards": [...]}, from test_vs_trl.py."""
    return _TRL


def machine() -> str:
    """CPU model, cores, load, library versions: the context every table needs."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"{cpu}, {os.cpu_count()} cores{load}; torch {torch.__version__} ({torch.get_num_threads()} thread), "
            f"transformers {transformers.__version__}")  # fmt: skip


def _header(write, title: str) -> None:
    write("")
    write(f"### {title}")
    write(f"date: {datetime.date.today().isoformat()}; machine: {machine()}")


def _throughput_table(write) -> None:
    _header(write, "Collector throughput (benchmarks/test_collector_throughput.py)")
    write("Real (non-padding) tokens/s: median over interleaved rounds (contestants in a rotated order each round); "
          "ratios: median of the per-round ratios. Full-vocabulary sampling at temperature 1 for every contestant; "
          "one torch thread.")  # fmt: skip
    names = ["generate", "hand loop", "hand loop, inference mode", "stepwise", "wave", "torchrl"]
    pairs = list(dict.fromkeys(pair for _, _, ratios in _THROUGHPUT.values() for pair in ratios))
    write("| config | B | " + " | ".join(names + [f"{a} ÷ {b}" for a, b in pairs]) + " | setup |")
    write("|---" * (len(names) + len(pairs) + 3) + "|")
    for (name, B), (description, rates, ratios) in _THROUGHPUT.items():
        cells = [f"{rates[n]:.0f}" if n in rates else "-" for n in names]
        cells += [f"{ratios[pair]:.2f}" if pair in ratios else "-" for pair in pairs]
        write(f"| {name} | {B} | " + " | ".join(cells) + f" | {description} |")


def _trl_table(write) -> None:
    _header(write, "make demo job: tokengym vs TRL GRPOTrainer (benchmarks/test_vs_trl.py)")
    rows = dict(_TRL)
    info = rows.pop("_info", {})
    if info:
        write(info["description"])
    write("| trainer | s / iteration | ÷ TRL (paired) | collect s | train s | mean reward, first 5 | "
          "mean reward, last 5 |")  # fmt: skip
    write("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        first, last = r["rewards"][:5], r["rewards"][-5:]
        paired = f"{r['vs_trl']:.2f}" if "vs_trl" in r else "1"
        write(f"| {name} | {r['s_per_iter']:.3f} | {paired} | {r.get('collect_s', float('nan')):.3f} | "
              f"{r.get('train_s', float('nan')):.3f} | {sum(first) / len(first):.3f} | {sum(last) / len(last):.3f} |")
    for name, r in rows.items():
        write(f"reward curve, {name}: " + " ".join(f"{x:.2f}" for x in r["rewards"]))


@pytest.fixture(scope="session")
def write_uncaptured(request):
    """``write_uncaptured(write_table)``: call ``write_table(write_line)`` with pytest's capture lifted, for a
    module that prints its table in a fixture's teardown (after closing engines that must not outlive it)."""

    def write(write_table) -> None:
        plugins = request.config.pluginmanager
        with plugins.getplugin("capturemanager").global_and_fixture_disabled():
            write_table(plugins.getplugin("terminalreporter").write_line)

    return write


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    if _THROUGHPUT:
        _throughput_table(write)
    if _BYTES:
        write("bytes stored per step and slot: " + ", ".join(f"max_length {k}: {v:.0f} B" for k, v in sorted(_BYTES.items())))
    if _TRL:
        _trl_table(write)
    if _CEILING:
        _ceiling_table(write)


def _ceiling_table(write) -> None:
    _header(write, "Collector ceiling (benchmarks/test_collector_ceiling.py)")
    write("Instant policies (random tokens of random lengths, no model), reward fn ignoring its input (the response "
          "text is still decoded); real tokens per second of wall clock and of this process's CPU time (other jobs on "
          "a loaded machine preempt the first, not the second), median of 3 interleaved rounds; floor: for waves, the "
          "same waves as (N, T) action / log-prob / mask / done tensors by a few torch ops; for steps, per env step "
          "B sampled tokens written into preallocated (B, T) storage, ended slots marked and their counters reset; "
          "in the same rounds. collector ÷ floor is a ratio of tokens/s (1 = the floor's speed). Step cases: the step "
          "contract alone (observation and next TensorDicts, the policy's three keys, every recorded key written 32 "
          "steps at a time; no env logic), in floors of cost.")  # fmt: skip
    write("| case | tokens/s (wall) | tokens/CPU-s | µs/token (CPU) | µs/env step (CPU) | decoding share | "
          "floor tokens/CPU-s | collector ÷ floor (wall) | step contract alone (x floor) |")  # fmt: skip
    write("|---|---|---|---|---|---|---|---|---|")
    for name, r in _CEILING.items():
        step = f"{r['us_per_env_step_cpu']:.0f}" if "us_per_env_step_cpu" in r else "-"
        floor = f"{r['floor_tokens_per_cpu_s'] / 1e6:.1f}M" if "floor_tokens_per_cpu_s" in r else "-"
        ratio = f"{r['collector_over_floor']:.3f}" if "collector_over_floor" in r else "-"
        contract = f"{r['contract_cost_in_floors']:.2f}" if "contract_cost_in_floors" in r else "-"
        write(f"| {name} | {r['tokens_per_s'] / 1e6:.2f}M | {r['tokens_per_cpu_s'] / 1e6:.2f}M | "
              f"{r['us_per_token_cpu']:.3f} | {step} | {r['decode_share']:.0%} | {floor} | {ratio} | {contract} |")


def _interleaved(runs: dict, rounds: int, benchmark) -> dict[str, list[float]]:
    """Tokens/s of each contestant in each of ``rounds`` rounds; a round runs all, in a rotated order."""
    names = list(runs)
    rates: dict[str, list[float]] = {n: [] for n in names}
    state = {"round": 0}
    for name in names:  # warm-up: first prefill, lazy imports, allocator
        runs[name]()

    def one_round() -> None:
        r = state["round"]
        state["round"] += 1
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            tokens = runs[name]()
            rates[name].append(tokens / (time.perf_counter() - start))

    benchmark.pedantic(one_round, rounds=rounds, iterations=1, warmup_rounds=0)
    return rates


@pytest.fixture
def interleaved():
    """``interleaved(runs, rounds, benchmark)``: tokens/s of each contestant per round, run in a rotated order."""
    return _interleaved
