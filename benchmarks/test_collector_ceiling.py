"""Collector ceiling (issue 19): how fast tokengym turns already-generated tokens into batches, on one core.

The policies answer instantly (random tokens of random lengths, no model), so what is measured is
everything tokengym does around generation: the env's unroll (termination, rewards with the response
text decoded), recording, provenance and the batch TensorDict. Beside each collector, in the same run
and interleaved with it, the floor: the same waves turned into (N, T) action / log-prob / mask / done
tensors by a few torch ops. The share of decoding is the time the env's decoder takes on the same
responses, over the collector's time.

Run: ``pytest benchmarks/test_collector_ceiling.py -q`` (one torch thread; the table prints at the end).

``test_dynamic_sampling_cost`` measures what ``CollectorOptions(dynamic_sampling=...)`` costs: the same collector
with and without it, interleaved, with a reward that gives every sample its own score (every group spreads, so
both yield the same batches and only the filter's bookkeeping differs).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import pytest
import torch
from tensordict import TensorDict

from tokengym.collectors import CollectorOptions, DynamicSampling, TokenCollector
from tokengym.llm_envs import PromptSource, TokenEnv, keys
from tokengym.llm_envs.multi_turn_env import MultiTurnTokenEnv, Turn
from tokengym.llm_envs.waves import WaveResult
from tokengym.testing import tiny_tokenizer

_PROMPTS = [f"{a}+{b}=" for a in range(40) for b in range(40)]
_DATASET = [f"{a}+{b}*{c}=" for a in range(25) for b in range(20) for c in range(20)]  # 10,000 distinct prompts


class InstantPolicy:
    """Random tokens of random lengths (uniform in [1, budget]), no model: whole waves or one token per slot."""

    def __init__(self, vocab: int, first: int, *, p_end: float, seed: int = 0) -> None:
        self.vocab, self.first, self.p_end, self.version = vocab, first, p_end, 0
        self.gen = torch.Generator().manual_seed(seed)
        self.eos = first - 1

    def __call__(self, td):
        B = td.batch_size[0]
        action = torch.randint(self.first, self.vocab, (B,), generator=self.gen)
        action = torch.where(torch.rand(B, generator=self.gen) < self.p_end, self.eos, action)
        td.set(keys.ACTION, action)
        td.set(keys.ACTION_LOG_PROB, torch.zeros(B))
        return td.set(keys.POLICY_VERSION, torch.full((B,), self.version))

    def generate(self, request):
        n, T = len(request), int(request.max_new_tokens.max())
        actions = torch.randint(self.first, self.vocab, (n, T), generator=self.gen)
        lengths = (torch.rand(n, generator=self.gen) * request.max_new_tokens).long() + 1
        return WaveResult(actions, lengths.clamp(max=request.max_new_tokens), -torch.rand(n, T, generator=self.gen),
                          version=self.version)  # fmt: skip

    def update_weights(self, weights=None) -> int:
        self.version += 1
        return self.version

    def set_seed(self, seed: int) -> None:
        self.gen.manual_seed(seed)

    def collection_state(self) -> dict:
        return {"version": self.version}

    def load_collection_state(self, state) -> None:
        self.version = state["version"]

    def close(self) -> None:
        pass


def _zero_reward(responses, prompts, metadata):
    return [0.0] * len(responses)


_SCORES = itertools.count()


def _distinct_reward(responses, prompts, metadata):
    """Every response its own score: every group has reward spread."""
    return [float(next(_SCORES)) for _ in responses]


def _feedback(responses, prompts, metadata, turns):
    return [Turn(0.0, "ok") for _ in responses]


@dataclasses.dataclass(frozen=True)
class Case:
    source: str  # "wave" | "step"
    B: int
    max_new_tokens: int
    mode: str  # "trajectories" | "steps"
    turns: int = 1
    batches: int = 3
    dataset: bool = False  # 10,000 distinct prompts, each drawn once (group_size 1) instead of 1,600 x 8

    @property
    def name(self) -> str:
        turns = "single" if self.turns == 1 else f"{self.turns}-turn"
        data = "-10k-prompts" if self.dataset else ""
        return f"{self.source}-B{self.B}-T{self.max_new_tokens}-{self.mode}-{turns}{data}"


CASES = [
    Case("wave", 256, 1024, "trajectories"),
    Case("wave", 256, 1024, "steps"),
    Case("wave", 64, 256, "trajectories", batches=8),
    Case("wave", 256, 1024, "trajectories", turns=2),
    Case("step", 64, 256, "trajectories", batches=2),
    Case("step", 256, 256, "trajectories", batches=1),
    Case("step", 64, 256, "steps", batches=4),
    Case("step", 64, 256, "trajectories", batches=2, dataset=True),
]


def _collector(case: Case, *, reward=_zero_reward, options: CollectorOptions | None = None) -> TokenCollector:
    tok = tiny_tokenizer()
    source = PromptSource(_DATASET, tok) if case.dataset else PromptSource(_PROMPTS, tok, group_size=8)
    kwargs = dict(batch_size=case.B, max_new_tokens=case.max_new_tokens, max_length=case.turns * (case.max_new_tokens + 16) + 16)
    if case.turns == 1:
        env = TokenEnv(source, tok, reward, **kwargs)
    else:
        env = MultiTurnTokenEnv(source, tok, _feedback, max_turns=case.turns, **kwargs)
    first = max(tok.all_special_ids) + 1
    policy = InstantPolicy(len(tok), first, p_end=1.0 / (case.max_new_tokens / 2), seed=0)
    policy.eos = tok.eos_token_id
    size = case.B if case.mode == "trajectories" else (case.max_new_tokens if case.source == "wave" else 64)
    return TokenCollector(env, policy, mode=case.mode, batch_size=size, source=case.source, options=options)


def _floor(case: Case, state: dict):
    """The same waves as (N, T) tensors built by a few torch ops: the least any collector must do."""
    policy = InstantPolicy(len(tiny_tokenizer()), 16, p_end=0.0, seed=0)
    budget = torch.full((case.B,), case.max_new_tokens)

    class _Request:
        max_new_tokens = budget

        def __len__(self):
            return case.B

    def run() -> int:
        result = policy.generate(_Request())
        t = torch.arange(result.actions.shape[1])
        mask = t < result.lengths[:, None]
        done = t == (result.lengths - 1)[:, None]
        _ = (result.actions * mask, result.log_probs * mask, mask, done)
        return int(result.lengths.sum())

    return _cpu_timed(run, state, "cpu:floor")


def _step_floor(case: Case, state: dict):
    """The minimal tensor work of the same env steps: per step, sample B tokens as the instant policy does, write
    them into preallocated (B, T) storage at each slot's position, mark the ended slots and reset their counters."""
    tok = tiny_tokenizer()
    first = max(tok.all_special_ids) + 1
    policy = InstantPolicy(len(tok), first, p_end=1.0 / (case.max_new_tokens / 2), seed=0)
    B, T, eos = case.B, case.max_new_tokens, tok.eos_token_id
    storage = torch.zeros(B, T, dtype=torch.int64)
    pos, rows = torch.zeros(B, dtype=torch.int64), torch.arange(B)
    steps = 200

    def run() -> int:
        nonlocal pos
        tokens = 0
        for _ in range(steps):
            action = torch.randint(first, policy.vocab, (B,), generator=policy.gen)
            action = torch.where(torch.rand(B, generator=policy.gen) < policy.p_end, eos, action)
            storage[rows, pos] = action
            ended = (action == eos) | (pos + 1 >= T)
            pos = torch.where(ended, 0, pos + 1)
            tokens += B
        return tokens

    return _cpu_timed(run, state, "cpu:floor")


