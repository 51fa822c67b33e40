"""The reasoning-gym recipe runs end to end in a quick mode and prints accuracy at init, after the warm
start and after RL; its flags are checked."""

import pytest
import torch

from tokengym.__main__ import main as cli
from tokengym._recipe_reasoning_gym import RandomReward, RecipeConfig, main, split_problems


def test_held_out_problems_are_never_trained_on():
    spec, train, held = split_problems(RecipeConfig())
    assert len(held) == 40 and len(train) == 160
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}


def test_quick_run_prints_the_three_stages(capsys):
    evals = main(RecipeConfig(iterations=2, trajectories=16, warm_start_steps=3, eval_every=1, warmup_iterations=1))
    out = capsys.readouterr().out
    assert [e["iter"] for e in evals] == ["init", "warm start", 0, 1]
    assert "held-out problems (never trained on): random init" in out and "nan" not in out.lower()


def test_seed_table_runs_both_arms_from_one_warm_start(capsys):
    rows = main(RecipeConfig(iterations=1, trajectories=16, warm_start_steps=3, eval_every=1, warmup_iterations=1,
                             seeds=2, samples=2, seed=4))  # fmt: skip
    out = capsys.readouterr().out
    assert [r["seed"] for r in rows] == [4, 5]
    for r in rows:
        assert set(r) >= {"warm", "grpo", "control", "grpo_sampled", "control_sampled"}
        assert 0.0 <= r["control_sampled"]["pass@2"] <= 1.0
    assert "| seed | after the warm start | GRPO |" in out and "random-reward control: held-out change mean" in out
    assert "CPU:" in out and "torch CPU capability" in out


def test_quick_run_with_dynamic_sampling_trains_on_spread_groups_only():
    from tokengym._recipe_reasoning_gym import build, warm_started

    config = RecipeConfig(iterations=1, trajectories=16, warm_start_steps=150, dynamic_sampling=True, samples=2)
    problems, tok, reward, model, _ = warm_started(config, log=lambda _line: None)
    collector, _, _ = build(config, model, tok, reward, problems[0])
    batch = next(iter(collector))
    score = batch["next", "reward_raw"].squeeze(-1).sum(1).reshape(-1, config.group_size)
    assert bool((score.max(1).values > score.min(1).values).all())
    assert collector.metrics["kept_groups"] == 2 and collector.metrics["drawn_groups"] >= 2
    collector.shutdown()


def test_random_reward_is_seeded_and_ignores_the_response():
    a, b = RandomReward(3), RandomReward(3)
    first = a(["x"] * 64, [""] * 64, [{}] * 64)
    assert torch.equal(first, b(["right"] * 64, [""] * 64, [{}] * 64))
    assert set(first.tolist()) == {0.0, 1.0}


def test_bad_flags():
    with pytest.raises(SystemExit):
        cli(["recipe-reasoning-gym", "--task", "sudoku"])
    with pytest.raises(ValueError, match="trajectories .* must be a multiple of group_size"):
        RecipeConfig(trajectories=10, group_size=4)
    with pytest.raises(ValueError, match="warm_start_fraction must be in"):
        RecipeConfig(warm_start_fraction=0.0)
    with pytest.raises(ValueError, match="model_size must be"):
        RecipeConfig(model_size="huge")
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        RecipeConfig(epochs=0)
    with pytest.raises(ValueError, match="seeds must be a positive int"):
        RecipeConfig(seeds=0)
