"""Training throughput on 2 ranks (torchrun, gloo, CPU) against one process at the same total batch.

``python benchmarks/distributed_throughput.py [--rounds 3]``: each round launches the one-process run and the 2-rank
runs (data parallel, FSDP2) back to back, in an order rotated per round; each run trains GRPO (collect, step, publish)
on a total batch of ``ROWS`` rows (groups of 4) and reports the wall time of every iteration after the first. The
table gives the medians over rounds of the per-run median iteration time, the rows per second, and per round the
ratio to the one-process run of that round. One torch thread per process; the machine's 2 cores are the 2 ranks'.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROWS, GROUP, NEW_TOKENS, ITERATIONS = 32, 4, 16, 6


def run(out: str, strategy: str) -> None:
    """One run (``one``: this process alone; ``dp`` / ``fsdp2``: a rank under torchrun); writes its iteration times."""
    import copy

    import torch

    torch.set_num_threads(1)
    from torchrl.objectives.llm import GRPOLoss

    from tokengym import distributed
    from tokengym.collectors import TokenCollector
    from tokengym.collectors.policies import PaddedSequenceActor, TransformersPolicy
    from tokengym.llm_envs import TokenEnv
    from tokengym.llm_envs.tasks import arithmetic_prompts, arithmetic_reward
    from tokengym.testing import tiny_model, tiny_tokenizer
    from tokengym.training import train
    from tokengym.transforms import GroupAdvantage, to_padded

    if strategy != "one":
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if strategy != "one" else 0
    tok = tiny_tokenizer()
    model = tiny_model(tok, size="small", seed=0)
    rows = distributed.rank_batch_size(ROWS, group_size=GROUP)
    prompts = distributed.shard_prompts(arithmetic_prompts(256, seed=0))
    env = TokenEnv(prompts, tok, arithmetic_reward(), batch_size=rows, max_new_tokens=NEW_TOKENS, group_size=GROUP,
                   model_config=model.config, seed=rank)  # fmt: skip
    sampler = model
    if strategy == "fsdp2":
        sampler = copy.deepcopy(model)
        distributed.shard_model(model)
    collector = TokenCollector(env, TransformersPolicy(sampler, env, seed=rank), mode="trajectories", batch_size=rows)
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    stamps = [time.perf_counter()]
    train(collector, loss, optim, iterations=ITERATIONS,
          prepare=lambda batch: to_padded(GroupAdvantage("grpo")(batch)),
          on_iteration=lambda row, data: stamps.append(time.perf_counter()),
          weights=(lambda: distributed.full_state_dict(model)) if strategy == "fsdp2" else None)  # fmt: skip
    if rank == 0:
        with open(out, "w") as f:
            json.dump([b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)], f)  # iterations after the first
    if strategy != "one":
        torch.distributed.destroy_process_group()


def _launch(strategy: str, folder: str) -> float:
    out = os.path.join(folder, f"{strategy}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if strategy == "one":
        command = [sys.executable, __file__, "as-rank", out, "one"]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
                   "as-rank", out, strategy]  # fmt: skip
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return statistics.median(json.load(f))


def main(rounds: int) -> None:
    names = ["one", "dp", "fsdp2"]
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as folder:
        for r in range(rounds):
            for name in names[r % 3:] + names[:r % 3]:
                times[name].append(_launch(name, folder))
    print(f"GRPO on tiny_model(size='small'), {ROWS} rows per step (groups of {GROUP}), {NEW_TOKENS} new tokens, "
          f"{ITERATIONS - 1} timed iterations per run, {rounds} rounds; gloo on the CPU, one torch thread per process\n")
    print("| run | seconds per iteration (median) | rows/s | speed vs one process (median of rounds) |")
    print("|---|---|---|---|")
    for name, label in (("one", "1 process"), ("dp", "2 ranks, data parallel"), ("fsdp2", "2 ranks, FSDP2")):
        med = statistics.median(times[name])
        ratio = statistics.median(o / t for o, t in zip(times["one"], times[name], strict=True))
        print(f"| {label} | {med:.3f} | {ROWS / med:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "as-rank":
        run(sys.argv[2], sys.argv[3])
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        parser.add_argument("--rounds", type=int, default=3)
        main(parser.parse_args().rounds)
