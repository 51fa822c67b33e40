"""The prepared GPU script's benchmark dry-runs on the CPU (the same code paths as on a GPU, the tiny model)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_dry_runs_on_the_cpu(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench.py"), "--device", "cpu", "--size", "tiny",
                          "--rounds", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    measures = {row["measure"] for row in result["rows"]}
    assert {"stepwise / hand loop (tok/s)", "waves / generate (tok/s)", "waves graph / waves (tok/s)",
            "stepwise compile / stepwise graph (tok/s)", "waves compile / waves graph (tok/s)"} <= measures, measures
    assert not [row for row in result["rows"] if "error" in str(row).lower()], result["rows"]
    assert "| throughput | stepwise / hand loop (tok/s) |" in (tmp_path / "gpu_bench.md").read_text()


def test_the_gpu_scripts_parse():
    for script in ("run.sh", "fetch_wheels.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu" / script)], check=True)
