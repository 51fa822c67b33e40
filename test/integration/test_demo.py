"""`make demo` runs `python -m tokengym demo`: a quick run trains, prints the table and saves the curves."""

import dataclasses
import re
import subprocess
import sys

import pytest

from tokengym.__main__ import build_parser, main
from tokengym._demo import DemoConfig, split_problems

ROW = re.compile(r"^ *\d+ +[-\d.]+ +[-\d.na]+ +[-\d.na]+ +\d+ +[-\d.]+( +[\d.]+ +[\d.na]+)?$")


def test_demo_quick_run(tmp_path, capsys):
    main(["demo", "--iterations", "3", "--eval-every", "2", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "mean reward (training prompts, sampled): first 1 iterations" in out
    assert re.search(r"greedy accuracy: training prompts \(20\) [\d.]+ -> [\d.]+, held-out prompts \(5\) [\d.]+ -> [\d.]+", out)
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000


def test_demo_log_is_clean_when_stdout_is_not_a_terminal(tmp_path):
    # `make demo > log`: no progress bar, no carriage returns, one table row per line, in order
    cmd = [sys.executable, "-m", "tokengym", "demo", "--iterations", "4", "--eval-every", "2",
           "--warm-start-steps", "5", "--out-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stdout and "\r" not in done.stderr
    assert "collecting" not in done.stderr and "tok/s]" not in done.stderr  # no tqdm bar anywhere
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["iter", "reward", "kl", "beta", "tok/s", "loss", "acc_train", "acc_held"]
    rows = lines[1:5]
    assert all(ROW.match(line) for line in rows), rows
    assert [int(line.split()[0]) for line in rows] == [0, 1, 2, 3]
    assert [len(line.split()) for line in rows] == [6, 8, 6, 8]  # accuracy every 2 iterations
    assert lines[5].startswith("mean reward (training prompts, sampled): first 1 iterations")
    assert lines[6].startswith("greedy accuracy: training prompts (20)")
    assert lines[7].startswith("reward curve: ") and len(lines) == 8


def test_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for field in dataclasses.fields(DemoConfig):
        assert f"--{field.name.rstrip('_').replace('_', '-')} " in text, field.name
    assert "(TRL's num_generations, verl's rollout.n). (default: 8)" in " ".join(text.split())


def test_flags_build_the_config():
    args = vars(build_parser().parse_args(["demo", "--lr", "0.01", "--held-out", "3", "--out-dir", "x"]))
    args.pop("command")
    assert DemoConfig(**args) == DemoConfig(lr=0.01, held_out=3, out_dir="x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--iterations", "0"], "iterations must be a positive int, got 0"),
        (["--trajectories", "12"], r"trajectories \(12\) must be a multiple of group_size \(8\)"),
        (["--held-out", "25"], "held_out must be < the 25 problems of max_operand=4, got 25"),
        (["--lr", "-1"], "lr must be > 0, got -1.0"),
        (["--iterations", "two"], "argument --iterations: invalid int value: 'two'"),
    ],
)
def test_demo_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_held_out_problems_are_never_trained_on():
    train, held_out = split_problems(DemoConfig(held_out=5, seed=1))
    assert len(train) == 20 and len(held_out) == 5
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held_out}
    assert split_problems(DemoConfig(held_out=5, seed=1)) == (train, held_out)
