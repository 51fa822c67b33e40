"""LoRA weight sync: bytes and seconds per update of an adapter ÷ a full-weight update, for TransformersPolicy,
VLLMPolicy and VLLMServerPolicy (``benchmarks/lora_weight_sync.py``, run in a fresh process: it starts two vLLM
engines and two vLLM servers; its docstring gives the configuration)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_lora_weight_sync(benchmark):
    script = os.path.join(os.path.dirname(__file__), "lora_weight_sync.py")
    out = {}

    def run():
        out["table"] = subprocess.run([sys.executable, script, "7"], capture_output=True, text=True, check=True,
                                      timeout=1200).stdout  # fmt: skip

    benchmark.pedantic(run, rounds=1, iterations=1)
    table = out["table"].strip()
    benchmark.extra_info["table"] = table
    print("\n" + table)
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ") and "backend" not in line]
    adapter = [float(r[4]) for r in rows if r[1].strip() == "adapter"]  # bytes / full
    assert len(adapter) == 3 and all(ratio < 0.1 for ratio in adapter)
