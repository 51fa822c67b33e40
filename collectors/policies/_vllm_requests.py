"""What both vLLM backends (in-process engine, running servers) ask of vLLM, in one place: the model's head size
(vLLM's CPU attention runs a fixed set), the sampling fields a :class:`~tokengym.collectors.policies.SamplingConfig`
maps to and vLLM's log-prob modes. :class:`~tokengym.collectors.policies.vllm_policy.VLLMPolicy` and
:class:`~tokengym.collectors.policies.vllm_server_policy.VLLMServerPolicy` both use these, so a wave means the same on
either; what every engine shares (seeds, budgets, the wave's result) is in :mod:`._wave_requests`.
"""

from __future__ import annotations

import json
import os

from tokengym.collectors.policies._wave_requests import request_seeds  # noqa: F401  (its former home)
from tokengym.collectors.policies.sampling import SamplingConfig

__all__ = ["LOGPROBS_MODES", "check_head_size", "check_logprobs_mode", "model_dir_config", "sampling_fields"]

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


def model_dir_config(model_dir) -> dict:
    """The ``config.json`` of a local model directory as a dict; ``{}`` when there is none (vLLM names what is missing)."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_head_size(config: dict, what: str, *, is_cpu: bool | None = None) -> None:
    """Refuse a model whose attention head size vLLM's CPU attention cannot run: such a model loads, then the
    engine dies at its first request (``Unsupported CPU attention configuration``).

    Args:
        config: the model's config (``config.json`` as a dict).
        what: names the model in the message.
        is_cpu: whether the engine runs on vLLM's CPU backend; ``None``: this process's vLLM build decides.
            Nothing is checked off the CPU backend, or where vLLM is not installed here (the head sizes it runs
            are vLLM's to say).
    """
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head = config.get("head_dim") or (hidden // heads if heads and hidden else None)
    if head is None or is_cpu is False:
        return
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return
    if is_cpu is None and not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(f"{what} has attention head size {head} (hidden_size {hidden} / {heads} heads), which vLLM's CPU "
                         f"attention cannot run (it runs {supported}): its engine would die at the first request; use a "
                         "model with one of those head sizes, e.g. tokengym.testing.tiny_model(tok, size='small') "
                         "(head size 64), or TransformersPolicy on CPU")  # fmt: skip


def sampling_fields(s: SamplingConfig) -> dict:
    """The temperature / top-k / top-p fields vLLM samples with (greedy: temperature 0, nothing else)."""
    if s.greedy:
        return {"temperature": 0.0}
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}


def check_logprobs_mode(mode: str, is_unmodified: bool, *, where: str = "the engine") -> None:
    """Processed log-probs always work; raw ones only where the sampling leaves the distribution unmodified."""
    if mode not in LOGPROBS_MODES or (mode == "raw_logprobs" and not is_unmodified):
        fix = ("start the engine with logprobs_mode='processed_logprobs'" if where == "the engine"
               else "start the server with --logprobs-mode processed_logprobs")  # fmt: skip
        raise ValueError(f"{where}'s logprobs_mode is {mode!r}: action_log_prob needs the log-prob of the "
                         f"distribution sampled from; {fix}")  # fmt: skip


