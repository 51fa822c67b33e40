"""One program, run by ``torchrun`` on 2 ranks (gloo, CPU) or as one process: the steps whose results the 2-rank run
must reproduce (``test_distributed_training.py`` compares them).

``python rank_program.py OUT [dp|fsdp2]``: under torchrun each rank trains on its half of each union batch (its
whole groups), the model whole on each rank (``dp``) or sharded (``fsdp2``); as one process it trains on the union
batch. Rank 0 (or the one process) saves, per case, the full parameters after the steps and the logged rows.
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.llm import GRPOLoss

from tokengym import distributed
from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    PaddedSequenceActor,
    SequenceActor,
    SharedPrefixActor,
    TransformersPolicy,
)
from tokengym.collectors.ray_collector import cat_batches
from tokengym.llm_envs import TokenEnv, keys
from tokengym.llm_envs.tasks import arithmetic_prompts
from tokengym.testing import make_trajectory_batch, tiny_model, tiny_tokenizer
from tokengym.training import TrainOptions, train, train_step
from tokengym.transforms import (
    AdaptiveKLController,
    GroupAdvantage,
    KLRewardTransform,
    across_ranks,
    to_padded,
)

torch.set_num_threads(1)

LOSSES = {  # name -> (loss from an actor, actor class, layout)
    "GRPOLoss padded": (lambda a: GRPOLoss(a, entropy_bonus=True, kl_to_ref_coeff=0.1), PaddedSequenceActor, "padded"),
    "GRPOLoss shared prefix": (lambda a: GRPOLoss(a, entropy_bonus=False), SharedPrefixActor, "padded"),
    "ClipPPOLoss": (lambda a: ClipPPOLoss(a, critic_network=None, entropy_bonus=True, functional=False),
                    SequenceActor, "steps"),
}  # fmt: skip
OPTIONS = {"whole": TrainOptions(max_grad_norm=0.5), "token budget": TrainOptions(micro_batch_tokens=24)}
LENGTHS = [3, 2, 4, 1, 5, 2, 6, 3]  # 4 groups of 2: ranks take groups {0, 1} and {2, 3}
SEEDS = (101, 202)  # a collecting rank's seed, by rank


def rows_of(batch, start: int, stop: int):
    """Rows [start, stop) of a trajectory batch, its prompt table kept."""
    part = batch.exclude(keys.PROMPTS)[start:stop]
    part.set_non_tensor(keys.PROMPTS, batch.get_non_tensor(keys.PROMPTS))
    return part


def layout(batch, kind: str):
    if kind == "steps":
        return batch
    return to_padded(batch)  # with the batch's reference log-probs (GRPOLoss's KL to the reference)


def trained_model(strategy: str, tok):
    torch.manual_seed(0)
    model = tiny_model(tok)
    if strategy == "fsdp2":
        distributed.shard_model(model)
    return model


def step_cases(strategy: str, rank: int, world: int) -> dict:
    tok, out = tiny_tokenizer(), {}
    union = GroupAdvantage("grpo")(make_trajectory_batch(LENGTHS, group_size=2, seed=3))
    rows = len(LENGTHS) // world
    part = rows_of(union, rank * rows, (rank + 1) * rows)
    for name, (make, actor, kind) in LOSSES.items():
        for split, options in OPTIONS.items():
            model = trained_model(strategy, tok)
            loss = make(actor(model, chunk_size=5))
            row = train_step(layout(part, kind), loss, torch.optim.SGD(model.parameters(), lr=1.0), options=options)
            out[f"{name}, {split}"] = {"params": distributed.full_state_dict(model), "rows": [row]}
    return out


def text_reward(responses, prompts, metadata) -> torch.Tensor:
    """A reward that differs within groups (the tiny model is rarely right): its answer's length mod 3."""
    return torch.tensor([float(len(r) % 3) for r in responses])


def statistics_case(rank: int, world: int) -> dict:
    """Batch statistics inside train()'s across_ranks: REINFORCE++'s whitened advantages and an adaptive KL
    controller's beta, from each rank's half (gathered) or from the union batch (one process)."""
    union = make_trajectory_batch(LENGTHS, group_size=2, seed=4)
    rows = len(LENGTHS) // world
    part = rows_of(union, rank * rows, (rank + 1) * rows)
    kl = KLRewardTransform(controller=AdaptiveKLController(0.1, target=0.5, horizon=4))
    with across_ranks():
        advantage = GroupAdvantage("reinforce_pp")(part.clone())[keys.ADVANTAGE]
        kl(part.clone())
    found = {"advantage": advantage, "beta": kl.beta}
    if world > 1:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, found)
        found = {"advantage": torch.cat([g["advantage"] for g in gathered]), "beta": [g["beta"] for g in gathered]}
    else:
        found["beta"] = [found["beta"]]
    return found


