"""train() on 2 ranks (torchrun, gloo, CPU, float32) takes the one-process step on the union batch, data parallel and
FSDP2; resumes exactly; refuses bad setups on every rank. One torchrun launch runs every case
(``rank_program.py``); the one-process reference runs here meanwhile."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from tokengym import distributed

HERE = pathlib.Path(__file__).resolve().parent
STRATEGIES = ("dp", "fsdp2")


def _program():
    spec = importlib.util.spec_from_file_location("rank_program", HERE / "rank_program.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the 2-rank results, the one-process results, their directory)."""
    folder = tmp_path_factory.mktemp("ranks")
    log = open(folder / "torchrun.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(HERE / "rank_program.py"), str(folder / "ranks.pt"), "both"],
                             stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    try:
        _program().main(str(folder / "one.pt"), "one")
        code = ranks.wait(timeout=900)
    finally:
        if ranks.poll() is None:
            os.killpg(ranks.pid, signal.SIGKILL)
            ranks.wait()
        log.close()
    assert code == 0, (folder / "torchrun.log").read_text()[-6000:]
    return (torch.load(folder / "ranks.pt", weights_only=False), torch.load(folder / "one.pt", weights_only=False),
            folder)  # fmt: skip


def _close(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=0, msg=f"{what}: {key}")


CASES = [f"{loss}, {split}" for loss in ("GRPOLoss padded", "GRPOLoss shared prefix", "ClipPPOLoss")
         for split in ("whole", "token budget")]  # fmt: skip


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", [*CASES, "train, 3 iterations", "train, LoRA"])
def test_two_ranks_take_the_one_process_step_on_the_union_batch(runs, strategy, case):
    ranks, one, _ = runs
    got, want = ranks[strategy][case], one["one"][case]
    program = _program()
    torch.manual_seed(0)
    start = (program.lora_model if "LoRA" in case else program.tiny_model)(program.tiny_tokenizer()).state_dict()
    assert max(float((want["params"][k] - start[k]).abs().max()) for k in start) > 1e-3  # the step moved the model
    _close(got["params"], want["params"], f"{strategy} {case} parameters")
    assert len(got["rows"]) == len(want["rows"])
    for row, expected in zip(got["rows"], want["rows"], strict=True):
        for key in [k for k in expected if k == "loss" or k.startswith("loss_")]:
            assert row[key] == pytest.approx(expected[key], abs=1e-5), (strategy, case, key)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_log_the_global_row(runs, strategy):
    """train()'s rows under torchrun are every rank's: the union batch's loss, mean reward over both ranks' rows."""
    ranks, one, _ = runs
    got, want = ranks[strategy]["train, 3 iterations"]["rows"], one["one"]["train, 3 iterations"]["rows"]
    assert [row["iter"] for row in got] == [0, 1, 2]
    for row, expected in zip(got, want, strict=True):
        assert row["loss"] == pytest.approx(expected["loss"], abs=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_resume_exactly(runs, strategy):
    resume = runs[0][strategy]["resume"]
    (uninterrupted,), (resumed,) = resume["uninterrupted"], resume["resumed"]
    assert torch.equal(uninterrupted["tokens"], resumed["tokens"])
    assert torch.equal(uninterrupted["log_probs"], resumed["log_probs"])
    before, after = resume["params"]
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_a_checkpoint_of_two_ranks_is_refused_in_one_process(runs):
    folder = runs[2]
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) and this run has 1.*--nproc-per-node 2"):
        distributed.load_checkpoint(folder / "ranks.pt.dp.checkpoint", model=None, optimizer=None, collector=None)
    with pytest.raises(FileNotFoundError, match="no tokengym run checkpoint"):
        distributed.load_checkpoint(folder, model=None, optimizer=None, collector=None)


def test_batch_statistics_are_the_union_batchs_inside_train(runs):
    """Whitening (REINFORCE++) and a KL controller's measure, each rank on its half inside across_ranks, give the
    union batch's advantages and beta on every rank."""
    ranks, one, _ = runs
    got, want = ranks["statistics"], one["statistics"]
    torch.testing.assert_close(got["advantage"], want["advantage"], atol=1e-6, rtol=0)
    assert float(want["advantage"].abs().max()) > 0.1
    assert got["beta"] == pytest.approx(want["beta"] * 2, abs=1e-9)  # both ranks' controllers moved as one
    assert want["beta"][0] != pytest.approx(0.1)  # the controller moved


REFUSALS = {  # case -> (rank 0's error, rank 1's error): every rank ends, none waits on a collective
    "different prompts": ("ValueError: shard_prompts: the 2 ranks were given different prompt lists",) * 2,
    "different collectors": ("ValueError: train() under torch.distributed needs every rank set up alike, but the 2 "
                             "ranks differ in batch_size: rank 0 4, rank 1 2",) * 2,
    "a rank fails": ("RuntimeError: train(): another rank failed", "ValueError: rank 1's prepare failed"),
    "policy on the sharded model": ("ValueError: the collector's policy generates with an FSDP2-sharded",) * 2,
    "same prompts on every rank": ("every one of the 2 ranks collects from the same 8 prompts",) * 2,  # a warning
    "world size 2, 6 rows of groups of 4": ("ValueError: a batch of 12 rows (3 groups of 4) does not split into whole "
                                            "groups over 2 ranks (a group is never split across ranks): use "
                                            "total=16 or 8",) * 2,
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_setups_end_every_rank_with_an_error(runs, case):
    found = runs[0]["refusals"]
    for rank, expected in enumerate(REFUSALS[case]):
        assert found[rank][case].startswith(expected), (rank, found[rank][case])


def test_one_process_helpers():
    assert distributed.shard_prompts(["a", "b", "c"]) == ["a", "b", "c"]
    assert distributed.rank_batch_size(12, group_size=4) == 12
    with pytest.raises(ValueError, match="not a whole number of groups"):
        distributed.rank_batch_size(10, group_size=4)
    with pytest.raises(TypeError, match="a sequence"):
        distributed.shard_prompts("abc")
    with pytest.raises(ValueError, match="needs a process group"):
        distributed.shard_model(torch.nn.Linear(2, 2))
    model = torch.nn.Linear(2, 2)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in distributed.full_state_dict(model).items())


def test_the_torchrun_example_trains_a_sharded_model_on_two_ranks(tmp_path):
    """examples/distributed_grpo.py as its docstring runs it (FSDP2; the data-parallel path is the cases above)."""
    example = HERE.parents[1] / "examples" / "distributed_grpo.py"
    with open(tmp_path / "log", "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                str(example), "--iterations", "2", "--quick", "--fsdp"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        try:
            code = run.wait(timeout=600)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    out = (tmp_path / "log").read_text()
    assert code == 0, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("iter ")]
    assert [line.split()[1] for line in lines] == ["0", "1"], out[-4000:]  # rank 0 alone prints
    assert "nan" not in " ".join(lines)


def test_a_group_of_one_is_one_process(tmp_path):
    """vLLM's in-process engine initializes a process group of one for itself: train() after it is the one-process
    train() (no setup collectives, no same-prompts warning), shard_prompts gives every prompt."""
    import socket
    import warnings

    program = _program()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        tok, prompts = program.tiny_tokenizer(), program.arithmetic_prompts(4, seed=5)
        torch.manual_seed(0)
        model = program.tiny_model(tok)
        assert distributed.shard_prompts(prompts) == prompts
        collector = program._collector(model, prompts, 0, tok)
        loss = program.GRPOLoss(program.PaddedSequenceActor(model), entropy_bonus=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same-prompts warning would raise here
            rows = program.train(collector, loss, torch.optim.SGD(model.parameters(), lr=0.1), iterations=1,
                                 prepare=program.prepare)  # fmt: skip
        assert [row["iter"] for row in rows] == [0]
    finally:
        torch.distributed.destroy_process_group()
