"""Start cost of the ``python`` tool: bubblewrap sandbox vs the rlimit fallback vs a bare subprocess.

One call of ``run_python("pass")`` per round, the three contestants interleaved round by round
(the same machine load for each), medians reported in ms per call. ``bare`` is
``subprocess.run([python, "-I", "-S", "-c", "pass"])``: the floor, an interpreter start.

Run: ``.venv/bin/pytest benchmarks/test_python_sandbox.py --benchmark-only -s``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from tokengym.llm_envs.tools import run_python

ROUNDS = 30


def _bare() -> None:
    subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)


def test_sandbox_start_cost(benchmark):
    contestants = {"bare": _bare, "rlimit": lambda: run_python("pass", sandbox="rlimit"),
                   "bwrap": lambda: run_python("pass", sandbox="bwrap")}  # fmt: skip
    times = {name: [] for name in contestants}
    for fn in contestants.values():  # warm-up (the bwrap check is cached after its first call)
        fn()
    for _ in range(ROUNDS):
        for name, fn in contestants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    median_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    benchmark.pedantic(contestants["bwrap"], rounds=5, warmup_rounds=1)
    benchmark.extra_info.update({f"{name}_ms": round(ms, 2) for name, ms in median_ms.items()})
    benchmark.extra_info["bwrap_over_rlimit"] = round(median_ms["bwrap"] / median_ms["rlimit"], 3)
    print(f"\n| sandbox | ms per call (median of {ROUNDS}, interleaved) |\n|---|---|")
    for name, ms in median_ms.items():
        print(f"| {name} | {ms:.1f} |")
    print(f"bwrap / rlimit = {median_ms['bwrap'] / median_ms['rlimit']:.2f}")