def _step_contract(case: Case, state: dict):
    """What the step contract alone costs, with no env logic: per env step, the observation TensorDict of the slots'
    state, the instant policy's sampling and its three keys written into it, a ``("next", ...)`` TensorDict of the
    step's keys, and every recorded key (21) kept and written into preallocated (B, T) storage 32 steps at a time
    (one stack and one copy per key), as a chunked recorder does at best."""
    tok = tiny_tokenizer()
    first = max(tok.all_special_ids) + 1
    policy = InstantPolicy(len(tok), first, p_end=1.0 / (case.max_new_tokens / 2), seed=0)
    B, T = case.B, case.max_new_tokens
    policy.eos = tok.eos_token_id  # the same sampling as the collector's policy
    obs = {k: torch.zeros(B, dtype=torch.bool if k == keys.ACTIVE else torch.int64)
           for k in (keys.TOKEN, keys.SEQ_LEN, keys.RESPONSE_LEN, keys.ACTIVE, keys.PROMPT_LEN, keys.TRAJ_ID,
                     keys.GROUP_ID, keys.SAMPLE_ID, keys.TURN)}  # fmt: skip
    flags = ("reward", "done", "terminated", "truncated")
    nxt_keys = (keys.TOKEN, keys.SEQ_LEN, keys.RESPONSE_LEN, keys.PROMPT_LEN, keys.TURN)
    kept: list[dict] = []
    storage: dict = {}
    steps, chunk = 200, 32

    def run() -> int:
        for _ in range(steps):
            td = TensorDict._new_unsafe(dict(obs), torch.Size([B]))
            policy(td)  # sampling, three keys set
            nxt = TensorDict._new_unsafe({**{k: obs[k] for k in nxt_keys}, "reward": torch.zeros(B, 1),
                                          **{f: torch.zeros(B, 1, dtype=torch.bool) for f in flags[1:]}}, torch.Size([B]))  # fmt: skip
            td.set(keys.NEXT, nxt)
            kept.append({**dict(td.items()), **{f"next.{k}": v for k, v in nxt.items()}})
            if len(kept) == chunk:
                for name, v in kept[0].items():
                    if not isinstance(v, torch.Tensor):
                        continue
                    if name not in storage:
                        storage[name] = v.new_zeros(B, T, *v.shape[1:])
                    storage[name][:, :chunk] = torch.stack([k[name] for k in kept], 1)
                kept.clear()
        return steps * B

    return _cpu_timed(run, state, "cpu:contract")


