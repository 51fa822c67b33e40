"""examples/reasoning_gym_heldout.py (the evaluation guide's held-out run) runs as written, shortened: pass@k before and
after GRPO on the held-out split, whose problems never reach training."""

import pathlib
import re
import runpy
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[3] / "examples" / "reasoning_gym_heldout.py"


@pytest.mark.slow  # 7 s on an idle core, 15 s on a busy one
def test_held_out_pass_at_k_before_and_after_grpo(monkeypatch, capsys):
    # a shortened warm start and three GRPO iterations (the page's run: 300 steps and 30 iterations)
    monkeypatch.setattr(sys, "argv", [EXAMPLE.name, "--warm-start-steps", "40", "--iterations", "3"])
    run = runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    before, after = run["before"], run["after"]
    for result in (before, after):
        assert result.metrics["prompts"] == 40 and result.metrics["samples"] == 320  # 8 samples per problem, once
        assert all(isinstance(result.metrics[k], float) and 0.0 <= result.metrics[k] <= 1.0 for k in ("pass@1", "pass@8"))
    held = {row["text"] for row in after.per_prompt}
    assert held == {row["text"] for row in before.per_prompt} and len(held) == 40
    assert run["trained_on"] and not held & run["trained_on"]  # GRPO trained on prompts, none of them held out
    assert len(run["train_problems"]) == 160 and len(run["rows"]) == 3
    lines = out.strip().splitlines()
    assert len(lines) == 5 and re.search(r"held-out \(40 problems\) after 3 GRPO iterations: +pass@1 [\d.]+, pass@8 ", lines[2])
    assert lines[3].endswith("held-out problems trained on: 0"), out


@pytest.mark.slow
def test_the_recipe_samples_trees_with_one_option(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [EXAMPLE.name, "--warm-start-steps", "2", "--iterations", "1", "--tree", "3,2"])
    run = runpy.run_path(str(EXAMPLE), run_name="__main__")
    metrics = run["collector"].metrics
    assert metrics["trees_started"] >= 8 and metrics["tree_forks"] > 0
    assert len(run["rows"]) == 1 and type(run["advantage"]).__name__ == "TreeAdvantage"
