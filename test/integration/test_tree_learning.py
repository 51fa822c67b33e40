"""benchmarks/tree_learning.py (trees vs chains at an equal token budget, with a random-reward control) runs as
written, shortened to one seed and a small budget: every arm spends the budget and the report has a row per arm."""

import pathlib
import runpy
import sys

import pytest

PROGRAM = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "tree_learning.py"


@pytest.mark.slow
def test_the_report_compares_trees_and_chains_at_an_equal_budget(monkeypatch, capsys):
    argv = [PROGRAM.name, "--seeds", "1", "--token-budget", "200", "--warm-start-steps", "2", "--tree", "2,2"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(PROGRAM), run_name="__main__")
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("| ") and "arm" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == ["chains", "tree", "chains, random reward", "tree, random reward"]
    spent = [line for line in captured.err.splitlines() if line.startswith("seed 0")]
    assert len(spent) == 4 and all(int(line.split(" tokens,")[0].rsplit(" ", 1)[1]) >= 200 for line in spent)
    chains, tree = (float(r.split(" | ")[2]) for r in rows[:2])
    assert tree < chains  # a tree's leaves share tokens: fewer sampled per leaf