def _cpu_timed(run, state: dict, name: str):
    """``run`` that also records its tokens per second of this process's CPU time (a loaded machine's other
    jobs preempt the wall clock, not this)."""

    def timed() -> int:
        start = time.process_time()
        tokens = run()
        state.setdefault(name, []).append(tokens / max(time.process_time() - start, 1e-9))
        return tokens

    return timed


def _run(collector: TokenCollector, batches: int, state: dict):
    it = state.setdefault("it", iter(collector))
    next(it)

    def run() -> int:
        tokens = 0
        for _ in range(batches):
            tokens += int(next(it)[keys.MASK].sum())
        return tokens

    return _cpu_timed(run, state, "cpu:collector")


def _decode_share(collector: TokenCollector, batch) -> float:
    """Seconds the env's response decoder takes for ``batch``'s responses, per real token."""
    env = collector.base_env
    mask = batch[keys.MASK]
    rows = [batch[keys.ACTION][i][mask[i]] for i in range(batch.shape[0])] if batch.batch_dims == 2 else []
    tokens = sum(len(r) for r in rows)
    if not tokens:
        return 0.0
    decode = getattr(env, "decode_responses", None) or (lambda r: env.tokenizer.batch_decode(r, skip_special_tokens=True))
    start = time.perf_counter()
    decode(rows)
    return (time.perf_counter() - start) / tokens


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_collector_ceiling(benchmark, case, interleaved, ceiling_table):
    torch.manual_seed(0)
    collector = _collector(case)
    state: dict = {}
    runs = {"collector": _run(collector, case.batches, state)}
    runs["floor"] = _floor(case, state) if case.source == "wave" else _step_floor(case, state)
    if case.source == "step":
        runs["contract"] = _step_contract(case, state)
    rates = interleaved(runs, 3, benchmark)
    med = {n: statistics.median(v) for n, v in rates.items()}
    per_token = 1e6 / med["collector"]
    decode = _decode_share(collector, next(state["it"])) * 1e6
    cpu = statistics.median(state["cpu:collector"][1:])  # the warm-up call is left out
    row = {"tokens_per_s": med["collector"], "us_per_token": per_token, "decode_share": decode / per_token,
           "tokens_per_cpu_s": cpu, "us_per_token_cpu": 1e6 / cpu}  # fmt: skip
    if case.source == "step":
        row["us_per_env_step"] = per_token * case.B
        row["us_per_env_step_cpu"] = 1e6 / cpu * case.B
    if "floor" in med:
        row["floor_tokens_per_s"] = med["floor"]
        row["floor_tokens_per_cpu_s"] = statistics.median(state["cpu:floor"][1:])
        row["collector_over_floor"] = statistics.median(a / b for a, b in zip(rates["collector"], rates["floor"], strict=True))
    if "contract" in med:  # how many floors the step contract alone costs
        row["contract_cost_in_floors"] = statistics.median(f / c for c, f in zip(rates["contract"], rates["floor"], strict=True))
    benchmark.extra_info.update(row)
    ceiling_table[case.name] = row


