"""The examples run end to end in a quick mode (each well under 20 s on 2 CPU cores, not asserted: timings vary with load)."""

from __future__ import annotations

import pathlib
import runpy
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("ppo.py", ["--iterations", "2", "--quick"]),
        ("grpo.py", ["--iterations", "2", "--quick"]),
        ("grpo.py", ["--iterations", "2", "--quick", "--correction", "truncate"]),
        ("custom_reward.py", ["--iterations", "2"]),
    ],
)
def test_example_runs(script, argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, *argv])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("\n") >= 2, out  # one line per iteration
    assert "nan" not in out.lower(), out
