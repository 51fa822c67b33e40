"""The models and the four generation contestants of ``bench.py``: each samples with tokengym's ``sample_tokens``
(temperature 1, full vocabulary), records the chosen token's log-prob and counts only real (non-padding) tokens."""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import inspect
import statistics
import time
import traceback
import warnings

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, Qwen2Config, Qwen2ForCausalLM
from transformers.cache_utils import Cache, CacheLayerMixin

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import SamplingConfig, TransformersPolicy, sample_tokens
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer

REAL_VOCAB = 151936
PROMPT_TOKENS = 32


def build_model(size: str, device: torch.device):
    """``(tokenizer, model, description)``: Qwen2.5-0.5B's shape with random weights in bf16 (``real``), or
    tokengym's tiny model in float32 (``tiny``). The tiny tokenizer's ids (< 512) are valid ids of either."""
    tok = tiny_tokenizer()
    if size == "tiny":
        model = tiny_model(tok).to(device).eval()
        return tok, model, f"tiny Qwen2 (vocab {model.config.vocab_size}), float32"
    config = Qwen2Config(vocab_size=REAL_VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: seconds, not a minute of CPU init
        model = Qwen2ForCausalLM(config)
    model = model.to(device, dtype=torch.bfloat16).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    return tok, model, "Qwen2.5-0.5B config (24 x 896, vocab 151,936), random weights, bf16"


def prompt_texts(tok, n: int) -> list[str]:
    """``n`` distinct prompts of about ``PROMPT_TOKENS`` tokens each."""
    texts = [f"Question {i}: what is {i} + {2 * i + 3}? Think step by step, then give the final value." for i in range(n)]
    return [tok.decode(tok(t)["input_ids"][:PROMPT_TOKENS]) for t in texts]


@dataclasses.dataclass
class Job:
    """What every contestant is asked: ``B`` prompts, up to ``new_tokens`` each or until EOS."""

    tok: object
    model: object
    device: torch.device
    B: int
    new_tokens: int

    @functools.cached_property
    def prompts(self) -> list[str]:
        return prompt_texts(self.tok, self.B)

    @property
    def eos(self) -> list[int]:
        return [self.tok.eos_token_id]

    @property
    def max_length(self) -> int:
        return 2 * PROMPT_TOKENS + self.new_tokens  # the env's buffer: the model's 32k context is not needed

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and attention mask (B, P) on the device."""
        x = self.tok(self.prompts, return_tensors="pt", padding=True)  # the tiny tokenizer pads on the left
        return x["input_ids"].to(self.device), x["attention_mask"].to(self.device)

    def env(self, reward_fn=None, *, group_size: int = 1, max_new_tokens: int | None = None, prompts=None) -> TokenEnv:
        prompts = self.prompts[: self.B // group_size] if prompts is None else prompts
        return TokenEnv(prompts, self.tok, reward_fn, batch_size=self.B, group_size=group_size,
                        max_new_tokens=max_new_tokens or self.new_tokens, eos_token_ids=self.eos,
                        model_config=self.model.config, max_length=self.max_length)  # fmt: skip

    def policy(self, env, decode: str = "dynamic") -> TransformersPolicy:
        return TransformersPolicy(self.model, env, sampling=SamplingConfig(), seed=0, decode=decode)


def real_tokens(actions: torch.Tensor, eos: list[int]) -> int:
    """Tokens up to and including the first EOS of each row (B, T)."""
    ended = torch.isin(actions, torch.tensor(eos, device=actions.device))
    after = (ended.cumsum(1) - ended.long()) > 0  # strictly after the first EOS
    return int((~after).sum())


def hand_loop(job: Job):
    """The practical limit: prefill (last position only), then per token one cached forward of the batch,
    ``sample_tokens`` and one device-to-host copy of the sampled ids to test EOS on the host, as the env does."""
    ids, mask = job.padded()
    model, eos = job.model, torch.tensor(job.eos)
    gen, sampling = torch.Generator(device=job.device).manual_seed(0), SamplingConfig()
    ones = torch.ones(job.B, 1, dtype=mask.dtype, device=job.device)
    # a one-token step's mask as SDPA takes it (B, 1, 1, C): a 2-D mask makes transformers read on the host whether
    # any column is masked, one more synchronization per step (the policy's KV cache passes the 4-D mask too)
    as_4d = (lambda a: a.bool()[:, None, None, :]) if model.config._attn_implementation == "sdpa" else (lambda a: a)

    @torch.inference_mode()
    def run() -> int:
        cache, attention = DynamicCache(config=model.config), mask
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       logits_to_keep=1).logits[:, -1]  # fmt: skip
        last, running, real, log_probs = pos[:, -1:], torch.ones(job.B, dtype=torch.bool), 0, []
        for _ in range(job.new_tokens):
            tokens, logp, _ = sample_tokens(logits, sampling, gen, with_raw_log_prob=False)
            log_probs.append(logp)
            real += int(running.sum())
            running &= ~torch.isin(tokens.cpu(), eos)  # the one host copy per step; ended rows are masked
            if not bool(running.any()):
                break
            attention, last = torch.cat([attention, ones], 1), last + 1
            logits = model(input_ids=tokens[:, None], attention_mask=as_4d(attention), position_ids=last,
                           past_key_values=cache).logits[:, -1]  # fmt: skip
        return real

    return run


class _Columns(CacheLayerMixin):
    """The graph loop's cache layer: keys and values (B, H, C, D) allocated once, each step's column written in
    place at a position held on the device (transformers' own StaticLayer moved its API between 5.17 and 5.19)."""

    is_compileable, is_sliding = True, False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, column: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.column, self.is_initialized = keys, values, column, True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.column, key_states)
        self.values.index_copy_(2, self.column, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length, *args):
        return self.keys.shape[2], 0

    def get_seq_length(self, *args):
        return 0

    def get_max_length(self):
        return self.keys.shape[2]


def graph_loop(job: Job):
    """The GPU's own speed, the baseline the others are measured against: the prompts prefilled into static buffers
    (prompt + new tokens columns), then per token one replay of a CUDA graph holding the model's forward over them,
    ``sample_tokens`` (its uniforms drawn before the replay: what ``torch.rand`` draws) and the chosen token's
    log-prob, and one device-to-host copy of the ids to test EOS on the host. Captured at the first run (the warm-up
    round); on the CPU the same step runs uncaptured."""
    ids, mask = job.padded()
    model, eos, B, P = job.model, torch.tensor(job.eos), ids.shape[0], ids.shape[1]
    C, dev, sampling = P + job.new_tokens, job.device, SamplingConfig()
    gen = torch.Generator(device=dev).manual_seed(0)
    probe = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids[:1, :1], past_key_values=probe, logits_to_keep=1)
    column = torch.zeros(1, dtype=torch.int64, device=dev)
    layers = [_Columns(torch.zeros(B, k.shape[1], C, k.shape[3], dtype=k.dtype, device=dev),
                       torch.zeros(B, v.shape[1], C, v.shape[3], dtype=v.dtype, device=dev), column)
              for k, v in ((layer.keys, layer.values) for layer in probe.layers)]  # fmt: skip
    cache = Cache(layers=layers)
    allowed = torch.zeros(B, C, dtype=torch.bool, device=dev)  # the columns each row attends to
    inputs = torch.zeros(B, 2, dtype=torch.int64, device=dev)  # token, position
    uniforms = torch.zeros(B, 1, dtype=torch.float64, device=dev)
    sdpa = model.config._attn_implementation == "sdpa"
    dtype = layers[0].keys.dtype

    def as_mask(a: torch.Tensor) -> torch.Tensor:  # bool for SDPA, additive for eager
        return a if sdpa else torch.zeros(a.shape, dtype=dtype, device=dev).masked_fill_(~a, torch.finfo(dtype).min)

    def step():
        allowed.index_fill_(1, column, True)
        logits = model(input_ids=inputs[:, :1], attention_mask=as_mask(allowed[:, None, None, :]),
                       position_ids=inputs[:, 1:], past_key_values=cache).logits[:, -1]  # fmt: skip
        return sample_tokens(logits, sampling, gen, with_raw_log_prob=False, uniforms=uniforms)[:2]

    graph: list = []  # [(graph, outputs)] once captured

    def replay():
        if dev.type != "cuda":
            return step()
        if not graph:
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream(dev).wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                graph.append((g, step()))
        graph[0][0].replay()
        return graph[0][1]

    @torch.inference_mode()
    def run() -> int:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cols = torch.arange(P, device=dev)
        causal = (cols[None, :] <= cols[:, None]) & mask.bool()[:, None, :]  # (B, P, P), pads attend to themselves
        causal |= torch.eye(P, dtype=torch.bool, device=dev)
        sub = DynamicCache(config=model.config)
        logits = model(input_ids=ids, attention_mask=as_mask(causal[:, None]), position_ids=pos, past_key_values=sub,
                       logits_to_keep=1).logits[:, -1]  # fmt: skip
        for layer, new in zip(layers, sub.layers, strict=True):
            layer.keys[:, :, :P], layer.values[:, :, :P] = new.keys, new.values
        allowed.zero_()
        allowed[:, :P] = mask.bool()
        column.fill_(P)
        inputs[:, 1:] = pos[:, -1:]
        tokens, logp = sample_tokens(logits, sampling, gen, with_raw_log_prob=False)[:2]
        running, real, log_probs = torch.ones(B, dtype=torch.bool), 0, [logp]
        for t in range(job.new_tokens):
            real += int(running.sum())
            running &= ~torch.isin(tokens.cpu(), eos)  # the one host copy per step; ended rows are masked
            if not bool(running.any()) or t == job.new_tokens - 1:
                break
            inputs[:, 0] = tokens
            inputs[:, 1] += 1
            uniforms.uniform_(0, 1, generator=gen)
            tokens, logp = replay()
            log_probs.append(logp.clone())
            column.add_(1)
        return real

    return run