def test_two_turn_over_single_turn(benchmark, interleaved):
    """Tokens/CPU-s of 2-turn waves over single-turn ones (B=256, up to 1024 tokens per trajectory, instant policy,
    6 batches per round), 7 rounds interleaved: a 2-turn trajectory's turns come from two waves and are copied into
    its batch, where a single-turn batch is one wave's rows as they are."""
    torch.manual_seed(0)
    cases = {"single": Case("wave", 256, 1024, "trajectories", batches=6),
             "2-turn": Case("wave", 256, 1024, "trajectories", turns=2, batches=6)}  # fmt: skip
    states: dict = {name: {} for name in cases}
    runs = {name: _run(_collector(case), case.batches, states[name]) for name, case in cases.items()}
    interleaved(runs, 7, benchmark)
    cpu = {name: states[name]["cpu:collector"][1:] for name in cases}  # the warm-up call is left out
    row = {f"tokens_per_cpu_s_{n}": statistics.median(v) for n, v in cpu.items()}
    row["two_turn_over_single"] = statistics.median(b / a for a, b in zip(cpu["single"], cpu["2-turn"], strict=True))
    benchmark.extra_info.update(row)
    print(f"\n2-turn ÷ single-turn waves (B256-T1024, tokens/CPU-s, median of 7 interleaved rounds): "
          f"single {row['tokens_per_cpu_s_single'] / 1e6:.2f}M, 2-turn {row['tokens_per_cpu_s_2-turn'] / 1e6:.2f}M, "
          f"ratio {row['two_turn_over_single']:.3f}")


SAMPLING_CASES = [Case("wave", 256, 1024, "trajectories"), Case("wave", 64, 256, "trajectories", batches=8),
                  Case("step", 64, 256, "trajectories", batches=2)]  # fmt: skip


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=[c.name for c in SAMPLING_CASES])
def test_dynamic_sampling_cost(benchmark, case, interleaved):
    """Tokens/s with and without dynamic sampling on the same settings (groups of 8), rounds interleaved."""
    torch.manual_seed(0)
    on = CollectorOptions(dynamic_sampling=DynamicSampling())
    collectors = {"off": _collector(case, reward=_distinct_reward), "on": _collector(case, reward=_distinct_reward, options=on)}
    states: dict = {name: {} for name in collectors}
    runs = {name: _run(c, case.batches, states[name]) for name, c in collectors.items()}
    rates = interleaved(runs, 5, benchmark)
    counts = collectors["on"].counts()
    assert counts["kept_groups"] == counts["drawn_groups"] > 0  # every group spread: the same batches
    row = {f"tokens_per_s_{n}": statistics.median(v) for n, v in rates.items()}
    row.update({f"tokens_per_cpu_s_{n}": statistics.median(states[n]["cpu:collector"][1:]) for n in collectors})
    row["on_over_off"] = statistics.median(a / b for a, b in zip(rates["on"], rates["off"], strict=True))
    benchmark.extra_info.update(row)
    print(f"\n{case.name}: " + ", ".join(f"{k} {v:,.3f}" if k == "on_over_off" else f"{k} {v / 1e6:.3f}M"
                                         for k, v in row.items()))  # fmt: skip