def _collector(model, prompts, seed: int, tok):
    env = TokenEnv(prompts, tok, text_reward, batch_size=4, max_new_tokens=6, group_size=2,
                   model_config=model.config)  # fmt: skip
    collector = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=4)
    collector.set_seed(seed)
    return collector


def lora_model(tok):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(tiny_model(tok), config)


def lora_case(strategy: str, rank: int, world: int) -> dict:
    """train_case with a LoRA model: only the adapters train; with FSDP2 only they are gathered for the policy."""
    tok, prompts = tiny_tokenizer(), arithmetic_prompts(8, seed=5)
    model = lora_model(tok)
    sampler, weights = model, None
    if strategy == "fsdp2":
        sampler = lora_model(tok)
        distributed.shard_model(model)
        weights = lambda: distributed.full_state_dict(model, adapters_only=True)  # noqa: E731
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    if world > 1:
        collector = _collector(sampler, distributed.shard_prompts(prompts), SEEDS[rank], tok)
        rows = train(collector, loss, optimizer, iterations=3, prepare=prepare, weights=weights)
        return {"params": distributed.full_state_dict(model), "rows": rows}
    collectors = [_collector(model, prompts[r::2], SEEDS[r], tok) for r in range(2)]
    batches = [iter(c) for c in collectors]
    rows = []
    for _ in range(3):
        rows.append(train_step(cat_batches([prepare(next(b)) for b in batches]), loss, optimizer))
        for c in collectors:
            c.update_policy_weights_(None)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "rows": rows}


def prepare(batch):
    return to_padded(GroupAdvantage("grpo")(batch))


def train_case(strategy: str, rank: int, world: int) -> dict:
    """3 iterations of collect, GRPO step, publish: each rank collects 4 rows from its prompts; one process collects
    the same rows with two collectors (each rank's prompts and seed) and trains on both batches at once."""
    tok, prompts = tiny_tokenizer(), arithmetic_prompts(8, seed=5)
    model = trained_model(strategy, tok)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    if world > 1:
        mine = distributed.shard_prompts(prompts)
        if strategy == "fsdp2":  # the policy generates with its own whole copy, sent the full weights each step
            torch.manual_seed(0)
            sampler = tiny_model(tok)
            collector = _collector(sampler, mine, SEEDS[rank], tok)
            rows = train(collector, loss, optimizer, iterations=3, prepare=prepare,
                         weights=lambda: distributed.full_state_dict(model))  # fmt: skip
        else:
            rows = train(_collector(model, mine, SEEDS[rank], tok), loss, optimizer, iterations=3, prepare=prepare)
        return {"params": distributed.full_state_dict(model), "rows": rows}
    collectors = [_collector(model, prompts[r::2], SEEDS[r], tok) for r in range(2)]
    batches = [iter(c) for c in collectors]
    rows = []
    for _ in range(3):
        data = cat_batches([prepare(next(b)) for b in batches])
        rows.append(train_step(data, loss, optimizer))
        for c in collectors:
            c.update_policy_weights_(None)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "rows": rows}


def _run(strategy: str, rank: int, tok, prompts):
    """A fresh run on this rank: the trained model, its optimizer (Adam: state to save), loss, sampler, collector."""
    model = trained_model(strategy, tok)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    sampler = model
    if strategy == "fsdp2":
        torch.manual_seed(0)
        sampler = tiny_model(tok)
    collector = _collector(sampler, distributed.shard_prompts(prompts), SEEDS[rank], tok)
    weights = (lambda: distributed.full_state_dict(model)) if strategy == "fsdp2" else None
    return model, optimizer, loss, sampler, collector, weights


def _iterate(run, iterations: int) -> list[dict]:
    """``train`` for ``iterations``; per iteration its row and the batch's tokens and sampled log-probs."""
    model, optimizer, loss, _, collector, weights = run
    seen = []
    def keep(row, data):
        seen.append({"row": dict(row), "tokens": data[keys.TOKENS].clone(), "log_probs": data[keys.LOG_PROBS].clone()})
    train(collector, loss, optimizer, iterations=iterations, prepare=prepare, weights=weights, on_iteration=keep)
    return seen


