"""`make demo` runs `python -m tokengym demo`: a quick run trains, prints the table and saves the curves."""

import dataclasses
import re
import subprocess
import sys

import pytest

from tokengym.__main__ import build_parser, main
from tokengym._demo import DemoConfig, split_problems
from tokengym._demo import main as run_demo

ROW = re.compile(r"^ *\d+ +[-\d.]+ +[-\d.na]+ +[-\d.na]+ +\d+ +[-\d.]+( +[\d.]+ +[\d.na]+)?$")


def test_demo_quick_run(tmp_path, capsys):
    main(["demo", "--iterations", "3", "--eval-every", "2", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "mean reward (training prompts, sampled): first 1 iterations" in out
    assert re.search(r"greedy accuracy: training prompts \(70\) [\d.]+ -> [\d.]+, held-out prompts \(30\) [\d.]+ -> [\d.]+", out)
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
    assert lines[6].startswith("greedy accuracy: training prompts (70)")
    assert lines[7].startswith("held-out greedy accuracy, after the warm start, every 2 iterations and after the last: ")
    assert len(lines[7].split(": ")[1].split()) == 3  # after the warm start, after iterations 2 and 4
    assert re.fullmatch(r"held-out problems answered right \(never trained on\): \d+ of 30 after the warm start -> "
                        r"\d+ of 30 after RL \([-+]\d+\)", lines[8])  # fmt: skip
    assert lines[9].startswith("reward curve: ")
    assert re.fullmatch(r"wall time: [\d.]+ s \(after imports\)", lines[10]) and len(lines) == 11


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
        (["--held-out", "46"], r"held_out must be <= 45, the pairs a != b of max_operand=9 .* got 46"),
        (["--seeds", "2", "--async"], "seeds=2 runs every seed in this process; drop --workers / --async"),
        (["--lr", "-1"], "lr must be > 0, got -1.0"),
        (["--iterations", "two"], "argument --iterations: invalid int value: 'two'"),
    ],
)
def test_demo_rejects_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("config", [DemoConfig(), DemoConfig(held_out=5, seed=1), DemoConfig(max_operand=4, held_out=10)])
def test_held_out_problems_are_never_trained_on(config):
    train, held_out = split_problems(config)
    assert len(train) == (config.max_operand + 1) ** 2 - config.held_out and len(held_out) == config.held_out
    trained = {p["prompt"] for p in train}
    assert not trained & {p["prompt"] for p in held_out}
    for p in held_out:  # a new pair of operands: its commuted twin is trained on, the sum is right
        a, b = p["prompt"].removesuffix("=").split("+")
        assert a != b and f"{b}+{a}=" in trained and p["answer"] == str(int(a) + int(b))
    assert split_problems(config) == (train, held_out)


@pytest.mark.slow
def test_seed_table_with_its_control(capsys):
    # `python -m tokengym demo --seeds N` at a reduced size: per seed the warm start, RL and the random-reward
    # control, all three evaluated on held-out problems that no arm trained on; then the verdict
    argv = ["demo", "--seeds", "2", "--seed", "3", "--iterations", "12", "--eval-every", "6", "--held-out", "12"]
    main(argv)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["seed 3", "seed 4"]
    assert lines[2].startswith("greedy accuracy: training (fraction of 88) / held-out (problems right of 12")
    table = [line.split(" | ") for line in lines[5:7]]
    assert [int(row[0].strip("| ")) for row in table] == [3, 4]
    for row in table:
        cells = [row[1], row[2], row[4]]  # after the warm start, after RL, the control: "training / held-out"
        train_acc = [float(c.split(" / ")[0]) for c in cells]
        held_right = [int(c.split(" / ")[1]) for c in cells]
        assert all(0 <= a <= 1 for a in train_acc) and all(0 <= n <= 12 for n in held_right)
        assert int(row[3]) == held_right[1] - held_right[0] and int(row[5].strip(" |")) == held_right[1] - held_right[2]
    assert re.fullmatch(r"verdict: RL gains >= 2 held-out problems over the warm start on [0-2] of 2 seeds and ends "
                        r"above the random-reward control on [0-2] of 2 \(bar: 2 of 2 each\): .+", lines[7])  # fmt: skip
    assert re.fullmatch(r"wall time: \d+ s", lines[8]) and len(lines) == 9
    for seed in (3, 4):
        train, held_out = split_problems(DemoConfig(seed=seed, held_out=12))
        assert len(held_out) == 12 and not {p["prompt"] for p in train} & {p["prompt"] for p in held_out}


@pytest.mark.slow
def test_demo_prints_the_held_out_curve(tmp_path, capsys):
    rows, evals = run_demo(DemoConfig(iterations=25, eval_every=5, out_dir=str(tmp_path)))
    out = capsys.readouterr().out
    assert len(rows) == 25 and [e["iter"] for e in evals] == [-1, 4, 9, 14, 19, 24]
    assert all(0 <= e[k] <= 1 for e in evals for k in ("train", "held_out"))
    curve = re.search(r"held-out greedy accuracy, after the warm start, every 5 iterations and after the last: (.+)", out)
    assert [float(v) for v in curve.group(1).split()] == pytest.approx([e["held_out"] for e in evals], abs=5e-4)
    right = re.search(r"(\d+) of 30 after the warm start -> (\d+) of 30 after RL \(([-+]\d+)\)", out)
    before, after, gain = (int(v) for v in right.groups())
    assert (before, after) == (round(30 * evals[0]["held_out"]), round(30 * evals[-1]["held_out"]))
    assert gain == after - before