class SampleWithTokengym(LogitsProcessor):
    """Draws inside ``generate`` with ``sample_tokens`` and records the log-prob; one-hot scores for greedy."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator, self.sampling, self.log_probs = generator, SamplingConfig(), []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        action, logp, _ = sample_tokens(scores, self.sampling, self.generator, with_raw_log_prob=False)
        self.log_probs.append(logp)
        return torch.full_like(scores, -float("inf")).scatter_(-1, action[:, None], 0.0)


def generate(job: Job):
    ids, mask = job.padded()
    gen = torch.Generator(device=job.device).manual_seed(0)

    def run() -> int:
        sampler = SampleWithTokengym(gen)
        out = job.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=job.new_tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([sampler]), eos_token_id=job.eos,
                                 pad_token_id=job.tok.pad_token_id, num_beams=1, use_cache=True)  # fmt: skip
        return real_tokens(out[:, ids.shape[1] :], job.eos)

    return run


def stepwise(job: Job):
    """One STEPS batch of ``new_tokens`` env steps (B * new_tokens frames); finished slots are refilled."""
    env = job.env()
    batches = iter(TokenCollector(env, job.policy(env), mode="steps", batch_size=job.new_tokens))
    return lambda: int(next(batches).get(keys.MASK).sum())


def _stepwise_on(job: Job, decode: str):
    """``stepwise`` with the policy's ``decode``; ``run.capture_seconds``: its captures' (compiles') seconds."""
    env = job.env()
    policy = job.policy(env, decode)
    batches = iter(TokenCollector(env, policy, mode="steps", batch_size=job.new_tokens))

    def run() -> int:
        tokens = int(next(batches).get(keys.MASK).sum())
        if policy.graph is not None:
            run.capture_seconds = policy.graph.capture_seconds
        return tokens

    run.capture_seconds = None
    return run


def stepwise_graph(job: Job):
    """``stepwise`` with the policy's decode step captured in a CUDA graph (``decode="graph"``; ``"static"``, the
    same step uncaptured, on the CPU)."""
    return _stepwise_on(job, "graph" if job.device.type == "cuda" else "static")


def stepwise_compile(job: Job):
    """``stepwise`` with the policy's decode step compiled (``decode="compile"``: ``torch.compile`` with
    ``mode="reduce-overhead"``, CUDA graphs on CUDA, Inductor's kernels on the CPU)."""
    return _stepwise_on(job, "compile")


def waves(job: Job):
    """One TRAJECTORIES batch of B trajectories, each generated in one ``model.generate`` wave and unrolled."""
    env = job.env()
    batches = iter(TokenCollector(env, job.policy(env), source="wave", mode="trajectories", batch_size=job.B))
    return lambda: int(next(batches).get(keys.MASK).sum())


def waves_graph(job: Job):
    """``waves`` on the policy's captured decode step (``decode="graph"``; ``"static"`` on the CPU): each wave one
    replayed graph per token instead of ``model.generate``."""
    env = job.env()
    policy = job.policy(env, "graph" if job.device.type == "cuda" else "static")
    batches = iter(TokenCollector(env, policy, source="wave", mode="trajectories", batch_size=job.B))
    return lambda: int(next(batches).get(keys.MASK).sum())


def waves_compile(job: Job):
    """``waves`` on the policy's compiled decode step (``decode="compile"``)."""
    env = job.env()
    policy = job.policy(env, "compile")
    batches = iter(TokenCollector(env, policy, source="wave", mode="trajectories", batch_size=job.B))
    return lambda: int(next(batches).get(keys.MASK).sum())


CONTESTANTS = {"graph loop": graph_loop, "hand loop": hand_loop, "stepwise": stepwise,
               "stepwise graph": stepwise_graph, "stepwise compile": stepwise_compile, "generate": generate,
               "waves": waves, "waves graph": waves_graph, "waves compile": waves_compile}  # fmt: skip


# -- measurements --
def interleaved(runs: dict, rounds: int, sync, log) -> tuple[dict[str, list[float]], dict[str, str], list[float]]:
    """Run every contestant once per round, order rotated per round; round 0 is a warm-up, not counted.

    Returns tokens/s per timed round of each contestant, the error of each that failed (dropped from later
    rounds) and the seconds of every run (to plan the time left)."""
    names = list(runs)
    rates: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, str] = {}
    seconds: list[float] = []
    for r in range(rounds + 1):
        k, done = r % len(names), []
        for name in names[k:] + names[:k]:
            if name in errors:
                continue
            try:
                sync()
                t = time.perf_counter()
                tokens = runs[name]()
                sync()
                dt = time.perf_counter() - t
            except Exception as err:  # one contestant failing leaves the others' numbers
                traceback.print_exc()
                errors[name] = error_text(err)
                continue
            seconds.append(dt)
            done.append(f"{name} {dt:.2f}s/{tokens}tok")
            if r:
                rates[name].append(tokens / dt)
        log(f"  round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(done))
    return rates, errors, seconds


def error_text(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def peak_memory(make, job: Job, sync) -> tuple[int, int] | None:
    """``(peak bytes allocated, bytes allocated before)`` of building contestant ``make`` and running it once
    (CUDA; ``None`` elsewhere, after running it all the same)."""
    is_cuda = job.device.type == "cuda"
    if is_cuda:
        gc.collect()
        torch.cuda.empty_cache()
        sync()
        before = torch.cuda.memory_allocated(job.device)
        torch.cuda.reset_peak_memory_stats(job.device)
    make(job)()
    sync()
    return (torch.cuda.max_memory_allocated(job.device), before) if is_cuda else None


def _syncs(caught) -> int:
    return sum("synchroniz" in str(w.message) for w in caught)


def _sites(caught) -> list[str]:
    """Where each synchronizing operation was called from (file:line of the Python frame)."""
    return [f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def count_syncs(job: Job, steps: int) -> dict:
    """Drive a TokenEnv and a TransformersPolicy by hand for ``steps`` env steps (policy, then
    ``env.step_and_maybe_reset``, as the step source does) and count the synchronizing CUDA operations of each step
    (``torch.cuda.set_sync_debug_mode("warn")``). Enough prompts that every slot is refilled every
    ``job.new_tokens`` steps; a step is a refill step when the env refilled a slot in it or in the step before (the
    policy then prefills), or it is the first (every slot prefilled)."""
    n_prompts = job.B * (steps // job.new_tokens + 2)
    env = job.env(prompts=prompt_texts(job.tok, n_prompts))
    policy = job.policy(env)
    is_cuda = job.device.type == "cuda"
    counts, refilled, sites = [], [], []
    obs = env.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if is_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                a = len(caught)
                td = policy(obs)
                b = len(caught)
                td, obs = env.step_and_maybe_reset(td)
                counts.append((_syncs(caught[a:b]), _syncs(caught[b:])))
                sites.append(_sites(caught[a:]))
                refilled.append(bool(td.get(keys.DONE).any()))  # not counted: after the step's window
        finally:
            if is_cuda:
                torch.cuda.set_sync_debug_mode(0)
    is_refill = [i == 0 or refilled[i] or refilled[i - 1] for i in range(steps)]
    run = hand_loop(dataclasses.replace(job, new_tokens=steps))  # the reference: its one .cpu() per step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if is_cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            hand_tokens = run()
        finally:
            if is_cuda:
                torch.cuda.set_sync_debug_mode(0)
    split = {"no_refill": [c for c, r in zip(counts, is_refill, strict=True) if not r],
             "refill": [c for c, r in zip(counts, is_refill, strict=True) if r]}  # fmt: skip
    out: dict = {"per_step_policy_env": counts, "is_refill": is_refill,
                 "hand_loop": {"syncs": _syncs(caught), "steps": -(-hand_tokens // job.B), "B": job.B}}
    for kind in split:  # where the syncs of each kind of step come from, most frequent first
        found = collections.Counter(site for step_sites, r in zip(sites, is_refill, strict=True)
                                    if r == (kind == "refill") for site in step_sites)  # fmt: skip
        out[f"sites_{kind}"] = found.most_common(6)
    for kind, cs in split.items():
        out[kind] = {"steps": len(cs), "median": statistics.median([p + e for p, e in cs]) if cs else None,
                     "median_policy": statistics.median([p for p, _ in cs]) if cs else None,
                     "median_env": statistics.median([e for _, e in cs]) if cs else None,
                     "max": max((p + e for p, e in cs), default=None)}  # fmt: skip
    return out


def grpo_iteration(job: Job, group_size: int, sync) -> dict:
    """One GRPO iteration: collect a TRAJECTORIES batch of ``job.B`` trajectories (``group_size`` per prompt) with the
    stepwise collector, GroupAdvantage("grpo"), to_padded, the batch to the device, GRPOLoss(PaddedSequenceActor),
    backward, AdamW step and the weight update (``tokengym.training.train``, its ``device=`` when it has one)."""
    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors.policies import PaddedSequenceActor
    from tokengym.training import train
    from tokengym.transforms import GroupAdvantage, to_padded

    gen = torch.Generator().manual_seed(0)
    env = job.env(lambda responses, prompts, metadata: torch.rand(len(responses), generator=gen), group_size=group_size)
    policy = job.policy(env)
    collector = TokenCollector(env, policy, mode="trajectories", batch_size=job.B)
    loss = GRPOLoss(PaddedSequenceActor(job.model), entropy_bonus=False)
    optimizer = torch.optim.AdamW(job.model.parameters(), lr=1e-6)
    has_device = "device" in inspect.signature(train).parameters
    advantage, marks = GroupAdvantage("grpo"), {}

    def prepare(batch):
        sync()
        marks["collected"], marks["tokens"] = time.perf_counter(), int(batch.get(keys.MASK).sum())
        data = to_padded(advantage(batch))
        marks["shape"] = list(data.batch_size)
        return data if has_device else data.to(job.device)

    is_cuda = job.device.type == "cuda"
    if is_cuda:
        torch.cuda.reset_peak_memory_stats(job.device)
    version = policy.version
    t = time.perf_counter()
    try:
        rows = train(collector, loss, optimizer, iterations=1, prepare=prepare,
                     **({"device": job.device} if has_device else {}))  # fmt: skip
        sync()
        end = time.perf_counter()
    finally:
        job.model.zero_grad(set_to_none=True)
        job.model.eval()
        del optimizer
    return {"collect_s": marks["collected"] - t, "train_s": end - marks["collected"], "tokens": marks["tokens"],
            "padded_shape": marks["shape"], "loss": rows[0]["loss"], "train_has_device": has_device,
            "version_bumped": policy.version > version,
            "peak_bytes": torch.cuda.max_memory_allocated(job.device) if is_cuda else None}  # fmt: skip


def train_step_memory(model, device: torch.device, rows: int, new_tokens: int, *, full_logits: bool,
                      max_tokens: int | None, checkpointing: bool, sync) -> dict:  # fmt: skip
    """One GRPO training step (``tokengym.training.train_step``: GRPOLoss(PaddedSequenceActor), backward, SGD with
    lr 0: no optimizer state) on a synthetic padded batch of ``rows`` x (32 + ``new_tokens``) tokens on ``device``:
    the peak allocated above the weights and the seconds of a second step (the first warms the allocator)."""
    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors.policies import PaddedSequenceActor
    from tokengym.testing import make_trajectory_batch
    from tokengym.training import TrainOptions, train_step
    from tokengym.transforms import GroupAdvantage, to_padded

    vocab = model.config.vocab_size
    lengths = [new_tokens - (i * 7) % max(1, new_tokens // 4) for i in range(rows)]
    batch = make_trajectory_batch(lengths, group_size=8, prompt_len=30, vocab=vocab, steps=new_tokens)
    padded = to_padded(GroupAdvantage("grpo")(batch)).to(device)
    loss = GRPOLoss(PaddedSequenceActor(model, full_logits=full_logits), entropy_bonus=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    options = TrainOptions(micro_batch_tokens=max_tokens, gradient_checkpointing=checkpointing)
    is_cuda = device.type == "cuda"
    try:
        train_step(padded.clone(), loss, optimizer, options=options)
        model.zero_grad(set_to_none=True)
        sync()
        base = torch.cuda.memory_allocated(device) if is_cuda else 0
        if is_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        train_step(padded.clone(), loss, optimizer, options=options)
        sync()
        seconds = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated(device) - base if is_cuda else None
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
        del optimizer
    return {"s": seconds, "peak_above_bytes": peak, "shape": list(padded.batch_size)}


def fsdp_step(model, device: torch.device, rows: int, new_tokens: int, sync) -> dict:
    """One GRPO ``train_step`` (SGD, lr 1e-3) on the same synthetic padded batch with ``model`` whole and with a copy
    sharded by ``tokengym.distributed.shard_model`` in a 1-rank process group (nccl on CUDA, gloo on the CPU): the
    seconds of each (a second step; the first warms up), the peak allocated above the weights and the largest parameter
    difference after the steps. The group is destroyed after."""
    import copy
    import os
    import socket

    from torchrl.objectives.llm import GRPOLoss

    from tokengym.collectors.policies import PaddedSequenceActor
    from tokengym.distributed import full_state_dict, shard_model
    from tokengym.testing import make_trajectory_batch
    from tokengym.training import train_step
    from tokengym.transforms import GroupAdvantage, to_padded

    is_cuda = device.type == "cuda"
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("nccl" if is_cuda else "gloo", rank=0, world_size=1,
                                             device_id=device if is_cuda else None)  # fmt: skip
    lengths = [new_tokens - (i * 7) % max(1, new_tokens // 4) for i in range(rows)]
    batch = make_trajectory_batch(lengths, group_size=8, prompt_len=30, vocab=model.config.vocab_size, steps=new_tokens)
    padded = to_padded(GroupAdvantage("grpo")(batch)).to(device)
    out: dict = {"shape": list(padded.batch_size)}
    try:
        whole = copy.deepcopy(model)
        sharded = shard_model(copy.deepcopy(model))
        for name, trained in (("whole", whole), ("fsdp2", sharded)):
            loss = GRPOLoss(PaddedSequenceActor(trained), entropy_bonus=False)
            optimizer = torch.optim.SGD(trained.parameters(), lr=1e-3)
            train_step(padded.clone(), loss, optimizer)  # warm-up (and the step compared below)
            sync()
            base = torch.cuda.memory_allocated(device) if is_cuda else 0
            if is_cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            train_step(padded.clone(), loss, optimizer)
            sync()
            out[f"{name}_s"] = time.perf_counter() - t
            out[f"{name}_peak_above_bytes"] = torch.cuda.max_memory_allocated(device) - base if is_cuda else None
            del optimizer, loss
        full = full_state_dict(sharded)
        out["max_param_diff"] = max(float((full[k].float() - v.float()).abs().max()) for k, v in whole.state_dict().items())
        out["dtype"] = str(next(model.parameters()).dtype)
    finally:
        torch.distributed.destroy_process_group()
    return out