def resume_case(strategy: str, rank: int, directory: str) -> dict:
    """2 iterations, a checkpoint, a 3rd; then a new run loaded from the checkpoint takes the 3rd again."""
    tok, prompts = tiny_tokenizer(), arithmetic_prompts(8, seed=5)
    run = _run(strategy, rank, tok, prompts)
    _iterate(run, 2)
    distributed.save_checkpoint(directory, model=run[0], optimizer=run[1], collector=run[4])
    uninterrupted = _iterate(run, 1)
    again = _run(strategy, rank, tok, prompts)
    torch.manual_seed(1234)  # the random state comes from the checkpoint, not from here
    distributed.load_checkpoint(directory, model=again[0], optimizer=again[1], collector=again[4],
                                sampler=again[3] if strategy == "fsdp2" else None)  # fmt: skip
    resumed = _iterate(again, 1)
    return {"uninterrupted": uninterrupted, "resumed": resumed,
            "params": [distributed.full_state_dict(run[0]), distributed.full_state_dict(again[0])]}  # fmt: skip


def _error(call) -> str:
    """The error ``call`` raised, as ``Type: message`` ('' if none)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for the test to check
        return f"{type(error).__name__}: {error}"
    return ""


def refusals(rank: int) -> dict[str, str]:
    """What each rank gets for a bad setup (every case must end on every rank, never hang)."""
    tok, prompts = tiny_tokenizer(), arithmetic_prompts(8, seed=5)
    found = {"different prompts": _error(lambda: distributed.shard_prompts(prompts[rank:]))}
    torch.manual_seed(0)
    model = tiny_model(tok)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = GRPOLoss(PaddedSequenceActor(model), entropy_bonus=False)
    env_batch = 4 if rank == 0 else 2  # rank 1 collects fewer rows
    env = TokenEnv(prompts, tok, text_reward, batch_size=env_batch, max_new_tokens=4, group_size=2,
                   model_config=model.config)  # fmt: skip
    odd = TokenCollector(env, TransformersPolicy(model, env), mode="trajectories", batch_size=env_batch)
    found["different collectors"] = _error(lambda: train(odd, loss, optimizer, iterations=1, prepare=prepare))

    def failing(batch):
        if rank == 1:
            raise ValueError("rank 1's prepare failed")
        return prepare(batch)

    collector = _collector(model, distributed.shard_prompts(prompts), SEEDS[rank], tok)
    found["a rank fails"] = _error(lambda: train(collector, loss, optimizer, iterations=2, prepare=failing))
    sharded = distributed.shard_model(tiny_model(tok))
    on_sharded = _collector(sharded, distributed.shard_prompts(prompts), SEEDS[rank], tok)
    found["policy on the sharded model"] = _error(lambda: train(
        on_sharded, GRPOLoss(PaddedSequenceActor(sharded)), torch.optim.SGD(sharded.parameters(), lr=0.1),
        iterations=1, prepare=prepare, weights=lambda: distributed.full_state_dict(sharded)))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:  # every rank given every prompt
        warnings.simplefilter("always")
        train(_collector(model, prompts, SEEDS[rank], tok), loss, optimizer, iterations=1, prepare=prepare)
    found["same prompts on every rank"] = " | ".join(str(w.message) for w in caught if "same" in str(w.message))
    found["world size 2, 6 rows of groups of 4"] = _error(lambda: distributed.rank_batch_size(12, group_size=4))
    return found


def main(out: str, strategy: str = "both") -> None:
    """``one``: the one-process reference; ``both``: under torchrun, data parallel and FSDP2, and the refusals."""
    if strategy == "one":
        results = {"one": {**step_cases(strategy, 0, 1), "train, 3 iterations": train_case(strategy, 0, 1),
                           "train, LoRA": lora_case(strategy, 0, 1)},
                   "statistics": statistics_case(0, 1)}  # fmt: skip
        torch.save(results, out)
        return
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {}
    for name in ("dp", "fsdp2"):
        results[name] = {**step_cases(name, rank, world), "train, 3 iterations": train_case(name, rank, world),
                         "train, LoRA": lora_case(name, rank, world),
                         "resume": resume_case(name, rank, f"{out}.{name}.checkpoint")}  # fmt: skip
    results["statistics"] = statistics_case(rank, world)
    results["refusals"] = {rank: refusals(rank)}
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, results["refusals"][rank])
    results["refusals"] = dict(enumerate(gathered))
    if rank == 0:
        torch.save(copy.deepcopy(results), out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
