"""Collect on running vLLM servers and push new weights into them (run: python examples/vllm_servers.py).

With a fleet of your own, skip the launcher and pass its URLs: ``TOKENGYM_SERVER_KEY=<key> python
examples/vllm_servers.py --urls http://10.0.0.1:8000 http://10.0.0.2:8000 --model-dir /shared/model`` (the
servers started with the same ``TOKENGYM_SERVER_KEY`` and ``VLLM_SERVER_DEV_MODE=1 python -m
vllm.entrypoints.openai.api_server --model /shared/model --host <private address> --middleware
tokengym.collectors.policies.server_guard.ServerKeyGuard --logprobs-mode processed_logprobs ...``). Without
``--urls`` it saves a tiny model, starts one local server for it (~25 s on CPU; 127.0.0.1, behind a random
key), collects, trains nothing but moves the weights a little, pushes them, collects again and stops it.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from tokengym.collectors import TokenCollector
from tokengym.collectors.policies import LocalVLLMServer, ServerOptions, VLLMServerPolicy
from tokengym.llm_envs import TokenEnv, keys
from tokengym.testing import tiny_model, tiny_tokenizer


def tiny_vllm_model(tok):
    """A tiny Qwen2 that vLLM's CPU kernels run (2 attention heads: head size 32)."""
    config = tiny_model(tok).config
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    return Qwen2ForCausalLM(config).eval()


def collect(
    urls: list[str], model, tok, *, iterations: int, weights_dir: str | None, key: str | None
) -> None:
    env = TokenEnv(["What is 12 + 7?", "Reverse the string abc:", "count down 5 4"], tok, batch_size=4,
                   max_new_tokens=8, max_length=64, group_size=2, model_config=model.config)  # fmt: skip
    # key None: the policy sends $TOKENGYM_SERVER_KEY
    policy = VLLMServerPolicy(urls, env, options=ServerOptions(weights_dir=weights_dir, api_key=key))
    with TokenCollector(env, policy, mode="trajectories", batch_size=4, source="wave") as collector:
        for i, batch in enumerate(collector):
            versions = batch.get(keys.POLICY_VERSION)[batch.get(keys.MASK)].unique().tolist()
            print(
                f"batch {i}: {batch.shape[0]} trajectories, {int(batch.get(keys.MASK).sum())} tokens, versions {versions}"
            )
            with torch.no_grad():  # a stand-in for a training step
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            collector.update_policy_weights_(model.state_dict())  # written once, reloaded into every server
            if i + 1 >= iterations:
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--urls", nargs="*", help="running vLLM servers (default: start one for a tiny model)"
    )
    parser.add_argument("--model-dir", help="a local copy of the served model (with --urls)")
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.urls:
        if not args.model_dir:
            parser.error(
                "--urls needs --model-dir (the served model: its tokenizer and the weights you train)"
            )
        tok, model = (
            AutoTokenizer.from_pretrained(args.model_dir),
            AutoModelForCausalLM.from_pretrained(args.model_dir),
        )
        collect(args.urls, model, tok, iterations=args.iterations, weights_dir=None, key=None)
        return
    tok = tiny_tokenizer()
    model = tiny_vllm_model(tok)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        tok.save_pretrained(path)
        with LocalVLLMServer(
            path, args=["--max-model-len", "128", "--kv-cache-memory-bytes", str(1 << 24)]
        ) as server:
            print(f"server at {server.url} (log: {server.log_path})")
            collect(
                [server.url], model, tok, iterations=args.iterations, weights_dir=None, key=server.api_key
            )


if __name__ == "__main__":
    main()
